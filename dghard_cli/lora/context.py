"""What the routes of an adapter output are given: :class:`RouteContext`.

:meth:`~dghard_cli.lora.output.AdapterOutput.write` builds one per run, once its decisions are
made and the layer-strength schedule is bound, and passes it to the exact route
(:mod:`~dghard_cli.lora.route_exact`), the factored route (:mod:`~dghard_cli.lora.route_factored`)
and the assembly (:mod:`~dghard_cli.lora.assemble`); each reads only what is here and what it is
passed (the staging directory, the plan), never state of the output object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dghard_cli.engine.plan import TensorJob
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.lora.source import AdapterCheckpoint


@dataclass(frozen=True)
class RouteContext:
    """The run's inputs and settings, as the adapter routes need them."""

    base: Checkpoint
    fts: Sequence[Checkpoint]
    #: the exact route (a linear method on plain LoRA adapters), else the factored one
    exact: bool
    #: ``--rank``: the cap of each module's rank (None: no cap given)
    rank: int | None
    #: dtype of the written factors (``--dtype``, else F32)
    factor_dtype: str
    #: ``--dtype``: of the full tensors the exact route writes (None: each tensor's output dtype)
    out_dtype: str | None
    #: the exact route's ``c_i(tensor)``, each tensor's λ(ℓ) included under a layer-strength
    #: schedule (None for a method that is not linear in the task vectors)
    coefficients: Callable[[str], list[float]] | None
    #: under a schedule on the exact route, each planned tensor's ``(layer, λ)`` for its report record
    layer_strengths: Mapping[str, tuple]
    #: per module, the largest rank among the adapter inputs (the factored route's default cap)
    input_ranks: Mapping[str, int]
    #: ``--core-space``: which LoRA modules the core-space route merges
    #: (:mod:`~dghard_cli.lora.route_core`); None: no core space
    core_rule: Callable[[TensorJob], bool] | None = None
    #: ``--core-space``: the method's MergeMethod.core_space ("lossless" or "cores")
    core_kind: str | None = None
    #: the factored route writes nothing for (and reads nothing of) a tensor every fine-tune
    #: shares with BASE (a merge: every method gives BASE back there)
    skip_untouched: bool = False


def input_ranks(fts: Sequence[Checkpoint]) -> dict[str, int]:
    """Per module, the largest input rank (adapter inputs only; empty for full fine-tunes)."""
    caps: dict[str, int] = {}
    for f in fts:
        if isinstance(f, AdapterCheckpoint):
            for m, d in f.modules.items():
                caps[m] = max(caps.get(m, 0), d.rank)
    return caps
