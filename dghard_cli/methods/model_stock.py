"""Model Stock (Jang et al., 2024): move from BASE towards the fine-tunes' average by a step set
by how much their task vectors agree.

Per tensor (or per row with ``filter_wise``), with N ≥ 2 fine-tunes and Δ_i = W_i − W_base
(mergekit 0.1.5's definition):

    cos = mean over pairs i < j of clamp(⟨Δ_i, Δ_j⟩ / max(‖Δ_i‖·‖Δ_j‖, 1e-6), −1, 1)
    t   = N·cos / (1 + (N − 1)·cos)          (t = 0 where |1 + (N − 1)·cos| < 1e-6)
    W   = t·mean_i(W_i) + (1 − t)·W_base = W_base + t·mean_i(Δ_i)

Fine-tunes that agree (cos → 1) give t → 1, the plain average; orthogonal ones (cos = 0)
give t = 0, BASE. Whole-tensor dot products are accumulated in float64 over row blocks (one
statistics pass); ``filter_wise`` takes one t per row (a 1-D tensor is one row) and needs no
statistics pass. There are no weights: the method sets its own.

Everything here is a pure function of tensors or numbers, except :class:`ModelStockKernel`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from dghard_cli.methods.merge_ops import BlockExact, Kernel
from dghard_cli.methods.registry import BOOL, BuildContext, MergeMethod, Param, boolean

NORM_FLOOR = 1e-6  # mergekit clamps ‖Δ_i‖·‖Δ_j‖ to at least this
SINGULAR = 1e-6  # |1 + (N − 1)·cos| below this: keep BASE (t = 0)


def _pair_cosines(gram: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine from Gram entries ``gram[..., i, j] = ⟨Δ_i, Δ_j⟩`` (float64)."""
    n = gram.shape[-1]
    diag = torch.diagonal(gram, dim1=-2, dim2=-1).clamp(min=0).sqrt()
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            den = (diag[..., i] * diag[..., j]).clamp(min=NORM_FLOOR)
            cos.append((gram[..., i, j] / den).clamp(-1, 1))
    return torch.stack(cos).mean(dim=0)


def stock_ratio(cos: torch.Tensor, n: int) -> torch.Tensor:
    """t = N·cos / (1 + (N − 1)·cos), 0 where the denominator is (nearly) 0."""
    den = 1 + (n - 1) * cos
    singular = den.abs() < SINGULAR
    return torch.where(singular, torch.zeros_like(cos), n * cos / torch.where(singular, 1, den))


def gram(deltas: Sequence[torch.Tensor], dim: int | None = None) -> torch.Tensor:
    """⟨Δ_i, Δ_j⟩ in float64: one N×N matrix (``dim=None``) or one per row (``dim=-1``)."""
    flat = [d.to(torch.float64) for d in deltas]
    if dim is None:
        flat = [f.reshape(-1) for f in flat]
        return torch.stack([torch.stack([a @ b for b in flat]) for a in flat])
    rows = [f.reshape(-1, f.shape[-1]) if f.dim() > 1 else f.reshape(1, -1) for f in flat]
    return torch.stack([torch.stack([(a * b).sum(-1) for b in rows], -1) for a in rows], -2)


def model_stock(base: torch.Tensor, fts: Sequence[torch.Tensor], filter_wise: bool = False) -> torch.Tensor:
    """Model Stock on whole tensors (statistics in float64, result in BASE's dtype)."""
    deltas = [f.to(torch.float64) - base.to(torch.float64) for f in fts]
    t = stock_ratio(_pair_cosines(gram(deltas, -1 if filter_wise else None)), len(fts))
    mean = sum(deltas) / len(deltas)
    if filter_wise:
        mean = mean.reshape(t.shape[0], -1) * t.unsqueeze(-1)
    else:
        mean = mean * t
    return (base.to(torch.float64) + mean.reshape(base.shape)).to(base.dtype)


class ModelStockKernel(Kernel):
    """Model Stock over N ≥ 2 fine-tunes: a statistics pass (the Gram matrix), then t·mean(Δ_i)."""

    def __init__(self, n: int, *, filter_wise: bool = False) -> None:
        self.n = n
        self.filter_wise = filter_wise
        self.needs_rows = filter_wise  # t per row: each block holds whole rows
        self._gram = torch.zeros((n, n), dtype=torch.float64)
        self._seen = filter_wise  # per row: every block has its rows whole, no pass needed
        self.t: float | None = None
        self.cos: float | None = None
        self._rows_t: list[torch.Tensor] = []

    def pending(self) -> bool:
        return not self._seen

    def observe(self, base: torch.Tensor, fts: list[torch.Tensor]) -> None:
        self._gram += gram([torch.sub(f, base) for f in fts]).cpu()

    def end_pass(self) -> None:
        self._seen = True
        cos = _pair_cosines(self._gram)
        self.cos = float(cos)
        self.t = float(stock_ratio(cos, self.n))

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        mean = deltas[0].clone()
        for d in deltas[1:]:
            mean.add_(d)
        mean.div_(self.n)
        if not self.filter_wise:
            assert self.t is not None
            return mean.mul_(self.t)
        t = stock_ratio(_pair_cosines(gram(deltas, -1)), self.n)
        self._rows_t.append(t.cpu())
        rows = mean.reshape(t.shape[0], -1)
        return rows.mul_(t.unsqueeze(-1).to(mean.dtype)).reshape(mean.shape)

    def stats(self) -> dict:
        if not self.filter_wise:
            return {"stock_t": self.t, "cosine": self.cos}
        t = torch.cat(self._rows_t) if self._rows_t else torch.zeros(0, dtype=torch.float64)
        return {
            "stock_t_mean": float(t.mean()) if t.numel() else None,
            "stock_t_min": float(t.min()) if t.numel() else None,
            "stock_t_max": float(t.max()) if t.numel() else None,
        }


# -- declared for dghard merge (see dghard_cli.methods.registry) ------------------------------------


def _model_stock_op(p: dict, ctx: BuildContext):
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp

    return ElementwiseMergeOp(
        lambda job: ModelStockKernel(len(job.fts), filter_wise=p["filter_wise"]), ctx.device, ctx.block_bytes
    )


def _summary(rows: list[dict], p: dict) -> dict:
    ts = [r["stock_t"] for r in rows if r.get("stock_t") is not None]
    ts += [r["stock_t_mean"] for r in rows if r.get("stock_t_mean") is not None]
    return {"median_stock_t": statistics.median(ts)} if ts else {}


PARAMS = (
    Param(
        "filter_wise",
        BOOL,
        "model-stock: one ratio t per row instead of per tensor.",
        default=False,
        check=boolean("filter_wise", "--filter-wise"),
        flag="--filter-wise",
    ),
)
MERGE_METHODS = (
    MergeMethod("model-stock", ("filter_wise",), _model_stock_op, summary=_summary, min_fine_tunes=2),
)
