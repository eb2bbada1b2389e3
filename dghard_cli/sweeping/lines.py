"""The ``lines`` family of ``dghard sweep``: layer-wise strengths λ(ℓ) = α + β·ℓ/(L−1) (LiNeS).

A candidate is ``dghard repair BASE FT OUT --lines α,β`` (W = W_base + λ(ℓ)·Δ), or, with a
shrinker in ``fixed`` (``{shrink: hard, scale: 1.0}``), ``… --lines α,β --shrink hard --scale 1.0``
(W = W_base + λ(ℓ)·Δ*). The search is two-dimensional:

1. **Coarse**: the entry's ``grid`` of (α, β) points — a list of pairs, evaluated in that order,
   or ``{alpha: [...], beta: [...]}`` for their product (α-major) — round-robin with the other
   entries, as for every family.
2. **Local refinement** (a compass search): around the best (α, β) so far, one step probes
   every unevaluated point of ``best ± s·span`` along α and along β at once (one round of the
   sweep, in the order α+, α−, β+, β−), where the step ``s`` (a share of each axis's range)
   starts at the distance to the nearest evaluated point (at most ``step``, default 0.1) and
   halves whenever all four neighbours are evaluated; the stage is done when ``s`` falls below
   ``tolerance``. Probes are rounded to 4 significant digits
   and clipped to the ranges.
3. **Per-group refinement** (``dghard sweep --refine groups``), once the (α, β) stage is done: a
   coordinate search of the same kind on per-group offsets δ added to the best schedule —
   groups: the embeddings, ``groups`` (default 4) contiguous ranges of blocks, the head — written
   as ``--layer-strengths`` with every block's λ(ℓ) = α + β·ℓ/(L−1) + δ_g. It starts from the best
   (α, β) candidate (δ = 0, already evaluated) and goes on as long as the budget lasts (or until
   its step falls below the tolerance). Offsets lie in ``group_range`` (default [−0.5, 0.5]).

Every probe is a pure function of what has been evaluated (like the golden-section search of the
other families), so a resumed sweep takes the same steps.

The code is in three modules: :mod:`dghard_cli.sweeping.lines_entry` (the candidate file's entry,
bound to FT's layers), :mod:`dghard_cli.sweeping.lines_candidates` (a candidate at a point; its
options, command and writing are the family's: :mod:`dghard_cli.sweeping.families.lines`) and :mod:`dghard_cli.sweeping.lines_search` (the refinement). This module
re-exports what the sweep and the tests use.
"""

from __future__ import annotations

from dghard_cli.sweeping.lines_candidates import (
    GroupPoint,
    group_names,
    group_ranges,
    group_schedule,
    make_candidate,
)
from dghard_cli.sweeping.lines_entry import bind_entries, check_entry, parse_entry
from dghard_cli.sweeping.lines_search import (
    compass_probe,
    compass_probes,
    entry_points,
    refine_probe,
    refine_probes,
)

__all__ = [
    "GroupPoint",
    "bind_entries",
    "check_entry",
    "compass_probe",
    "compass_probes",
    "entry_points",
    "group_names",
    "group_ranges",
    "group_schedule",
    "make_candidate",
    "parse_entry",
    "refine_probe",
    "refine_probes",
]
