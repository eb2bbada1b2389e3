"""Checks of the adapter's tensor values: NaN/Inf, storage dtypes, all-zero factors, the size of
each module's update, and updates that are tiny next to their peers (the same module in other
layers)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from dghard_cli.audit.config_checks import (
    Geometry,
)
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.safetensors_format import FLOAT_DTYPES, UNIT_ROUNDOFF
from dghard_cli.lora.adapter import LoraModule
from dghard_cli.lora.config import LoraConfig
from dghard_cli.lora.findings import (
    Finding,
    finding,
)
from dghard_cli.lora.spectra import (
    lowrank_spectrum,
    spectrum_stats,
)

#: RMS of a module's update below this fraction of the median over its peers (same module
#: name in other layers) is a no-op update next to the rest of the adapter.
TINY_VS_PEERS = 1e-3


# -- values ------------------------------------------------------------------------------------------
def nonfinite_counts(ti: TensorInfo, block_bytes: int) -> tuple[int, int]:
    """(NaN count, Inf count) of a float tensor, read in row blocks."""
    nan = inf = 0
    rows = ti.shape[0] if ti.shape else 1
    step = max(1, block_bytes // max(1, ti.row_bytes)) if ti.shape else 1
    for r0 in range(0, rows, step) if ti.shape else [None]:
        x = ti.read((r0, min(rows, r0 + step))) if r0 is not None else ti.read()
        if x.is_floating_point():
            nan += int(torch.isnan(x).sum())
            inf += int(torch.isinf(x).sum())
    return nan, inf


def nonfinite_finding(module: str | None, tensor: str, nan: int, inf: int, total: int) -> Finding:
    return finding(
        "NONFINITE",
        module,
        f"{tensor.rsplit('.', 2)[-2] if module else tensor} has {nan} NaN and {inf} Inf values (of "
        f"{total}); every output through it becomes NaN/Inf — restore the weights from an earlier "
        "checkpoint or retrain.",
        tensor=tensor,
        nan=nan,
        inf=inf,
    )


def dtype_finding(module: str | None, ti: TensorInfo) -> Finding:
    return finding(
        "NON_FLOAT_TENSOR",
        module,
        f"{ti.name} is stored as {ti.dtype}; LoRA tensors must be floating point (quantised factors "
        "are not a PEFT LoRA format) — re-export in float32, bfloat16 or float16.",
        tensor=ti.name,
        dtype=ti.dtype,
    )


@dataclass
class ModuleValues:
    """What the factors of one module measure (the factors themselves are not kept)."""

    scaling: float | None
    stats: dict
    zero: bool


def read_factors(mod: LoraModule, geo: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """B (``out x r``) and A (``r x in``) as float64, in PEFT's orientation."""
    a = mod.a.read().to(torch.float64)
    b = mod.b.read().to(torch.float64)
    if geo.transposed_factors:
        a, b = a.T, b.T
    return b.reshape(geo.out, geo.rank), a.reshape(geo.rank, -1)


def sum_of_squares(x: torch.Tensor) -> float:
    """Σx² in one pass: NaN if x has a NaN, Inf if it has an Inf, 0 iff every entry is 0 (float64
    has the range to square any float32/bf16/fp16 value without underflow or overflow)."""
    v = x.reshape(-1)
    return float(torch.dot(v, v)) if v.numel() else 0.0


def module_values(
    mod: LoraModule, geo: Geometry, cfg: LoraConfig
) -> tuple[ModuleValues | None, list[Finding]]:
    """Read A and B, check finiteness and zeros, and compute the spectrum of scaling·B·A."""
    out: list[Finding] = []
    name = mod.module
    bad = False
    for ti in (mod.a, mod.b):
        if ti.dtype not in FLOAT_DTYPES:
            out.append(dtype_finding(name, ti))
            bad = True
    if bad:
        return None, out
    b, a = read_factors(mod, geo)
    squares = {}
    for ti, x in ((mod.a, a), (mod.b, b)):
        ss = sum_of_squares(x)
        if not math.isfinite(ss):
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            out.append(nonfinite_finding(name, ti.name, nan, inf, x.numel()))
            bad = True
        squares[ti.name] = ss
    if bad:
        return None, out
    a_zero = squares[mod.a.name] == 0.0
    b_zero = squares[mod.b.name] == 0.0
    if a_zero:
        out.append(
            finding(
                "A_ALL_ZERO",
                name,
                "every entry of A is zero, so this module's update B·A is zero; PEFT never initialises "
                "A to zero — the export or a conversion step lost the weights.",
                tensor=mod.a.name,
            )
        )
    if b_zero:
        out.append(
            finding(
                "B_ALL_ZERO",
                name,
                "every entry of B is zero, so this module's update B·A is zero: it never trained "
                "(PEFT initialises B to zero) — check that the module received gradients (frozen, "
                "learning rate, saved too early).",
                tensor=mod.b.name,
            )
        )
    scaling = cfg.scaling_for(name)
    spec = lowrank_spectrum(b, a, scaling if scaling is not None else 1.0)
    u = max(UNIT_ROUNDOFF.get(mod.a.dtype, 2.0**-24), UNIT_ROUNDOFF.get(mod.b.dtype, 2.0**-24))
    stats = spectrum_stats(spec, u)
    zero = a_zero or b_zero or stats["delta_norm"] == 0.0
    if not zero and stats["numerical_rank"] < geo.rank:
        out.append(
            finding(
                "RANK_DEFICIENT",
                name,
                f"only {stats['numerical_rank']} of the {geo.rank} directions of B·A stand above the "
                f"rounding of its {mod.b.dtype} factors; the rest are dead (never trained or collapsed) — "
                f"a rank-{max(1, stats['numerical_rank'])} adapter would do the same.",
                numerical_rank=stats["numerical_rank"],
                rank=geo.rank,
            )
        )
    return ModuleValues(scaling=scaling, stats=stats, zero=zero), out


def extra_value_findings(mod: LoraModule, block_bytes: int) -> list[Finding]:
    """Finiteness of the DoRA magnitude and lora_B.bias; non-positive magnitudes."""
    out: list[Finding] = []
    for ti in (mod.magnitude, mod.b_bias):
        if ti is None:
            continue
        if ti.dtype not in FLOAT_DTYPES:
            out.append(dtype_finding(mod.module, ti))
            continue
        x = ti.read().to(torch.float64)
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        if nan or inf:
            out.append(nonfinite_finding(mod.module, ti.name, nan, inf, x.numel()))
            continue
        if ti is mod.magnitude:
            bad = int((x <= 0).sum())
            if bad:
                out.append(
                    finding(
                        "DORA_MAGNITUDE_NONPOSITIVE",
                        mod.module,
                        f"{bad} of {x.numel()} DoRA magnitudes are zero or negative; those output rows "
                        "are switched off or sign-flipped — check the training run.",
                        count=bad,
                        min=float(x.min()),
                    )
                )
    return out


def peer_tiny_findings(records: list[dict], ratio: float) -> list[Finding]:
    """Modules whose update RMS is below ``ratio`` x the median of their peers (no ``--base``)."""
    live = [r for r in records if r.get("delta_rms")]
    if len(live) < 3:
        return []
    by_leaf: dict[str, list[float]] = {}
    for r in live:
        by_leaf.setdefault(r["module"].rsplit(".", 1)[-1], []).append(r["delta_rms"])
    overall = statistics.median(r["delta_rms"] for r in live)
    out = []
    for r in live:
        peers = by_leaf[r["module"].rsplit(".", 1)[-1]]
        ref = statistics.median(peers) if len(peers) >= 3 else overall
        if r["delta_rms"] < ratio * ref:
            out.append(
                finding(
                    "DELTA_TINY",
                    r["module"],
                    f"this module's update is {r['delta_rms'] / ref:.2g}x the typical size of its peers "
                    f"(RMS {r['delta_rms']:.3g} vs median {ref:.3g}); it barely changes the model — it may "
                    "not have trained.",
                    basis="peers",
                    ratio=r["delta_rms"] / ref,
                    delta_rms=r["delta_rms"],
                    median_rms=ref,
                )
            )
    return out
