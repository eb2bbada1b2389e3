"""Independent float64 references for the merge methods, written from their definitions.

Nothing here imports dghard_cli. The DARE random stream is rebuilt from its documented
definition (BLAKE2b of (seed, name, index, chunk) seeds a CPU torch.Generator per chunk).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch


def keep_count(n: int, density: float) -> int:
    if density >= 1:
        return n
    return max(1, int(density * n))


def topk_mask(delta: np.ndarray, density: float) -> np.ndarray:
    """Top-k by magnitude; ties at the threshold: the first ones in row-major order."""
    a = np.abs(delta).ravel()
    k = keep_count(a.size, density)
    order = np.argsort(-a, kind="stable")  # stable: equal magnitudes keep row-major order
    mask = np.zeros(a.size, dtype=bool)
    mask[order[:k]] = True
    return mask.reshape(delta.shape)


def elect_and_mean(parts: list[np.ndarray], weights: list[float]) -> np.ndarray:
    total = sum(w * p for w, p in zip(weights, parts, strict=True))
    sign = np.where(total >= 0, 1.0, -1.0)
    num = np.zeros_like(parts[0])
    den = np.zeros_like(parts[0])
    for w, p in zip(weights, parts, strict=True):
        agree = (p != 0) & (np.sign(w * p) == sign) & (w != 0)
        num += np.where(agree, w * p, 0.0)
        den += np.where(agree, w, 0.0)
    return np.where(den != 0, num / np.where(den != 0, den, 1.0), 0.0)


def ref_wise_ft(b: np.ndarray, f: np.ndarray, alpha: float) -> np.ndarray:
    return (1 - alpha) * b + alpha * f


def ref_task_arithmetic(b: np.ndarray, fs: list[np.ndarray], w: list[float], lam: float) -> np.ndarray:
    return b + lam * sum(wi * (f - b) for wi, f in zip(w, fs, strict=True))


def ref_ties(b: np.ndarray, fs: list[np.ndarray], w: list[float], density: float, lam: float) -> np.ndarray:
    trimmed = []
    for f in fs:
        d = f - b
        trimmed.append(np.where(topk_mask(d, density), d, 0.0))
    return b + lam * elect_and_mean(trimmed, w)


def dare_keep(seed: int, name: str, index: int, density: float, numel: int, chunk: int) -> np.ndarray:
    out = np.zeros(numel, dtype=bool)
    for c in range(math.ceil(numel / chunk)):
        key = f"dghard-dare\0{seed}\0{name}\0{index}\0{c}".encode()
        s = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
        g = torch.Generator().manual_seed(s)
        length = min(chunk, numel - c * chunk)
        u = torch.rand(length, generator=g, dtype=torch.float32)
        out[c * chunk : c * chunk + length] = (u < density).numpy()
    return out


def ref_dare(
    b: np.ndarray,
    fs: list[np.ndarray],
    w: list[float],
    density: float,
    lam: float,
    seed: int,
    name: str,
    chunk: int,
    *,
    ties: bool,
) -> np.ndarray:
    dropped = []
    for i, f in enumerate(fs):
        d = f - b
        keep = dare_keep(seed, name, i, density, d.size, chunk).reshape(d.shape)
        dropped.append(np.where(keep, d / density, 0.0))
    if ties:
        return b + lam * elect_and_mean(dropped, w)
    return b + lam * sum(wi * p for wi, p in zip(w, dropped, strict=True))


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA from the centred Gram matrices (n x n), as in Kornblith et al. (2019)."""
    n = x.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    kx = h @ (x @ x.T) @ h
    ky = h @ (y @ y.T) @ h
    return float(np.trace(kx @ ky) / (np.linalg.norm(kx) * np.linalg.norm(ky)))


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()
