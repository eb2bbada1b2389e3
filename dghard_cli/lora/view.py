"""How an adapted tensor is presented to the engine: :class:`ModuleDelta` (one LoRA module's
factors and scaling, and the ``W_base + ΔW`` rows PEFT's merge gives, DoRA and ``lora_bias``
included) and :class:`ComputedTensorInfo` (a tensor whose float32 bytes are computed on read,
in row blocks of at most ``COMPUTE_BLOCK_BYTES`` of float64).

Relies only on :class:`~dghard_cli.io.checkpoint.TensorInfo` (reading the stored factors).
:mod:`dghard_cli.lora.source` is the public entry and gives the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dghard_cli.io.checkpoint import TensorInfo

#: dtype of the adapted (computed) tensors: W_base + ΔW rounded once to float32.
VIEW_DTYPE = "F32"
#: float64 rows computed at a time when an adapted tensor is read.
COMPUTE_BLOCK_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class ModuleDelta:
    """One adapted module: its factors, PEFT's scaling, and how ΔW lies on the base weight."""

    module: str
    a: TensorInfo
    b: TensorInfo
    scaling: float
    rank: int
    transposed: bool  # ΔW = scaling·(B·A)ᵀ (embeddings, Conv1D) instead of scaling·B·A
    embedding: bool
    base: TensorInfo  # the weight ΔW is added to: BASE's, or the adapter's ``base_layer.weight``
    magnitude: TensorInfo | None = None  # DoRA
    b_bias: TensorInfo | None = None  # lora_bias

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, A)`` as stored (float64)."""
        return self.b.read().to(torch.float64), self.a.read().to(torch.float64)

    def delta_rows(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``ΔW`` (or its rows ``[r0, r1)``) in the base weight's layout, float64."""
        a = self.a.read().to(torch.float64)
        if self.transposed:
            b = self.b.read().to(torch.float64)
            at = a.T if rows is None else a[:, rows[0] : rows[1]].T
            return (at @ b.T).mul_(self.scaling)
        b = self.b.read(rows).to(torch.float64)
        return (b @ a).mul_(self.scaling)

    def adapted_rows(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``W_ft`` rows as PEFT's merge gives them, float64."""
        w = self.base.read(rows).to(torch.float64).add_(self.delta_rows(rows))
        if self.magnitude is not None:
            m = self.magnitude.read().to(torch.float64).reshape(-1)
            if rows is not None:
                m = m[rows[0] : rows[1]]
            norm = torch.linalg.vector_norm(w, dim=1)
            w.mul_((m / norm).unsqueeze(1))
        return w

    def adapted_bias(self, base_bias: TensorInfo) -> Callable[[tuple[int, int] | None], torch.Tensor]:
        assert self.b_bias is not None
        lb = self.b_bias

        def compute(rows: tuple[int, int] | None) -> torch.Tensor:
            return base_bias.read(rows).to(torch.float64) + self.scaling * lb.read(rows).to(torch.float64)

        return compute


@dataclass(frozen=True)
class ComputedTensorInfo(TensorInfo):
    """A tensor whose bytes are computed on read (float32), not stored anywhere."""

    compute: Callable[[tuple[int, int] | None], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )
    #: dtype a written checkpoint gives it by default (BASE's), not the computed float32
    output_dtype: str | None = None

    def read_raw(self, rows: tuple[int, int] | None = None, *, pin: bool = False) -> torch.Tensor:
        """float32 bytes of the tensor (or rows ``[r0, r1)``), computed in row blocks so the float64
        intermediate stays within ``COMPUTE_BLOCK_BYTES`` whatever the tensor's size."""
        assert self.compute is not None
        r0, r1 = rows if rows is not None else (0, self.shape[0] if self.shape else 1)
        shape = (r1 - r0, *self.shape[1:]) if self.shape else ()
        out = torch.empty(shape, dtype=torch.float32, pin_memory=pin)
        if len(self.shape) < 2:
            out.copy_(self.compute(rows).reshape(shape))
        else:
            step = max(1, COMPUTE_BLOCK_BYTES // max(1, 8 * math.prod(self.shape[1:])))
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                out[a - r0 : b - r0] = self.compute((a, b))
        return out.reshape(-1).view(torch.uint8)


def _computed(like: TensorInfo, name: str, shard: str, file: Path, compute, output_dtype: str) -> TensorInfo:
    numel = math.prod(like.shape)
    return ComputedTensorInfo(
        name=name,
        dtype=VIEW_DTYPE,
        shape=like.shape,
        shard=shard,
        file=file,
        offset=0,
        nbytes=numel * 4,
        reader=like.reader,
        compute=compute,
        output_dtype=output_dtype,
    )
