"""Run several sweep jobs at once: in threads of this process, or as Ray tasks on a cluster.

An executor is generic over the job function ``fn(job, assignment) -> result``: it knows
nothing of candidates or evaluations. ``fn`` should return its failures as results; if it
raises anyway (or, under Ray, its worker is lost twice), the executor returns
``on_error(job, exc)`` as that job's result, so one bad job never stops the others.

Jobs submitted beyond ``slots`` wait in a queue (first in, first out) until one in flight
finishes; both executors behave the same way there.

Neither Ray nor torch is imported at module level: ``dghard sweep`` without ``--ray-address``
must not pay for them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Protocol

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.numbers import env_number

JobFn = Callable[[Any, dict], Any]
ErrorFn = Callable[[Any, BaseException], Any]


class Executor(Protocol):
    slots: int  # jobs that may run at once

    def submit(self, job: object, assignment: dict) -> object:
        """Queue ``fn(job, assignment)``; returns a handle (hashable)."""

    def wait(self, handles: list, timeout: float | None) -> list[tuple[object, object]]:
        """Finished ``(handle, result)`` pairs among ``handles``; at least one unless ``timeout`` ran out."""

    def cancel(self, handles: list) -> None:
        """Stop these jobs, best effort; returns within a few seconds."""

    def close(self) -> None: ...


class WorkerLost(RuntimeError):
    """A Ray job whose worker process (or node) died on both attempts."""


def _check_slots(slots: int) -> int:
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise InputError(f"--jobs must be a whole number >= 1, got {slots!r}")
    return slots


# --- threads -----------------------------------------------------------------------------


class LocalExecutor:
    """``slots`` threads in this process.

    ``cancel`` drops queued jobs; a running thread cannot be stopped from outside, so a job
    already running finishes (``fn`` must bound its own work, e.g. with the evaluation's
    timeout). Its result is still ``on_error(job, CancelledError())``.
    """

    #: jobs run in this process (the sweep may write candidates itself, in its main thread)
    remote = False

    def __init__(self, fn: JobFn, slots: int, on_error: ErrorFn) -> None:
        self.slots = _check_slots(slots)
        self._fn = fn
        self._on_error = on_error
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="dghard-job")
        self._jobs: dict[Future, Any] = {}
        self._cancelled: set[Future] = set()
        self._results: dict[Future, Any] = {}

    def submit(self, job: object, assignment: dict) -> Future:
        fut = self._pool.submit(self._fn, job, dict(assignment))
        self._jobs[fut] = job
        return fut

    def _result(self, fut: Future) -> Any:
        # a handle may be waited on again (the sweep handles a job once more when an
        # interruption landed while it handled it): its result is the one already given
        if fut in self._results:
            return self._results[fut]
        job = self._jobs.pop(fut, None)
        if fut in self._cancelled:
            self._cancelled.discard(fut)
            res = self._on_error(job, CancelledError("cancelled"))
        else:
            try:
                res = fut.result()
            except BaseException as exc:  # noqa: BLE001 - any failure of one job is that job's result
                res = self._on_error(job, exc)
        self._results[fut] = res
        return res

    def wait(self, handles: list, timeout: float | None) -> list[tuple[object, object]]:
        if not handles:
            return []
        done, _ = futures_wait(handles, timeout=timeout, return_when="FIRST_COMPLETED")
        return [(h, self._result(h)) for h in handles if h in done]

    def cancel(self, handles: list) -> None:
        for fut in handles:
            if fut in self._jobs:
                fut.cancel()
                self._cancelled.add(fut)

    def close(self) -> None:
        for fut in list(self._jobs):
            fut.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- resources ---------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/\-]*$")
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_resources(text: str | None) -> dict[str, float]:
    """``"gpu=1,cpu=2,accelerator_type:H100=0.01,mem=16G"`` -> Ray's names per job.

    ``cpu`` -> ``CPU`` (num_cpus), ``gpu`` -> ``GPU`` (num_gpus), ``mem``/``memory`` ->
    ``memory`` in bytes (suffix K, M, G, T: powers of 1024), any other name a custom resource.
    ``CPU`` defaults to 1 (Ray's own default for a task). Raises :class:`InputError`.
    """
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            if text and text.strip():
                raise InputError(f"--eval-resources: empty entry in {text!r} (expected NAME=AMOUNT,...)")
            continue
        name, sep, raw = part.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name or not raw:
            raise InputError(f"--eval-resources: {part!r} is not NAME=AMOUNT (e.g. gpu=1,cpu=2)")
        if not _NAME.match(name):
            raise InputError(
                f"--eval-resources: {name!r} is not a resource name (letters, digits, _ . : / -)"
            )
        key = {"cpu": "CPU", "gpu": "GPU", "mem": "memory", "memory": "memory"}.get(name.lower(), name)
        if key == "memory":
            m = _SIZE.match(raw)
            if not m:
                raise InputError(f"--eval-resources: {name}={raw!r} is not a size (e.g. mem=16G)")
            unit = (m.group(2) or "").upper().replace("IB", "").rstrip("B") or ""
            value = float(m.group(1)) * _SIZE_UNITS[unit]
        else:
            try:
                value = float(raw)
            except ValueError:
                raise InputError(f"--eval-resources: {name}={raw!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise InputError(f"--eval-resources: {name}={raw!r} must be a finite number >= 0")
        if key != "memory" and value > 1 and value != int(value):
            raise InputError(
                f"--eval-resources: {name}={raw!r}: Ray takes amounts above 1 in whole units only (e.g. 2, or 0.5)"
            )
        if key in out:
            raise InputError(f"--eval-resources: {name!r} is given twice")
        out[key] = value
    out.setdefault("CPU", 1.0)
    return out


def _task_options(resources: dict[str, float]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    custom = {}
    for key, value in resources.items():
        if key == "CPU":
            opts["num_cpus"] = value
        elif key == "GPU":
            opts["num_gpus"] = value
        elif key == "memory":
            opts["memory"] = int(value)
        else:
            custom[key] = value
    if custom:
        opts["resources"] = custom
    return opts


# --- Ray ---------------------------------------------------------------------------------

# Bounds on Ray's own connection retries (it otherwise retries a dead address for minutes).
# Read by Ray when it is imported, so they only help if dghard imports Ray first. Measured on
# Ray 2.60: a port that answers but is no Ray GCS is refused after ~24 s with these, minutes without.
_CONNECT_ENV = {
    "RAY_gcs_rpc_server_connect_timeout_s": "3",
    "RAY_py_gcs_connect_timeout_s": "5",
    "RAY_gcs_server_port_wait_time_s": "2",
}
_PROBE_TIMEOUT_S = 5.0
_QUIET = {"log_to_driver": False, "logging_level": "ERROR", "configure_logging": True}


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: The HTTP/2 connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the Ray
#: Client server) answers with a SETTINGS frame of its own; anything else (a dashboard, Redis, a
#: web server) does not.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def check_address_form(address: str) -> None:
    """Before anything connects: a URL of another scheme (a pasted dashboard ``http://HOST:8265``,
    ``file://``) was looked up as a host named after the scheme."""
    m = _SCHEME.match(address)
    if m and m.group(1).lower() != "ray":
        raise InputError(
            f"--ray-address {address!r}: a {m.group(1)}:// URL is not a Ray address; give the "
            "cluster's HOST:PORT (its GCS, port 6379 by default), ray://HOST:10001 (Ray Client) or "
            "auto (a dashboard URL, http://HOST:8265, is neither)"
        )


def names_private_cluster(address: str | None) -> bool:
    """No address, ``local``, or ``auto`` with RAY_ADDRESS=local: Ray starts a new local cluster
    for each, and here that is always the private one (loopback only, ``--jobs`` CPUs, its
    workers' start bounded). Anything else names a running cluster and is probed first."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    return address is None or address == "local"


def resolve_auto() -> str:
    """What ``auto`` means, as Ray resolves it (RAY_ADDRESS, else the cluster ``ray start`` last
    started here); InputError when there is none."""
    from ray._private import services

    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":  # RAY_ADDRESS=auto: Ray looks the cluster up, as for no RAY_ADDRESS
        check_address_form(env)
        return env
    try:
        found = services.get_ray_address_from_environment("auto", None)
    except ConnectionError:
        found = None
    if not found or found == "auto":
        raise InputError(
            "--ray-address auto: no running Ray cluster found here (RAY_ADDRESS is unset and "
            "`ray start` has started none); give the cluster's HOST:PORT"
        )
    return str(found)


def _speaks_grpc(sock: socket.socket) -> bool:
    try:
        sock.settimeout(_PROBE_TIMEOUT_S)
        sock.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    except OSError:
        return False
    return head[3] == 0x04  # a SETTINGS frame


def _probe(address: str) -> None:
    """Fail fast on an address nothing listens on, or where something other than a Ray cluster
    answers (Ray itself retries for minutes, or ~25 s with the bounds above).

    ``address`` is resolved (``auto`` looked up). Every host is probed, this one's names
    (localhost, 127.0.0.0/8, ::1, the host name) too: only the literal ``local``, a new cluster
    with nothing yet to answer, is not (a prefix test let ``localhost:6379`` through to Ray's
    25 s of retries)."""
    if address == "local":
        return
    check_address_form(address)
    client = address.startswith("ray://")
    rest = address[len("ray://") :] if client else address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
    else:
        host, port_text = rest, ""
    try:
        port = int(port_text) if port_text else (10001 if client else 6379)
    except ValueError:
        raise InputError(f"--ray-address {address!r}: {port_text!r} is not a port number") from None
    if not host:
        raise InputError(f"--ray-address {address!r}: no host (expected HOST:PORT, ray://HOST:PORT or auto)")
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as sock:
            grpc = _speaks_grpc(sock)
    except socket.gaierror as exc:
        raise InputError(
            f"--ray-address {address!r}: cannot resolve host {host!r} ({exc.strerror})"
        ) from None
    except TimeoutError:
        raise InputError(
            f"--ray-address {address!r}: no answer from {host}:{port} within {_PROBE_TIMEOUT_S:g} s"
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(f"--ray-address {address!r}: cannot connect to {host}:{port} ({reason})") from None
    if not grpc:
        raise InputError(
            f"--ray-address {address!r}: {host}:{port} answers but is not a Ray cluster (no gRPC "
            "server there); give the GCS port (6379 by default) or ray://HOST:10001, not the "
            "dashboard's or another service's"
        )


#: How long the first worker may take to start (seconds); DGHARD_RAY_START_TIMEOUT_S overrides,
#: from 0.1 s up to a day (beyond it Ray's timeout arithmetic overflows long before float range).
WORKER_START_TIMEOUT_S = 120.0
WORKER_START_TIMEOUT_MIN_S = 0.1
WORKER_START_TIMEOUT_MAX_S = 86400.0

#: Ray's raylet holds back the first driver's registration until the workers it prestarts for
#: that job have registered. Workers that die as they start never do, and ray.init then waits
#: forever inside the driver's CoreWorker construction, holding the GIL (no Python timer runs,
#: the worker-start probe is never submitted). A private cluster skips that wait, so ray.init
#: returns and the probe bounds the workers' start.
_PRIVATE_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def worker_start_timeout() -> float:
    """DGHARD_RAY_START_TIMEOUT_S, or 120 s; InputError naming it and its range when out of it."""
    return env_number(
        "DGHARD_RAY_START_TIMEOUT_S",
        WORKER_START_TIMEOUT_S,
        low=WORKER_START_TIMEOUT_MIN_S,
        high=WORKER_START_TIMEOUT_MAX_S,
        what="a number of seconds",
    )


def _ping() -> int:
    """The worker-start probe: runs on a worker, imports nothing more than this module."""
    return os.getpid()


def _logs_dir(ray: Any) -> str | None:
    """The log directory of the cluster this process started (a private one is gone, with
    ``ray logs``, by the time its error is read; its files stay)."""
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    try:
        return str(node.get_logs_dir_path()) if node is not None else None
    except Exception:  # noqa: BLE001 - Ray's private API: a hint, best effort
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _RayHandle:
    __slots__ = ("job", "assignment", "ref", "done", "result")

    def __init__(self, job: Any, assignment: dict) -> None:
        self.job = job
        self.assignment = assignment
        self.ref: Any = None
        self.done = False
        self.result: Any = None

    def __repr__(self) -> str:
        state = "done" if self.done else "running" if self.ref is not None else "queued"
        return f"<RayJob {self.job!r} {state}>"


class RayExecutor:
    """Each job is a Ray task (``max_retries=1``: one retry if its worker dies).

    ``fn`` must be importable by name on the workers (a module-level function of an installed
    package). ``address`` ``None`` starts a private local cluster (``num_cpus=slots``, loopback
    only) unless Ray is already initialised in this process (then that connection is used,
    whatever ``address`` says, and ``close`` leaves it open).

    Cancelling: Ray's polite cancel raises ``KeyboardInterrupt`` in the task between Python
    bytecodes only, so ``fn`` must poll its evaluation (``proc.wait(timeout=...)`` in a loop,
    not a bare ``proc.wait()``) and kill its process group on the way out; after
    ``cancel_grace_s`` the worker is killed, which does not reach a child in its own session.
    """

    #: jobs run on other processes or machines: each writes its own candidate
    remote = True

    def __init__(
        self,
        fn: JobFn,
        slots: int,
        on_error: ErrorFn,
        *,
        address: str | None,
        resources: dict[str, float],
        runtime_env: dict | None = None,
        cancel_grace_s: float = 3.0,
    ) -> None:
        self.slots = _check_slots(slots)
        self._start_timeout = worker_start_timeout()  # a bad value is refused before Ray starts
        self._on_error = on_error
        self._grace = cancel_grace_s
        self._owns = False
        self._queue: deque[_RayHandle] = deque()
        self._running: dict[Any, _RayHandle] = {}  # ObjectRef -> handle
        self._private = private = names_private_cluster(address)
        ray = self._import_ray(None if private else address)
        self._ray = ray
        task_env = None
        if ray.is_initialized():
            task_env = runtime_env
        else:
            self._connect(ray, address, runtime_env)
        where = "the local Ray cluster" if private else f"the Ray cluster at {address}"
        try:
            self._check_resources(ray, resources, where)
            opts = _task_options(resources)
            if task_env:
                opts["runtime_env"] = task_env
            self._remote = ray.remote(fn).options(max_retries=1, retry_exceptions=False, **opts)
            self._check_workers_start(ray, opts, where)
        except BaseException:
            self.close()  # a cluster this executor started (or joined) is not left behind
            raise

    @staticmethod
    def _import_ray(address: str | None) -> Any:
        if "ray" not in sys.modules:
            if address is None:
                # a private cluster listens on loopback only (Ray otherwise picks the node's IP)
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            else:
                for key, value in _CONNECT_ENV.items():
                    os.environ.setdefault(key, value)
        try:
            import ray
        except ImportError:
            raise InputError(
                "--ray-address/--eval-resources need Ray, which is not installed: pip install 'dghard[ray]'"
            ) from None
        return ray

    def _connect(self, ray: Any, address: str | None, runtime_env: dict | None) -> None:
        if names_private_cluster(address):
            self._start_private(ray, runtime_env)
            return
        given = address
        if address == "auto":
            address = resolve_auto()
        _probe(address)
        # only the address the user gave is contacted: Ray reads RAY_ADDRESS over an explicit one
        saved = os.environ.pop("RAY_ADDRESS", None)
        try:
            ray.init(address=address, runtime_env=runtime_env, **_QUIET)
        except (ConnectionError, TimeoutError, ValueError, RuntimeError) as exc:
            raise InputError(f"--ray-address {given!r}: {_first_line(exc)}") from None
        finally:
            if saved is not None:
                os.environ["RAY_ADDRESS"] = saved
        self._owns = True

    def _start_private(self, ray: Any, runtime_env: dict | None) -> None:
        """A new cluster on this machine, loopback only, ``slots`` CPUs, stopped by ``close``."""
        # The environment variable set before import covers the usual case; if Ray was
        # imported earlier, flip the constant it was read into (best effort).
        constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
        saved = getattr(constants, "ENABLE_RAY_CLUSTER", None)
        if saved is not None:
            constants.ENABLE_RAY_CLUSTER = False
        try:
            ray.init(  # "local": a new cluster even if RAY_ADDRESS is set
                address="local",
                num_cpus=self.slots,
                include_dashboard=False,
                runtime_env=runtime_env,
                _system_config=dict(_PRIVATE_SYSTEM_CONFIG),
                **_QUIET,
            )
        finally:
            if saved is not None:
                constants.ENABLE_RAY_CLUSTER = saved
        self._owns = True

    def _check_workers_start(self, ray: Any, opts: dict, where: str) -> None:
        """One trivial task with the jobs' resources and runtime environment, before any job: a
        worker that cannot start (a runtime environment that fails to build, a node whose Python
        cannot import dghard) left the sweep waiting for minutes with no output, Ray's worker
        errors hidden. RuntimeFailure (exit 3) naming the cause, or the bound that ran out."""
        ref = ray.remote(_ping).options(max_retries=0, **opts).remote()
        try:
            ray.get(ref, timeout=self._start_timeout)
        except ray.exceptions.GetTimeoutError:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            logs = _logs_dir(ray) if self._owns and self._private else None
            raise RuntimeFailure(
                f"{where} started no worker for an evaluation within {self._start_timeout:g} s "
                f"(resources per job: {opts or 'Ray defaults'}): its workers cannot start, or none "
                "has those resources free now",
                hint=(
                    f"see the cluster's logs in {logs} (kept after it stops)"
                    if logs
                    else "see the workers' logs (`ray logs`)"
                )
                + ", or raise DGHARD_RAY_START_TIMEOUT_S",
            ) from None
        except ray.exceptions.RayError as exc:
            raise RuntimeFailure(
                f"{where}: a worker for the evaluations could not start: {_first_line(exc)}",
                hint="see the workers' logs (`ray logs`); every node needs dghard installed",
            ) from None

    def _check_resources(self, ray: Any, wanted: dict[str, float], where: str) -> None:
        have = ray.cluster_resources()
        for key, amount in wanted.items():
            if amount > 0 and have.get(key, 0.0) < amount:
                name = {"CPU": "cpu", "GPU": "gpu", "memory": "mem"}.get(key, key)
                raise InputError(
                    f"--eval-resources asks for {name}={amount:g} per job but {where} has "
                    f"{have.get(key, 0.0):g} {key} in all"
                )

    # -- jobs --

    def submit(self, job: object, assignment: dict) -> _RayHandle:
        handle = _RayHandle(job, dict(assignment))
        self._queue.append(handle)
        self._launch()
        return handle

    def _launch(self) -> None:
        while self._queue and len(self._running) < self.slots:
            handle = self._queue.popleft()
            handle.ref = self._remote.remote(handle.job, handle.assignment)
            self._running[handle.ref] = handle

    def _finish(self, handle: _RayHandle, exc: BaseException | None = None) -> None:
        ray = self._ray
        self._running.pop(handle.ref, None)
        if exc is None:
            try:
                handle.result = ray.get(handle.ref)
                handle.done = True
                return
            except ray.exceptions.RayTaskError as err:  # fn raised: hand on its own exception
                exc = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
            except ray.exceptions.TaskCancelledError as err:
                exc = CancelledError(_first_line(err))
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as err:
                exc = WorkerLost(
                    "the Ray worker running this job was lost on both attempts "
                    f"(Ray retries once): {_first_line(err)}"
                )
                exc.__cause__ = err
            except Exception as err:  # noqa: BLE001 - other RayError: the job's result, not the sweep's end
                exc = err
        handle.result = self._on_error(handle.job, exc)
        handle.done = True

    def _collect(self, timeout: float | None) -> None:
        refs = list(self._running)
        if not refs:
            return
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            self._finish(self._running[ref])
        self._launch()

    def wait(self, handles: list, timeout: float | None) -> list[tuple[object, object]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [(h, h.result) for h in handles if h.done]
            if done or not handles:
                return done
            if not self._running:
                return []  # nothing of these can finish (all cancelled or foreign handles)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._collect(left)
            if deadline is not None and time.monotonic() >= deadline:
                return [(h, h.result) for h in handles if h.done]

    def cancel(self, handles: list) -> None:
        """Non-force ``ray.cancel`` (KeyboardInterrupt in the task, so ``fn``'s cleanup runs),
        then force (the worker is killed) for any still running after the grace period."""
        ray = self._ray
        running = []
        for h in handles:
            if h.done:
                continue
            if h.ref is None:
                self._queue.remove(h)
                h.result, h.done = self._on_error(h.job, CancelledError("cancelled before it started")), True
                continue
            with contextlib.suppress(Exception):  # best effort
                ray.cancel(h.ref, force=False)
            running.append(h)
        if running:
            refs = [h.ref for h in running]
            _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=self._grace)
            for ref in not_ready:
                with contextlib.suppress(Exception):  # best effort
                    ray.cancel(ref, force=True)
            for h in running:
                self._running.pop(h.ref, None)
                h.result, h.done = self._on_error(h.job, CancelledError("cancelled")), True
        self._launch()

    def close(self) -> None:
        if self._queue or self._running:
            self.cancel([*self._queue, *self._running.values()])
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns = False
