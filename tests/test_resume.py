"""Interrupted runs: the journal keeps finished shards; a rerun resumes to identical bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dghard_cli import RepairOptions, RunOptions, repair
from dghard_cli.errors import InputError
from dghard_cli.io.output import JOURNAL, staging_dir
from dghard_cli.testing.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parent.parent


def make_slow_pair(root: Path, shards: int = 12, n: int = 800) -> tuple[Path, Path]:
    """One square matrix per shard: each shard costs a noticeable eigendecomposition."""
    g = torch.Generator().manual_seed(0)
    base, ft = [], []
    for i in range(shards):
        b = torch.randn(n, n, generator=g) * 0.02
        base.append((f"model.layers.{i:02d}.mlp.up_proj.weight", b))
        ft.append(
            (
                f"model.layers.{i:02d}.mlp.up_proj.weight",
                b
                + torch.randn(n, n, generator=g) * 1e-3
                + torch.randn(n, 1, generator=g) @ torch.randn(1, n, generator=g) * 3e-3,
            )
        )
        base.append((f"model.layers.{i:02d}.input_layernorm.weight", torch.ones(n)))
        ft.append((f"model.layers.{i:02d}.input_layernorm.weight", torch.ones(n) + 0.01))
    cfg = {"model_type": "llama"}
    write_checkpoint(root / "base", base, shards=shards, config=cfg)
    write_checkpoint(root / "ft", ft, shards=shards, config=cfg)
    return root / "base", root / "ft"


def start(base: Path, ft: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "dghard_cli", "repair", str(base), str(ft), str(out), "-q"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_shards(out: Path, proc: subprocess.Popen, k: int, timeout: float = 120) -> int:
    journal = staging_dir(out) / JOURNAL
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"run finished before it could be interrupted: {proc.stderr.read()}")
        if journal.exists():
            n = len(journal.read_text().splitlines()) - 1
            if n >= k:
                return n
        time.sleep(0.005)
    pytest.fail("no shard finished in time")


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))} | {
        "index": (d / "model.safetensors.index.json").read_bytes()
    }


@pytest.fixture(scope="module")
def slow_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    base, ft = make_slow_pair(root)
    ref = root / "reference"
    repair(base, ft, ref, RepairOptions(run=RunOptions(device="cpu")))
    return base, ft, ref


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_to_byte_identical_output(slow_pair, tmp_path):
    base, ft, ref = slow_pair
    out = tmp_path / "out"
    proc = start(base, ft, out)
    done = wait_for_shards(out, proc, 3)
    proc.kill()
    proc.wait()
    assert not out.exists() and staging_dir(out).exists()
    # the rerun (same command) resumes on its own and skips the journaled shards
    report = repair(base, ft, out, RepairOptions(run=RunOptions(device="cpu")))
    assert len(report["output"]["resumed_shards"]) >= done >= 3
    assert shard_bytes(out) == shard_bytes(ref)
    ref_report = json.loads((ref / "dghard_report.json").read_text())
    strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert strip(report["tensors"]) == strip(ref_report["tensors"])
    assert not staging_dir(out).exists()


@pytest.mark.slow
def test_sigint_exits_3_with_a_resume_hint_and_resume_flag_works(slow_pair, tmp_path):
    base, ft, ref = slow_pair
    out = tmp_path / "out"
    proc = start(base, ft, out)
    wait_for_shards(out, proc, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "again to resume" in lines[0]
    journal = (staging_dir(out) / JOURNAL).read_text().splitlines()
    names = [json.loads(x)["name"] for x in journal[1:]]
    # no partial shard is left behind: every file in the staging dir is journaled
    on_disk = sorted(p.name for p in staging_dir(out).glob("*.safetensors"))
    assert on_disk == sorted(names)
    report = repair(base, ft, out, RepairOptions(run=RunOptions(device="cpu", resume=True)))
    assert report["output"]["resumed_shards"] == sorted(names)
    assert shard_bytes(out) == shard_bytes(ref)


@pytest.mark.slow
def test_sigterm_is_an_interrupt_too(slow_pair, tmp_path):
    base, ft, _ = slow_pair
    out = tmp_path / "out"
    proc = start(base, ft, out)
    wait_for_shards(out, proc, 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "resume" in err


def test_resume_refuses_a_partial_output_of_another_command(tmp_path):
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    base, ft = make_pair(
        tmp_path, ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    )
    out = tmp_path / "out"
    stage = staging_dir(out)
    stage.mkdir()
    (stage / JOURNAL).write_text(json.dumps({"fingerprint": "something else"}) + "\n")
    with pytest.raises(InputError, match="different command"):
        repair(base, ft, out, RepairOptions(run=RunOptions(resume=True)))
    # without --resume a stale partial output is replaced, not trusted
    report = repair(base, ft, out)
    assert report["output"]["resumed_shards"] == []
    with pytest.raises(InputError, match="no partial output"):
        repair(base, ft, tmp_path / "other", RepairOptions(run=RunOptions(resume=True)))


def test_a_corrupted_journaled_shard_is_recomputed(tmp_path):
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    base, ft = make_pair(
        tmp_path,
        ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64),
        ft_shards=3,
    )
    ref = tmp_path / "ref"
    repair(base, ft, ref)
    out = tmp_path / "out"
    # simulate an interrupted run: journal two shards, one of which was damaged on disk
    from dghard_cli.engine.plan import PolicyOptions, build_plan
    from dghard_cli.engine.writer import fingerprint
    from dghard_cli.io.hub import open_checkpoint
    from dghard_cli.io.output import file_sha256
    from dghard_cli.repairing import repair_parameters

    b, f = open_checkpoint(str(base)), open_checkpoint(str(ft))
    plan = build_plan(b, [f], PolicyOptions())
    fp = fingerprint("repair", "dg-hard", repair_parameters(RepairOptions()), plan, [b, f])
    stage = staging_dir(out)
    stage.mkdir()
    lines = [json.dumps({"fingerprint": fp})]
    ref_report = json.loads((ref / "dghard_report.json").read_text())
    for shard in sorted(p.name for p in ref.glob("*.safetensors"))[:2]:
        data = (ref / shard).read_bytes()
        recs = [r for r in ref_report["tensors"] if r["shard"] == shard]
        lines.append(
            json.dumps(
                {"name": shard, "size": len(data), "sha256": file_sha256(ref / shard), "tensors": recs}
            )
        )
        (stage / shard).write_bytes(data)
    damaged = sorted(p.name for p in ref.glob("*.safetensors"))[1]
    raw = bytearray((stage / damaged).read_bytes())
    raw[-1] ^= 0xFF
    (stage / damaged).write_bytes(bytes(raw))
    (stage / JOURNAL).write_text("\n".join(lines) + "\n")
    report = repair(base, ft, out)
    assert damaged not in report["output"]["resumed_shards"] and len(report["output"]["resumed_shards"]) == 1
    assert shard_bytes(out) == shard_bytes(ref)


def test_verify_command_rechecks_a_written_directory(tmp_path):
    from typer.testing import CliRunner

    from dghard_cli.cli import app
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    base, ft = make_pair(
        tmp_path,
        ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64),
        ft_shards=2,
    )
    out = tmp_path / "out"
    report = repair(base, ft, out)
    files = report["output"]["files"]
    assert len(files) == 2 and all(len(f["sha256"]) == 64 for f in files)
    r = CliRunner().invoke(app, ["verify", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and "shard sizes and sha256" in doc["checks"] and "finite values" in doc["checks"]
    # flip one byte inside a tensor's data: sizes still match, the hash does not
    victim = out / files[1]["name"]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x01
    victim.write_bytes(bytes(raw))
    r = CliRunner().invoke(app, ["verify", str(out)])
    assert r.exit_code == 1 and "sha256" in r.stderr
    assert CliRunner().invoke(app, ["verify", str(out), "--quick"]).exit_code == 0
    # a NaN written into the data: found by the scan even without a report
    (out / "dghard_report.json").unlink()
    import struct

    n = struct.unpack("<Q", raw[:8])[0]
    raw[8 + n : 8 + n + 4] = struct.pack("<f", float("nan"))
    victim.write_bytes(bytes(raw))
    r = CliRunner().invoke(app, ["verify", str(out)])
    assert r.exit_code == 1 and "NaN" in r.stderr
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "nope")]).exit_code == 2


def test_a_resumed_run_says_so_on_stderr_and_in_the_report(tmp_path):
    from conftest import run_dghard

    from dghard_cli.engine.plan import PolicyOptions, build_plan
    from dghard_cli.engine.writer import fingerprint
    from dghard_cli.io.hub import open_checkpoint
    from dghard_cli.io.output import file_sha256
    from dghard_cli.repairing import repair_parameters
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    base, ft = make_pair(
        tmp_path,
        ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64),
        ft_shards=3,
    )
    ref = tmp_path / "ref"
    fresh = run_dghard("repair", base, ft, ref, "--json")
    assert fresh.returncode == 0, fresh.stderr
    assert "resuming" not in fresh.stderr
    assert json.loads(fresh.stdout)["output"]["resumed"] is False
    # an interrupted run of the same command: its first shard journaled in the staging directory
    b, f = open_checkpoint(str(base)), open_checkpoint(str(ft))
    plan = build_plan(b, [f], PolicyOptions())
    fp = fingerprint("repair", "dg-hard", repair_parameters(RepairOptions()), plan, [b, f])
    out = tmp_path / "out"
    stage = staging_dir(out)
    stage.mkdir()
    ref_report = json.loads((ref / "dghard_report.json").read_text())
    first = sorted(p.name for p in ref.glob("*.safetensors"))[0]
    recs = [r for r in ref_report["tensors"] if r["shard"] == first]
    (stage / first).write_bytes((ref / first).read_bytes())
    rec = {
        "name": first,
        "size": (ref / first).stat().st_size,
        "sha256": file_sha256(ref / first),
        "tensors": recs,
    }
    (stage / JOURNAL).write_text(json.dumps({"fingerprint": fp}) + "\n" + json.dumps(rec) + "\n")
    r = run_dghard("repair", base, ft, out, "--json")
    assert r.returncode == 0, r.stderr
    total = len(ref_report["tensors"])
    lines = [ln for ln in r.stderr.splitlines() if "resuming" in ln]
    assert lines == [
        f"[dghard] resuming: {len(recs)} of {total} tensors already written (1 of 3 shards, verified), continuing"
    ]
    doc = json.loads(r.stdout)
    assert doc["output"]["resumed"] is True and doc["output"]["resumed_tensors"] == len(recs)
    assert doc["output"]["resumed_shards"] == [first]
    assert json.loads((out / "dghard_report.json").read_text())["output"]["resumed"] is True
    assert shard_bytes(out) == shard_bytes(ref)
