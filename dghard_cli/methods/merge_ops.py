"""Per-tensor pipeline operations for ``dghard merge``.

An elementwise merge (WiSE-FT, task arithmetic, TIES, DARE, DARE-TIES, RECALL) is a *kernel*
that maps the fine-tunes' delta blocks to the merged delta block; :class:`ElementwiseMergeOp`
reads BASE and every fine-tune in row blocks (all inputs streamed together, tensor by tensor),
forms Δ_i = W_i − W_base in the work dtype, applies the kernel and yields ``W_base + merged``
in the output dtype. TIES needs each delta's top-k: tensors up to ``WHOLE_BYTES`` of work
copies are processed whole (select and trim in one pass); larger ones get the same exact
selection from statistics passes over their row blocks (:mod:`dghard_cli.methods.topk_stream`),
then are trimmed block by block, so memory stays a few blocks whatever the tensor's size.
Kernels that need other whole-tensor statistics first (SLERP's norms, Model Stock's cosines)
use the same statistics passes.

Work dtype: float32 (float64 when an input is stored in float64). The difference of two
bf16/fp16 numbers is exact in float32; that of two float32 numbers is rounded once, and TIES'
top-k stays exact anyway (see :mod:`dghard_cli.methods.ties`: the few entries whose rounded
magnitude equals the rounded threshold are ranked by their float64 magnitude).

:class:`~dghard_cli.methods.spectral_merge.SpectralMergeOp` is DG-Hard in merge: each Δ_i of an eligible matrix is filtered as in
``repair`` (same spectra, same projector), then combined by task arithmetic; tensors that are
not eligible matrices get plain task arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from dghard_cli.engine.ops import JobInputs, OutputRangeError, all_finite, cast_out, strength_advice
from dghard_cli.engine.plan import TensorJob
from dghard_cli.engine.scratch import Scratch, current
from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.methods import ties as T
from dghard_cli.methods.dare import DareStream
from dghard_cli.methods.task_arithmetic import task_arithmetic_delta
from dghard_cli.methods.topk_stream import StreamingTopK
from dghard_cli.methods.wise_ft import wise_ft_delta

#: ``exact(i, positions) -> float64 |W_i − W_base|`` at flat positions of the current block.
BlockExact = Callable[[int, "torch.Tensor"], "torch.Tensor"]

BLOCK_BYTES = 64 * 1024 * 1024


def per_ft(value: float | Sequence[float], n: int) -> list[float]:
    """One value per fine-tune from one value (the same for all) or a list of them."""
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * n


#: TIES works on a whole tensor at once (one pass selects and trims) when all its work copies
#: fit in this; larger tensors are selected by statistics passes over row blocks, then trimmed
#: block by block (peak memory: a few blocks, not a few copies of the tensor).
WHOLE_BYTES = 128 * 1024 * 1024
#: Elements read at once when TIES ranks the entries tied at its threshold by exact magnitude.
EXACT_SPAN = 1 << 22


def work_dtype(job: TensorJob) -> torch.dtype:
    """float32; float64 when an input is stored in float64 or the output is float64 (e.g. the
    wide output a layer-strength schedule asks for before its own single cast)."""
    infos = [*job.fts, *([job.base] if job.base is not None else [])]
    wide = job.out_dtype == "F64" or any(i.dtype == "F64" for i in infos)
    return torch.float64 if wide else torch.float32


def merged_rows(job: TensorJob) -> int | None:
    """Rows the method covers (the shared rows of a resized vocabulary), None for 0-/1-D."""
    if len(job.shape) < 2:
        return None
    return job.shared_rows if job.shared_rows is not None else job.shape[0]


def merged_numel(job: TensorJob) -> int:
    rows = merged_rows(job)
    if rows is None:
        return math.prod(job.shape)
    return rows * math.prod(job.shape[1:])


def flat_blocks(job: TensorJob, block_bytes: int, itemsize: int) -> list[tuple[int, int]] | None:
    """Element spans of the merged part when a single row does not fit in a block (a 1×N
    matrix, a long vector): row blocks cannot split those. None: row blocks will do."""
    rows = merged_rows(job)
    row_elems = max(1, math.prod(job.shape[1:])) if rows is not None else merged_numel(job)
    if row_elems * itemsize <= block_bytes:
        return None
    n = merged_numel(job)
    step = max(1, block_bytes // itemsize)
    return [(e0, min(e0 + step, n)) for e0 in range(0, n, step)]


def row_blocks(job: TensorJob, block_bytes: int, itemsize: int) -> list[tuple[int, int] | None]:
    rows = merged_rows(job)
    if rows is None:
        return [None]
    row_elems = max(1, math.prod(job.shape[1:]))
    step = max(1, block_bytes // (row_elems * itemsize))
    if job.shared_rows is None and step >= rows:
        return [None]
    return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


class Kernel:
    """Maps the fine-tunes' delta blocks (row-major order) to the merged delta block.

    A kernel that needs statistics of whole tensors first (a top-k threshold, a norm, a
    cosine) asks for *statistics passes*: while :meth:`pending`, the operation feeds it every
    row block of BASE and the fine-tunes (:meth:`observe`, then :meth:`end_pass`), holding one
    block at a time; then the output pass calls :meth:`combine` on each block.
    """

    needs_whole = False  # TIES: processes tensors up to ``whole_bytes`` whole, in one pass
    #: blocks must hold whole rows (per-row statistics): a row longer than a block is then not
    #: split into pieces of the flattened tensor (a 1×N matrix is read whole)
    needs_rows = False

    #: the job's scratch (CPU; set by :meth:`begin`): buffers a kernel may reuse within a block
    work: Scratch | None = None

    def begin(self, dtype: torch.dtype, *, whole: bool, work: Scratch | None = None) -> None:
        """Called once before any pass: the work dtype, whether the tensor is one block, and the
        scratch buffers (None: allocate)."""
        self.work = work

    def pending(self) -> bool:
        """Does the kernel need (another) statistics pass over the blocks?"""
        return False

    def observe(self, base: torch.Tensor, fts: list[torch.Tensor]) -> None:  # pragma: no cover
        """One block of a statistics pass: W_base and every W_i, in the work dtype."""

    def end_pass(self) -> None:  # pragma: no cover - interface
        """The statistics pass is over."""

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        """The merged delta of one block (``exact(i, positions)``: |W_i − W_base| in float64)."""
        return self.block(deltas)

    def block(self, deltas: list[torch.Tensor]) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def stats(self) -> dict:
        return {}


class WiseFTKernel(Kernel):
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def block(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        return wise_ft_delta(deltas[0], self.alpha, overwrite=True)


class TaskArithmeticKernel(Kernel):
    def __init__(self, weights: Sequence[float], lam: float) -> None:
        self.weights, self.lam = list(weights), lam

    def block(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        return task_arithmetic_delta(deltas, self.weights, self.lam, overwrite=True)


class _Election:
    """Sign election + disjoint mean over blocks, counting conflicts for the report."""

    def __init__(self, weights: Sequence[float], lam: float, *, normalize: bool = True) -> None:
        self.weights, self.lam = list(weights), lam
        self.normalize = normalize
        self.counts: dict = {}
        self.numel = 0

    def __call__(self, trimmed: list[torch.Tensor], work: Scratch | None = None) -> torch.Tensor:
        """The merged delta of one block; with ``work``, ``trimmed`` (the caller's own) is
        overwritten and the temporaries come from ``work``."""
        self.numel += trimmed[0].numel()
        return T.ties_delta(trimmed, self.weights, self.lam, self.counts, normalize=self.normalize, work=work)

    def stats(self) -> dict:
        conflicts = self.counts.get("sign_conflicts", 0)
        return {
            "sign_conflicts": conflicts,
            "sign_conflict_fraction": conflicts / self.numel if self.numel else 0.0,
        }


class TiesKernel(Kernel):
    """TIES. Whole tensors (up to ``whole_bytes`` of work copies): one pass per delta selects
    and trims in place. Larger tensors: the exact top-k of each delta is found by statistics
    passes over the row blocks (:class:`~dghard_cli.methods.topk_stream.StreamingTopK`, the
    same selection as the whole-tensor one), then each block is trimmed and elected."""

    needs_whole = True

    def __init__(
        self,
        weights: Sequence[float],
        lam: float,
        density: float | Sequence[float],
        numel: int,
        *,
        normalize: bool = True,
    ) -> None:
        self.n = len(weights)
        self.k = [T.keep_count(numel, d) for d in per_ft(density, self.n)]  # per fine-tune
        self.numel = numel
        self.sel: list[T.TopK | None] = [None] * self.n
        self.streams: list[StreamingTopK] | None = None
        self.election = _Election(weights, lam, normalize=normalize)

    def begin(self, dtype: torch.dtype, *, whole: bool, work: Scratch | None = None) -> None:
        super().begin(dtype, whole=whole, work=work)
        if not whole:
            self.streams = [StreamingTopK(self.numel, k, dtype) for k in self.k]

    def pending(self) -> bool:
        return self.streams is not None and any(s.pending for s in self.streams)

    def observe(self, base: torch.Tensor, fts: list[torch.Tensor]) -> None:
        assert self.streams is not None
        b = base.reshape(-1)
        for s, ft in zip(self.streams, fts, strict=True):
            if s.pending:
                f = ft.reshape(-1)
                mag = None if self.work is None else self.work.take("ties.1", f.shape, f.dtype, f.device)
                s.observe(
                    torch.sub(f, b, out=mag).abs_(),
                    lambda pos, f=f: (f[pos].double() - b[pos].double()).abs(),
                    owned=True,
                    work=self.work,
                )

    def end_pass(self) -> None:
        assert self.streams is not None
        for s in self.streams:
            if s.pending:
                s.end_pass()

    def trim_whole(self, i: int, delta: torch.Tensor, exact: T.ExactMagnitudes) -> None:
        """Select and trim a whole Δ_i in place (``exact``: its unrounded magnitudes)."""
        work = self.work
        mag = (
            delta.abs()
            if work is None
            else torch.abs(delta, out=work.take("ties.1", delta.shape, delta.dtype, delta.device))
        )
        sel = T.select_topk(mag, self.k[i], exact, work=work)
        self.sel[i] = sel
        del mag
        T.trim_(delta, sel)

    def combine(self, base: torch.Tensor, deltas: list[torch.Tensor], exact: BlockExact) -> torch.Tensor:
        if self.streams is not None:  # row blocks: trim with the streamed selection
            for i, (s, d) in enumerate(zip(self.streams, deltas, strict=True)):
                s.trim_(d, lambda pos, i=i: exact(i, pos), self.work)
        return self.election(deltas, self.work)

    def stats(self) -> dict:
        if self.streams is not None:
            kept = [s.kept for s in self.streams]
            threshold = [s.threshold if s.k else None for s in self.streams]
        else:
            kept = [s.kept if s else 0 for s in self.sel]
            threshold = [float(s.threshold) if s and s.k else None for s in self.sel]
        return {
            "kept": kept,
            "kept_fraction": [k / self.numel if self.numel else 0.0 for k in kept],
            "threshold": threshold,
            **self.election.stats(),
        }


class DareKernel(Kernel):
    """DARE on each delta, then task arithmetic (``ties=False``) or TIES' election (``ties=True``)."""

    def __init__(
        self,
        weights: Sequence[float],
        lam: float,
        density: float | Sequence[float],
        seed: int,
        name: str,
        numel: int,
        *,
        ties: bool,
        normalize: bool = True,
    ) -> None:
        self.weights, self.lam = list(weights), lam
        ds = per_ft(density, len(self.weights))
        self.streams = [DareStream(seed, name, i, d, numel) for i, d in enumerate(ds)]
        self.numel = numel
        self.election = _Election(weights, lam, normalize=normalize) if ties else None

    def block(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        dropped = [s(d) for s, d in zip(self.streams, deltas, strict=True)]
        if self.election is not None:
            return self.election(dropped, self.work)
        return task_arithmetic_delta(dropped, self.weights, self.lam, overwrite=True)

    def stats(self) -> dict:
        kept = [s.kept for s in self.streams]
        out = {"kept": kept, "kept_fraction": [k / self.numel if self.numel else 0.0 for k in kept]}
        if self.election is not None:
            out.update(self.election.stats())
        return out


class LayerWeightsKernel(Kernel):
    """RECALL: ``Σ_i α_{l,i}·Δ_i`` with the weights of the tensor's layer."""

    def __init__(self, group: str, weights: Sequence[float]) -> None:
        self.group = group
        self.alpha = list(weights)  # [α_base, α_ft1, …]

    def block(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        return task_arithmetic_delta(deltas, self.alpha[1:], 1.0, overwrite=True)

    def stats(self) -> dict:
        return {"recall_group": self.group, "recall_weights": self.alpha}


def squared_norm(t: torch.Tensor) -> float:
    """‖t‖² in one pass with no temporary; NaN/Inf anywhere in ``t`` make it non-finite.

    Finite values whose squares overflow the work dtype (float32 beyond ~1.8e19, bf16's top
    range) are summed again in float64, so only a NaN/Inf in ``t`` gives a non-finite result."""
    flat = t.reshape(-1)
    if not flat.numel():
        return 0.0
    sq = float(torch.dot(flat, flat))
    if math.isfinite(sq) or flat.dtype == torch.float64 or not bool(torch.isfinite(flat).all()):
        return sq
    wide = flat.to(torch.float64)
    return float(torch.dot(wide, wide))


def _nonfinite_input(job: TensorJob, b: torch.Tensor, f: torch.Tensor, i: int) -> InputError:
    """Why Δ_i = FT_i − BASE is not finite: NaN/Inf in an input (named), or two finite inputs
    whose difference is beyond the work dtype's range (bf16's ±3.4e38 apart overflow float32)."""
    if not bool(torch.isfinite(b).all()):
        which = "BASE"
    elif not bool(torch.isfinite(f).all()):
        which = f"fine-tune #{i + 1}"
    else:
        wd = str(b.dtype).removeprefix("torch.")
        fix = "fix the checkpoint" if b.dtype == torch.float64 else "merge in float64 with --dtype fp64"
        return InputError(
            f"tensor {job.name!r}: the update Δ = FT − BASE of fine-tune #{i + 1} overflows {wd} "
            f"(both inputs are finite, but their difference exceeds {wd}'s range "
            f"±{torch.finfo(b.dtype).max:.3g}); {fix}, or check the checkpoint (weights this large "
            "are rarely real)"
        )
    return InputError(f"tensor {job.name!r} in {which} contains NaN or Inf; fix the checkpoint")


class ElementwiseMergeOp:
    """Streams BASE and all fine-tunes through an elementwise :class:`Kernel`."""

    def __init__(
        self,
        make_kernel: Callable[[TensorJob], Kernel],
        device: torch.device,
        block_bytes: int = BLOCK_BYTES,
        whole_bytes: int = WHOLE_BYTES,
    ) -> None:
        self.make_kernel = make_kernel
        self.device = device
        self.block_bytes = block_bytes
        self.whole_bytes = max(whole_bytes, block_bytes)

    def _read(
        self, job: TensorJob, src: JobInputs, key: str, rows, wd: torch.dtype, work: Scratch | None = None
    ) -> torch.Tensor:
        """One block of an input in the work dtype (in ``work``'s buffer for ``key`` when given)."""
        raw = self._raw(job, src, key, rows)
        if work is None:
            return raw.to(device=self.device, dtype=wd)
        return work.take(f"merge.{key}", raw.shape, wd, self.device).copy_(raw)

    def _delta(
        self, job: TensorJob, src: JobInputs, i: int, rows, b: torch.Tensor, work: Scratch | None
    ) -> torch.Tensor:
        """Δ_i = W_i − W_base of one block, in the work dtype (the same numbers either way: the
        conversion to the work dtype is exact, the subtraction rounds once)."""
        if work is None:  # never in place: a read may be a view of the input's buffer
            return torch.sub(self._read(job, src, f"ft{i}", rows, b.dtype), b)
        return self._read(job, src, f"ft{i}", rows, b.dtype, work).sub_(b)

    @staticmethod
    def _raw(job: TensorJob, src: JobInputs, key: str, rows) -> torch.Tensor:
        """One block of an input as stored (its dtype, on the CPU)."""
        if isinstance(rows, Span):  # a piece of the flattened tensor
            return src.flat(key, (rows.start, rows.stop))
        full = rows is None and job.shared_rows is not None
        r = (0, job.shared_rows) if full else rows
        return src.base(r) if key == "base" else src.ft(int(key[2:]), r)

    @staticmethod
    def _exact(job: TensorJob, src: JobInputs, i: int) -> T.ExactMagnitudes:
        """|W_i − W_base| in float64 at flat positions, read from the inputs when asked."""

        def exact(pos: torch.Tensor) -> torch.Tensor:
            # positions are sorted: read only the span around each group of them, piece by piece
            pos = pos.cpu()
            out = torch.empty(pos.numel(), dtype=torch.float64)
            step = EXACT_SPAN
            lo = 0
            while lo < pos.numel():
                start = int(pos[lo])
                hi = int(torch.searchsorted(pos, start + step))
                stop = int(pos[hi - 1]) + 1
                idx = pos[lo:hi] - start
                b = src.flat("base", (start, stop))[idx].to(torch.float64)
                f = src.flat(f"ft{i}", (start, stop))[idx].to(torch.float64)
                out[lo:hi] = (f - b).abs()
                lo = hi
            return out

        return exact

    def _block_exact(
        self, job: TensorJob, src: JobInputs, rows, b: torch.Tensor, wd: torch.dtype
    ) -> BlockExact:
        """|W_i − W_base| in float64 at flat positions of this block (W_i's block as stored: only
        the asked entries are converted)."""
        bf = b.reshape(-1)

        def exact(i: int, pos: torch.Tensor) -> torch.Tensor:
            f = self._raw(job, src, f"ft{i}", rows).reshape(-1)
            f_at = f[pos.to(f.device)].to(device=bf.device, dtype=torch.float64)
            return (f_at - bf[pos].to(torch.float64)).abs()

        return exact

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        wd = work_dtype(job)
        n = len(job.fts)
        kernel = self.make_kernel(job)
        itemsize = torch.empty((), dtype=wd).element_size()
        per_entry = itemsize * (n + 2)
        whole = kernel.needs_whole and merged_numel(job) * per_entry <= self.whole_bytes
        blocks: list = [None] if whole else row_blocks(job, self.block_bytes, per_entry)
        if job.shared_rows is not None and whole:
            blocks = [(0, job.shared_rows)]
        if not whole and not kernel.needs_rows:
            spans = flat_blocks(job, self.block_bytes, per_entry)
            if spans is not None:  # 1×N, long vectors: pieces of the flattened tensor
                blocks = [Span(a, b) for a, b in spans]
        # CPU: the float copies of BASE and the deltas live in the job's scratch, reused from
        # block to block and job to job (a new tensor costs its page faults, several times the
        # arithmetic); the kernels own the deltas and may overwrite them
        work = current() if self.device.type == "cpu" else None
        kernel.begin(wd, whole=whole, work=work)
        while kernel.pending():  # statistics passes (TIES' top-k, SLERP's norms, ...): one block at a time
            for rows in blocks:
                kernel.observe(
                    self._read(job, src, "base", rows, wd, work),
                    [self._read(job, src, f"ft{i}", rows, wd, work) for i in range(n)],
                )
            kernel.end_pass()
        sumsq = [0.0] * n
        dots = [0.0] * n  # ⟨Δ_i, W_base⟩
        merged_sq = 0.0
        for rows in blocks:
            b = self._read(job, src, "base", rows, wd, work)
            deltas = []
            for i in range(n):
                d = self._delta(job, src, i, rows, b, work)
                sq = squared_norm(d)  # Δ is finite iff BASE and FT are (inf − x, x − inf, nan: not)
                if not math.isfinite(sq):
                    raise _nonfinite_input(job, b, self._read(job, src, f"ft{i}", rows, wd), i)
                sumsq[i] += sq
                dots[i] += float(torch.dot(d.reshape(-1), b.reshape(-1))) if d.numel() else 0.0
                if whole:
                    assert isinstance(kernel, TiesKernel)
                    kernel.trim_whole(i, d, self._exact(job, src, i))
                deltas.append(d)
            merged = kernel.combine(b, deltas, self._block_exact(job, src, rows, b, wd))
            del deltas
            msq = squared_norm(merged)
            if not math.isfinite(msq):
                # every input and delta is finite here (checked above): the strengths overflow
                raise OutputRangeError(
                    f"tensor {job.name!r}: the merge's weighted deltas overflow {wd} from finite inputs",
                    advice=strength_advice(wd),
                )
            merged_sq += msq
            out = cast_out(merged.add_(b).cpu(), job.out_dtype, job.name)
            if work is not None and work.owns(out):  # no cast: the sum is still a scratch buffer
                out = out.clone()
            del merged
            if job.out_dtype == "F16" and not all_finite(out):
                raise RuntimeFailure(
                    f"tensor {job.name!r}: the merged values overflow float16; use --dtype bf16"
                )
            yield out
        if job.shared_rows is not None and job.shape[0] > job.shared_rows:
            yield cast_out(src.ft(0, (job.shared_rows, job.shape[0])), job.out_dtype, job.name)
        rec["delta_norms"] = [math.sqrt(s) for s in sumsq]
        rec["delta_norm"] = rec["delta_norms"][0]
        rec["delta_dot_bases"] = dots
        rec["delta_dot_base"] = dots[0]
        rec["merged_delta_norm"] = math.sqrt(merged_sq)
        rec.update(kernel.stats())


class Span(tuple):
    """Elements ``[start, stop)`` of a flattened tensor (a block that is not a row range)."""

    def __new__(cls, start: int, stop: int) -> Span:
        return super().__new__(cls, (start, stop))

    @property
    def start(self) -> int:
        return self[0]

    @property
    def stop(self) -> int:
        return self[1]
