"""Bad inputs: exit code 2, one line naming the culprit, nothing written, inputs untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import load_dir, run_dghard
from safetensors.torch import save_file

from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    return make_pair(root, CFG, dtype="float32", base_shards=1, ft_shards=3, seed=0)


def fresh(pair, tmp_path) -> tuple[Path, Path]:
    base, ft = pair
    b, f = tmp_path / "base", tmp_path / "ft"
    shutil.copytree(base, b)
    shutil.copytree(ft, f)
    return b, f


def digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_refused(args, out: Path, *needles: str, inputs: tuple[Path, ...] = ()) -> str:
    before = {d: digest(d) for d in inputs if d.exists()}
    r = run_dghard("repair", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dghard: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists() or not any(out.iterdir())
    assert not list(out.parent.glob(f".{out.name}.dghard-*"))
    for d, h in before.items():
        assert digest(d) == h, f"input {d} was modified"
    return lines[0]


def shard_of(ft: Path, name: str) -> Path:
    return ft / json.loads((ft / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_path(pair, tmp_path):
    base, _ = pair
    out = tmp_path / "out"
    assert_refused([base, tmp_path / "nope", out], out, "nope", "no such directory")


def test_hub_id_that_cannot_be_resolved_offline(pair, tmp_path):
    base, _ = pair
    out = tmp_path / "out"
    assert_refused([base, "some-org/not-cached-model", out], out, "some-org/not-cached-model", "Hub")


def test_malformed_hub_id(pair, tmp_path):
    base, _ = pair
    out = tmp_path / "out"
    assert_refused([base, "org/../etc", out], out, "org/../etc")


def test_empty_directory(pair, tmp_path):
    base, _ = pair
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    assert_refused([base, empty, out], out, "empty")


def test_pickle_only_checkpoint_is_refused_not_unpickled(pair, tmp_path):
    base, _ = pair
    pk = tmp_path / "pickled"
    pk.mkdir()
    # a pickle that would create a file if it were ever unpickled
    canary = tmp_path / "canary"
    payload = (
        b"\x80\x04\x95"
        + struct.pack("<Q", 0)[:0]
        + b"cbuiltins\nopen\n("
        + repr(str(canary)).encode()
        + b"\nVw\ntR."
    )
    (pk / "pytorch_model.bin").write_bytes(payload)
    out = tmp_path / "out"
    line = assert_refused([base, pk, out], out, "pytorch_model.bin", "safetensors")
    assert "unpickle" in line
    assert not canary.exists()


def test_truncated_safetensors(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.layers.0.mlp.up_proj.weight")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, victim.name, inputs=(base, ft))


def test_corrupt_header(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.norm.weight")
    data = bytearray(victim.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + min(n, 16)] = b"\xff" * min(n, 16)
    victim.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, victim.name, "JSON", inputs=(base, ft))


def test_index_naming_a_missing_shard(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.norm.weight")
    victim.unlink()
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, victim.name, "missing")


def test_index_naming_a_file_outside_the_checkpoint(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    idx = ft / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    victim = doc["weight_map"]["model.norm.weight"]
    outside = tmp_path / "x.safetensors"
    shutil.copy(ft / victim, outside)  # a real file is there: it must still not be read
    for k, v in doc["weight_map"].items():
        if v == victim:
            doc["weight_map"][k] = "../x.safetensors"
    idx.write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, "../x.safetensors", "outside")


def test_symlinked_shard_escaping_the_directory(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.norm.weight")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(victim, outside)
    victim.symlink_to(outside)
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, victim.name, "symlink")


def test_non_embedding_shape_mismatch(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.layers.0.mlp.up_proj.weight")
    t = load_dir_file(victim)
    t["model.layers.0.mlp.up_proj.weight"] = torch.randn(CFG.intermediate_size + 1, CFG.hidden_size)
    save_file(t, str(victim))
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, "model.layers.0.mlp.up_proj.weight", "shape")


def test_base_only_tensors(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    victim = shard_of(ft, "model.layers.0.mlp.down_proj.weight")
    t = load_dir_file(victim)
    del t["model.layers.0.mlp.down_proj.weight"]
    save_file(t, str(victim))
    idx = ft / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    del doc["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    idx.write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, "model.layers.0.mlp.down_proj.weight", "--allow-missing")


@pytest.mark.parametrize("where", ["inside", "equal", "parent"])
def test_out_overlapping_an_input(pair, tmp_path, where):
    base, ft = fresh(pair, tmp_path)
    out = {"inside": ft / "repaired", "equal": ft, "parent": tmp_path}[where]
    before = digest(ft)
    r = run_dghard("repair", base, ft, out, "--overwrite")
    assert r.returncode == 2 and "overlaps input" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert digest(ft) == before
    assert not (ft / "repaired").exists()


def test_stale_index_listing_a_tensor_the_shard_lacks(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    idx = ft / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["model.ghost.weight"] = next(iter(doc["weight_map"].values()))
    idx.write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert_refused([base, ft, out], out, "model.ghost.weight")


def test_bad_options(pair, tmp_path):
    base, ft = pair
    out = tmp_path / "out"
    assert_refused([base, ft, out, "--include", "("], out, "--include")
    assert_refused([base, ft, out, "--dtype", "int3"], out, "--dtype")
    assert_refused([base, ft, out, "--shard-size", "lots"], out, "lots")
    assert_refused([base, ft, out, "--noise", "known"], out, "--sigma")
    r = run_dghard("repair", base, ft, out, "--no-such-option")
    assert r.returncode == 2  # usage errors are exit 2 too


def load_dir_file(p: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(p))


def test_inputs_are_untouched_by_a_successful_run(pair, tmp_path):
    base, ft = fresh(pair, tmp_path)
    before = (digest(base), digest(ft))
    r = run_dghard("repair", base, ft, tmp_path / "out", "-q")
    assert r.returncode == 0, r.stderr
    assert (digest(base), digest(ft)) == before
    assert load_dir(tmp_path / "out").keys() == load_dir(ft).keys()
