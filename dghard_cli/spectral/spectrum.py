"""The spectral core: singular values of a weight delta, the Gavish–Donoho cut, shrinkers.

A matrix ``Δ`` (``m x n``) is handled in its *tall form* ``X`` (``N x M``, ``N >= M``): ``X = Δ``
when ``m >= n``, else ``X = Δᵀ``. The route measured fastest and most accurate (on CPU here
and on an H200) is the eigendecomposition of the float64 Gram matrix ``G = XᵀX`` (``M x M``),
accumulated over row blocks of ``X`` so a tall matrix never has to be in memory at once:
``σ_i = sqrt(λ_i(G))`` and the right singular vectors ``V`` of ``X``. Every shrinker is a
weight ``w_i`` per singular component, and the filtered delta is

    X* = Σ_i w_i σ_i u_i v_iᵀ = c·X + (X V_S) diag(w_S − c) V_Sᵀ,

where ``c`` is the most common weight and ``S`` the components whose weight differs from it
(for the hard cut: the kept spikes, or the dropped bulk when more than half are kept), so the
projection costs ``O(N M |S|)``.

All functions here are pure: tensors in, tensors and plain statistics out. This module holds
the types (:class:`ShrinkSpec`, :class:`Spectrum`, :class:`Filtered`, :class:`Projector`);
:mod:`.routes` computes spectra, :mod:`.shrinkers` turns them into weights, :mod:`.decide` says
what that means for one matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dghard_cli.errors import InputError

SHRINKERS = ("hard", "soft", "optimal", "twoknob")
NOISE_RULES = ("median", "known")
ROUTE = "gram-eigh-float64"
ROUTE_QR32 = "qr-float32+eigh-float64"
#: ``--route`` values: the float64 Gram route, the float32 QR route, or the device's best.
ROUTES = ("auto", "gram64", "qr32")
#: CUDA compute capabilities with full-rate float64 (data-centre parts); others are ~1/32-1/64.
FAST_FP64_CAPABILITIES = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}

#: Per-entry std of round-to-nearest error, as a multiple of unit roundoff x rms(value),
#: for values spread over many binades (uniform error in ±ulp/2, ulp/|w| log-uniform).
ROUNDING_STD_FACTOR = 0.4


@dataclass(frozen=True)
class ShrinkSpec:
    """Which shrinker, at what strength, with which noise rule."""

    shrink: str = "hard"
    scale: float = 1.0
    noise: str = "median"
    sigma: float | None = None
    a: float = 1.0  # twoknob: weight of the spikes (σ > scale·τ)
    b: float = 0.0  # twoknob: weight of the bulk

    def __post_init__(self) -> None:
        if self.shrink not in SHRINKERS:
            raise InputError(f"--shrink {self.shrink!r} is not one of {', '.join(SHRINKERS)}")
        if self.noise not in NOISE_RULES:
            raise InputError(f"--noise {self.noise!r} is not one of {', '.join(NOISE_RULES)}")
        if self.noise == "known" and (self.sigma is None or not self.sigma > 0):
            raise InputError("--noise known needs --sigma S with S > 0 (per-entry noise std)")
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise InputError(f"--scale must be a finite number >= 0, got {self.scale}")
        for knob, val in (("a", self.a), ("b", self.b)):
            if not math.isfinite(val):
                raise InputError(f"--{knob} must be finite, got {val}")

    def describe(self) -> dict:
        d = {"shrink": self.shrink, "scale": self.scale, "noise": self.noise}
        if self.noise == "known":
            d["sigma"] = self.sigma
        if self.shrink == "twoknob":
            d["a"], d["b"] = self.a, self.b
        return d


@dataclass
class Spectrum:
    """Singular values (descending, float64) of the tall form, and its right singular vectors
    on demand (all of them from a full eigendecomposition, or only those a filter needs)."""

    shape: tuple[int, int]  # the original matrix shape (m, n)
    sigma: np.ndarray
    fro2: float  # ‖Δ‖_F² (trace of the Gram matrix)
    gram: torch.Tensor | None = None  # M x M float64, kept while vectors may still be asked for
    full_vectors: torch.Tensor | None = None  # M x M float64, columns ordered like ``sigma``

    @property
    def vectors(self) -> torch.Tensor:
        """All right singular vectors (a full eigendecomposition if not yet done)."""
        if self.full_vectors is None:
            assert self.gram is not None, "spectrum has neither vectors nor its Gram matrix"
            _, evecs = torch.linalg.eigh(self.gram)
            self.full_vectors = evecs.flip(1)
        return self.full_vectors

    @vectors.setter
    def vectors(self, value: torch.Tensor) -> None:
        self.full_vectors = value

    def vectors_for(self, idx: np.ndarray) -> torch.Tensor:
        """The right singular vectors of the components ``idx`` (indices into ``sigma``).

        On the CPU a top or bottom block of at most ``PARTIAL_MAX`` components comes from a
        Chebyshev-filtered subspace iteration whose residuals certify it (``PARTIAL_TOL``);
        anything else, or a block the iteration cannot certify, from the full decomposition.
        """
        idx = np.asarray(idx, dtype=np.int64)
        if self.full_vectors is None and self.gram is not None and idx.size:
            vecs = partial_eigenvectors(self.gram, self.sigma**2, idx)
            if vecs is not None:
                return vecs
        v = self.vectors
        return v[:, torch.as_tensor(idx, device=v.device, dtype=torch.long)]

    @property
    def big(self) -> int:
        return max(self.shape)

    @property
    def small(self) -> int:
        return min(self.shape)

    @property
    def beta(self) -> float:
        return self.small / self.big


@dataclass
class Filtered:
    """The result of a shrinker on one spectrum: weights plus statistics for the report."""

    weights: np.ndarray
    tau: float
    stats: dict = field(default_factory=dict)


# -- Gram accumulation and eigendecomposition ------------------------------------------


#: Largest block of eigenvectors computed by the filtered subspace iteration (else full eigh).
PARTIAL_MAX = 48
#: Residual ‖G v − θ v‖ and eigenvalue mismatch, relative to λ_max, that certify a block.
PARTIAL_TOL = 1e-11


def partial_eigenvectors(
    g: torch.Tensor, lam: np.ndarray, idx: np.ndarray, *, extra: int = 8
) -> torch.Tensor | None:
    """Eigenvectors of the symmetric ``g`` for the eigenvalues ``lam[idx]`` (``lam`` descending),
    when ``idx`` is the top or the bottom block; None when that is not the case or the result
    cannot be certified.

    A Chebyshev polynomial of ``g`` that is small on the eigenvalues outside the block (plus
    ``extra`` guard vectors) and large on the block is applied to random vectors; a
    Rayleigh–Ritz step then separates the block's eigenvectors, and every residual
    ‖g v − θ v‖ and every θ − λ must be below ``PARTIAL_TOL·λ_max``. The subspace error is then
    below residual / gap, where the gap is the distance to the first eigenvalue outside.
    """
    m = g.shape[0]
    k = idx.size
    if k == 0 or k > PARTIAL_MAX or g.device.type != "cpu":
        return None
    top = bool(np.array_equal(idx, np.arange(k)))
    bottom = bool(np.array_equal(idx, np.arange(m - k, m)))
    if not (top or bottom):
        return None
    width = min(m - 1, k + extra)
    if width <= k:
        return None
    lam_max = float(max(abs(lam[0]), abs(lam[-1]), 1e-300))
    if top:
        lo, hi, want = float(lam[-1]), float(lam[width]), float(lam[k - 1])
    else:  # the same on -g
        lo, hi, want = -float(lam[0]), -float(lam[m - 1 - width]), -float(lam[m - k])
    c, e = 0.5 * (hi + lo), 0.5 * (hi - lo)
    if e <= 0:
        return None
    gamma = (want - c) / e
    if gamma <= 1.0 + 1e-6:
        return None
    strongest = ((float(lam[0]) if top else -float(lam[-1])) - c) / e
    # Degree per pass: the block's strongest direction must not outgrow its weakest by more than
    # ~1e6 before the basis is re-orthonormalised (or rounding would erase the weakest).
    spread = math.acosh(max(strongest, gamma)) - math.acosh(gamma)
    per_pass = int(min(8, max(1, math.floor(13.8 / spread)) if spread > 0 else 8))
    gain = math.log(math.cosh(per_pass * math.acosh(gamma)))  # damping won per pass, log scale
    passes = int(math.ceil(math.log(1e16) / gain))
    if passes * per_pass > 160:
        return None
    op = g if top else -g
    gen = torch.Generator().manual_seed(m * 7919 + k)
    y = torch.linalg.qr(torch.randn((m, width), generator=gen, dtype=torch.float64))[0]
    for _ in range(passes):  # Chebyshev filter of degree ``per_pass``, then re-orthonormalise
        y_prev, y_cur = y, (op @ y - c * y) / e
        for _ in range(1, per_pass):
            y_prev, y_cur = y_cur, 2.0 * (op @ y_cur - c * y_cur) / e - y_prev
        y = torch.linalg.qr(y_cur)[0]
    theta, w = torch.linalg.eigh(y.T @ g @ y)
    order = torch.argsort(theta, descending=True)
    sel = order[:k] if top else order[-k:]
    theta, v = theta[sel], y @ w[:, sel]
    res = torch.linalg.vector_norm(g @ v - v * theta, dim=0)
    target = torch.from_numpy(np.ascontiguousarray(lam[idx]))
    if (
        float(res.max()) > PARTIAL_TOL * lam_max
        or float((theta - target).abs().max()) > PARTIAL_TOL * lam_max
    ):
        return None
    return v.contiguous()


# -- thresholds and shrinkers ---------------------------------------------------------


# -- applying the weights -------------------------------------------------------------


@dataclass
class Projector:
    """``X* = c·X + (X V_S) diag(d) V_Sᵀ`` on row blocks of the tall form."""

    c: float
    vs: torch.Tensor  # M x |S| float64
    d: torch.Tensor  # |S| float64

    @classmethod
    def from_weights(cls, spectrum: Spectrum, weights: np.ndarray) -> Projector:
        w = np.asarray(weights, dtype=np.float64).copy()
        w[spectrum.sigma == 0] = np.nan  # any weight does for a null component
        finite = w[~np.isnan(w)]
        if finite.size == 0:
            c = 0.0
        else:
            values, counts = np.unique(finite, return_counts=True)
            c = float(values[np.argmax(counts)])
        w = np.where(np.isnan(w), c, w)
        idx = np.flatnonzero(w != c)
        if idx.size:
            vs = spectrum.vectors_for(idx)
        else:
            vs = torch.zeros((spectrum.small, 0), dtype=torch.float64)
        dev = (
            spectrum.full_vectors.device
            if spectrum.full_vectors is not None
            else (spectrum.gram.device if spectrum.gram is not None else vs.device)
        )
        vs = vs.to(dev)
        d = torch.as_tensor(w[idx] - c, dtype=torch.float64, device=dev)
        return cls(c=c, vs=vs, d=d)

    @property
    def identity(self) -> bool:
        return self.c == 1.0 and self.vs.shape[1] == 0

    @property
    def zero(self) -> bool:
        return self.c == 0.0 and self.vs.shape[1] == 0

    def apply(self, xb: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Filtered rows for a float64 row block ``xb`` of the tall form (same device).

        ``inplace`` overwrites ``xb`` (saves one block of memory when it is a temporary).
        """
        coeff = (xb @ self.vs) * self.d if self.vs.shape[1] else None
        if inplace:
            out = xb.mul_(self.c) if self.c != 1.0 else xb
        else:
            out = xb * self.c if self.c != 1.0 else xb.clone()
        if coeff is not None:
            out.addmm_(coeff, self.vs.T)
        return out
