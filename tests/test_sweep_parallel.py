"""`dghard sweep --jobs N --devices …`: several evaluations at a time give the same evaluated set,
report and winner as one at a time; at most N run at once, each on its own device; an
interruption with evaluations in flight resumes without evaluating a finished one again; at
most N + 1 candidates are on disk; a failing evaluation or write fails its candidate only; bad
execution options are exit 2 before anything runs.

Uses the generated pair and stand-in evaluation of tests/test_sweep.py, behind a wrapper that
logs, per evaluation, when it ran, on which device, and how many candidates were on disk."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_dghard
from test_sweep import Pair, alive

from dghard_cli.errors import InputError, Interrupted, RuntimeFailure
from dghard_cli.sweeping import execution, jobs, steps
from dghard_cli.sweeping.run import SweepOptions, staging_path, sweep

WRAPPER = """
import json, os, signal, subprocess, sys, time
from pathlib import Path

root, model, output, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
stage = Path(os.environ.get("SWEEP_STAGE", "/nonexistent"))
on_disk = sum(1 for p in (stage / "jobs").glob("*/candidate") if p.is_dir()) + (stage / "winner").is_dir()
rec = {"name": os.environ["DGHARD_CANDIDATE"], "start": time.time(), "device_arg": device,
       "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "on_disk": on_disk, "pid": os.getpid()}
control = root / "kill_worker.json"  # {"name": "once" | "always"}: SIGKILL the Ray worker running us
how = json.loads(control.read_text()).get(rec["name"]) if control.exists() else None
marker = root / ("killed-" + rec["name"].replace(" ", "_"))
if how == "always" or (how == "once" and not marker.exists()):
    marker.write_text("1")
    pid = os.getpid()
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
            os.kill(pid, 9)
            time.sleep(60)
rm = os.environ.get("WRAP_RM_STAGE_ON")  # a hostile evaluation: deletes the sweep's staging directory
if rm and rm in rec["name"]:
    import shutil
    shutil.rmtree(stage, ignore_errors=True)
hang = os.environ.get("WRAP_HANG_ON")
if hang and hang in rec["name"]:
    (root / "hanging").write_text(str(os.getpid()))
    time.sleep(120)
time.sleep(float(os.environ.get("WRAP_SLEEP", "0")))
rc = subprocess.call([sys.executable, str(root / "evaluate.py"), model, output])
# logged means finished: a stop that comes now cannot turn this evaluation into a killed one
# (it was exiting 0 when the interruption came, and the sweep must keep it)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rec["end"] = time.time()
with open(root / "wrap.jsonl", "a") as fh:
    fh.write(json.dumps(rec) + "\\n")
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    p = Pair(tmp_path_factory.mktemp("parallel"))
    (p.root / "wrap.py").write_text(WRAPPER)
    return p


def _template(pair: Pair, device: str = "x") -> str:
    wrap = shlex.quote(str(pair.root / "wrap.py"))
    return f"{shlex.quote(sys.executable)} {wrap} {shlex.quote(str(pair.root))} {{model}} {{output}} {device}"


def _log(pair: Pair) -> list[dict]:
    path = pair.root / "wrap.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _reset(pair: Pair) -> None:
    pair.reset_calls()
    (pair.root / "wrap.jsonl").unlink(missing_ok=True)


def _run(pair: Pair, out: Path, monkeypatch, *, template: str | None = None, **kw) -> dict:
    monkeypatch.setenv("SWEEP_STAGE", str(staging_path(out)))
    opts = SweepOptions(
        eval_template=template or _template(pair),
        budget=kw.pop("budget", 12),
        candidates=pair.candidates,
        **kw,
    )
    return sweep(pair.base, pair.ft, out, opts)


def _comparable(doc: dict) -> dict:
    """The report less what depends on timing (times, which device; a candidate's size counts its
    report, whose timings differ by a few bytes: its weights are compared apart)."""
    rows = [
        {k: v for k, v in r.items() if k not in ("seconds", "cached", "device", "reproduce", "bytes")}
        for r in doc["candidates"]
    ]
    # rewritten_at_end: whether the winner was still on disk at the end, which with a tie
    # tolerance can depend on the order evaluations finished in (its bytes are the same)
    win = {k: v for k, v in (doc["winner"] or {}).items() if k not in ("reproduce", "rewritten_at_end")}
    budget = {k: v for k, v in doc["budget"].items() if k not in ("run_now", "from_cache")}
    return {"rows": rows, "winner": win, "budget": budget, "benchmarks": doc["benchmarks"]}


def _weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_the_same_evaluations_and_winner_with_1_and_3_jobs(pair, tmp_path, monkeypatch):
    _reset(pair)
    one = _run(pair, tmp_path / "one", monkeypatch, jobs=1)
    serial = _log(pair)
    _reset(pair)
    three = _run(pair, tmp_path / "three", monkeypatch, jobs=3)
    log = _log(pair)
    assert _comparable(one) == _comparable(three)
    assert one["winner"] is not None and one["budget"]["used"] == 12
    assert _weights(tmp_path / "one") == _weights(tmp_path / "three")
    # every evaluation ran once, and several of them at the same time
    assert sorted(r["name"] for r in log) == sorted(r["name"] for r in serial)
    overlap = max(sum(1 for r in log if r["start"] < t < r["end"]) for t in [r["start"] + 1e-3 for r in log])
    assert 2 <= overlap <= 3
    assert max(r["on_disk"] for r in log) <= 3 + 1  # the candidates in flight and the winner


def test_each_running_evaluation_has_its_own_device(pair, tmp_path, monkeypatch):
    _reset(pair)
    monkeypatch.setattr(execution, "visible_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # --devices index what this process sees
    monkeypatch.setenv("WRAP_SLEEP", "0.3")
    doc = _run(
        pair, tmp_path / "out", monkeypatch, template=_template(pair, "{device}"), devices=["1,3"], budget=6
    )
    log = _log(pair)
    assert doc["winner"] is not None and len(log) == 6
    assert {r["cuda"] for r in log} <= {"5", "7"} and {r["cuda"] for r in log} == {"5", "7"}
    assert all(r["device_arg"] == r["cuda"] for r in log)  # {device} is what CUDA_VISIBLE_DEVICES holds
    for r in log:  # two evaluations running at the same time never share a device
        for q in log:
            if q is not r and q["start"] < r["end"] and r["start"] < q["end"]:
                assert q["cuda"] != r["cuda"]
    assert all(c.get("device") in ("5", "7") for c in doc["candidates"])


def test_an_interruption_with_evaluations_in_flight_resumes_without_repeating_one(
    pair, tmp_path, monkeypatch
):
    _reset(pair)
    out = tmp_path / "out"
    monkeypatch.setenv("WRAP_HANG_ON", "soft scale=1.5")  # the 4th candidate of the coarse round hangs
    hanging = pair.root / "hanging"

    def interrupt_when_hanging() -> None:
        for _ in range(600):
            if hanging.exists():
                time.sleep(0.3)  # the other evaluations in flight are running too
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    t = threading.Thread(target=interrupt_when_hanging)
    t.start()
    with pytest.raises(Interrupted):
        _run(pair, out, monkeypatch, jobs=3)
    t.join()
    pid = int(hanging.read_text())
    assert not alive(pid)  # the hanging evaluation was taken down
    finished = [r["name"] for r in _log(pair)]
    assert staging_path(out).is_dir() and not out.exists()
    monkeypatch.delenv("WRAP_HANG_ON")
    (pair.root / "wrap.jsonl").unlink()
    doc = _run(pair, out, monkeypatch, jobs=3)
    again = [r["name"] for r in _log(pair)]
    assert not set(finished) & set(again)  # nothing finished is evaluated twice
    assert doc["budget"]["from_cache"] == len(finished) and doc["budget"]["run_now"] == 12 - len(finished)
    _reset(pair)
    assert _comparable(doc) == _comparable(_run(pair, tmp_path / "straight", monkeypatch, jobs=1))


def test_a_failing_evaluation_or_write_fails_that_candidate_only(pair, tmp_path, monkeypatch):
    _reset(pair)
    real_run, real_prepare = jobs.run_command, steps.prepare

    def crash_one(*args, **kwargs):
        if kwargs.get("label") == "hard scale=3.0":
            raise OSError("the worker lost its scratch disk")
        return real_run(*args, **kwargs)

    def refuse_one(job):
        if job.label == "optimal scale=3.0":
            raise InputError("tensor 'x': the strength overflows bfloat16")
        return real_prepare(job)

    monkeypatch.setattr(jobs, "run_command", crash_one)
    monkeypatch.setattr(steps, "prepare", refuse_one)
    doc = _run(pair, tmp_path / "out", monkeypatch, jobs=2)
    by = {r["name"]: r for r in doc["candidates"]}
    assert by["hard scale=3.0"]["status"] == "failed"
    assert "the worker lost its scratch disk" in by["hard scale=3.0"]["message"]
    assert by["optimal scale=3.0"]["status"] == "failed"
    assert "could not be written" in by["optimal scale=3.0"]["message"]
    assert doc["winner"] is not None and sum(r["status"] == "ok" for r in doc["candidates"]) == 10 - 2


def test_the_disk_bound(pair, tmp_path, monkeypatch):
    _reset(pair)
    # less free space than one candidate takes and nothing running: exit 3, resumable
    monkeypatch.setattr(steps, "_disk_free", lambda s: 1024)
    out = tmp_path / "out"
    with pytest.raises(RuntimeFailure, match="not enough free disk space"):
        _run(pair, out, monkeypatch, jobs=2)
    # room for exactly one candidate at a time: the second write waits for the first to be scored
    monkeypatch.setattr(
        steps,
        "_disk_free",
        lambda s: steps._disk_needed(s) if not any((s.stage / "jobs").glob("*/candidate")) else 0,
    )
    doc = _run(pair, out, monkeypatch, jobs=2, budget=6)
    assert doc["winner"] is not None
    assert all(r["on_disk"] <= 2 for r in _log(pair))  # the one in flight and the winner


def test_keep_candidates_keeps_every_loser_in_out(pair, tmp_path, monkeypatch):
    _reset(pair)
    doc = _run(pair, tmp_path / "out", monkeypatch, jobs=2, budget=6, keep_candidates=True)
    kept = sorted(p.name for p in (tmp_path / "out" / "candidates").iterdir())
    losers = [r for r in doc["candidates"] if r["order"] != doc["winner"]["order"]]
    assert [k[:4] for k in kept] == [f"{r['order']:03d}-" for r in losers]
    assert kept[0] == f"{losers[0]['order']:03d}-{losers[0]['name'].replace(' ', '_')}"
    assert all((tmp_path / "out" / "candidates" / k / "dghard_report.json").is_file() for k in kept)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--jobs", "0"], "--jobs must be a whole number from 1 to 4096"),
        (["--jobs", "9" * 400], "got a 400-digit number"),  # never sized: list(range(10**400))
        (["--devices", "0"], "device 0 does not exist: this machine shows no CUDA device"),
        (["--devices", "0,0"], "device 0 is given twice"),
        (["--devices", "cuda0"], "is not a device index"),
        (["--executor", "dask"], "--executor 'dask' is not one of: local, ray"),
        (["--ray-address", "127.0.0.1:1"], "--ray-address needs --executor ray"),
        (["--eval-resources", "gpu=1"], "--eval-resources needs --executor ray"),
        (["--executor", "ray", "--devices", "0"], "--devices is for the local executor"),
        (
            ["--executor", "ray", "--ray-address", "127.0.0.1:1"],
            "--ray-address '127.0.0.1:1': cannot connect",
        ),
        (["--executor", "ray", "--eval-resources", "gpu=-1"], "--eval-resources"),
    ],
)
def test_bad_execution_options_are_exit_2_before_anything_runs(pair, tmp_path, monkeypatch, args, message):
    _reset(pair)
    monkeypatch.setattr(execution, "visible_gpu_count", lambda: 0)
    out = tmp_path / "out"
    res = run_dghard("sweep", pair.base, pair.ft, out, "--eval", _template(pair), *args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) <= 2, res.stderr
    assert not out.exists() and not staging_path(out).exists() and not _log(pair)


def test_device_options_that_do_not_fit(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "visible_gpu_count", lambda: 2)
    for kw, message in (
        ({"devices": ["0,2"]}, "device 2 does not exist: this machine shows 2 CUDA device(s)"),
        ({"devices": ["0,1"], "jobs": 3}, "--jobs 3 with 2 device(s) in --devices"),
        ({}, "--eval uses {device} but no --devices were given"),
    ):
        with pytest.raises(InputError) as e:
            _run(pair, tmp_path / "out", monkeypatch, template=_template(pair, "{device}"), **kw)
        assert message in str(e.value)


def test_json_progress_is_one_object_per_line(pair, tmp_path, monkeypatch):
    _reset(pair)
    monkeypatch.setenv("SWEEP_STAGE", str(staging_path(tmp_path / "out")))
    res = run_dghard(
        "sweep", pair.base, pair.ft, tmp_path / "out", "--eval", _template(pair), "--candidates",
        pair.candidates, "--budget", "5", "--jobs", "2", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stderr.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("candidate") == 3 and "round" in kinds and "evaluating" in kinds
    last = [e for e in events if e["kind"] == "candidate"][-1]
    assert last["done"] == 3 and last["budget"] == 3 and last["best"]["name"] and "eta_s" in last
    assert json.loads(res.stdout)["winner"]["name"] == last["best"]["name"]


def test_the_live_table_shows_running_queued_best_and_eta():
    import io

    from rich.console import Console

    from dghard_cli.cli.render_sweep import ProgressLines, ProgressTable, progress_printer

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    printer = progress_printer(console)
    assert isinstance(printer, ProgressTable)
    assert isinstance(progress_printer(Console(file=io.StringIO())), ProgressLines)  # a log: lines
    state = {"done": 1, "budget": 6, "slots": 2, "queued": 3, "eta_s": 754.0}
    printer(
        {
            "kind": "evaluating",
            "name": "hard scale=3.0",
            "reference": False,
            **state,
            "running": ["hard scale=3.0"],
        }
    )
    row = {"name": "soft scale=0.5", "phase": "coarse", "status": "ok", "hm": 82.1, "repair": 84.1,
           "retention": 80.3, "cached": False, "seconds": {"eval": 2.5}, "device": "1"}  # fmt: skip
    ev = {"kind": "candidate", "row": row, "order": 1, **state, "running": ["hard scale=3.0"],
          "best": {"name": "soft scale=0.5", "hm": 82.1}}  # fmt: skip
    printer(ev)
    table = printer.table()
    text = Console(file=io.StringIO(), width=120, record=True)
    text.print(table)
    shown = text.export_text()
    assert "hard scale=3.0" in shown and "done 1/6" in shown and "queued 3" in shown
    assert "best soft scale=0.5 HM 82.1" in shown and "ETA 12 min 34 s" in shown
    printer.close()
    assert "sweep 1/6 soft scale=0.5 (coarse): HM 82.1" in buf.getvalue() and "on device 1" in buf.getvalue()


def test_the_distance_has_the_same_bits_whatever_the_thread_count(tmp_path):
    """A Ray worker measures the candidates it writes; the distance breaks ties, so it must not
    depend on the process (torch's sums differed in the last bit between the sweep and a Ray
    worker: a Ray sweep's report differed from the local one in scripts/bench_sweep_jobs.py)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.sweeping.choose import update_distance

    g = torch.Generator().manual_seed(3)
    shapes = {"a.weight": (700, 900), "b.weight": (1500, 333)}
    dirs = {}
    for label in ("base", "ft", "cand"):
        d = tmp_path / label
        d.mkdir()
        save_file({n: torch.randn(*s, generator=g) for n, s in shapes.items()}, str(d / "model.safetensors"))
        dirs[label] = Checkpoint(d, label=label)
    before = torch.get_num_threads()
    try:
        seen = set()
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            seen.add(update_distance(dirs["base"], [dirs["ft"]], dirs["cand"]).hex())
    finally:
        torch.set_num_threads(before)
        for ck in dirs.values():
            ck.close()
    assert len(seen) == 1, seen
    # and it is the float64 distance: ‖C − F‖ / ‖F − B‖
    from safetensors.numpy import load_file

    b, f, c = (load_file(str(tmp_path / x / "model.safetensors")) for x in ("base", "ft", "cand"))
    num = sum(np.sum((c[n].astype(np.float64) - f[n].astype(np.float64)) ** 2) for n in shapes)
    den = sum(np.sum((f[n].astype(np.float64) - b[n].astype(np.float64)) ** 2) for n in shapes)
    assert abs(float.fromhex(seen.pop()) - math.sqrt(num / den)) < 1e-11


def test_a_full_disk_while_the_sweep_writes_its_report_is_exit_3_and_resumes(pair, tmp_path, monkeypatch):
    """Writes without a message of their own (the sweep's report) used to end as 'internal
    error: OSError'; a full disk is the machine's state: exit 3 saying so, the cache kept."""
    import errno

    from dghard_cli.sweeping import run as sweep_run

    _reset(pair)
    real = sweep_run.write_json

    def full(path, doc):
        if Path(path).name == "sweep_report.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, doc)

    monkeypatch.setattr(sweep_run, "write_json", full)
    out = tmp_path / "out"
    args = ["sweep", pair.base, pair.ft, out, "--eval", _template(pair), "--candidates", pair.candidates]
    res = run_dghard(*args, "--budget", "4")
    assert res.returncode == 3, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert (
        "disk full while writing" in line and "sweep_report.json" in line and "run the same command" in line
    )
    assert "internal error" not in res.stderr and staging_path(out).is_dir()
    monkeypatch.setattr(sweep_run, "write_json", real)
    res = run_dghard(*args, "--budget", "4", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["budget"]["from_cache"] == 4


def test_an_interruption_while_a_candidate_is_written_keeps_what_finished_meanwhile(
    pair, tmp_path, monkeypatch
):
    """The main thread writes a candidate while others evaluate; an evaluation that finishes
    during that write and a Ctrl-C before it is collected must still be cached."""
    _reset(pair)
    monkeypatch.setenv("WRAP_SLEEP", "0.8")
    real, writes = steps.prepare, []

    def slow_third_write(job):
        if job.write is not None:
            writes.append(job.label)
            if len(writes) == 3:  # the first two candidates are evaluating meanwhile
                deadline = time.time() + 60

                def exited() -> bool:  # logged, and the evaluation's process is gone: finished
                    done = [r for r in _log(pair) if r["name"] in writes[:2]]
                    return len(done) == 2 and not any(alive(r["pid"]) for r in done)

                # (logged alone was not finished: on a loaded machine the Ctrl-C could land
                # between the wrapper's log line and its exit, and a killed evaluation is rightly
                # not cached)
                while not exited() and time.time() < deadline:
                    time.sleep(0.05)
                raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(steps, "prepare", slow_third_write)
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        _run(pair, out, monkeypatch, jobs=2)
    finished = {r["name"] for r in _log(pair)}
    assert set(writes[:2]) <= finished  # both had finished when the interruption came
    monkeypatch.setattr(steps, "prepare", real)
    (pair.root / "wrap.jsonl").unlink()
    doc = _run(pair, out, monkeypatch, jobs=2)
    assert not finished & {r["name"] for r in _log(pair)}  # none of them evaluated again
    assert doc["budget"]["from_cache"] == len(finished)


def test_an_evaluation_that_finished_but_hands_its_result_back_late_is_still_cached(
    pair, tmp_path, monkeypatch
):
    """On a busy machine a job's thread can hand its finished evaluation back seconds after the
    command exited; an interruption meanwhile must wait for it and cache it (a fixed 2 s window
    lost it, and the resume evaluated it again: the flake seen at load average 6)."""
    _reset(pair)
    real_run, real_prepare, writes = jobs.run_command, steps.prepare, []
    exited: list[str] = []

    def slow_hand_back(*args, **kwargs):
        res = real_run(*args, **kwargs)
        if len(writes) >= 2 and kwargs.get("label") == writes[1]:
            exited.append(kwargs["label"])
            time.sleep(4.0)  # a loaded machine: the thread gets the CPU back late
        return res

    def interrupt_third_write(job):
        if job.write is not None:
            writes.append(job.label)
            if len(writes) == 3:
                deadline = time.time() + 60
                while not exited and time.time() < deadline:  # the 2nd has exited
                    time.sleep(0.05)
                raise KeyboardInterrupt
        return real_prepare(job)

    monkeypatch.setattr(jobs, "run_command", slow_hand_back)
    monkeypatch.setattr(steps, "prepare", interrupt_third_write)
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        _run(pair, out, monkeypatch, jobs=2)
    assert exited == writes[1:2]
    finished = {r["name"] for r in _log(pair)}
    monkeypatch.setattr(jobs, "run_command", real_run)
    monkeypatch.setattr(steps, "prepare", real_prepare)
    (pair.root / "wrap.jsonl").unlink()
    doc = _run(pair, out, monkeypatch, jobs=2)
    assert not finished & {r["name"] for r in _log(pair)}  # none evaluated again
    assert doc["budget"]["from_cache"] == len(finished) == 4  # BASE, FT and the two candidates


def test_an_interruption_while_a_finished_evaluation_is_handled_keeps_it(pair, tmp_path, monkeypatch):
    """The interruption landed while the sweep's thread handled an evaluation that had finished,
    before its record was cached: the job had left the jobs in flight, so nothing collected it,
    and the resume evaluated it again (the stop CI's flake, with the same candidates)."""
    from dghard_cli.sweeping.cache import Cache

    _reset(pair)
    real_put, calls = Cache.put, []

    def put(self, key, rec, results):
        calls.append(key)
        if len(calls) == 4:  # the 2nd candidate (after BASE and FT), before it is cached
            raise KeyboardInterrupt
        return real_put(self, key, rec, results)

    monkeypatch.setattr(Cache, "put", put)
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        _run(pair, out, monkeypatch, jobs=2)
    finished = {r["name"] for r in _log(pair)}
    assert len(calls) >= 5  # the interrupted one was handled again, and cached
    monkeypatch.setattr(Cache, "put", real_put)
    (pair.root / "wrap.jsonl").unlink()
    doc = _run(pair, out, monkeypatch, jobs=2)
    assert not finished & {r["name"] for r in _log(pair)}  # none evaluated again
    assert doc["budget"]["from_cache"] == len(finished)


def test_an_evaluation_that_deletes_the_staging_directory_stops_the_sweep_with_one_clear_error(
    pair, tmp_path, monkeypatch
):
    """With --jobs 2 the deletion made a write fail on a vanished path ("writing ...: No such file
    or directory") and another candidate be reported as "interrupted"."""
    _reset(pair)
    monkeypatch.setenv("WRAP_RM_STAGE_ON", "soft scale=0.5")
    monkeypatch.setenv("WRAP_SLEEP", "0.3")
    with pytest.raises(
        RuntimeFailure, match="staging directory .* was removed or replaced while the sweep ran"
    ):
        _run(pair, tmp_path / "out", monkeypatch, jobs=2)
    assert not (tmp_path / "out").exists()


def test_an_evaluation_that_ignores_sigterm_is_killed_and_its_thread_returns(tmp_path):
    from dghard_cli.sweeping import evaluate

    pidfile = tmp_path / "pid"
    template = f"sh -c 'trap \"\" TERM; echo $$ > {pidfile}; sleep 60' {{model}} {{output}}"
    outcome: list = []

    def run() -> None:
        try:
            evaluate.run_command(
                template, tmp_path, tmp_path / "o", tmp_path / "logs", timeout=None, label="x"
            )
        except evaluate.EvaluationCancelled as exc:
            outcome.append(exc)

    evaluate.allow_evaluations()
    t = threading.Thread(target=run)
    t.start()
    while not pidfile.exists() or not pidfile.read_text().strip():
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    t0 = time.monotonic()
    assert evaluate.terminate_running(wait=evaluate.KILL_GRACE_S + 2) == 1
    t.join(timeout=10)
    assert not t.is_alive() and outcome and time.monotonic() - t0 < evaluate.KILL_GRACE_S + 3
    assert not alive(pid)
    evaluate.allow_evaluations()


def test_an_evaluation_whose_command_exits_0_as_the_interruption_comes_is_a_result(tmp_path):
    """The command was finishing (its results written, exiting 0) when the sweep was interrupted;
    the sweep discarded it because the reaper had not yet reported the exit, and the resumed sweep
    evaluated it again (the CI flake at load average 6). The reaper's report decides: a command
    that exits 0 on its own is kept, however late the report comes."""
    from dghard_cli.sweeping import evaluate

    started = tmp_path / "started"
    # SIGTERM ignored: the command finishes its write and exits 0 within the reaper's grace
    template = f"trap '' TERM; touch {started}; sleep 0.5; echo '{{}}' > {{output}}; exit 0 # {{model}}"
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(
                evaluate.run_command(
                    template, tmp_path, tmp_path / "o.json", tmp_path / "logs", timeout=None, label="x"
                )
            )
        except evaluate.EvaluationCancelled as exc:
            outcome.append(exc)

    evaluate.allow_evaluations()
    t = threading.Thread(target=run)
    t.start()
    while not started.exists():
        time.sleep(0.02)
    assert evaluate.terminate_running(wait=evaluate.KILL_GRACE_S + 2) == 1
    t.join(timeout=20)
    evaluate.allow_evaluations()
    assert not t.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], evaluate.EvalRun), outcome
    assert outcome[0].status == "ok" and (tmp_path / "o.json").read_text().strip() == "{}"


def test_device_lists_that_would_share_or_escape_a_gpu(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "visible_gpu_count", lambda: 8)
    for devices, jobs_, message in (
        (["1,01"], None, "device 1 is given twice"),
        (["²"], None, "is not a device index"),
        (["0,7"], 1, None),  # every listed device is checked, not only the first --jobs
        (["0,9"], 1, "device 9 does not exist"),
    ):
        opts = SweepOptions(eval_template=_template(pair), devices=devices, jobs=jobs_)
        if message is None:
            assert execution.plan_execution(opts) == (1, ["0"])
            continue
        with pytest.raises(InputError, match=message):
            execution.plan_execution(opts)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    with pytest.raises(InputError, match="is not among this process's CUDA_VISIBLE_DEVICES"):
        execution.plan_execution(SweepOptions(eval_template=_template(pair), devices=["GPU-cccc"]))
    assert execution.plan_execution(SweepOptions(eval_template=_template(pair), devices=["1"])) == (
        1,
        ["GPU-bbbb"],
    )
    # {device} on Ray needs a GPU per task
    opts = SweepOptions(
        eval_template=_template(pair, "{device}"), executor="ray", eval_resources="gpu=0,cpu=1"
    )
    with pytest.raises(InputError, match="the Ray tasks get no GPU"):
        execution.plan_execution(opts)


def test_keep_candidates_keeps_every_loser_when_the_winner_is_decided_late(pair, tmp_path, monkeypatch):
    """With a tie tolerance the winner so far is not monotone: the final winner may have lost
    while its round ran. It comes back from the kept ones (not written again) and the candidate
    that sat in the winner's place is kept, not deleted."""
    _reset(pair)
    doc = _run(
        pair, tmp_path / "out", monkeypatch, jobs=3, budget=8, keep_candidates=True, tie_tolerance=1000.0
    )
    kept = sorted(p.name[:3] for p in (tmp_path / "out" / "candidates").iterdir())
    losers = [f"{r['order']:03d}" for r in doc["candidates"] if r["order"] != doc["winner"]["order"]]
    assert kept == losers
    assert doc["winner"]["rewritten_at_end"] is False
    assert not list((tmp_path / "out" / "candidates").glob("*.key"))


@pytest.mark.parametrize("units, base_task", [("auto", 50.0), ("points", 0.5)])
def test_units_tells_the_sweep_how_to_read_scores_below_one_point(pair, tmp_path, units, base_task):
    """Under --units auto a benchmark whose scores all lie in [0, 1] is read as fractions: points
    below one (an expert on another expert's facts, in the knowledge merge benchmark) became up
    to 100; the sweep had no way to say otherwise and now takes --units as score does."""
    b, f = tmp_path / "b.json", tmp_path / "f.json"
    b.write_text(json.dumps({"task": 0.5, "general": 70.0}))
    f.write_text(json.dumps({"task": 0.9, "general": 40.0}))  # points: both below one point
    ev = f'{shlex.quote(sys.executable)} -c \'import json,sys; open(sys.argv[2],"w").write(json.dumps({{"task": 0.6, "general": 60.0}}))\' {{model}} {{output}}'
    res = run_dghard(
        "sweep", pair.base, pair.ft, tmp_path / "out", "--eval", ev, "--candidates", pair.candidates,
        "--base-results", b, "--ft-results", f, "--budget", "1", "--units", units, "--json",
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    doc = json.loads(res.stdout)
    task = next(x for x in doc["benchmarks"] if x["name"] == "task")
    assert task["base"] == pytest.approx(base_task)
