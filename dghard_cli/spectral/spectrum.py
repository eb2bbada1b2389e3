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

All functions here are pure: tensors in, tensors and plain statistics out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from dghard_cli.errors import InputError
from dghard_cli.io.safetensors_format import UNIT_ROUNDOFF
from dghard_cli.spectral.marchenko_pastur import (
    ks_distance,
    lambda_star,
    mp_median,
    omega,
    optimal_frobenius_shrink,
)

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


def gram_accumulate(blocks: Iterable[torch.Tensor], m_small: int, device: torch.device) -> torch.Tensor:
    """``G = Σ_b X_bᵀ X_b`` in float64 over row blocks ``X_b`` (``rows x M``) of the tall form."""
    g = torch.zeros((m_small, m_small), dtype=torch.float64, device=device)
    for xb in blocks:
        gram_add_(g, xb.to(device=device, dtype=torch.float64))
    return g


def gram_add_(g: torch.Tensor, x: torch.Tensor) -> None:
    """``g += xᵀx`` in float64, through torch's BLAS (one thread pool for all the heavy work:
    numpy's OpenBLAS pool running beside torch's OpenMP pool slowed eigensolvers 50x here)."""
    g.addmm_(x.T, x)


#: Eigenvalues of the float64 Gram matrix below ``GRAM_FLOOR * M * eps * λ_max`` are rounding
#: error of its formation and eigendecomposition, not singular values: they are set to zero.
GRAM_FLOOR = 4.0


def spectrum_from_gram(
    g: torch.Tensor, shape: tuple[int, int], *, lazy_vectors: bool | None = None
) -> Spectrum:
    """Eigendecomposition of the Gram matrix: σ descending, vectors to match.

    ``lazy_vectors`` (default: on the CPU) computes the eigenvalues alone now and only the
    vectors a filter needs later (:meth:`Spectrum.vectors_for`): about half the cost of a
    full decomposition when few components are kept. Singular values below the route's
    resolution (``sqrt(4 M eps) σ_max``, about 1e-6 σ_max for M = 4096) are exact zeros: an
    exactly rank-deficient delta then has a well-defined numerical rank, the same whatever
    rotation of it is given.
    """
    g = 0.5 * (g + g.T)  # exact symmetry for the eigensolver
    if lazy_vectors is None:
        lazy_vectors = g.device.type == "cpu"
    if lazy_vectors:
        lam = torch.linalg.eigvalsh(g).flip(0).numpy().astype(np.float64)
        vectors = None
    else:
        evals, evecs = torch.linalg.eigh(g)
        lam = evals.flip(0).cpu().numpy().astype(np.float64)
        vectors = evecs.flip(1)
    floor = GRAM_FLOOR * g.shape[0] * np.finfo(np.float64).eps * max(float(lam[0]) if lam.size else 0.0, 0.0)
    lam[lam <= floor] = 0.0
    sig = np.sqrt(lam)
    fro2 = float(torch.trace(g))
    return Spectrum(shape=shape, sigma=sig, fro2=fro2, gram=g if lazy_vectors else None, full_vectors=vectors)


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


def choose_route(device: torch.device, requested: str = "auto") -> str:
    """``gram64`` (float64 Gram) everywhere float64 is fast; ``qr32`` on GPUs where it is not."""
    if requested not in ROUTES:
        raise InputError(f"--route {requested!r} is not one of {', '.join(ROUTES)}")
    if requested != "auto":
        return requested
    if (
        device.type == "cuda"
        and tuple(torch.cuda.get_device_capability(device)) not in FAST_FP64_CAPABILITIES
    ):
        return "qr32"
    return "gram64"


def spectrum_from_r(
    r: torch.Tensor, shape: tuple[int, int], fro2: float, eigh_device: torch.device, out_device: torch.device
) -> tuple[Spectrum, float]:
    """Spectrum from the float32 R factor: float64 eigendecomposition of RᵀR.

    Returns the spectrum and the absolute error bound of its singular values used to check
    threshold decisions (see :func:`qr_decision_is_safe`).
    """
    m_small = r.shape[1]
    r64 = r.to(device=eigh_device, dtype=torch.float64)
    if r64.shape[0] < m_small:  # fewer rows than columns only for a tall form with N < M (not reached)
        r64 = torch.cat([r64, r64.new_zeros((m_small - r64.shape[0], m_small))], dim=0)
    lazy = eigh_device.type == "cpu" and out_device.type == "cpu"
    spec = spectrum_from_gram(r64.T @ r64, shape, lazy_vectors=lazy)
    if spec.full_vectors is not None:
        spec.full_vectors = spec.full_vectors.to(out_device)
    spec.fro2 = fro2
    sigma_max = float(spec.sigma[0]) if spec.sigma.size else 0.0
    bound = QR32_ERROR_FACTOR * math.sqrt(m_small) * 2.0**-24 * sigma_max
    return spec, bound


#: Singular values of the float32 QR route are trusted to ``QR32_ERROR_FACTOR·sqrt(M)·u32·σ_max``
#: (Householder QR backward error, with a safety factor; measured errors sit well below it).
QR32_ERROR_FACTOR = 8.0


def qr_decision_is_safe(
    sigma: np.ndarray, tau: float, bound: float, spec: ShrinkSpec, shape: tuple[int, int]
) -> bool:
    """True when no singular value is within the float32 route's error of the threshold.

    The threshold itself moves with the median (unknown noise: by at most ω·bound), so a
    component is decided safely when ``|σ_i − τ| > bound·(1 + ω·scale)``. Soft and optimal
    shrinkers are continuous in σ; their decision is the hard one at the same τ.
    """
    if sigma.size == 0 or bound == 0.0:
        return True
    big, small = max(shape), min(shape)
    slack = bound * (1.0 + (omega(small / big) * spec.scale if spec.noise == "median" else 0.0))
    return bool(np.min(np.abs(sigma - tau)) > slack)


def tall_rows(x: torch.Tensor, rows_per_block: int) -> Iterable[torch.Tensor]:
    """Row blocks of a matrix already in its tall form."""
    for r0 in range(0, x.shape[0], rows_per_block):
        yield x[r0 : r0 + rows_per_block]


def block_rows(ncols: int, budget_bytes: int, itemsize: int = 8) -> int:
    """Rows per block so one float64 block of ``ncols`` columns fits in ``budget_bytes``."""
    return max(1, budget_bytes // max(1, ncols * itemsize))


# -- thresholds and shrinkers ---------------------------------------------------------


def noise_from_median(median_sv: float, shape: tuple[int, int]) -> float:
    """Per-entry noise std implied by the median singular value (Marchenko–Pastur)."""
    big, small = max(shape), min(shape)
    return median_sv / math.sqrt(big * mp_median(small / big))


def gd_threshold(sigma: np.ndarray, shape: tuple[int, int], spec: ShrinkSpec) -> tuple[float, float, float]:
    """Gavish–Donoho threshold ``τ`` (scale applied), the median σ, and the noise level used.

    Unknown noise: ``τ = scale·ω(β)·median(σ)``; known noise ``s``: ``τ = scale·λ*(β)·sqrt(N)·s``.
    The median is the statistical one (mean of the middle pair for an even count).
    """
    big, small = max(shape), min(shape)
    beta = small / big
    median_sv = float(np.median(sigma)) if sigma.size else 0.0
    if spec.noise == "known":
        assert spec.sigma is not None
        noise = float(spec.sigma)
        tau0 = lambda_star(beta) * math.sqrt(big) * noise
    else:
        noise = noise_from_median(median_sv, shape)
        tau0 = omega(beta) * median_sv
    return spec.scale * tau0, median_sv, noise


def shrink_weights(
    sigma: np.ndarray, shape: tuple[int, int], tau: float, noise: float, spec: ShrinkSpec
) -> np.ndarray:
    """Weight ``w_i`` per component so that the filtered singular values are ``w_i σ_i``.

    hard: 1 above τ, else 0 (strictly above, as the paper); soft: ``max(σ − τ, 0)/σ``;
    optimal: Gavish–Donoho 2017 Frobenius shrinker with noise ``scale·s``;
    twoknob: ``a`` above τ, ``b`` at or below.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    spikes = sigma > tau
    if spec.shrink == "hard":
        return spikes.astype(np.float64)
    if spec.shrink == "twoknob":
        return np.where(spikes, spec.a, spec.b).astype(np.float64)
    safe = np.where(sigma > 0, sigma, 1.0)
    if spec.shrink == "soft":
        return np.where(sigma > 0, np.maximum(sigma - tau, 0.0) / safe, 0.0)
    # optimal
    unit = math.sqrt(max(shape)) * noise * spec.scale
    if unit <= 0:
        return (sigma > 0).astype(np.float64)
    beta = min(shape) / max(shape)
    eta = optimal_frobenius_shrink(sigma / unit, beta) * unit
    return np.where(sigma > 0, eta / safe, 0.0)


def rounding_noise(rms_ft: float, ft_dtype: str) -> float:
    """Per-entry std of the storage rounding of a tensor with this rms in this dtype."""
    return ROUNDING_STD_FACTOR * UNIT_ROUNDOFF.get(ft_dtype, 2.0**-24) * rms_ft


def filter_spectrum(
    spectrum: Spectrum,
    spec: ShrinkSpec,
    *,
    ft_dtype: str = "F32",
    rms_ft: float | None = None,
) -> Filtered:
    """Threshold, weights and the per-matrix diagnostics the report carries."""
    sigma = spectrum.sigma
    shape = spectrum.shape
    big, small = spectrum.big, spectrum.small
    beta = spectrum.beta
    tau, median_sv, noise = gd_threshold(sigma, shape, spec)
    weights = shrink_weights(sigma, shape, tau, noise, spec)
    total = float(np.sum(sigma**2))
    kept_sv = weights * sigma
    energy_kept = float(np.sum(kept_sv**2) / total) if total > 0 else 1.0
    rank_kept = int(np.count_nonzero(kept_sv > 0))
    spikes = int(np.count_nonzero(sigma > tau))

    implied = noise_from_median(median_sv, shape)
    edge = implied * (math.sqrt(big) + math.sqrt(small))
    share_above_edge = float(np.count_nonzero(sigma > edge) / small) if small else 0.0
    bulk = sigma[sigma <= tau]
    ks = ks_distance(bulk**2 / (big * implied**2), beta) if implied > 0 and bulk.size >= 2 else None
    stats: dict = {
        "beta": beta,
        "median_sv": median_sv,
        "tau": tau,
        "noise_level": noise,
        "sigma_max": float(sigma[0]) if sigma.size else 0.0,
        "rank_kept": rank_kept,
        "spikes": spikes,
        "numerical_rank": int(np.count_nonzero(sigma > 0)),
        "energy_kept": energy_kept,
        "mp_edge": edge,
        "share_above_mp_edge": share_above_edge,
        "ks_distance": ks,
        "powerlaw_slope": powerlaw_slope(sigma),
    }
    if rms_ft is not None:
        rho = rounding_noise(rms_ft, ft_dtype)
        stats["rounding_ratio"] = implied / rho if rho > 0 else None
        stats["low_rank"] = is_low_rank(sigma, shape, implied, rho)
    return Filtered(weights=weights, tau=tau, stats=stats)


def is_low_rank(sigma: np.ndarray, shape: tuple[int, int], implied_noise: float, rho: float) -> int | None:
    """Rank ``r`` if Δ is an exact low-rank update over storage rounding (a merged LoRA), else None.

    The bulk (the noise implied by the median) is at the storage-rounding level of the
    fine-tune's dtype, and a few components stand far (10x) above that rounding bulk's edge:
    the median is rounding noise and the unknown-noise threshold means nothing there.
    """
    if rho <= 0 or implied_noise > 2.0 * rho:
        return None
    big, small = max(shape), min(shape)
    rounding_edge = rho * (math.sqrt(big) + math.sqrt(small))
    r = int(np.count_nonzero(sigma > 10.0 * rounding_edge))
    return r if 1 <= r <= small // 2 else None


def powerlaw_slope(sigma: np.ndarray) -> float | None:
    """Slope of log σ_i against log i over the top half of the spectrum (a bulk-free delta
    falls off like a power law; a spiked Marchenko–Pastur spectrum is flat after the spikes)."""
    half = sigma[: max(2, sigma.size // 2)]
    half = half[half > 0]
    if half.size < 3:
        return None
    x = np.log(np.arange(1, half.size + 1, dtype=np.float64))
    y = np.log(half)
    return float(np.polyfit(x, y, 1)[0])


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


def filter_dense(
    delta: torch.Tensor,
    spec: ShrinkSpec,
    *,
    ft_dtype: str = "F32",
    rms_ft: float | None = None,
    block_bytes: int = 64 * 1024 * 1024,
) -> tuple[torch.Tensor, Filtered]:
    """Filter an in-memory delta (any device); returns ``Δ*`` in float64 and the statistics.

    Public in-memory API (the commands stream row blocks through ``SpectralFilterOp``).
    """
    if delta.ndim != 2:
        raise ValueError("filter_dense needs a 2-D tensor")
    shape = (int(delta.shape[0]), int(delta.shape[1]))
    x = delta.T if shape[0] < shape[1] else delta
    rows = block_rows(x.shape[1], block_bytes)
    g = gram_accumulate(tall_rows(x, rows), x.shape[1], delta.device)
    spectrum = spectrum_from_gram(g, shape)
    filt = filter_spectrum(spectrum, spec, ft_dtype=ft_dtype, rms_ft=rms_ft)
    proj = Projector.from_weights(spectrum, filt.weights)
    out = torch.cat([proj.apply(b.to(torch.float64)) for b in tall_rows(x, rows)], dim=0)
    return (out.T if shape[0] < shape[1] else out), filt
