"""DARE (Yu et al., 2024, "Language Models are Super Mario"): drop and rescale.

Each entry of Δ_i is kept with probability ``density`` (dropped with p = 1 − density) and
the survivors are divided by ``density`` = 1 − p, so the expected delta is unchanged:

    DARE(Δ)[j] = Δ[j] / density   if u_j < density,   else 0,

with u_j uniform in [0, 1) (float32, so the keep probability is density rounded to float32).
The division is an IEEE float64 division rounded once to the work dtype: the survivors are
Δ/(1 − p) correctly rounded. Then DARE-linear adds the results as task arithmetic and
DARE-TIES runs TIES' sign election and disjoint mean on them.

The random numbers are a function of (seed, tensor name, fine-tune index, position): the
flattened tensor is cut into chunks of ``CHUNK`` entries and chunk c draws from a CPU
``torch.Generator`` seeded with a stable hash (BLAKE2b) of (seed, name, index, c). So the
output is the same whatever the order tensors are processed in, the row blocks they are
cut into, the output shard layout, the device, or a resumed run.
"""

from __future__ import annotations

import hashlib

import torch

#: Entries per random chunk (a chunk's numbers come from its own seeded generator).
CHUNK = 1 << 20


def stream_seed(seed: int, name: str, index: int, chunk: int, domain: str = "dghard-dare") -> int:
    """The generator seed of one chunk: a stable 63-bit hash of (domain, seed, name, index, chunk)."""
    key = f"{domain}\0{seed}\0{name}\0{index}\0{chunk}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def uniforms(
    seed: int, name: str, index: int, numel: int, start: int, stop: int, domain: str = "dghard-dare"
) -> torch.Tensor:
    """u_j for flat positions ``[start, stop)`` of the tensor (CPU float32), from the chunked
    stream of ``domain`` (DELLA draws from the same construction in its own domain)."""
    if not 0 <= start <= stop <= numel:
        raise ValueError("range outside the tensor")
    parts = []
    c = start // CHUNK
    while c * CHUNK < stop:
        c0 = c * CHUNK
        length = min(CHUNK, numel - c0)
        g = torch.Generator().manual_seed(stream_seed(seed, name, index, c, domain))
        u = torch.rand(length, generator=g, dtype=torch.float32)
        parts.append(u[max(start, c0) - c0 : min(stop, c0 + length) - c0])
        c += 1
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def keep_mask(
    seed: int, name: str, index: int, density: float, numel: int, start: int, stop: int
) -> torch.Tensor:
    """Which entries ``[start, stop)`` of the flattened tensor survive (CPU bool tensor)."""
    return uniforms(seed, name, index, numel, start, stop) < density


def rescale(delta: torch.Tensor, density: float) -> torch.Tensor:
    """``Δ / density``: an IEEE division in float64, rounded once to Δ's dtype."""
    divisor = torch.tensor(density, dtype=torch.float64, device=delta.device)
    return torch.div(delta.to(torch.float64), divisor).to(delta.dtype)


def drop_and_rescale(delta: torch.Tensor, keep: torch.Tensor, density: float) -> torch.Tensor:
    """``Δ / density`` where ``keep``, else 0 (``keep`` has Δ's shape, or is flat)."""
    keep = keep.reshape(delta.shape).to(delta.device)
    return rescale(delta, density).masked_fill_(~keep, 0)


def dare(delta: torch.Tensor, density: float, seed: int, name: str, index: int = 0) -> torch.Tensor:
    """DARE on a whole tensor, with the random stream of (seed, name, index)."""
    n = delta.numel()
    return drop_and_rescale(delta, keep_mask(seed, name, index, density, n, 0, n), density)


class DareStream:
    """The DARE masks of one (tensor, fine-tune) pair, for consecutive row blocks."""

    def __init__(self, seed: int, name: str, index: int, density: float, numel: int) -> None:
        self.seed, self.name, self.index = seed, name, index
        self.density = density
        self.numel = numel
        self.pos = 0
        self.kept = 0

    def __call__(self, delta_block: torch.Tensor) -> torch.Tensor:
        """DARE of the next block (row-major continuation of the previous ones)."""
        n = delta_block.numel()
        keep = keep_mask(self.seed, self.name, self.index, self.density, self.numel, self.pos, self.pos + n)
        self.pos += n
        self.kept += int(torch.count_nonzero(keep))
        return drop_and_rescale(delta_block, keep, self.density)
