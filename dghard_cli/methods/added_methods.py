"""SLERP, Model Breadcrumbs (+TIES), DELLA (+linear) and Model Stock in ``dghard merge``: their
parameters (declared once), validation, pipeline operation and report totals.

:mod:`dghard_cli.merge` wires this table in with a few lines; the math lives in each method's
module (:mod:`~dghard_cli.methods.slerp`, :mod:`~dghard_cli.methods.breadcrumbs`,
:mod:`~dghard_cli.methods.della`, :mod:`~dghard_cli.methods.model_stock`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from dghard_cli.errors import InputError
from dghard_cli.methods.breadcrumbs import BreadcrumbsKernel
from dghard_cli.methods.dare import CHUNK
from dghard_cli.methods.della import DellaKernel
from dghard_cli.methods.merge_ops import ElementwiseMergeOp, merged_numel, per_ft
from dghard_cli.methods.model_stock import ModelStockKernel
from dghard_cli.methods.slerp import SlerpKernel


@dataclass(frozen=True)
class AddedMethod:
    """One method: the parameters it takes, their defaults, how many fine-tunes it merges."""

    name: str
    takes: frozenset[str]
    defaults: dict = field(default_factory=dict)
    min_fts: int = 1
    max_fts: int | None = None
    non_negative_weights: bool = False  # a disjoint mean/sum elects signs: weights >= 0
    mergekit: str = ""


_LINEAR = frozenset({"weights", "lambda", "density"})
METHODS: dict[str, AddedMethod] = {
    m.name: m
    for m in (
        AddedMethod("slerp", frozenset({"t"}), {"t": 0.5}, 1, 1, mergekit="slerp"),
        AddedMethod(
            "breadcrumbs", _LINEAR | {"gamma"}, {"density": 0.9, "gamma": 0.01}, mergekit="breadcrumbs"
        ),
        AddedMethod(
            "breadcrumbs-ties",
            _LINEAR | {"gamma", "normalize"},
            {"density": 0.9, "gamma": 0.01, "normalize": False},
            non_negative_weights=True,
            mergekit="breadcrumbs_ties",
        ),
        AddedMethod(
            "della",
            _LINEAR | {"epsilon", "seed", "normalize"},
            {"density": 0.5, "epsilon": 0.15, "seed": 0, "normalize": True},
            non_negative_weights=True,
            mergekit="della",
        ),
        AddedMethod(
            "della-linear",
            _LINEAR | {"epsilon", "seed"},
            {"density": 0.5, "epsilon": 0.15, "seed": 0},
            mergekit="della_linear",
        ),
        AddedMethod(
            "model-stock", frozenset({"filter_wise"}), {"filter_wise": False}, 2, mergekit="model_stock"
        ),
    )
}
NAMES = tuple(METHODS)

#: ``normalize`` of the existing sign-electing methods (dghard's disjoint mean).
NORMALIZE_DEFAULT = {"ties": True, "dare-ties": True}
#: Parameters this module adds to :class:`dghard_cli.merge.MergeOptions` (None: not given).
OPTION_NAMES = ("t", "gamma", "epsilon", "filter_wise", "normalize")


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{flag(name)} must be a finite number, got {value!r}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{flag(name)} must be true or false, got {value!r}")
    return value


def resolve(method: str, given: dict, n_fts: int, p: dict) -> None:
    """Fill the added parameters of ``method`` into ``p`` (defaults, checks); InputError otherwise.

    ``given``: the values given (None: not given); ``p`` already holds weights, lambda,
    density and seed when the method takes them.
    """
    if method in NORMALIZE_DEFAULT:
        v = given.get("normalize")
        p["normalize"] = NORMALIZE_DEFAULT[method] if v is None else _bool("normalize", v)
        return
    spec = METHODS.get(method)
    if spec is None:
        return
    if n_fts < spec.min_fts or (spec.max_fts is not None and n_fts > spec.max_fts):
        if spec.max_fts == 1:
            raise InputError(f"--method {method} interpolates BASE and one fine-tune; got {n_fts} fine-tunes")
        raise InputError(f"--method {method} needs at least {spec.min_fts} fine-tunes; got {n_fts}")
    vals = {k: (spec.defaults.get(k) if given.get(k) is None else given[k]) for k in spec.takes}
    if "t" in spec.takes:
        t = _number("t", vals["t"])
        if not 0.0 <= t <= 1.0:
            raise InputError(f"--t must be in [0, 1] (0 = BASE, 1 = the fine-tune), got {t}")
        p["t"] = t
        p["dot_threshold"] = 0.9995
    if "gamma" in spec.takes:
        gamma = _number("gamma", vals["gamma"])
        if not 0.0 <= gamma < 1.0:
            raise InputError(
                f"--gamma is the fraction of largest entries dropped and must be in [0, 1), got {gamma}"
            )
        p["gamma"] = gamma
    if "epsilon" in spec.takes:
        eps = _number("epsilon", vals["epsilon"])
        bad = [d for d in per_ft(p["density"], n_fts) if d < 1 and not (d - eps > 0 and d + eps < 1)]
        if eps < 0 or bad:
            d = bad[0] if bad else p["density"]
            raise InputError(
                f"--epsilon {eps} with --density {d}: keep probabilities density ± epsilon must lie in "
                "(0, 1); use epsilon >= 0 below min(density, 1 − density)"
            )
        p["epsilon"] = eps
        p["random_stream"] = (
            f"torch.Generator(CPU) per {CHUNK}-entry chunk, seeded by BLAKE2b('dghard-della', seed, name, "
            "index, chunk)"
        )
    if "filter_wise" in spec.takes:
        p["filter_wise"] = _bool("filter_wise", vals["filter_wise"])
    if "normalize" in spec.takes:
        p["normalize"] = _bool("normalize", vals["normalize"])


def make_op(method: str, p: dict, device: torch.device, block_bytes: int) -> ElementwiseMergeOp:
    """The pipeline operation of an added method (an elementwise merge with its kernel)."""
    if method == "slerp":
        return ElementwiseMergeOp(lambda job: SlerpKernel(p["t"]), device, block_bytes)
    if method in ("breadcrumbs", "breadcrumbs-ties"):
        return ElementwiseMergeOp(
            lambda job: BreadcrumbsKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["gamma"],
                merged_numel(job),
                ties=method == "breadcrumbs-ties",
                normalize=p.get("normalize", False),
            ),
            device,
            block_bytes,
        )
    if method in ("della", "della-linear"):
        # ranking a block's rows needs ~4 float64/int64 temporaries per entry: smaller blocks
        return ElementwiseMergeOp(
            lambda job: DellaKernel(
                p["weights"],
                p["lambda"],
                p["density"],
                p["epsilon"],
                p["seed"],
                job.name,
                merged_numel(job),
                ties=method == "della",
                normalize=p.get("normalize", True),
            ),
            device,
            max(1, block_bytes // 4),
        )
    if method == "model-stock":
        return ElementwiseMergeOp(
            lambda job: ModelStockKernel(len(job.fts), filter_wise=p["filter_wise"]), device, block_bytes
        )
    raise AssertionError(method)


def summary(method: str, rows: list[dict]) -> dict:
    """Method-level totals for the report's ``merge`` section (beyond kept fractions/conflicts)."""
    out: dict = {}
    if method == "slerp":
        rules = [r.get("slerp_rule") for r in rows]
        out["spherical_tensors"] = rules.count("spherical")
        out["linear_tensors"] = rules.count("linear")
    if method == "model-stock":
        ts = [r["stock_t"] for r in rows if r.get("stock_t") is not None]
        ts += [r["stock_t_mean"] for r in rows if r.get("stock_t_mean") is not None]
        if ts:
            out["median_stock_t"] = statistics.median(ts)
    return out
