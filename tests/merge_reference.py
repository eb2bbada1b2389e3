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


# -- SLERP, Breadcrumbs, DELLA, Model Stock (mergekit 0.1.5's definitions) ----------------


def ref_slerp(b: np.ndarray, f: np.ndarray, t: float) -> np.ndarray:
    """Spherical interpolation of the flattened tensors; linear when |cos| > 0.9995."""
    a, c = b.ravel(), f.ravel()
    na, nc = np.linalg.norm(a), np.linalg.norm(c)
    na = na if na > 1e-8 else 1.0
    nc = nc if nc > 1e-8 else 1.0
    cos = float(np.clip(np.dot(a / na, c / nc), -1.0, 1.0))
    if abs(cos) > 0.9995:
        return (1 - t) * b + t * f
    theta = np.arccos(cos)
    return (np.sin((1 - t) * theta) * b + np.sin(t * theta) * f) / np.sin(theta)


def breadcrumbs_mask(delta: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """Ranks (larger magnitude first, ties row-major) dropped_top+1 .. dropped_top+keep."""
    n = delta.size
    if density >= 1:
        return np.ones(delta.shape, dtype=bool)
    keep = int(density * n)
    bottom = max(0, n - keep - int(gamma * n))
    dropped = n - bottom - keep
    order = np.argsort(-np.abs(delta).ravel(), kind="stable")
    mask = np.zeros(n, dtype=bool)
    mask[order[dropped : dropped + keep]] = True
    return mask.reshape(delta.shape)


def ref_breadcrumbs(b, fs, w, density, gamma, lam, *, ties: bool, normalize: bool) -> np.ndarray:
    parts = [np.where(breadcrumbs_mask(f - b, density, gamma), f - b, 0.0) for f in fs]
    if ties:
        return b + lam * elect(parts, w, normalize=normalize)
    return b + lam * sum(wi * p for wi, p in zip(w, parts, strict=True))


def elect(parts: list[np.ndarray], weights: list[float], *, normalize: bool) -> np.ndarray:
    """TIES' sign election, then the disjoint mean (``normalize``) or the disjoint sum."""
    if normalize:
        return elect_and_mean(parts, weights)
    total = sum(w * p for w, p in zip(weights, parts, strict=True))
    sign = np.where(total >= 0, 1.0, -1.0)
    return sum(
        np.where((p != 0) & (np.sign(w * p) == sign) & (w != 0), w * p, 0.0)
        for w, p in zip(weights, parts, strict=True)
    )


def della_uniforms(seed: int, name: str, index: int, numel: int, chunk: int) -> np.ndarray:
    out = np.zeros(numel, dtype=np.float64)
    for c in range(math.ceil(numel / chunk)):
        key = f"dghard-della\0{seed}\0{name}\0{index}\0{c}".encode()
        s = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
        g = torch.Generator().manual_seed(s)
        length = min(chunk, numel - c * chunk)
        out[c * chunk : c * chunk + length] = torch.rand(length, generator=g, dtype=torch.float32).numpy()
    return out


def della_probabilities(mag32: np.ndarray, density: float, epsilon: float) -> np.ndarray:
    """Keep probabilities from the ranks of |Δ| (as formed in float32) along axis 1."""
    x = mag32.reshape(1, -1) if mag32.ndim == 1 else mag32
    m = x.shape[1]
    if m == 1:
        return np.full(mag32.shape, density)
    rank = np.argsort(np.argsort(x, axis=1, kind="stable"), axis=1, kind="stable").astype(np.float64)
    return (rank * (2 * epsilon / (m - 1)) + (density - epsilon)).reshape(mag32.shape)


def ref_della(b32, fs32, w, density, epsilon, lam, seed, name, chunk, *, ties: bool, normalize: bool):
    """DELLA from float32 inputs (ranks of the float32 |Δ|), everything else in float64."""
    b = b32.astype(np.float64)
    parts = []
    for i, f32 in enumerate(fs32):
        d = f32.astype(np.float64) - b
        p = della_probabilities(np.abs(f32 - b32), density, epsilon)
        u = della_uniforms(seed, name, i, d.size, chunk).reshape(d.shape)
        parts.append(np.where(u < p, d / p, 0.0))
    if ties:
        return b + lam * elect(parts, w, normalize=normalize)
    return b + lam * sum(wi * p for wi, p in zip(w, parts, strict=True))


def ref_model_stock(b: np.ndarray, fs: list[np.ndarray], filter_wise: bool = False) -> np.ndarray:
    deltas = [f - b for f in fs]
    if filter_wise:
        rows = [d.reshape(-1, d.shape[-1]) if d.ndim > 1 else d.reshape(1, -1) for d in deltas]
    else:
        rows = [d.reshape(1, -1) for d in deltas]
    n = len(fs)
    cos = []
    for i in range(n):
        for j in range(i + 1, n):
            den = np.maximum(np.linalg.norm(rows[i], axis=1) * np.linalg.norm(rows[j], axis=1), 1e-6)
            cos.append(np.clip((rows[i] * rows[j]).sum(axis=1) / den, -1, 1))
    c = np.mean(cos, axis=0)
    den = 1 + (n - 1) * c
    t = np.where(np.abs(den) < 1e-6, 0.0, n * c / np.where(np.abs(den) < 1e-6, 1.0, den))
    mean = sum(rows) / n
    return b + (t[:, None] * mean).reshape(b.shape)
