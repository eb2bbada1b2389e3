"""`dghard sweep --executor ray`: each candidate's write-and-evaluate is a task on a Ray cluster
(here a local one: 127.0.0.1, 2 CPUs). The sweep gives the same evaluated set, report and winner
(byte for byte) as the local executor; a worker lost mid-evaluation is retried once, then that
candidate is marked failed and the sweep goes on."""

from __future__ import annotations

import json
import os

import pytest
from test_sweep_parallel import _comparable, _log, _reset, _run, _weights
from test_sweep_parallel import pair as pair  # noqa: F401 (the module's fixture)


@pytest.fixture(scope="module")
def ray_cluster():
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only; read when ray is imported
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


def test_a_ray_sweep_is_the_local_sweep(pair, ray_cluster, tmp_path, monkeypatch):  # noqa: F811
    _reset(pair)
    local = _run(pair, tmp_path / "local", monkeypatch, jobs=1, budget=8)
    _reset(pair)
    on_ray = _run(pair, tmp_path / "ray", monkeypatch, jobs=2, budget=8, executor="ray")
    assert _comparable(on_ray) == _comparable(local)
    assert _weights(tmp_path / "ray") == _weights(tmp_path / "local")
    assert len(_log(pair)) == 8  # every evaluation ran once, on the cluster's workers
    assert {p.name for p in (tmp_path / "ray").iterdir()} == {p.name for p in (tmp_path / "local").iterdir()}


def test_a_lost_worker_is_retried_once_then_fails_its_candidate(pair, ray_cluster, tmp_path, monkeypatch):  # noqa: F811
    _reset(pair)
    control = pair.root / "kill_worker.json"
    control.write_text(json.dumps({"hard scale=3.0": "always", "soft scale=0.5": "once"}))
    for m in pair.root.glob("killed-*"):
        m.unlink()
    try:
        doc = _run(pair, tmp_path / "out", monkeypatch, jobs=2, budget=10, executor="ray")
    finally:
        control.unlink()
    by = {r["name"]: r for r in doc["candidates"]}
    lost = by["hard scale=3.0"]
    assert lost["status"] == "failed" and "lost on both attempts" in lost["message"], lost["message"]
    assert by["soft scale=0.5"]["status"] == "ok"  # its worker died once: the retry evaluated it
    assert doc["winner"] is not None and sum(r["status"] == "ok" for r in doc["candidates"]) == 8 - 1
    _reset(pair)
    again = _run(pair, tmp_path / "out2", monkeypatch, jobs=2, budget=10, executor="ray")
    assert again["budget"]["from_cache"] == 0  # a lost worker's failure is not cached: a resume retries it
