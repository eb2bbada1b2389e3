"""Warnings about the inputs of a run: BASE and FT swapped, BASE and FT in different dtypes.

Neither stops a run (each may be what the user wants); each is one line on stderr and an entry
of the report's ``summary.warnings``.

**Swapped BASE and FT.** Two kinds of evidence, the first decisive, the second only when strong:

1. Metadata. BASE's ``config.json`` ``_name_or_path`` (where transformers loaded the model from
   before saving it) or the ``base_model`` of BASE's model card names FT: BASE was made from FT,
   so the two are swapped. When FT's metadata names BASE instead, the order is confirmed and the
   weights are not looked at. A name matches an input when it equals the input as given (a
   directory or a Hub id), resolves to the same directory, or ends in the same last path
   component (``org/Model-7B`` and ``/models/Model-7B``) while the other input's does not.
2. The weights (after the run, from numbers the run computes anyway). Per matrix, the share of
   the update along BASE's own weights, ``s = ⟨Δ, W_base⟩ / ‖Δ‖²`` with ``Δ = W_ft − W_base``.
   Fine-tuning moves a matrix along its own weights only by shrinking it (weight decay pulls
   ``W`` toward zero: ``s < 0``, often ``s ≪ −1``); otherwise the update is close to orthogonal
   to ``W_base`` (``s ≈ 0``). Swapping the inputs maps ``s`` to ``−1 − s``, so a fine-tune made
   with weight decay, swapped, shows ``s ≫ 0``: "FT" is larger than "BASE" along BASE's own
   direction, by more than the update itself (``‖W_ft‖² − ‖W_base‖² = (1 + 2s)·‖Δ‖²``). The
   warning needs at least :data:`MIN_MATRICES` matrices and ``s > `` :data:`S_MIN` in at least
   :data:`MIN_SHARE` of them. A swap of a fine-tune made without weight decay (``s ≈ −1``
   swapped, ``s ≈ 0`` not) cannot be told from the weights and is not flagged: only metadata
   catches it.

**Different dtypes.** The float dtype holding most of each input's bytes; when BASE's and a
fine-tune's differ the warning names both and the output's dtype (deltas are formed in float32
or wider from the exact stored values either way).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from pathlib import Path

from dghard_cli.engine.plan import Plan
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.output import read_side_text
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.report.model_card import declared_base_models

#: A swap is flagged from the weights only when this many matrices or more have a delta ...
MIN_MATRICES = 4
#: ... and at least this share of them has ``s = ⟨Δ, W_base⟩/‖Δ‖²`` above :data:`S_MIN`.
MIN_SHARE = 0.9
S_MIN = 1.0

DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}


def _label(i: int, n: int) -> str:
    return "FT" if n == 1 else f"FT #{i + 1}"


# -- metadata ------------------------------------------------------------------------------------


def _tail(spec: str) -> str:
    return spec.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _real(path: Path) -> str | None:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):
        return None


def names_input(ref: str, ck: Checkpoint, other: Checkpoint) -> bool:
    """Whether the model name ``ref`` (from a config or a model card) designates input ``ck``
    rather than ``other``."""
    ref = ref.strip().rstrip("/")
    if not ref:
        return False
    if ref == ck.source.rstrip("/"):
        return True
    if os.path.isabs(ref) and _real(Path(ref)) is not None and _real(Path(ref)) == _real(ck.path):
        return True
    tail = _tail(ref)
    return bool(tail) and tail == _tail(ck.source) and tail != _tail(other.source)


def origin_names(ck: Checkpoint) -> list[str]:
    """Where a checkpoint says it came from: ``_name_or_path`` of its config, and the
    ``base_model`` entries of its model card (read as side files are: guarded, size-limited)."""
    found: list[str] = []
    try:
        cfg = ck.config()
    except InputError:
        cfg = None
    if isinstance(cfg, dict) and isinstance(cfg.get("_name_or_path"), str):
        found.append(cfg["_name_or_path"])
    text, _ = read_side_text(ck.path, "README.md")
    found += declared_base_models(text)
    return found


def metadata_swap(base: Checkpoint, fts: list[Checkpoint]) -> tuple[list[str], bool]:
    """``(warnings, order confirmed)`` from the inputs' metadata (rule 1 of the module)."""
    warnings: list[str] = []
    confirmed = True
    base_refs = origin_names(base)
    for i, ft in enumerate(fts):
        from_ft = [r for r in base_refs if names_input(r, ft, base)]
        to_base = [r for r in origin_names(ft) if names_input(r, base, ft)]
        if from_ft and not to_base:
            warnings.append(
                f"BASE and {_label(i, len(fts))} look swapped: BASE's metadata names "
                f"{from_ft[0]!r} (that is {_label(i, len(fts))}) as the model it was made from; "
                "the base goes first, then the fine-tune"
            )
        if not to_base:
            confirmed = False
    return warnings, confirmed


# -- weights -------------------------------------------------------------------------------------


def along_base_shares(records: list[dict], i: int = 0) -> list[float]:
    """``s = ⟨Δ_i, W_base⟩/‖Δ_i‖²`` of every matrix (2-D) the method ran on with a non-zero delta
    (vectors are left out: a norm's weights sit near 1, and a shift of them is no evidence)."""
    out = []
    for r in records:
        if len(r.get("shape") or ()) != 2:
            continue
        dots = r.get("delta_dot_bases") or ([r["delta_dot_base"]] if "delta_dot_base" in r else [])
        norms = r.get("delta_norms") or ([r.get("delta_norm")] if r.get("delta_norm") is not None else [])
        if i >= len(dots) or i >= len(norms) or norms[i] is None or dots[i] is None:
            continue
        n2 = float(norms[i]) ** 2
        if n2 > 0.0:
            out.append(float(dots[i]) / n2)
    return out


def weights_swap(records: list[dict], n_fts: int) -> list[str]:
    """Warnings from the weights (rule 2 of the module)."""
    warnings = []
    for i in range(n_fts):
        s = along_base_shares(records, i)
        if len(s) < MIN_MATRICES:
            continue
        above = sum(1 for x in s if x > S_MIN)
        if above >= MIN_SHARE * len(s):
            label = _label(i, n_fts)
            warnings.append(
                f"BASE and {label} look swapped: in {above} of {len(s)} matrices {label} − BASE points "
                f"along BASE's own weights by more than its size (median ⟨Δ, W_base⟩/‖Δ‖² = "
                f"{statistics.median(s):.3g}; a fine-tune shrinks toward zero or moves across, "
                "so BASE looks like the fine-tune); the base goes first, then the fine-tune"
            )
    return warnings


# -- dtypes --------------------------------------------------------------------------------------


def main_dtype(ck: Checkpoint) -> str | None:
    """The float dtype holding most of a checkpoint's bytes (None: no float tensor)."""
    by = Counter()
    for t in ck.tensors.values():
        if t.dtype in FLOAT_DTYPES:
            by[t.dtype] += t.nbytes
    return by.most_common(1)[0][0] if by else None


def dtype_warnings(base: Checkpoint, fts: list[Checkpoint], plan: Plan) -> list[str]:
    b = main_dtype(base)
    f = [main_dtype(ft) for ft in fts]
    if b is None or all(x in (None, b) for x in f):
        return []
    out_by = Counter()
    for j in plan.jobs:
        if j.out_dtype in FLOAT_DTYPES:
            out_by[j.out_dtype] += j.out_nbytes
    out = out_by.most_common(1)[0][0] if out_by else f[0]
    name = lambda d: DTYPE_NAMES.get(d, str(d))  # noqa: E731
    ins = " and ".join([f"BASE is {name(b)}", *(f"{_label(i, len(fts))} {name(x)}" for i, x in enumerate(f))])
    why = "the fine-tune's dtype; --dtype sets another" if out == f[0] else "as --dtype asks"
    return [
        f"{ins}: the deltas are formed from the exact stored values in float32 or wider, and the "
        f"output is {name(out)} ({why})"
    ]


def before_run(base: Checkpoint, fts: list[Checkpoint], plan: Plan) -> tuple[list[str], bool]:
    """``(warnings, swap ruled out by metadata)`` known before any tensor is read."""
    swapped, confirmed = metadata_swap(base, fts)
    return swapped + dtype_warnings(base, fts, plan), confirmed or bool(swapped)
