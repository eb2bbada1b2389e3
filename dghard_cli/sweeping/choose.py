"""Choosing among scored candidates: feasibility (every target keeps enough of the fine-tune's
gain), the objective (HM by default), closeness to the fine-tune; and the distance that measures
that closeness."""

from __future__ import annotations

import math

import numpy as np
import torch

from dghard_cli.io.checkpoint import Checkpoint

#: ``--objective``: what the sweep maximises, and the score field (of ``dghard score``) it reads.
OBJECTIVES = {"hm": "hm", "retention": "retention", "normalised-accuracy": "normalised_accuracy"}

#: How each objective is named in messages.
OBJECTIVE_LABELS = {"hm": "HM", "retention": "% retention", "normalised-accuracy": "normalised accuracy"}

#: Row blocks of the distance computation (float64 bytes per input block).
DISTANCE_BLOCK_BYTES = 64 * 1024 * 1024


def _sq(x: torch.Tensor) -> float:
    """Σ x² in float64 with numpy's pairwise summation, whose order depends on the length alone:
    torch's reduction gave another last bit in a Ray worker process than in the sweep's own, and
    the distance breaks ties."""
    a = x.detach().cpu().numpy().ravel()
    return float(np.sum(a * a))


def update_distance(base: Checkpoint, fts: list[Checkpoint], cand: Checkpoint) -> float:
    """‖W_c − W_ref‖ / ‖W_ref − W_base‖ over all floating tensors (float64, row blocks), to 12
    significant digits.

    W_ref is the fine-tune (several: W_base + Σ_i (W_i − W_base)). Tensors whose shape differs
    from BASE's (a resized vocabulary) compare with the first fine-tune and add nothing to
    the denominator.
    """
    num = den = 0.0
    for name, info in cand.tensors.items():
        if not info.is_float:
            continue
        ft_infos = [f.tensors.get(name) for f in fts]
        if any(t is None or not t.is_float for t in ft_infos):
            continue
        b = base.tensors.get(name)
        same = b is not None and b.is_float and all(t.shape == b.shape == info.shape for t in ft_infos)
        rows = info.shape[0] if info.shape else 0
        width = max(1, info.numel // rows) if rows else 1
        step = max(1, DISTANCE_BLOCK_BYTES // (8 * width))
        spans = [(r, min(rows, r + step)) for r in range(0, rows, step)] if rows else [None]
        for span in spans:
            c = info.read(span).to(torch.float64)
            if not same:
                f0 = ft_infos[0]
                if f0.shape != info.shape:
                    continue
                num += _sq(c - f0.read(span).to(torch.float64))
                continue
            bb = b.read(span).to(torch.float64)
            if len(fts) == 1:
                ref = ft_infos[0].read(span).to(torch.float64)
            else:
                ref = bb.clone()
                for t in ft_infos:
                    ref += t.read(span).to(torch.float64) - bb
            num += _sq(c - ref)
            den += _sq(ref - bb)
    if den <= 0:
        return 0.0 if num <= 0 else math.inf
    # 12 significant digits: a last-bit difference between two machines' arithmetic (a Ray
    # worker's CPU) cannot reorder a tie
    return float(f"{math.sqrt(num / den):.12g}")


def target_ok(cd: dict, min_retention: float | None) -> bool:
    """Every target whose retention is defined keeps at least ``min_retention`` % (None: no bar)."""
    if min_retention is None:
        return True
    return all(v is None or v >= min_retention for v in cd["target_retention"].values())


def objective(
    cd: dict | None, distance: float, min_retention: float | None, measure: str = "hm"
) -> tuple | None:
    """What the search maximises: feasible first, then the ``measure`` (a key of
    :data:`OBJECTIVES`; infeasible: the worst target's retention, so refinement moves toward
    feasibility), then closeness to the fine-tune."""
    if cd is None:
        return None
    value = cd[OBJECTIVES[measure]]
    if value is None:
        return (-1, 0.0, -distance)
    if target_ok(cd, min_retention):
        return (1, value, -distance)
    worst = min((v for v in cd["target_retention"].values() if v is not None), default=-math.inf)
    return (0, worst, -distance)


def choose_winner(
    rows: list[dict], min_retention: float | None, tie_tolerance: float, measure: str = "hm"
) -> tuple[dict | None, str | None]:
    """The winner among scored candidate rows (the ``measure``'s field, ``feasible``,
    ``distance``, ``order``)."""
    key = OBJECTIVES[measure]
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None, "no candidate could be evaluated (see each candidate's status and message)"
    defined = [r for r in ok if r[key] is not None]
    if not defined:
        if measure == "normalised-accuracy":
            return None, (
                "normalised accuracy is undefined for every candidate (no improved benchmark or target "
                "scored above 0 by the fine-tune, in bounded units)"
            )
        if measure == "retention":
            return None, "% retention is undefined for every candidate (no improved benchmarks)"
        return None, "HM is undefined for every candidate (no damaged and no improved benchmarks)"
    feasible = [r for r in defined if r["feasible"]]
    if not feasible:
        return None, (
            f"no candidate keeps at least {min_retention:g} % of the fine-tune's gain on every target "
            "(--min-target-retention)"
        )
    best = max(r[key] for r in feasible)
    tied = [r for r in feasible if r[key] >= best - tie_tolerance]
    return min(tied, key=lambda r: (r["distance"], r["order"])), None
