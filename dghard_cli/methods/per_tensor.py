"""Method parameters that vary by tensor (a mergekit recipe's gradients and filters).

:func:`tensor_parameter_sets` evaluates and validates every method tensor's parameters before
anything is written (a bad value is a one-line error naming the tensor); :class:`PerTensorOp`
then runs each tensor with its own parameters, building one pipeline operation per distinct
parameter set.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from dghard_cli.architecture import layer_index
from dghard_cli.engine.ops import JobInputs, TensorOp
from dghard_cli.engine.plan import Plan, TensorJob
from dghard_cli.errors import InputError


class TensorParameterSource(Protocol):
    def check(self, num_layers: int) -> None: ...

    def __call__(self, name: str, num_layers: int) -> dict: ...


def num_layers(plan: Plan) -> int:
    """Decoder layers in the plan's tensor names (``layers.i.``, ``h.i.``, ...): max index + 1."""
    idx = [i for i in (layer_index(j.name) for j in plan.jobs) if i is not None]
    return max(idx) + 1 if idx else 0


def tensor_parameter_sets(
    plan: Plan, opts, n_fts: int, resolve: Callable[[object, int], dict]
) -> dict[str, tuple[dict, dict]]:
    """``name -> (effective parameters, the values that came from the recipe)`` for every method
    tensor; ``resolve(options, n_fts)`` validates (InputError, prefixed with the tensor's name).
    The source gives parameter values by name (``lambda``, ``t``, ...): those of built-in
    fields replace the options' fields, the others their ``extra`` entries."""
    from dghard_cli.methods.registry import options_values

    source: TensorParameterSource = opts.tensor_parameters
    layers = num_layers(plan)
    source.check(layers)
    out: dict[str, tuple[dict, dict]] = {}
    for job in plan.jobs:
        if not job.runs_method:
            continue
        values = source(job.name, layers)
        fields, extra = options_values(values)
        try:
            p = resolve(dataclasses.replace(opts, **fields, extra={**opts.extra, **extra}), n_fts)
        except InputError as exc:
            raise InputError(f"tensor {job.name!r}: {exc}") from None
        out[job.name] = (p, dict(values))
    return out


class PerTensorOp:
    """Runs each tensor with its own parameters (one operation per distinct parameter set)."""

    def __init__(self, sets: dict[str, tuple[dict, dict]], make_op: Callable[[dict], TensorOp]) -> None:
        self.sets = sets
        self.make_op = make_op
        self._ops: dict[str, TensorOp] = {}

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        p, values = self.sets[job.name]
        key = json.dumps(p, sort_keys=True, default=str)
        op = self._ops.get(key)
        if op is None:
            op = self._ops.setdefault(key, self.make_op(p))
        rec["parameters"] = values
        yield from op(job, src, rec)
