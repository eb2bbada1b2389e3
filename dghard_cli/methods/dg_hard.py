"""DG-Hard (and the other spectral shrinkers) as a per-tensor pipeline operation.

For one matrix the operation makes two passes over row blocks of the delta (tall form; see
:mod:`dghard_cli.spectral.spectrum`): the first accumulates the float64 Gram matrix, the second applies
the filter and writes ``W_base + Δ*`` in the output dtype, block by block. A matrix too large
to prefetch is read from disk block by block in both passes, so memory never grows with it.

Decisions recorded per tensor: ``unchanged`` (Δ = 0: the fine-tune's value), ``low-rank``
(the median singular value is storage rounding noise, as for a merged LoRA: the unknown-noise
threshold means nothing, so the fine-tune's value is kept), rank 0 (the base's value), all
components kept (the fine-tune's value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dghard_cli.engine.ops import JobInputs, cast_out, passthrough
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.scratch import Scratch, current
from dghard_cli.errors import KEEP_NONFINITE, InputError, RuntimeFailure
from dghard_cli.io.safetensors_format import torch_dtype
from dghard_cli.spectral.decide import LOW_RANK, UNCHANGED, Decision, decide
from dghard_cli.spectral.routes import (
    block_rows,
    choose_route,
    gram_add_,
    qr_decision_is_safe,
    spectrum_from_gram,
    spectrum_from_r,
)
from dghard_cli.spectral.spectrum import ROUTE, ROUTE_QR32, Projector, ShrinkSpec, Spectrum


class NonFiniteDelta(InputError):
    """An input tensor holds NaN/Inf (or its delta overflows)."""


@dataclass
class DeltaSpectrum:
    """Pass 1 over a job's delta: its spectrum (None when Δ = 0) and ‖W_ft‖ statistics."""

    spectrum: Spectrum | None
    fro2: float
    rms_ft: float
    shape: tuple[int, int]
    route: str = ROUTE
    sigma_bound: float = 0.0  # absolute error bound of the singular values (0: float64 route)
    delta: torch.Tensor | None = None  # the float64 tall-form delta, kept when it was one block
    dot_base: float = 0.0  # ⟨Δ, W_base⟩ (float64): how much of Δ points along the base weights


def delta_blocks(src: JobInputs, rows: int, cols: int, device: torch.device, block_bytes: int, ft: int = 0):
    """Blocks ``(range, base block, ft block)`` of a matrix's first ``rows`` rows, on ``device``.

    Tall matrices (rows >= cols) come in row blocks, read from disk block by block when the
    job was not prefetched; wide ones are read whole and split into column blocks. Either way
    the tall form of a block's delta is ``f - b`` (tall) or ``(f - b).T`` (wide).
    """
    if rows >= cols:
        step = block_rows(cols, block_bytes)
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            yield (r0, r1), _to(src.base((r0, r1)), device), _to(src.ft(ft, (r0, r1)), device)
    else:
        base = _to(src.base()[:rows], device)
        fine = _to(src.ft(ft)[:rows], device)
        step = block_rows(rows, block_bytes)
        for c0 in range(0, cols, step):
            c1 = min(c0 + step, cols)
            yield (c0, c1), base[:, c0:c1], fine[:, c0:c1]


def _dot64(
    x: torch.Tensor, b: torch.Tensor, chunk_elems: int = 1 << 20, work: Scratch | None = None
) -> torch.Tensor:
    """⟨x, b⟩ in float64 for a float64 ``x`` and a ``b`` of any float dtype and the same 2-D
    shape, in row chunks so the float64 copy of ``b`` stays small (a whole one would double a
    block's memory); the copy goes in ``work`` when given."""
    step = max(1, chunk_elems // max(1, x.shape[1]))
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for r0 in range(0, x.shape[0], step):
        xs = x[r0 : r0 + step]
        bs = _f64(b[r0 : r0 + step], work, "dg.b64")  # pass 1: the slot of pass 2's base block
        total += torch.sum(xs * bs) if not xs.is_contiguous() else torch.dot(xs.reshape(-1), bs.reshape(-1))
    return total


def _f64(t: torch.Tensor, work: Scratch | None, slot: str) -> torch.Tensor:
    """A float64 copy of ``t`` — always a copy, written in place by the callers (a float64
    input's ``.to`` would be the input itself): a new tensor, or ``work``'s buffer for ``slot``
    (contiguous either way for the non-dense slices given here, so the products that follow see
    the same layout)."""
    if work is None:
        return t.to(torch.float64, copy=True)
    return work.take(slot, t.shape, torch.float64, t.device).copy_(t)


def _own(t: torch.Tensor, work: Scratch | None) -> torch.Tensor:
    """``t``, copied when it is a scratch buffer (a block about to leave for the writer)."""
    return t.clone() if work is not None and work.owns(t) else t


def default_block_bytes(device: torch.device) -> int:
    """Float64 block size of the spectral passes: 32 MB on CPU (resident memory), 1 GB on GPU."""
    return (1 << 30) if device.type == "cuda" else (32 << 20)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a synchronising copy when the host buffer is pinned."""
    if device.type == "cpu":
        return t
    return t.to(device, non_blocking=t.is_pinned())


def delta_spectrum(
    job: TensorJob,
    src: JobInputs,
    device: torch.device,
    block_bytes: int = 64 * 1024 * 1024,
    ft: int = 0,
    route: str = "gram64",
) -> DeltaSpectrum:
    """Spectrum of Δ = W_ft − W_base (shared rows only for a resized vocabulary).

    ``gram64``: accumulates the float64 Gram matrix of the tall form block by block.
    ``qr32``: a float32 QR of the tall form over row blocks (TSQR), then a float64
    eigendecomposition of RᵀR (on the CPU when the device's float64 is slow); the singular
    values' error bound travels with the result (``sigma_bound``) so decisions can be checked.
    Raises NonFiniteDelta (an InputError naming the tensor) when an input holds NaN/Inf.
    """
    rows = job.shared_rows if job.shared_rows is not None else job.shape[0]
    cols = job.shape[1]
    shape = (rows, cols)
    tall = rows >= cols
    small = min(shape)
    gram = route == "gram64"
    g = torch.zeros((small, small), dtype=torch.float64, device=device)
    sumsq_ft = torch.zeros((), dtype=torch.float64, device=device)
    fro2_t = torch.zeros((), dtype=torch.float64, device=device)
    dot_t = torch.zeros((), dtype=torch.float64, device=device)
    r: torch.Tensor | None = None
    nblocks = 0
    # CPU: the float64 blocks live in the job's scratch (the kept one-block delta too: it is valid
    # until the job's next delta_spectrum)
    work = current() if device.type == "cpu" else None
    for _, b, f in delta_blocks(src, rows, cols, device, block_bytes, ft):
        nblocks += 1
        x = _f64(f, work, "dg.x")
        sumsq_ft += torch.linalg.vector_norm(x) ** 2
        x = x.sub_(b)  # exact: the difference of two float32-representable values
        dot_t += _dot64(x, b, work=work)
        if not tall:
            x = x.T
        if gram:
            gram_add_(g, x)
        else:
            fro2_t += torch.linalg.vector_norm(x) ** 2
            x32 = x.to(torch.float32)
            r = torch.linalg.qr(x32 if r is None else torch.cat([r, x32], dim=0), mode="r")[1]
    finite = bool(torch.isfinite(g).all()) if gram else bool(torch.isfinite(fro2_t))
    if not finite or not bool(torch.isfinite(sumsq_ft)):
        raise NonFiniteDelta(
            f"tensor {job.name!r}: BASE or fine-tune values are NaN/Inf (or overflow); fix the checkpoint",
            advice=KEEP_NONFINITE,
        )
    rms_ft = math.sqrt(float(sumsq_ft) / (rows * cols))
    kept = x if nblocks == 1 else None  # pass 2 reuses a one-block delta instead of re-forming it
    if gram:
        fro2 = float(torch.trace(g))
        spectrum = spectrum_from_gram(g, shape) if fro2 > 0.0 else None
        return DeltaSpectrum(
            spectrum=spectrum, fro2=fro2, rms_ft=rms_ft, shape=shape, delta=kept, dot_base=float(dot_t)
        )
    fro2 = float(fro2_t)
    if fro2 == 0.0 or r is None:
        return DeltaSpectrum(spectrum=None, fro2=0.0, rms_ft=rms_ft, shape=shape, route=ROUTE_QR32)
    slow_fp64 = device.type == "cuda" and choose_route(device) == "qr32"
    eigh_device = torch.device("cpu") if slow_fp64 else device
    spectrum, bound = spectrum_from_r(r, shape, fro2, eigh_device, device)
    return DeltaSpectrum(
        spectrum, fro2, rms_ft, shape, route=ROUTE_QR32, sigma_bound=bound, delta=kept, dot_base=float(dot_t)
    )


class SpectralFilterOp:
    """Runs a shrinker on the delta of every method tensor of a plan."""

    def __init__(
        self, spec: ShrinkSpec, device: torch.device, block_bytes: int = 32 * 1024 * 1024, route: str = "auto"
    ) -> None:
        self.spec = spec
        self.device = device
        self.block_bytes = block_bytes
        self.route = choose_route(device, route)

    def spectrum(self, job: TensorJob, src: JobInputs, ft: int = 0) -> tuple[DeltaSpectrum, Decision]:
        """The delta's spectrum and the shrinker's decision, by the fast route when it is safe.

        On the float32 route, a matrix whose cut falls within the route's error bound of a
        singular value is recomputed on the float64 route (and reported so).
        """
        ds = delta_spectrum(job, src, self.device, self.block_bytes, ft, route=self.route)
        dec = decide(ds.spectrum, self.spec, ft_dtype=job.fts[ft].dtype, rms_ft=ds.rms_ft)
        if dec.filtered is None:
            return ds, dec
        if ds.sigma_bound and not qr_decision_is_safe(
            ds.spectrum.sigma, dec.filtered.tau, ds.sigma_bound, self.spec, ds.shape
        ):
            ds = delta_spectrum(job, src, self.device, self.block_bytes, ft, route="gram64")
            ds.route = ROUTE + " (float32 cut was ambiguous)"
            dec = decide(ds.spectrum, self.spec, ft_dtype=job.fts[ft].dtype, rms_ft=ds.rms_ft)
        return ds, dec

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        try:
            ds, dec = self.spectrum(job, src)
        except NonFiniteDelta:
            if not src.allow_nonfinite:
                raise
            rec["action"], rec["reason"], rec["nonfinite"] = "kept-ft", "nonfinite", True
            yield from passthrough(job, src, rec)
            return
        rec["delta_norm"] = math.sqrt(max(ds.fro2, 0.0))
        rec["delta_dot_base"] = ds.dot_base
        if dec.kind == UNCHANGED:
            rec["action"], rec["reason"] = "kept-ft", "unchanged"
            yield from passthrough(job, src, rec)
            return
        rec.update(_round_stats(dec.stats))
        rec["route"] = ds.route
        if dec.kind == LOW_RANK:
            rec["action"], rec["reason"] = "kept-ft", "low-rank"
            yield from passthrough(job, src, rec)
            return
        proj = dec.projector(ds.spectrum, self.device)
        if proj.identity and job.shared_rows is None:
            yield from passthrough(job, src, rec)
            return
        delta, ds.delta = ds.delta, None
        yield from filtered_pass(
            job,
            src,
            ds.shape,
            self.device,
            self.block_bytes,
            [proj],
            check=lambda t: _fits(t, job),
            delta=delta,
        )


def filtered_pass(
    job: TensorJob,
    src: JobInputs,
    shape: tuple[int, int],
    device: torch.device,
    block_bytes: int,
    projectors: Sequence[Projector | None],
    *,
    check: Callable[[torch.Tensor], torch.Tensor],
    weights: Sequence[float] | None = None,
    lam: float = 1.0,
    delta: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Pass 2 of a spectral operation: the output's blocks in the output dtype, in order.

    ``weights`` None (``repair``): ``W_base + Δ*`` with the one projector of ``projectors``
    (``delta``: pass 1's float64 tall-form delta when it was one block, reused instead of
    re-read). Otherwise (``merge``): ``W_base + λ·Σ_i w_i·Δ_i*``, one projector per fine-tune
    (None: Δ_i = 0). ``check`` sees every float64 block before its cast (and may raise).
    Rows beyond ``shape`` (a resized vocabulary) keep the first fine-tune's values.
    """
    rows, cols = shape
    tall = rows >= cols
    out_dtype = torch_dtype(job.out_dtype)
    single = weights is None
    work = current() if device.type == "cpu" else None
    if single and delta is not None and not projectors[0].zero:  # one block: reuse pass 1's delta
        b64 = _f64(_to(src.base()[:rows], device), work, "dg.b64")
        xs = projectors[0].apply(delta, inplace=True)
        del delta
        yield _own(check(b64.add_(xs if tall else xs.T)).to(out_dtype), work).cpu()
        del xs, b64
    else:
        n = 1 if single else len(projectors)
        gens = [delta_blocks(src, rows, cols, device, block_bytes, ft=i) for i in range(n)]
        full = None if tall else torch.empty((rows, cols), dtype=out_dtype, device=device)
        for parts in zip(*gens, strict=True):
            rng, b, _ = parts[0]
            fines = [f for _, _, f in parts]
            if single:
                out = _filtered_block(b, fines[0], projectors[0], tall, out_dtype, check, work)
            else:
                out = _merged_block(b, fines, projectors, weights, lam, tall, out_dtype, check, work)
            if full is None:
                yield _own(out, work).cpu()
            else:
                full[:, rng[0] : rng[1]] = out
        if full is not None:
            yield full.cpu()
    if job.shared_rows is not None and job.shape[0] > rows:
        yield cast_out(src.ft(0, (rows, job.shape[0])), job.out_dtype, job.name)


def _filtered_block(
    b, f, proj: Projector, tall: bool, out_dtype, check, work: Scratch | None = None
) -> torch.Tensor:
    """``W_base + Δ*`` of one block (rank 0: the base's value as stored); the float64 copies in
    ``work`` when given (the result may then be one of its buffers)."""
    if proj.zero:
        return b.to(out_dtype)
    b64 = _f64(b, work, "dg.b64")
    x = _f64(f, work, "dg.x").sub_(b64)
    xs = proj.apply(x if tall else x.T, inplace=True)
    return check(b64.add_(xs if tall else xs.T)).to(out_dtype)


def _merged_block(
    b, fines, projectors, weights, lam: float, tall: bool, out_dtype, check, work: Scratch | None = None
) -> torch.Tensor:
    """``W_base + λ·Σ_i w_i·Δ_i*`` of one block, accumulated from zero in float64 (the copies in
    ``work`` when given: the result may then be one of its buffers)."""
    b64 = _f64(b, work, "dg.b64")
    acc_shape = b64.shape if tall else b64.T.shape
    acc = (
        torch.zeros(acc_shape, dtype=torch.float64, device=b64.device)
        if work is None
        else work.take("dg.acc", acc_shape, torch.float64, b64.device).zero_()
    )
    for f, proj, w in zip(fines, projectors, weights, strict=True):
        if proj is None or proj.zero or w == 0:
            continue
        x = _f64(f, work, "dg.x").sub_(b64)
        acc.add_(proj.apply(x if tall else x.T, inplace=True), alpha=w)
    if lam != 1.0:
        acc.mul_(lam)
    return check(b64.add_(acc if tall else acc.T)).to(out_dtype)


def _fits(t: torch.Tensor, job: TensorJob) -> torch.Tensor:
    """Refuse to write values the output dtype cannot hold.

    The filtered values are finite by construction (the Gram matrix was checked finite, so
    every delta entry is, and the projector is made of unit vectors), so only a cast that
    overflows (float16's range is ±65504) could create an Inf; check that cheaply.
    """
    if job.out_dtype == "F16" and float(t.abs().max()) > 65504.0:
        raise RuntimeFailure(
            f"tensor {job.name!r}: the repaired values exceed float16's range; use --dtype bf16 or fp32"
        )
    return t


def _round_stats(stats: dict) -> dict:
    out = {}
    for k, v in stats.items():
        out[k] = float(f"{v:.10g}") if isinstance(v, float) else v
    return out
