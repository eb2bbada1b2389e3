"""The layer-strength schedule bound to one checkpoint: its layer stack, whether a schedule can
bind to a pair, and the plan's jobs annotated with their block and λ (:func:`bind`).

Relies on :mod:`dghard_cli.architecture` (a tensor's place, the model's depth), the plan types
of :mod:`dghard_cli.engine.plan` and the checkpoint reader. The schedule as given, and its λ
for every place of a layer stack (:class:`~dghard_cli.schedule.spec.Strengths`), live in
:mod:`dghard_cli.schedule.spec`; :mod:`dghard_cli.schedule` describes the schedule itself.
"""

from __future__ import annotations

import re

from dghard_cli.architecture import (
    VOCAB_EMBEDDING,
    ModelDepth,
    model_depth,
    tensor_place,
)
from dghard_cli.architecture import unknown_place_message as _unknown
from dghard_cli.engine.plan import Eligibility, Plan, PolicyOptions, TensorJob
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.schedule.spec import LayerSchedule, Strengths

#: Actions the schedule scales: the method's tensors and, under a schedule, the rest of the
#: floating tensors the spectral methods would pass through (norms, biases, small, ≥3-D).
SCALABLE_REASONS = ("1-d", "small", "vector")

# -- bound to a model ------------------------------------------------------------------------------


def checkpoint_depth(ck: Checkpoint) -> ModelDepth:
    """The layer stack of a checkpoint (names and config.json must agree)."""
    return model_depth(ck.tensors, ck.config(), where=f"{ck.label} ({ck.source})")


def schedule_problem(base: Checkpoint, ft: Checkpoint) -> str | None:
    """Why a schedule cannot be bound to this pair with the default policy (None: it can):
    the layer stack cannot be read, or a floating tensor of both has no known place."""
    try:
        depth = checkpoint_depth(ft)
        for name, info in ft.tensors.items():
            b = base.tensors.get(name)
            if b is None or info.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
                continue
            place = tensor_place(name)
            if place is None:
                return _unknown(name)
            if isinstance(place, int) and not 0 <= place < depth.num_layers:
                return f"tensor {name!r} is in block {place}, but the model has {depth.num_layers} blocks"
    except InputError as exc:
        return str(exc)
    return None


def scheduled_eligibility(policy: PolicyOptions) -> Eligibility:
    """A plain schedule (no spectral method): every selected floating tensor is scaled."""

    def eligible(name: str, info) -> str | None:
        if info.dtype not in FLOAT_DTYPES:
            return "non-float"
        if not policy.selected(name):
            return "excluded"
        return None

    return eligible


def _scalable(job: TensorJob) -> bool:
    """A tensor the method passes through that the schedule scales instead (norms, biases, …)."""
    if job.action != "kept-ft" or job.base is None or not job.fts:
        return False
    if job.base.dtype not in FLOAT_DTYPES or any(f.dtype not in FLOAT_DTYPES for f in job.fts):
        return False
    reason = job.reason or ""
    return reason in SCALABLE_REASONS or bool(re.fullmatch(r"\d+-d", reason))


def bind(schedule: LayerSchedule, plan: Plan, ft: Checkpoint) -> Strengths:
    """Resolve ``schedule`` for FT's layer stack and annotate the plan's jobs with their λ.

    Raises InputError (nothing written yet) for an unreadable depth or a bad per-group form.
    """
    strengths = schedule.resolve(checkpoint_depth(ft))
    jobs = {j.name: j for j in plan.jobs}
    for job in plan.jobs:
        if _scalable(job):
            job.action = "scaled"
            assert job.base is not None
            if job.base.shape != job.shape:  # a resized vocabulary too small for the method
                job.shared_rows = min(job.base.shape[0], job.shape[0])
        if job.action in ("method", "resized", "scaled"):
            job.layer, job.strength = strengths.for_tensor(job.name)
    for job in plan.jobs:
        if job.action == "tied" and job.tied_to is not None:
            first = jobs[job.tied_to]
            if first.strength is None:
                continue
            # one parameter, one strength: the input embedding's
            embed_name = job.name if VOCAB_EMBEDDING.search(job.name) else first.name
            first.layer, first.strength = strengths.for_tensor(embed_name)
            job.layer, job.strength = first.layer, first.strength
    return strengths


def strength_fields(job: TensorJob) -> dict:
    """Per-tensor report fields of a scheduled job (empty for the others)."""
    if job.strength is None:
        return {}
    return {"layer": job.layer, "layer_strength": job.strength}
