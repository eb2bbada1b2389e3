"""The streaming engine: read → compute → write, overlapped, with bounded memory.

One place streams tensors for every command that writes a model (repair, merge, sweep
candidates). Three stages run at once:

- a **prefetch** thread reads the inputs of the next tensors (raw bytes, ``pread``) while
  their byte total stays under a budget;
- the **calling thread** runs the per-tensor operation, which yields output blocks (whole
  tensors, or row blocks for tall matrices, which it reads itself in blocks);
- a **writer** thread appends blocks to the current shard file, hashing as it goes, and
  journals each finished shard.

Memory in flight is the prefetch budget plus the write-queue budget plus the operation's own
blocks: a small multiple of the largest tensor (or of the block size for tall matrices), never
of the model. Shards already journaled by an interrupted run are skipped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dghard_cli.engine.ops import InlineReads, JobInputs, TensorOp, base_record, passthrough
from dghard_cli.engine.plan import Plan, TensorJob
from dghard_cli.engine.scratch import ScratchPool
from dghard_cli.errors import DGHardError, RuntimeFailure
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.output import OutputStage, ShardRecord
from dghard_cli.io.safetensors_format import build_header


class ByteBudget:
    """A counting semaphore over bytes; one item larger than the budget may pass alone."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self._cv = threading.Condition()
        self.closed = False

    def acquire(self, n: int) -> None:
        with self._cv:
            while not self.closed and self.used > 0 and self.used + n > self.limit:
                self._cv.wait(0.2)
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


@dataclass
class StageClock:
    """Where a streaming run's time goes, in seconds. The three threads overlap, so the busy
    times add up to more than the wall time when the overlap works: ``read`` (the prefetch
    thread), ``write`` (the writer thread: bytes to the shard files and their hashes) and
    ``compute`` (the compute thread, less its waits and its own reads); ``read_inline``: the
    compute thread reading tensors too large to prefetch, in row blocks; ``wait_read`` and
    ``wait_write``: the compute thread idle, waiting for inputs or for room in the write queue."""

    read: float = 0.0
    write: float = 0.0
    wait_read: float = 0.0
    wait_write: float = 0.0
    loop: float = 0.0
    inline: InlineReads | None = None

    def report(self) -> dict[str, float]:
        inline = self.inline.seconds if self.inline is not None else 0.0
        compute = max(0.0, self.loop - self.wait_read - self.wait_write - inline)
        return {
            k: round(v, 3)
            for k, v in (
                ("read", self.read),
                ("read_inline", inline),
                ("compute", compute),
                ("write", self.write),
                ("wait_read", self.wait_read),
                ("wait_write", self.wait_write),
            )
        }


def job_inputs(job: TensorJob) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    if job.base is not None:
        out["base"] = job.base
    for i, info in enumerate(job.fts):
        out[f"ft{i}"] = info
    return out


@dataclass
class EngineOptions:
    # inputs read ahead (the current job's included). 128 MB on the CPU: every command there is
    # compute-bound (the compute thread waited ≤ 0.1 s for reads on the 0.5B bench with 128 MB,
    # 0.0 with 256), and the jobs' reused work buffers (engine.scratch) now hold what the larger
    # read-ahead used to: peak RSS 750 -> 615 MB for repair, 865 -> 705 MB for TIES
    prefetch_bytes: int = 128 * 1024 * 1024
    write_bytes: int = 64 * 1024 * 1024  # outputs queued for the writer
    stream_bytes: int = 256 * 1024 * 1024  # jobs with more input than this are read in blocks
    allow_nonfinite: bool = False  # NaN/Inf in an input tensor: pass FT's value through, reported
    pin: bool = False  # read into page-locked buffers (asynchronous host-to-device copies)
    compute_workers: int = 1  # tensors computed at once (one thread each) when small enough
    parallel_bytes: int = 64 * 1024 * 1024  # inputs up to this size may be computed in parallel

    @classmethod
    def for_device(cls, device: torch.device, **overrides) -> EngineOptions:
        """Budgets for a device: small on CPU (resident memory is the constraint), large on
        CUDA (keep a 7B model's largest matrices prefetched while the GPU computes)."""
        if device.type == "cuda":
            base = dict(prefetch_bytes=4 << 30, write_bytes=1 << 30, stream_bytes=3 << 30, pin=True)
        else:
            base = {"compute_workers": max(1, torch.get_num_threads())}
        base.update(overrides)
        return cls(**base)


class _Prefetcher(threading.Thread):
    def __init__(
        self,
        jobs: list[TensorJob],
        opts: EngineOptions,
        wanted: Callable[[TensorJob], bool],
        clock: StageClock,
    ):
        super().__init__(daemon=True, name="dghard-prefetch")
        self.clock = clock
        self.jobs = jobs
        self.budget = ByteBudget(opts.prefetch_bytes)
        self.stream_bytes = opts.stream_bytes
        self.pin = opts.pin
        self.wanted = wanted
        self.out: queue.Queue = queue.Queue()
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for job in self.jobs:
                if self.stop.is_set():
                    return
                if job.in_nbytes > self.stream_bytes or not self.wanted(job):
                    self.out.put((job, None, 0))
                    continue
                self.budget.acquire(job.in_nbytes)
                if self.stop.is_set():
                    return
                t0 = time.perf_counter()
                raw = {key: info.read_raw(pin=self.pin) for key, info in job_inputs(job).items()}
                self.clock.read += time.perf_counter() - t0
                self.out.put((job, raw, job.in_nbytes))
        except BaseException as exc:  # handed to the consumer
            self.out.put((None, exc, 0))

    def next(self) -> tuple[TensorJob, dict | None, int]:
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    job, raw, held = self.out.get(timeout=0.5)
                except queue.Empty:
                    if not self.is_alive():
                        raise RuntimeFailure("internal error: the prefetch thread stopped") from None
                    continue
                if job is None:
                    raise raw
                return job, raw, held
        finally:
            self.clock.wait_read += time.perf_counter() - t0

    def shutdown(self) -> None:
        """Stop reading and wait for the thread: a daemon thread still inside torch when the
        interpreter exits (an interrupted run) can abort the process in torch's teardown
        ("terminate called without an active exception", exit -6 instead of 3)."""
        self.stop.set()
        self.budget.close()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=60)


class _Writer(threading.Thread):
    """Owns the output files: opens shards, appends bytes, finishes and journals them."""

    def __init__(self, stage: OutputStage, limit: int, clock: StageClock) -> None:
        super().__init__(daemon=True, name="dghard-writer")
        self.clock = clock
        self.stage = stage
        self.q: queue.Queue = queue.Queue()
        self.budget = ByteBudget(limit)
        self.error: BaseException | None = None
        self._current = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            kind = item[0]
            t0 = time.perf_counter()
            try:
                if self.error is not None:
                    if kind == "data":
                        self.budget.release(item[3])
                    elif kind in ("sync", "stop"):
                        item[-1].set() if kind == "sync" else None
                        if kind == "stop":
                            self._abort()
                            return
                    continue
                if kind == "open":
                    _, shard, entries, metadata = item
                    self._current = self.stage.shard_writer(shard, entries, metadata)
                elif kind == "data":
                    _, name, buf, n = item
                    try:
                        self._current.write(name, _as_bytes(buf))
                    finally:
                        self.budget.release(n)
                elif kind == "close":
                    _, shard, records = item
                    size, digest = self._current.finish()
                    self._current = None
                    self.stage.record(ShardRecord(name=shard, size=size, sha256=digest, tensors=records))
                elif kind == "sync":
                    if self._current is not None:
                        self._current.flush()
                    item[1].set()
                elif kind == "stop":
                    self._abort()
                    return
            except BaseException as exc:  # disk full, permissions: surfaced to the caller
                self.error = exc
                if kind == "sync":
                    item[1].set()
                if kind == "stop":
                    return
            finally:
                self.clock.write += time.perf_counter() - t0

    def _abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None

    def check(self) -> None:
        if self.error is not None:
            err = self.error
            if isinstance(err, DGHardError):
                raise err
            if isinstance(err, OSError):
                raise RuntimeFailure(f"writing {self.stage.dir}: {err.strerror or err}") from None
            raise RuntimeFailure(f"writer failed: {err!r}") from None

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.check()
        n = _nbytes(tensor)
        t0 = time.perf_counter()
        self.budget.acquire(n)
        self.clock.wait_write += time.perf_counter() - t0
        self.q.put(("data", name, tensor, n))

    def sync(self) -> None:
        ev = threading.Event()
        self.q.put(("sync", ev))
        t0 = time.perf_counter()
        while not ev.wait(0.5):
            if not self.is_alive():
                break
        self.clock.wait_write += time.perf_counter() - t0
        self.check()


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return memoryview(t).nbytes


def _as_bytes(t) -> memoryview:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype != torch.uint8:
            t = t.reshape(-1).view(torch.uint8)
        return memoryview(t.numpy()).cast("B")
    return memoryview(t).cast("B")


def shard_metadata(shard: str, ft_metadata: dict[str, dict[str, str]]) -> dict[str, str]:
    """Metadata of an output shard: the fine-tune's for a mirrored shard, and format=pt."""
    meta = dict(ft_metadata.get(shard, {}))
    meta["format"] = "pt"
    return meta


def shard_entries(plan: Plan, shard: str) -> list[tuple[str, str, tuple[int, ...]]]:
    jobs = {j.name: j for j in plan.jobs}
    return [(n, jobs[n].out_dtype, jobs[n].shape) for n in plan.shards[shard]]


def tensor_location(stage: OutputStage, plan: Plan, name: str, ft_metadata) -> tuple[str, int, int]:
    """(shard file, absolute offset, nbytes) of an output tensor in the staging directory."""
    for shard, names in plan.shards.items():
        if name in names:
            entries = shard_entries(plan, shard)
            header, offsets = build_header(entries, shard_metadata(shard, ft_metadata))
            i = names.index(name)
            begin, end = offsets[i]
            return shard, len(header) + begin, end - begin
    raise KeyError(name)


def execute(
    plan: Plan,
    stage: OutputStage,
    op: TensorOp,
    *,
    ft_metadata: dict[str, dict[str, str]],
    options: EngineOptions | None = None,
    on_tensor: Callable[[TensorJob, dict], None] | None = None,
    clock: StageClock | None = None,
) -> list[dict]:
    """Run ``op`` on every method tensor of the plan, pass the rest through, write the shards.

    Returns the per-tensor report records in write order (journaled shards of an interrupted
    run contribute their recorded records without being recomputed); ``clock`` receives where
    the time went.
    """
    opts = options or EngineOptions()
    clock = clock if clock is not None else StageClock()
    clock.inline = clock.inline or InlineReads()
    t_loop = time.perf_counter()
    todo_shards = [s for s in plan.shards if s not in stage.done]
    jobs_by_name = {j.name: j for j in plan.jobs}
    todo_jobs = [jobs_by_name[n] for s in todo_shards for n in plan.shards[s]]
    records: dict[str, dict] = {}
    for s in plan.shards:
        if s in stage.done:
            for r in stage.done[s].tensors:
                records[r["name"]] = r

    def wanted(job: TensorJob) -> bool:
        return job.action != "tied"

    def produce(job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if job.runs_method:
            return op(job, src, rec)
        return passthrough(job, src, rec, "base" if job.action == "kept-base" else "ft0")

    def computed(job: TensorJob, raw: dict | None, held: int) -> tuple[dict, list]:
        """A whole job on a worker thread: its record and every output block, in order. Its
        inputs' read-ahead budget is returned as soon as it is computed: the main thread may be
        waiting for the prefetcher, which may be waiting for that budget (a job larger than
        what the pending ones leave of the budget deadlocked when it was returned at write)."""
        # one thread per worker: OpenMP's thread count is per calling thread, so set it here
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        rec = base_record(job)
        try:
            with scratches.job():
                blocks = list(
                    produce(
                        job,
                        JobInputs(
                            job, raw, allow_nonfinite=opts.allow_nonfinite, pin=opts.pin, reads=clock.inline
                        ),
                        rec,
                    )
                )
        finally:
            del raw
            pre.budget.release(held)
        rec["seconds"] = round(time.perf_counter() - t0, 6)
        return rec, blocks

    # work buffers reused from job to job (a new tensor costs its page faults): one per job in
    # flight, dropped before a large job (computed alone) and at the end
    scratches = ScratchPool()
    workers = max(1, opts.compute_workers)
    threads_before = torch.get_num_threads()
    pool = (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dghard-compute") if workers > 1 else None
    )
    pending: deque = deque()  # (job, future, held bytes), oldest first
    shard_records: list[dict] = []

    def finish(job: TensorJob, rec: dict, held: int) -> None:
        pre.budget.release(held)  # 0 for a worker's job (returned when it was computed)
        records[job.name] = rec
        shard_records.append(rec)
        if on_tensor is not None:
            on_tensor(job, rec)

    def flush(keep: int = 0) -> None:
        """Write the oldest computed jobs, in order, until at most ``keep`` are in flight."""
        while len(pending) > keep:
            job, fut, held = pending.popleft()
            rec, blocks = fut.result()
            for block in blocks:
                writer.put(job.name, block)
            del blocks
            finish(job, rec, held)

    pre = _Prefetcher(todo_jobs, opts, wanted, clock)
    writer = _Writer(stage, opts.write_bytes, clock)
    pre.start()
    writer.start()
    try:
        for shard in todo_shards:
            writer.q.put(("open", shard, shard_entries(plan, shard), shard_metadata(shard, ft_metadata)))
            shard_records = []
            for _ in plan.shards[shard]:
                job, raw, held = pre.next()
                small = raw is not None and job.in_nbytes <= opts.parallel_bytes and job.action != "tied"
                if pool is not None and small:
                    # several small tensors at once, one thread each (eigensolvers scale poorly
                    # with threads; two at a time were measured 21 % faster on 2 cores)
                    pending.append((job, pool.submit(computed, job, raw, held), 0))
                    del raw
                    flush(keep=workers)
                    continue
                flush()
                torch.set_num_threads(threads_before)
                t0 = time.perf_counter()
                rec = base_record(job)
                src = JobInputs(
                    job, raw, allow_nonfinite=opts.allow_nonfinite, pin=opts.pin, reads=clock.inline
                )
                if job.action == "tied":
                    assert job.tied_to is not None
                    writer.sync()
                    blocks = _copy_written(stage, plan, job.tied_to, ft_metadata)
                    rec["delta_norm"] = records.get(job.tied_to, {}).get("delta_norm")
                else:
                    blocks = produce(job, src, rec)
                scratches.release()  # the small jobs' buffers: this one sizes its own
                with scratches.job():
                    for block in blocks:
                        writer.put(job.name, block)
                scratches.release()
                rec["seconds"] = round(time.perf_counter() - t0, 6)
                del raw, src, blocks  # drop the inputs before the next job's are read
                finish(job, rec, held)
            flush()
            writer.q.put(("close", shard, shard_records))
        writer.sync()
        writer.q.put(("stop", threading.Event()))
        writer.join()
        writer.check()
    except BaseException:
        pre.shutdown()
        for _, fut, _ in pending:
            fut.cancel()
        writer.budget.close()
        writer.q.put(("stop", threading.Event()))
        writer.join(timeout=60)
        raise
    finally:
        pre.shutdown()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads_before)
        scratches.release()
        clock.loop = time.perf_counter() - t_loop
    return [records[j.name] for j in plan.jobs]


def _copy_written(stage: OutputStage, plan: Plan, name: str, ft_metadata) -> Iterator[torch.Tensor]:
    shard, offset, nbytes = tensor_location(stage, plan, name, ft_metadata)
    path = stage.dir / shard
    chunk = 64 * 1024 * 1024
    with open(path, "rb") as fh:
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            fh.seek(offset + done)
            data = fh.read(n)
            if len(data) != n:
                raise RuntimeFailure(f"internal error: {path} is shorter than expected")
            yield torch.frombuffer(bytearray(data), dtype=torch.uint8)
            done += n
