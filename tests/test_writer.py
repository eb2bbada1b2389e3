"""The one writer (``engine/writer.py``): a checkpoint and an adapter go through the same checks,
each done once, and the same exception → exit-code table."""

from __future__ import annotations

import pytest
import torch
from conftest import count_out_checks

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import RuntimeFailure
from dghard_cli.lora.output import LoraOutputOptions
from dghard_cli.merging import MergeOptions, merge
from dghard_cli.testing.synthetic import ArchConfig, make_pair
from dghard_cli.testing.synthetic_lora import make_adapter

ARCH = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("writer")
    base, ft = make_pair(root / "pair", ARCH, ft_shards=2)
    ads = [
        make_adapter(root / f"ad{k}", ARCH, r=4, alpha=8, targets=("q_proj", "down_proj"), seed=k)[0]
        for k in (1, 2)
    ]
    return base, ft, ads


@pytest.mark.parametrize("kind", ["checkpoint", "adapter", "adapter-factored"])
def test_out_is_checked_once_whatever_the_kind(inputs, tmp_path, monkeypatch, kind):
    """OUT's path rule ran twice for an adapter (its writer and its staging directory) before the
    one writer; once now, for either kind."""
    import dghard_cli.lora.writer  # noqa: F401  (loaded, so its name is counted too)

    base, ft, ads = inputs
    calls = count_out_checks(monkeypatch)
    run = RunOptions(quiet=True, device="cpu")
    if kind == "checkpoint":
        doc = merge(
            str(base), [str(ft), str(ft)], str(tmp_path / "out"), MergeOptions(method="ties", run=run)
        )
        assert doc["output"].get("format") != "peft"
    else:
        method = "task-arithmetic" if kind == "adapter" else "ties"
        opts = MergeOptions(method=method, run=run, lora=LoraOutputOptions(allow_lossy=True))
        doc = merge(str(base), [str(a) for a in ads], str(tmp_path / "out"), opts)
        assert doc["output"]["format"] == "peft"
        assert doc["parameters"]["adapter_route"] == ("exact" if kind == "adapter" else "factored")
    assert calls == [str(tmp_path / "out")]


def test_cuda_out_of_memory_in_an_adapter_run_keeps_the_finished_modules(inputs, tmp_path, monkeypatch):
    """A CUDA out-of-memory error while an adapter is written is exit 3 with the resumable stage
    named, as for a checkpoint (it read "internal error" before the one writer)."""
    import dghard_cli.lora.output as output

    base, _, ads = inputs

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(output, "factored_units", boom)
    opts = MergeOptions(
        method="ties", run=RunOptions(quiet=True, device="cpu"), lora=LoraOutputOptions(allow_lossy=True)
    )
    with pytest.raises(RuntimeFailure, match=r"^CUDA out of memory; finished modules are kept in "):
        merge(str(base), [str(a) for a in ads], str(tmp_path / "out"), opts)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_adapter_run_resumes_to_the_same_bytes(inputs, tmp_path, monkeypatch):
    """Ctrl-C while an adapter is written leaves its stage (exit 3); the same command resumes it."""
    import dghard_cli.lora.output as output
    from dghard_cli.errors import Interrupted

    base, _, ads = inputs
    opts = MergeOptions(
        method="ties", run=RunOptions(quiet=True, device="cpu"), lora=LoraOutputOptions(allow_lossy=True)
    )
    merge(str(base), [str(a) for a in ads], str(tmp_path / "whole"), opts)
    real = output.assemble

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "assemble", interrupted)
    with pytest.raises(Interrupted, match="finished modules are kept in"):
        merge(str(base), [str(a) for a in ads], str(tmp_path / "out"), opts)
    monkeypatch.setattr(output, "assemble", real)
    doc = merge(str(base), [str(a) for a in ads], str(tmp_path / "out"), opts)
    assert doc["output"]["resumed_units"] > 0
    name = "adapter_model.safetensors"
    assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_an_internal_error_while_an_adapter_is_written_releases_out(inputs, tmp_path, monkeypatch):
    """Any exception releases OUT's lock, not only those of the exit-code table (a RuntimeError
    from LAPACK left it held after the one writer came, so a retry in the same process was
    refused as "another dghard run is writing")."""
    import dghard_cli.lora.output as output
    from dghard_cli.io.lock import OutLock

    base, _, ads = inputs

    def fails(*a, **k):
        raise RuntimeError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(output, "factored_units", fails)
    opts = MergeOptions(
        method="ties", run=RunOptions(quiet=True, device="cpu"), lora=LoraOutputOptions(allow_lossy=True)
    )
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="failed to converge") as raised:
        merge(str(base), [str(a) for a in ads], str(out), opts)
    assert raised.tb is not None  # the traceback keeps the run's frames (and its stage) alive
    OutLock(out).acquire().release()


def test_bad_input_after_every_tensor_is_written_keeps_the_shards(inputs, tmp_path, monkeypatch):
    """A side file found bad once every shard is written (swapped for a link mid-run) is exit 2,
    and the shards stay for the rerun, as before the one writer (which discarded them)."""
    from dghard_cli.errors import InputError
    from dghard_cli.io.output import OutputStage
    from dghard_cli.repairing import RepairOptions, repair

    base, ft, _ = inputs
    real = OutputStage.copy_side_files

    def bad(self, *a, **k):
        raise InputError("FT/config.json: a symbolic link; not read")

    monkeypatch.setattr(OutputStage, "copy_side_files", bad)
    out = tmp_path / "out"
    opts = RepairOptions(run=RunOptions(quiet=True, device="cpu"))
    with pytest.raises(InputError, match="symbolic link"):
        repair(str(base), str(ft), str(out), opts)
    monkeypatch.setattr(OutputStage, "copy_side_files", real)
    doc = repair(str(base), str(ft), str(out), opts)
    assert doc["output"]["resumed"] and len(doc["output"]["resumed_shards"]) == 2


def test_a_refused_report_path_prints_no_input_warning_first(tmp_path):
    """The output checks come before the inputs' warnings, as before the one writer."""
    from conftest import run_dghard

    base, _ = make_pair(tmp_path / "a", ARCH, ft_shards=1)
    _, ft = make_pair(tmp_path / "b", ARCH, ft_shards=1, dtype="bfloat16")
    res = run_dghard("repair", base, ft, tmp_path / "out", "--report", ft / "notes.json")
    assert res.returncode == 2, res.stderr
    assert "warning" not in res.stderr and "--report" in res.stderr, res.stderr
    ok = run_dghard("repair", base, ft, tmp_path / "out2")
    assert ok.returncode == 0 and "warning" in ok.stderr, ok.stderr  # the warning exists
