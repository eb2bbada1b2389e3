"""Hugging Face Hub ids, resolved offline from a local cache laid out as huggingface_hub does.

Each run is a fresh process: huggingface_hub reads HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE and
HF_ENDPOINT once, at import, and these tests set them per run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from conftest import load_dir, run_dghard_process

from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)


def cache_repo(cache: Path, repo_id: str, src: Path, commit: str) -> Path:
    """Put ``src``'s files into ``cache`` as huggingface_hub would: blobs + symlinked snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_repair_from_hub_ids_offline_with_the_cache(tmp_path):
    base, ft = make_pair(tmp_path / "src", CFG, ft_shards=2)
    cache = tmp_path / "cache"
    cache_repo(cache, "acme/tiny-base", base, "a" * 40)
    cache_repo(cache, "acme/tiny-ft", ft, "b" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    r = run_dghard_process("repair", "acme/tiny-base", "acme/tiny-ft", out, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["ft"]["source"] == "acme/tiny-ft"
    assert load_dir(out).keys() == load_dir(ft).keys()
    # a pinned revision that the cache holds
    r = run_dghard_process(
        "repair", "acme/tiny-base", "acme/tiny-ft", tmp_path / "out2", "--revision", "b" * 40, "-q", env=env
    )
    assert r.returncode == 0, r.stderr
    # one it does not: a one-line error that names the id and says how to fix it
    r = run_dghard_process("repair", "acme/tiny-base", "acme/missing", tmp_path / "out3", env=env)
    assert r.returncode == 2 and "acme/missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_hub_miss_says_what_to_do_for_the_offline_setting_in_force(tmp_path):
    """With HF_HUB_OFFLINE set, the error must not tell the user to set it; without it, it may."""
    cache = tmp_path / "cache"
    cache.mkdir()
    base, _ = make_pair(tmp_path / "src", CFG)
    offline = run_dghard_process(
        "repair",
        base,
        "acme/not-cached",
        tmp_path / "o1",
        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    assert offline.returncode == 2 and len(offline.stderr.strip().splitlines()) == 1, offline.stderr
    assert "HF_HUB_OFFLINE is set" in offline.stderr and str(cache) in offline.stderr
    assert "set HF_HUB_OFFLINE=1" not in offline.stderr
    # online, with a Hub endpoint that refuses connections: the offline cache is the suggestion
    online = run_dghard_process(
        "repair",
        base,
        "acme/not-cached",
        tmp_path / "o2",
        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert online.returncode == 2 and len(online.stderr.strip().splitlines()) == 1, online.stderr
    assert "set HF_HUB_OFFLINE=1" in online.stderr and "HF_HUB_OFFLINE is set" not in online.stderr
