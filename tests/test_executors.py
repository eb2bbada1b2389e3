"""Sweep executors: threads (LocalExecutor) and Ray tasks (RayExecutor) on one shared local cluster."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from executor_jobs import on_error, run_job

from dghard_cli.errors import InputError
from dghard_cli.sweeping.executors import LocalExecutor, RayExecutor, parse_resources

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for the module: loopback only, 2 CPUs, 1 pretend GPU, quiet."""
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "PYTHONPATH")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), saved["PYTHONPATH"] or ""])
    import ray

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make(kind, ray_cluster_or_none, slots, resources=None, **kw):
    if kind == "local":
        return LocalExecutor(run_job, slots, on_error)
    return RayExecutor(run_job, slots, on_error, address=None, resources=resources or {"CPU": 1.0}, **kw)


def wait_for_file(path: Path, seconds: float = 30) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


@pytest.fixture(params=["local", "ray"])
def kind(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def drain(ex, handles, timeout=60):
    out, pending, deadline = {}, list(handles), time.monotonic() + timeout
    while pending:
        assert time.monotonic() < deadline, f"jobs still pending: {pending}"
        for h, result in ex.wait(pending, timeout=5):
            out[h] = result
            pending.remove(h)
    return [out[h] for h in handles]


def test_same_results_and_errors_become_results(kind):
    ex = make(kind, None, 2)
    try:
        jobs = [("square", 3), ("boom", 7), ("square", 4)]
        results = drain(ex, [ex.submit(j, {"device": "1"}) for j in jobs])
    finally:
        ex.close()
    assert results == [
        (9, {"device": "1"}),
        ("error", "boom", "ValueError", "bad candidate 7"),  # the job's own exception, both executors
        (16, {"device": "1"}),
    ]


def test_slots_bound_jobs_in_flight(kind, tmp_path):
    ex = make(kind, None, 2)
    try:
        handles = [ex.submit(("timed", (str(tmp_path), i, 0.6)), {}) for i in range(5)]
        assert sorted(drain(ex, handles)) == [0, 1, 2, 3, 4]
    finally:
        ex.close()
    spans = [tuple(map(float, p.read_text().split())) for p in tmp_path.glob("*.txt")]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2  # at most 2 at once, and the two slots were used


def test_wait_timeout_returns_nothing_yet(kind, tmp_path):
    ex = make(kind, None, 1)
    try:
        h = ex.submit(("timed", (str(tmp_path), 0, 1.0)), {})
        assert ex.wait([h], timeout=0.1) == []
        assert drain(ex, [h]) == [0]
    finally:
        ex.close()


def test_ray_worker_killed_once_is_retried(ray_cluster, tmp_path):
    ex = make("ray", ray_cluster, 1)
    marker = tmp_path / "first-attempt"
    try:
        assert drain(ex, [ex.submit(("die_once", str(marker)), {})]) == ["survived"]
    finally:
        ex.close()
    assert marker.exists()


def test_ray_worker_killed_twice_is_an_error_result(ray_cluster):
    ex = make("ray", ray_cluster, 2)
    try:
        died, fine = drain(ex, [ex.submit(("die_always", None), {}), ex.submit(("square", 5), {})])
    finally:
        ex.close()
    assert fine == (25, {})
    assert died[:3] == ("error", "die_always", "WorkerLost")
    assert "worker" in died[3] and "lost on both attempts" in died[3]


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_ray_cancel_kills_the_evaluation(ray_cluster, tmp_path):
    ex = make("ray", ray_cluster, 2)
    pid_file = tmp_path / "pid"
    try:
        h = ex.submit(("sleep_child", str(pid_file)), {})
        pid = int(wait_for_file(pid_file))
        assert not _gone(pid)
        t0 = time.monotonic()
        ex.cancel([h])
        assert time.monotonic() - t0 < 10
        assert ex.wait([h], timeout=0)[0][1][2] == "CancelledError"
    finally:
        ex.close()
    assert (tmp_path / "pid.interrupted").exists()  # the polite cancel reached the job's cleanup
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, "sleep 60 survived the cancel"
        time.sleep(0.1)


def test_ray_cancel_forces_a_job_that_ignores_it(ray_cluster, tmp_path):
    ex = make("ray", ray_cluster, 2, cancel_grace_s=1.0)
    pid_file = tmp_path / "pid"
    try:
        h = ex.submit(("stubborn", str(pid_file)), {})
        worker = int(wait_for_file(pid_file))
        t0 = time.monotonic()
        ex.cancel([h])
        assert time.monotonic() - t0 < 5
        assert ex.wait([h], timeout=0)[0][1][2] == "CancelledError"
    finally:
        ex.close()
    assert (tmp_path / "pid.interrupted").exists()
    deadline = time.monotonic() + 10
    while not _gone(worker):
        assert time.monotonic() < deadline, "the worker survived the forced cancel"
        time.sleep(0.1)


def test_ray_gpu_task_sees_its_device(ray_cluster):
    ex = make("ray", ray_cluster, 1, resources=parse_resources("gpu=1,cpu=1"))
    try:
        assert drain(ex, [ex.submit(("env", None), {})]) == ["0"]
    finally:
        ex.close()


def test_ray_refuses_resources_the_cluster_lacks(ray_cluster):
    with pytest.raises(InputError, match="--eval-resources asks for gpu=2 .* has 1 GPU"):
        make("ray", ray_cluster, 1, resources=parse_resources("gpu=2"))
    with pytest.raises(InputError, match="accelerator_type:H100=0.01 .* has 0"):
        make("ray", ray_cluster, 1, resources=parse_resources("accelerator_type:H100=0.01"))


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RAY_")
    }  # none of the fixture's Ray settings
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1", "no-such-host.invalid:6379"])
def test_unreachable_address_fails_fast(address):
    t0 = time.monotonic()
    proc = _fresh_python(f"""
        from dghard_cli.errors import InputError
        from dghard_cli.sweeping.executors import RayExecutor
        try:
            RayExecutor(print, 1, print, address={address!r}, resources={{"CPU": 1.0}})
        except InputError as exc:
            print("INPUT-ERROR", exc)
        """)
    assert time.monotonic() - t0 < 30
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("INPUT-ERROR --ray-address"), proc.stdout + proc.stderr
    assert "refused" in line or "resolve" in line


def test_ray_missing_says_how_to_install():
    proc = _fresh_python("""
        import sys
        sys.modules["ray"] = None
        from dghard_cli.sweeping.executors import RayExecutor
        RayExecutor(print, 1, print, address=None, resources={})
        """)
    assert "pip install 'dghard[ray]'" in proc.stderr


def test_parse_resources():
    assert parse_resources("gpu=1,cpu=2,accelerator_type:H100=0.01,mem=16G") == {
        "GPU": 1.0,
        "CPU": 2.0,
        "accelerator_type:H100": 0.01,
        "memory": 16 * 1024**3,
    }
    assert parse_resources("") == {"CPU": 1.0}
    assert parse_resources(None) == {"CPU": 1.0}
    assert parse_resources(" GPU = 0.5 ") == {"GPU": 0.5, "CPU": 1.0}
    assert parse_resources("mem=512MiB") == {"memory": 512 * 1024**2, "CPU": 1.0}


@pytest.mark.parametrize(
    "text",
    [
        "gpu",
        "gpu=",
        "=1",
        "gpu=one",
        "gpu=-1",
        "gpu=nan",
        "gpu=inf",
        "gpu=1.5",
        "gpu=1,gpu=2",
        "gpu=1,,cpu=1",
        "a b=1",
        "mem=lots",
    ],
)
def test_parse_resources_refuses(text):
    with pytest.raises(InputError, match="^--eval-resources") as info:
        parse_resources(text)
    assert "\n" not in str(info.value)


def test_ray_private_cluster_is_loopback_and_closed():
    proc = _fresh_python("""
        import ray
        from executor_jobs import on_error, run_job
        from dghard_cli.sweeping.executors import RayExecutor
        ex = RayExecutor(run_job, 2, on_error, address=None, resources={"CPU": 1.0})
        h = ex.submit(("square", 6), {})
        print("RESULT", ex.wait([h], timeout=60)[0][1][0])
        print("NODES", sorted(n["NodeManagerAddress"] for n in ray.nodes()), ray.cluster_resources()["CPU"])
        ex.close()
        print("CLOSED", ray.is_initialized())
        """)
    assert "RESULT 36" in proc.stdout, proc.stdout + proc.stderr
    assert "NODES ['127.0.0.1'] 2.0" in proc.stdout
    assert "CLOSED False" in proc.stdout


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:8265", "https://head:8265/#/overview", "file:///tmp/ray"]
)
def test_a_url_of_another_scheme_is_refused_before_anything_connects(address):
    """A pasted dashboard URL was looked up as a host named 'http' ("cannot resolve host")."""
    from dghard_cli.sweeping.executors import _probe, check_address_form

    for fn in (check_address_form, _probe):
        with pytest.raises(InputError, match=r"is not a Ray address.*HOST:PORT"):
            fn(address)


def test_a_service_that_is_not_ray_is_refused_within_seconds():
    """A port that answers but is no Ray GCS took ~27 s and 7 lines of Ray's warnings."""
    import socket
    import threading

    from dghard_cli.sweeping.executors import _probe

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def serve() -> None:  # an HTTP/1 server: reads the request, answers 400, closes
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(InputError, match="answers but is not a Ray cluster"):
            _probe(f"127.0.0.1:{port}")
        assert time.monotonic() - t0 < 6
    finally:
        srv.close()


def test_auto_resolves_ray_address_and_refuses_a_dead_one_fast():
    """`auto` with a dead RAY_ADDRESS went through Ray's own retries (~27 s)."""
    t0 = time.monotonic()
    proc = _fresh_python("""
        import os
        os.environ["RAY_ADDRESS"] = "127.0.0.1:1"
        from dghard_cli.errors import InputError
        from dghard_cli.sweeping.executors import RayExecutor
        try:
            RayExecutor(print, 1, print, address="auto", resources={"CPU": 1.0})
        except InputError as exc:
            print("INPUT-ERROR", exc)
        """)
    assert time.monotonic() - t0 < 30
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("INPUT-ERROR --ray-address") and "127.0.0.1:1" in line and "refused" in line, (
        proc.stdout + proc.stderr
    )


def test_an_explicit_address_is_the_one_contacted_whatever_ray_address_says(monkeypatch):
    """Ray reads RAY_ADDRESS over the address passed to ray.init: a --ray-address was ignored."""
    from dghard_cli.sweeping import executors

    seen = {}

    class FakeRay:
        @staticmethod
        def init(address, **kw):
            seen["address"], seen["env"] = address, os.environ.get("RAY_ADDRESS")

    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    monkeypatch.setattr(executors, "_probe", lambda a: None)
    ex = executors.RayExecutor.__new__(executors.RayExecutor)
    ex.slots, ex._owns = 1, False
    ex._connect(FakeRay, "head.example:6379", None)
    assert seen == {"address": "head.example:6379", "env": None}
    assert os.environ["RAY_ADDRESS"] == "10.9.9.9:6379"


def test_workers_that_cannot_start_are_a_clear_exit_3_within_a_bound(ray_cluster, tmp_path, monkeypatch):
    """No worker could start for the jobs' resources: the sweep waited over 200 s, silent."""
    from dghard_cli.errors import RuntimeFailure

    busy = make("ray", ray_cluster, 1, resources=parse_resources("gpu=1,cpu=1"))
    pid_file = tmp_path / "pid"
    try:
        h = busy.submit(("sleep_child", str(pid_file)), {})  # holds the cluster's only GPU
        wait_for_file(pid_file)
        monkeypatch.setenv("DGHARD_RAY_START_TIMEOUT_S", "2")
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"started no worker for an evaluation within 2 s"):
            make("ray", ray_cluster, 1, resources=parse_resources("gpu=1,cpu=1"))
        assert time.monotonic() - t0 < 15
    finally:
        busy.cancel([h])
        busy.close()


# --- workers that die as they start ------------------------------------------------------

_DYING_WORKERS = """\
import os, sys
if any("default_worker.py" in a for a in (getattr(sys, "orig_argv", None) or sys.argv)):
    os._exit(1)  # a Ray worker: dies as it starts (the driver and the cluster's own processes live)
"""


def _session_leftovers(sid: int) -> list[int]:
    """Processes still in session ``sid`` (the cluster's agents outlive a driver killed mid-start)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_workers_that_die_as_they_start_are_exit_3_within_the_bound(tmp_path):
    """A private cluster whose workers die as they start (a broken sitecustomize): the sweep waited
    silently for over 200 s inside ray.init (Ray's raylet holds back the first driver's
    registration until the workers it prestarts for it register; the wait holds the GIL, so the
    worker-start probe and its bound never ran)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_DYING_WORKERS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env["DGHARD_RAY_START_TIMEOUT_S"] = "2"
    code = """
        import faulthandler, sys, time
        faulthandler.dump_traceback_later(60, exit=True)  # before the fix: shows where it waits
        import ray
        from executor_jobs import on_error, run_job
        from dghard_cli.errors import RuntimeFailure
        from dghard_cli.sweeping.executors import RayExecutor
        t0 = time.monotonic()
        try:
            RayExecutor(run_job, 2, on_error, address=None, resources={"CPU": 1.0})
        except RuntimeFailure as exc:
            print("RUNTIME-FAILURE", time.monotonic() - t0, exc)
        print("CLOSED", ray.is_initialized())
        """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in _session_leftovers(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.startswith(("RUNTIME-FAILURE", "CLOSED"))]
    assert len(lines) == 2, out + err
    _, seconds, message = lines[0].split(" ", 2)
    assert message.startswith("the local Ray cluster started no worker for an evaluation within 2 s"), message
    assert "\n" not in message
    assert float(seconds) < 45  # the cluster's start (seconds on a loaded machine) and the 2 s bound
    assert lines[1] == "CLOSED False"  # the private cluster the failed executor started is stopped


# --- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("localhost:1", "refused"),
        ("LOCALHOST:1", "refused"),
        ("127.0.0.2:1", "refused"),
        (f"{socket.gethostname()}:1", "refused"),
        ("[::1]:1", "cannot connect"),  # refused, or no IPv6 here
        ("localfoo:1", "cannot resolve host 'localfoo'"),
    ],
)
def test_an_address_naming_this_host_is_probed_like_127_0_0_1(address, why):
    """`localhost:6379` skipped the probe (it starts with "local"): 25 s and 8 lines of Ray's
    logging, where 127.0.0.1:6379 is one line in a second."""
    from dghard_cli.sweeping.executors import _probe

    t0 = time.monotonic()
    with pytest.raises(InputError, match=rf"^--ray-address '{re.escape(address)}': .*{why}"):
        _probe(address)
    assert time.monotonic() - t0 < 6


class _FakeRay:
    """Records ray.init's arguments; connects nowhere."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def init(self, **kw) -> None:
        self.calls.append(kw)


def _bare_executor(slots: int = 2):
    from dghard_cli.sweeping import executors

    ex = executors.RayExecutor.__new__(executors.RayExecutor)
    ex.slots, ex._owns = slots, False
    return ex


def test_auto_through_ray_address_naming_this_host_is_probed(monkeypatch):
    """`auto` with RAY_ADDRESS=localhost:... skipped the probe too."""
    monkeypatch.setenv("RAY_ADDRESS", "localhost:1")
    fake = _FakeRay()
    with pytest.raises(InputError, match=r"^--ray-address 'localhost:1': cannot connect to localhost:1"):
        _bare_executor()._connect(fake, "auto", None)
    assert fake.calls == []  # refused before Ray was asked


@pytest.mark.parametrize(("address", "ray_address"), [("local", None), ("auto", "local")])
def test_only_the_literal_local_skips_the_probe_and_it_is_a_private_cluster(
    monkeypatch, address, ray_address
):
    """`local` (given, or `auto` through RAY_ADDRESS as Ray reads it) is a new local cluster: the
    private one (loopback, --jobs CPUs, no prestart wait), with nothing to probe."""
    from dghard_cli.sweeping import executors

    if ray_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    monkeypatch.setattr(executors, "_probe", lambda a: pytest.fail(f"probed {a!r}"))
    fake = _FakeRay()
    _bare_executor(slots=3)._connect(fake, address, None)
    (call,) = fake.calls
    assert call["address"] == "local" and call["num_cpus"] == 3 and call["include_dashboard"] is False
    assert call["_system_config"] == {"prestart_worker_first_driver": False}


# --- the worker-start bound from the environment -----------------------------------------


@pytest.mark.parametrize("value", ["1e300", "inf", "nan", "-1", "0", "0.01", "86401", "abc", "9" * 5000])
def test_a_start_timeout_out_of_range_is_refused_naming_the_variable_and_range(monkeypatch, value):
    """DGHARD_RAY_START_TIMEOUT_S=1e300 was an internal OverflowError (inside Ray's ray.get)."""
    from dghard_cli.sweeping.executors import worker_start_timeout

    monkeypatch.setenv("DGHARD_RAY_START_TIMEOUT_S", value)
    with pytest.raises(
        InputError, match=r"^DGHARD_RAY_START_TIMEOUT_S must be .* from 0\.1 to 86400"
    ) as info:
        worker_start_timeout()
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_a_start_timeout_in_range_or_unset_is_read(monkeypatch):
    from dghard_cli.sweeping.executors import WORKER_START_TIMEOUT_S, worker_start_timeout

    for value, want in [("2", 2.0), (" 0.5 ", 0.5), ("86400", 86400.0), ("", WORKER_START_TIMEOUT_S)]:
        monkeypatch.setenv("DGHARD_RAY_START_TIMEOUT_S", value)
        assert worker_start_timeout() == want
    monkeypatch.delenv("DGHARD_RAY_START_TIMEOUT_S")
    assert worker_start_timeout() == WORKER_START_TIMEOUT_S
