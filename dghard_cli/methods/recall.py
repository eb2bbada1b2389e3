"""RECALL (Wang et al., EMNLP 2025, arXiv 2510.20479): per-layer merge weights from the
similarity of hidden representations — the pure math.

The paper runs every model on a few *typical* samples (chosen by clustering the newest
fine-tune's representations), compares the models' layer-wise hidden representations, turns
the similarities into per-layer weights with a softmax, and merges layer by layer. It does not
publish its kernel, pooling, temperature or sample selection; the choices made here (all
options, all documented in the README) are:

- **models**: M = {BASE, FT_1 … FT_N}; the merged layer is the convex combination
  ``W_l = Σ_m α_{l,m}·W_{l,m} = W_base,l + Σ_i α_{l,i}·Δ_{l,i}``;
- **similarity** ``K_l(m, m')`` of two models' representations at layer l (rows aligned: the
  same tokens or samples): linear CKA (default), RBF-kernel CKA (bandwidth: the median pairwise
  distance), or the mean row-wise cosine;
- **weights**: each fine-tune r in turn is a reference; ``p^r_{l,m} = softmax_m(K_l(m, r)/T)``
  and ``α_{l,m}`` is the mean of ``p^r_{l,m}`` over the references. Where the models agree
  (typically shallow layers) the weights are near uniform — the layer is averaged and keeps
  the base's general features; where a fine-tune's representation has moved away, it keeps
  its own weight (task-specific adaptation). With one fine-tune:
  ``α_ft = 1 / (1 + exp((K(base, ft) − 1)/T))`` ∈ [½, 1);
- **typical samples**: deterministic k-means (farthest-point start, Lloyd iterations) of the
  mean-pooled last hidden states of the newest (last listed) fine-tune over the calibration
  pool; the sample nearest each centroid is taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dghard_cli.architecture import is_input_embedding, layer_index

KERNELS = ("linear-cka", "rbf-cka", "cosine")
POOLINGS = ("token", "mean")
SELECTIONS = ("kmeans", "first")


def tensor_group(name: str, num_layers: int) -> str:
    """Which representation a tensor's weights come from: ``embed`` or ``layer.<i>``.

    Layer tensors use their layer's output; input embeddings use the embedding output; any
    other tensor (final norm, lm_head) uses the last layer's output, which is its input.
    """
    i = layer_index(name)
    if i is not None:
        return f"layer.{min(i, num_layers - 1)}"
    if is_input_embedding(name):
        return "embed"
    return f"layer.{num_layers - 1}"


def _centered(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.mean(axis=0, keepdims=True)


def _cka_from_grams(kx: np.ndarray, ky: np.ndarray) -> float:
    """CKA of two already centred kernel matrices (n x n)."""
    hsic = float(np.sum(kx * ky))
    nx, ny = float(np.linalg.norm(kx)), float(np.linalg.norm(ky))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return hsic / (nx * ny)


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al., 2019) of two representations with aligned rows."""
    xc, yc = _centered(x), _centered(y)
    n, dx, dy = xc.shape[0], xc.shape[1], yc.shape[1]
    if n <= max(dx, dy):
        return _cka_from_grams(xc @ xc.T, yc @ yc.T)
    cross = float(np.linalg.norm(yc.T @ xc) ** 2)
    nx, ny = float(np.linalg.norm(xc.T @ xc)), float(np.linalg.norm(yc.T @ yc))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return cross / (nx * ny)


def _rbf_gram_centered(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    sq = np.sum(x * x, axis=1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)
    off = d2[~np.eye(len(x), dtype=bool)]
    med = float(np.median(np.sqrt(off))) if off.size else 0.0
    k = np.exp(-d2 / (2.0 * med * med)) if med > 0 else np.ones_like(d2)
    h = k - k.mean(axis=0, keepdims=True)
    return h - h.mean(axis=1, keepdims=True)


def rbf_cka(x: np.ndarray, y: np.ndarray) -> float:
    """CKA with Gaussian kernels, bandwidth σ = the median pairwise distance of each side."""
    return _cka_from_grams(_rbf_gram_centered(x), _rbf_gram_centered(y))


def cosine_rows(x: np.ndarray, y: np.ndarray) -> float:
    """Mean over aligned rows of the cosine between x_r and y_r (1 for two zero rows)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    dot = np.sum(x * y, axis=1)
    both = (nx > 0) & (ny > 0)
    cos = np.where(both, dot / np.where(both, nx * ny, 1.0), np.where((nx == 0) & (ny == 0), 1.0, 0.0))
    return float(np.mean(cos))


def similarity(kernel: str, x: np.ndarray, y: np.ndarray) -> float:
    if kernel == "linear-cka":
        return linear_cka(x, y)
    if kernel == "rbf-cka":
        return rbf_cka(x, y)
    if kernel == "cosine":
        return cosine_rows(x, y)
    raise ValueError(f"unknown kernel {kernel!r}")


def similarity_matrix(kernel: str, features: Sequence[np.ndarray]) -> np.ndarray:
    """``K[m, m']`` for every pair of models (symmetric, ones on the diagonal)."""
    m = len(features)
    out = np.eye(m)
    for a in range(m):
        for b in range(a + 1, m):
            out[a, b] = out[b, a] = similarity(kernel, features[a], features[b])
    return out


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - np.max(z))
    return e / e.sum()


def model_weights(sim: np.ndarray, temperature: float, references: Sequence[int]) -> np.ndarray:
    """``α_m = mean_r softmax_m(K[m, r] / T)`` over the reference models r."""
    if not references:
        raise ValueError("at least one reference model")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError("temperature must be > 0")
    return np.mean([softmax(sim[:, r] / temperature) for r in references], axis=0)


def select_typical(features: np.ndarray, k: int, iterations: int = 50) -> list[int]:
    """Indices of ``k`` typical rows: deterministic k-means, then the row nearest each centroid."""
    x = np.asarray(features, dtype=np.float64)
    p = x.shape[0]
    if k >= p:
        return list(range(p))
    if k <= 0:
        return []

    def sqdist(a: np.ndarray, c: np.ndarray) -> np.ndarray:
        return np.maximum(np.sum(a * a, 1)[:, None] + np.sum(c * c, 1)[None, :] - 2.0 * (a @ c.T), 0.0)

    first = int(np.argmin(sqdist(x, x.mean(axis=0, keepdims=True))[:, 0]))
    centers = [first]
    nearest = sqdist(x, x[[first]])[:, 0]
    while len(centers) < k:
        nxt = int(np.argmax(nearest))
        centers.append(nxt)
        nearest = np.minimum(nearest, sqdist(x, x[[nxt]])[:, 0])
    c = x[centers].copy()
    for _ in range(iterations):
        labels = np.argmin(sqdist(x, c), axis=1)
        new = np.stack([x[labels == j].mean(axis=0) if np.any(labels == j) else c[j] for j in range(k)])
        if np.allclose(new, c, rtol=0.0, atol=0.0):
            break
        c = new
    d = sqdist(x, c)
    chosen: list[int] = []
    for j in range(k):
        for i in np.argsort(d[:, j], kind="stable"):
            if int(i) not in chosen:
                chosen.append(int(i))
                break
    return sorted(chosen)
