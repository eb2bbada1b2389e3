"""The hostile and corrupt input catalogue: every row exits 2 with one line, reads nothing
outside the checkpoint, allocates nothing in proportion to a number written in a file."""

from __future__ import annotations

import json
import resource
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from dghard_cli.cli import app
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    make_pair(root, CFG, dtype="float32", base_shards=1, ft_shards=2, seed=0)
    return root


def shard_path(ft: Path, k: int = 0) -> Path:
    return sorted(ft.glob("*.safetensors"))[k]


def header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, head: bytes | str, body: bytes, n: int | None = None) -> None:
    hb = head.encode() if isinstance(head, str) else head
    path.write_bytes(struct.pack("<Q", len(hb) if n is None else n) + hb + body)


def edit_header(
    ft: Path, fn: Callable[[dict], None], *, body: Callable[[bytes], bytes] = lambda b: b
) -> None:
    p = shard_path(ft)
    h, b = header(p)
    fn(h)
    write_raw(p, json.dumps(h), body(b))


def first_tensor(h: dict) -> str:
    return next(k for k in h if k != "__metadata__")


def set_offsets(h: dict, name: str, begin: int, end: int) -> None:
    h[name]["data_offsets"] = [begin, end]


def overlap(h: dict) -> None:
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b = names[1]
    h[b]["data_offsets"] = [h[b]["data_offsets"][0] - 4, h[b]["data_offsets"][1] - 4]


def edit_index(ft: Path, fn: Callable[[dict], None]) -> None:
    p = ft / "model.safetensors.index.json"
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def retarget(doc: dict, target: str) -> None:
    victim = sorted(set(doc["weight_map"].values()))[0]
    for k, v in doc["weight_map"].items():
        if v == victim:
            doc["weight_map"][k] = target


def symlink_escape(ft: Path) -> None:
    p = shard_path(ft)
    outside = ft.parent / "outside.safetensors"
    shutil.move(p, outside)
    p.symlink_to(outside)


def duplicate_across_shards(ft: Path) -> None:
    a, b = shard_path(ft, 0), shard_path(ft, 1)
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    name = next(iter(ta))
    tb[name] = ta[name]
    save_file(tb, str(b))
    edit_index(ft, lambda d: None)


def huge_config(ft: Path) -> None:
    cfg = json.loads((ft / "config.json").read_text())
    cfg["padding"] = "x" * (17 * 1024 * 1024)
    (ft / "config.json").write_text(json.dumps(cfg))


# (id, mutation of the FT directory, words the one-line message must contain)
ROWS: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("file-shorter-than-8-bytes", lambda ft: shard_path(ft).write_bytes(b"\x01\x02"), ("truncated",)),
    (
        "header-length-larger-than-file",
        lambda ft: write_raw(shard_path(ft), "{}", b"", n=10_000),
        ("larger than the file",),
    ),
    ("header-length-absurd", lambda ft: write_raw(shard_path(ft), "{}", b"", n=2**62), ("absurd",)),
    ("header-not-json", lambda ft: write_raw(shard_path(ft), "{not json", b""), ("not valid JSON",)),
    ("header-not-utf8", lambda ft: write_raw(shard_path(ft), b"\xff\xfe{}", b""), ("not valid JSON",)),
    ("header-not-an-object", lambda ft: write_raw(shard_path(ft), "[1, 2]", b""), ("not a JSON object",)),
    (
        "duplicate-key-in-header",
        lambda ft: write_raw(
            shard_path(ft),
            '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
            b"\0" * 4,
        ),
        ("duplicate key",),
    ),
    (
        "unknown-dtype",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(dtype="F7")),
        ("unknown dtype",),
    ),
    (
        "shape-negative",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(shape=[-1, 4])),
        ("invalid shape",),
    ),
    (
        "shape-not-integers",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(shape=[2.5])),
        ("invalid shape",),
    ),
    (
        "shape-absurd",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(shape=[2**40, 2**40])),
        ("bytes but its data_offsets",),
    ),
    (
        "offsets-not-a-pair",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(data_offsets=[0])),
        ("invalid data_offsets",),
    ),
    (
        "offsets-reversed",
        lambda ft: edit_header(ft, lambda h: set_offsets(h, first_tensor(h), 8, 4)),
        ("invalid data_offsets",),
    ),
    (
        "offsets-out-of-bounds",
        lambda ft: edit_header(ft, lambda h: set_offsets(h, first_tensor(h), 0, 10**12)),
        ("past the end",),
    ),
    ("offsets-overlapping", lambda ft: edit_header(ft, overlap), ("overlap",)),
    (
        "offsets-not-covering-data",
        lambda ft: edit_header(ft, lambda h: None, body=lambda b: b + b"\0" * 64),
        ("cover",),
    ),
    (
        "shape-times-dtype-not-matching-offsets",
        lambda ft: edit_header(ft, lambda h: h[first_tensor(h)].update(dtype="F16")),
        ("bytes but its data_offsets",),
    ),
    (
        "metadata-not-strings",
        lambda ft: edit_header(ft, lambda h: h.update(__metadata__={"a": 1})),
        ("__metadata__",),
    ),
    (
        "index-absolute-path",
        lambda ft: edit_index(ft, lambda d: retarget(d, "/etc/passwd")),
        ("not a plain file name",),
    ),
    (
        "index-dotdot-path",
        lambda ft: edit_index(ft, lambda d: retarget(d, "../base/model.safetensors")),
        ("not a plain file name",),
    ),
    (
        "index-not-json",
        lambda ft: (ft / "model.safetensors.index.json").write_text("{oops"),
        ("not valid JSON",),
    ),
    (
        "index-without-weight-map",
        lambda ft: (ft / "model.safetensors.index.json").write_text("{}"),
        ("weight_map",),
    ),
    (
        "index-non-string-file",
        lambda ft: edit_index(ft, lambda d: d["weight_map"].update({"x": 3})),
        ("not a file name",),
    ),
    ("symlink-escaping-the-directory", symlink_escape, ("symlink", "outside")),
    ("duplicate-tensor-across-shards", duplicate_across_shards, ("duplicate tensor names",)),
    ("config-json-huge", huge_config, ("config.json", "limit")),
    ("config-json-not-json", lambda ft: (ft / "config.json").write_text("{nope"), ("config.json", "JSON")),
    ("config-json-not-an-object", lambda ft: (ft / "config.json").write_text("[]"), ("config.json",)),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_hostile_checkpoint_rows(template, tmp_path, row):
    _, mutate, needles = row
    base, ft = tmp_path / "base", tmp_path / "ft"
    shutil.copytree(template / "base", base)
    shutil.copytree(template / "ft", ft)
    mutate(ft)
    out = tmp_path / "out"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = CliRunner().invoke(app, ["repair", str(base), str(ft), str(out)])
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dghard: error: ") and "Traceback" not in r.stderr, (
        r.stderr
    )
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists() and not list(tmp_path.glob(".out.dghard-*"))
    # nothing in proportion to a hostile number was allocated
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


@pytest.mark.parametrize("spec", ["a/b/c", "org/na me", "../x", "org/..", "org/", "/org/name", "org\\name"])
def test_hub_ids_that_are_not_org_name(template, tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)  # '../x' must not name a directory beside wherever the suite runs
    r = CliRunner().invoke(app, ["repair", str(template / "base"), spec, str(tmp_path / "out")])
    assert r.exit_code == 2
    assert "not a Hugging Face Hub id" in r.stderr or "no such directory" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_nonfinite_input_is_an_error_naming_the_tensor_or_passed_through(template, tmp_path):
    base, ft = tmp_path / "base", tmp_path / "ft"
    shutil.copytree(template / "base", base)
    shutil.copytree(template / "ft", ft)
    from safetensors.torch import load_file

    p = shard_path(ft, 1)
    t = load_file(str(p))
    name = next(k for k, v in t.items() if v.ndim == 2)
    t[name][3, 5] = float("nan")
    onedim = next(k for k, v in t.items() if v.ndim == 1)
    save_file(t, str(p))
    r = CliRunner().invoke(app, ["repair", str(base), str(ft), str(tmp_path / "out")])
    assert r.exit_code == 2 and name in r.stderr and "NaN" in r.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.dghard-*"))
    r = CliRunner().invoke(
        app, ["repair", str(base), str(ft), str(tmp_path / "out"), "--allow-nonfinite", "--json"]
    )
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    rec = next(x for x in doc["tensors"] if x["name"] == name)
    assert rec["action"] == "kept-ft" and rec["reason"] == "nonfinite"
    assert any("non-finite" in w for w in doc["summary"]["warnings"])
    out = load_file(str(tmp_path / "out" / p.name))
    assert torch.isnan(out[name][3, 5]) and torch.equal(out[onedim], t[onedim])


RECIPE_ROWS = [
    (
        "python-object-tag",
        "method: ties\nbase: b\nmodels: [f]\nx: !!python/object/apply:os.system ['touch {canary}']\n",
        ("not valid YAML",),
    ),
    ("python-name-tag", "method: !!python/name:os.system ties\nbase: b\nmodels: [f]\n", ("not valid YAML",)),
    ("custom-tag", "method: !shell ties\nbase: b\nmodels: [f]\n", ("not valid YAML",)),
    ("not-a-mapping", "- ties\n- b\n", ("mapping",)),
    ("unknown-key", "method: ties\nbase: b\nmodels: [f]\nrm_rf: true\n", ("rm_rf",)),
    ("wrong-type", "method: ties\nbase: b\nmodels: [f]\ndensity: lots\n", ("density",)),
    ("missing-models", "method: ties\nbase: b\n", ("models",)),
    ("huge", "method: ties\nbase: b\nmodels: [f]\n# " + "x" * (1 << 21) + "\n", ("1 MiB",)),
    (
        "overlong-model-path",
        "method: ties\nbase: b\nmodels: [" + "x" * 5000 + "]\n",
        ("cannot be looked up",),
    ),
]


@pytest.mark.parametrize("row", RECIPE_ROWS, ids=[r[0] for r in RECIPE_ROWS])
def test_hostile_recipe_rows(tmp_path, row):
    _, text, needles = row
    canary = tmp_path / "canary"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text.replace("{canary}", str(canary)))
    r = CliRunner().invoke(app, ["merge", "--config", str(recipe)])
    assert r.exit_code == 2, (r.exit_code, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not canary.exists()  # safe loading only: no tag ever ran


@pytest.mark.parametrize(
    "field,value", [("r", 10**9), ("r", -3), ("lora_alpha", "lots"), ("rank_pattern", {"q_proj": 2**40})]
)
def test_hostile_adapter_configs(tmp_path, field, value):
    from dghard_cli.testing.synthetic_lora import make_adapter

    ad, _, _ = make_adapter(tmp_path / "adapter", CFG, r=4)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg[field] = value
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["audit-lora", str(ad), "--json"])
    assert r.exit_code in (1, 2), (r.exit_code, r.stdout, r.stderr)
    if r.exit_code == 2:
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    else:  # reported as an error finding in the one JSON document
        doc = json.loads(r.stdout)
        assert any(f["level"] == "error" for f in doc["findings"])


def test_overlong_path_names_are_input_errors(tmp_path):
    r = CliRunner().invoke(app, ["repair", "x" * 5000, str(tmp_path / "ft"), str(tmp_path / "out")])
    assert r.exit_code == 2 and "cannot be looked up" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# =============================================================================================
# File system, paths and sizes at the edges (issue 15). Each row names its class:
#   1 a path runs a command · 2 secrets leak into the output · 3 inputs (or outputs) written over
#   4 hangs · 5 crashes / wrong exit codes · 6 memory at the edges · 7 other
# Rows that could hang run the real command line in a subprocess with a timeout.
# =============================================================================================

import hashlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from conftest import REPO, run_dghard  # noqa: E402


def run_capped(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real command line in a subprocess with 4 GB of address space: a run that reads a
    device forever fails there instead of taking the machine's memory."""

    def cap() -> None:
        import resource as res

        res.setrlimit(res.RLIMIT_AS, (4 << 30, 4 << 30))

    e = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "dghard_cli", *map(str, args)],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
    )


def fresh_pair(template: Path, tmp: Path) -> tuple[Path, Path]:
    base, ft = tmp / "base", tmp / "ft"
    shutil.copytree(template / "base", base)
    shutil.copytree(template / "ft", ft)
    return base, ft


def tree_digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        h.update(str(p.relative_to(d)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("dghard: error: "), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[-1]


def link(path: Path, target: str | Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


SECRET = "dghard-test-secret-7f3a9c"


def secret_file(ft: Path) -> Path:
    p = ft.parent / "secret.json"
    p.write_text(json.dumps({"token": SECRET}))
    return p


def rename_shard(ft: Path, new: str) -> None:
    """Rename FT's first shard to ``new`` and point its index entries at it."""
    old = shard_path(ft)
    old.rename(ft / new)
    edit_index(
        ft, lambda d: d["weight_map"].update({k: new for k, v in d["weight_map"].items() if v == old.name})
    )


def move_index_outside(ft: Path) -> None:
    idx = ft / "model.safetensors.index.json"
    outside = ft.parent / "index-elsewhere.json"
    shutil.move(idx, outside)
    idx.symlink_to(outside)


def char_device(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # the numbers of /dev/zero


def deep_json(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


def add_tensors(d: Path, tensors: dict) -> None:
    from safetensors.torch import load_file

    p = shard_path(d)
    t = load_file(str(p))
    t.update(tensors)
    save_file(t, str(p), metadata={"format": "pt"})
    if (d / "model.safetensors.index.json").exists():
        edit_index(d, lambda doc: doc["weight_map"].update({k: p.name for k in tensors}))


def overflowing_shape(ft: Path) -> None:
    p = shard_path(ft)
    h, b = header(p)
    h["zero.overflow"] = {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [len(b), len(b)]}
    write_raw(p, json.dumps(h), b)
    edit_index(ft, lambda d: d["weight_map"].update({"zero.overflow": p.name}))


def no_tensors(ft: Path) -> None:
    for p in ft.glob("*.safetensors"):
        p.unlink()
    (ft / "model.safetensors.index.json").unlink()
    write_raw(ft / "model.safetensors", "{}", b"")


def root_only(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    def wrapped(ft: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        fn(ft)

    return wrapped


# (id, class, mutation of FT, exit code, words the last stderr line must contain)
FS_ROWS: list[tuple[str, int, Callable[[Path], None], int, tuple[str, ...]]] = [
    # 2: nothing outside the input directory is read (and so nothing can reach OUT)
    (
        "c2-tokenizer-links-to-proc-environ",
        2,
        lambda ft: link(ft / "tokenizer.json", "/proc/self/environ"),
        2,
        ("tokenizer.json", "outside"),
    ),
    (
        "c2-chat-template-links-to-etc-shadow",
        2,
        lambda ft: link(ft / "chat_template.jinja", "/etc/shadow"),
        2,
        ("chat_template.jinja", "outside"),
    ),
    (
        "c2-config-links-to-a-secret",
        2,
        lambda ft: link(ft / "config.json", secret_file(ft)),
        2,
        ("config.json", "outside"),
    ),
    (
        "c2-side-file-links-into-sibling-dir",
        2,
        lambda ft: link(ft / "generation_config.json", ft.parent / "base" / "config.json"),
        2,
        ("generation_config.json", "outside"),
    ),
    ("c2-index-links-outside", 2, move_index_outside, 2, ("index", "outside")),
    (
        "c2-directory-named-like-a-side-file",
        2,
        lambda ft: (ft / "tokenizer.json").mkdir(),
        2,
        ("tokenizer.json", "directory"),
    ),
    # 3: shard names that collide with the files dghard writes into OUT
    (
        "c3-shard-named-README.md",
        3,
        lambda ft: rename_shard(ft, "README.md"),
        2,
        ("README.md", "writes into OUT"),
    ),
    (
        "c3-shard-named-dghard_report.json",
        3,
        lambda ft: rename_shard(ft, "dghard_report.json"),
        2,
        ("dghard_report.json", "writes into OUT"),
    ),
    (
        "c3-shard-named-the-journal",
        3,
        lambda ft: rename_shard(ft, "dghard_journal.jsonl"),
        2,
        ("dghard_journal.jsonl", "writes into OUT"),
    ),
    # 4: FIFOs where files belong never block
    ("c4-fifo-as-shard", 4, lambda ft: fifo(shard_path(ft)), 2, ("FIFO",)),
    ("c4-fifo-as-config", 4, lambda ft: fifo(ft / "config.json"), 2, ("config.json", "FIFO")),
    ("c4-fifo-as-index", 4, lambda ft: fifo(ft / "model.safetensors.index.json"), 2, ("FIFO",)),
    ("c4-fifo-as-side-file", 4, lambda ft: fifo(ft / "tokenizer.json"), 2, ("tokenizer.json", "FIFO")),
    # 5: input errors are exit 2, valid inputs exit 0 (not "internal error", exit 3)
    (
        "c5-device-as-config",
        5,
        root_only(lambda ft: char_device(ft / "config.json")),
        2,
        ("config.json", "character device"),
    ),
    ("c5-config-links-to-dev-zero", 5, lambda ft: link(ft / "config.json", "/dev/zero"), 2, ("config.json",)),
    ("c5-deeply-nested-config", 5, lambda ft: deep_json(ft / "config.json"), 2, ("config.json", "nested")),
    ("c5-deeply-nested-index", 5, lambda ft: deep_json(ft / "model.safetensors.index.json"), 2, ("nested",)),
    ("c5-shape-product-overflows", 5, overflowing_shape, 2, ("zero.overflow", "overflows")),
    ("c5-no-tensors", 5, no_tensors, 2, ("no tensors",)),
    (
        "c5-zero-size-tensors",
        5,
        lambda ft: add_tensors(ft, {"zero.rows": torch.zeros(0, 32), "zero.vec": torch.zeros(0)}),
        0,
        (),
    ),
    # 7: null metadata is no metadata (the reference safetensors library opens such files)
    ("c7-metadata-null", 7, lambda ft: edit_header(ft, lambda h: h.update(__metadata__=None)), 0, ()),
]


@pytest.mark.parametrize("row", FS_ROWS, ids=[r[0] for r in FS_ROWS])
def test_file_system_rows(template, tmp_path, row):
    rid, _, mutate, code, needles = row
    base, ft = fresh_pair(template, tmp_path)
    if rid == "c5-zero-size-tensors":  # valid in both checkpoints
        add_tensors(base, {"zero.rows": torch.zeros(0, 32), "zero.vec": torch.zeros(0)})
    mutate(ft)
    before = (tree_digest(base), tree_digest(ft))
    out = tmp_path / "out"
    if rid.startswith(("c4-", "c5-device", "c5-config-links-to-dev")):  # could block or read forever
        r = run_capped("repair", base, ft, out, "--json", timeout=120)
    else:
        res = CliRunner().invoke(app, ["repair", str(base), str(ft), str(out), "--json"])
        r = subprocess.CompletedProcess([], res.exit_code, res.stdout, res.stderr)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert (tree_digest(base), tree_digest(ft)) == before  # inputs untouched
    assert not list(tmp_path.glob(".out.dghard-*")), list(tmp_path.glob(".out.*"))
    if code == 2:
        line = one_line_error(r.stderr)
        for n in needles:
            assert n in line, (n, line)
        assert not out.exists()
        return
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    ok = CliRunner().invoke(app, ["verify", str(out)])
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    if rid == "c5-zero-size-tensors":
        recs = {t["name"]: t for t in doc["tensors"]}
        assert recs["zero.rows"]["action"] == "kept-ft" and recs["zero.rows"]["reason"] == "empty"
        assert recs["zero.rows"]["shape"] == [0, 32] and recs["zero.vec"]["shape"] == [0]
        assert any("zero-size" in n for n in doc["notes"])
    for p in out.iterdir():  # no secret copied anywhere
        assert SECRET.encode() not in p.read_bytes()


def test_c5_zero_size_tensors_in_merges(template, tmp_path):
    base, ft = fresh_pair(template, tmp_path)
    extra = {"zero.rows": torch.zeros(0, 32), "zero.vec": torch.zeros(0)}
    add_tensors(base, extra)
    add_tensors(ft, extra)
    for method in ("ties", "dare-ties", "task-arithmetic"):
        out = tmp_path / method
        r = CliRunner().invoke(
            app,
            [
                "merge",
                "--method",
                method,
                str(base),
                str(ft),
                str(ft),
                "--out",
                str(out),
                "--json",
                "--min-numel",
                "0",
            ],
        )
        assert r.exit_code == 0, (method, r.stderr, r.exception)
        recs = {t["name"]: t for t in json.loads(r.stdout)["tensors"]}
        assert recs["zero.rows"]["reason"] == "empty"


def test_c2_hub_cache_lookalike_whose_links_escape_the_cache(template, tmp_path):
    """A snapshot's files may link into the cache's blobs/, nowhere else."""
    cache = tmp_path / "models--org--name"
    snap, blobs = cache / "snapshots" / "abc123", cache / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in sorted((template / "ft").iterdir()):
        blob = blobs / hashlib.sha256(p.name.encode()).hexdigest()
        shutil.copy(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    out = tmp_path / "out"
    r = run_dghard("repair", template / "base", snap, out, "-q")
    assert r.returncode == 0, r.stderr  # links into blobs/ are what a real cache holds
    assert (out / "config.json").read_bytes() == (template / "ft" / "config.json").read_bytes()
    shutil.rmtree(out)
    (tmp_path / "outside.json").write_text(json.dumps({"token": SECRET}))
    link(snap / "tokenizer.json", os.path.relpath(tmp_path / "outside.json", snap))
    r = run_dghard("repair", template / "base", snap, out)
    assert r.returncode == 2 and "outside" in one_line_error(r.stderr) and not out.exists()
    link(snap / "tokenizer.json", "../../refs/main")  # inside the cache but not its blob store
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123")
    r = run_dghard("repair", template / "base", snap, out)
    assert r.returncode == 2 and "outside" in one_line_error(r.stderr) and not out.exists()


def test_c7_large_tokenizer_is_copied_in_full(template, tmp_path):
    base, ft = fresh_pair(template, tmp_path)
    big = ft / "tokenizer.json"
    payload = json.dumps({"model": {"vocab": {"t": 1}}, "pad": "x" * (65 * 1024 * 1024)})
    big.write_text(payload)
    out = tmp_path / "out"
    r = run_dghard("repair", base, ft, out, "--json")
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.json").read_bytes() == big.read_bytes()
    assert "tokenizer.json" in json.loads(r.stdout)["output"]["copied_files"]


# -- 3: no output over an input, or over another output --------------------------------------------


def _recipe_into(ft: Path, base: Path, tmp: Path) -> list[str]:
    recipe = tmp / "recipe.yaml"
    recipe.write_text(
        f"method: ties\nbase: {base}\nmodels: [{ft}, {ft}]\nout: {tmp / 'merged'}\nreport: {ft / 'report.json'}\n"
    )
    return ["merge", "--config", str(recipe)]


def _recipe_onto_itself(ft: Path, base: Path, tmp: Path) -> list[str]:
    recipe = tmp / "recipe.yaml"
    recipe.write_text(
        f"method: ties\nbase: {base}\nmodels: [{ft}, {ft}]\nout: {tmp / 'merged'}\nreport: {recipe}\n"
    )
    return ["merge", "--config", str(recipe)]


def _scores(tmp: Path) -> tuple[Path, Path, Path]:
    b, f, c = tmp / "b.json", tmp / "f.json", tmp / "c.json"
    b.write_text(json.dumps({"x": 50.0, "y": 50.0}))
    f.write_text(json.dumps({"x": 40.0, "y": 70.0}))
    c.write_text(json.dumps({"x": 45.0, "y": 65.0}))
    return b, f, c


OUTPUT_ROWS: list[tuple[str, Callable[[Path, Path, Path], list[str]], tuple[str, ...]]] = [
    (
        "report-onto-a-shard-of-FT",
        lambda b, f, t: ["repair", str(b), str(f), str(t / "out"), "--report", str(shard_path(f))],
        ("FT",),
    ),
    (
        "report-inside-BASE",
        lambda b, f, t: ["repair", str(b), str(f), str(t / "out"), "--report", str(b / "r.json")],
        ("inside BASE",),
    ),
    (
        "report-onto-the-model-card",
        lambda b, f, t: ["repair", str(b), str(f), str(t / "out"), "--report", str(t / "out" / "README.md")],
        ("README.md",),
    ),
    (
        "report-onto-an-output-shard",
        lambda b, f, t: [
            "repair",
            str(b),
            str(f),
            str(t / "out"),
            "--report",
            str(t / "out" / shard_path(f).name),
        ],
        ("safetensors", "writes itself"),
    ),
    (
        "merge-report-into-FT",
        lambda b, f, t: [
            "merge",
            "--method",
            "ties",
            str(b),
            str(f),
            str(f),
            "--out",
            str(t / "out"),
            "--report",
            str(f / "report.json"),
        ],
        ("inside FT",),
    ),
    ("recipe-report-into-FT", lambda b, f, t: _recipe_into(f, b, t), ("inside FT",)),
    ("recipe-report-onto-the-recipe", lambda b, f, t: _recipe_onto_itself(f, b, t), ("--config",)),
    (
        "inspect-html-onto-FT-config",
        lambda b, f, t: ["inspect", str(b), str(f), "--html", str(f / "config.json")],
        ("--html",),
    ),
    ("inspect-plot-into-FT", lambda b, f, t: ["inspect", str(b), str(f), "--plot", str(f)], ("--plot",)),
    (
        "inspect-html-and-plot-same-path",
        lambda b, f, t: ["inspect", str(b), str(f), "--plot", str(t / "p"), "--html", str(t / "p")],
        ("same path",),
    ),
    (
        "inspect-html-onto-a-plot-file",
        lambda b, f, t: [
            "inspect",
            str(b),
            str(f),
            "--plot",
            str(t / "p"),
            "--html",
            str(t / "p" / "heatmap_delta_norm.png"),
        ],
        ("--plot",),
    ),
    (
        "score-report-onto-its-base-results",
        lambda b, f, t: [
            "score",
            "--base",
            str(_scores(t)[0]),
            "--ft",
            str(t / "f.json"),
            "--candidate",
            str(t / "c.json"),
            "--report",
            str(t / "b.json"),
        ],
        ("--base",),
    ),
    (
        "report-html-onto-the-report",
        lambda b, f, t: [
            "report",
            str(shard_path(f).parent / "r.json"),
            "--html",
            str(shard_path(f).parent / "r.json"),
        ],
        ("--html",),
    ),
]


@pytest.mark.parametrize("row", OUTPUT_ROWS, ids=[r[0] for r in OUTPUT_ROWS])
def test_c3_outputs_never_land_on_inputs(template, tmp_path, row):
    rid, argv, needles = row
    base, ft = fresh_pair(template, tmp_path)
    if rid.startswith("report-html"):
        r = run_dghard("repair", base, ft, tmp_path / "first", "--report", ft.parent / "r.json", "-q")
        assert r.returncode == 0, r.stderr
        shutil.move(ft.parent / "r.json", ft / "r.json")
    args = argv(base, ft, tmp_path)
    scores = {p: p.read_bytes() for p in [*tmp_path.glob("*.json"), *tmp_path.glob("*.yaml")]}
    before = (tree_digest(base), tree_digest(ft))
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    line = one_line_error(r.stderr)
    for n in needles:
        assert n in line, (n, line)
    assert (tree_digest(base), tree_digest(ft)) == before
    assert {p: p.read_bytes() for p in scores} == scores
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()


# -- 3 and 7: the sweep judges, and keeps, exactly what it wrote --------------------------------------

SWEEP_EVAL = r"""
import json, os, sys, time
from pathlib import Path
model, output = sys.argv[1], sys.argv[2]
name = os.environ["DGHARD_CANDIDATE"]
with open(os.environ["SWEEP_LOG"], "a") as fh:
    fh.write(json.dumps([name, model, output]) + "\n")
if name == "BASE":
    res = {"x": 50.0, "y": 50.0}
elif name == "FT":
    res = {"x": 40.0, "y": 70.0}
else:
    s = float(name.split("scale=")[1].split()[0])
    res = {"x": 44.0 + s, "y": 68.0 - s}
    if os.environ.get("SWEEP_TAMPER_ON", "@") in name:
        how = os.environ["SWEEP_TAMPER"]
        shard = sorted(Path(model).glob("*.safetensors"))[0]
        if how == "flip":
            with open(shard, "r+b") as fh:
                fh.seek(-3, 2)
                b = fh.read(1)
                fh.seek(-3, 2)
                fh.write(bytes([b[0] ^ 0xFF]))
        elif how == "plant":
            (Path(model) / "planted.txt").write_text("not from dghard")
        elif how == "rewrite":
            data = shard.read_bytes()
            shard.unlink()
            shard.write_bytes(data)
        elif how == "late":  # a child (a server, an uploader) that writes after the command exits
            import subprocess
            child = (  # cwd in the candidate; once it is OUT (dghard has moved it), write there
                "import os, sys, time; os.chdir(sys.argv[1]); t = time.time()\n"
                "while not os.path.exists(sys.argv[2]) and time.time() < t + 30: time.sleep(0.05)\n"
                "time.sleep(0.5); open('planted.txt', 'w').write('late')"
            )
            p = subprocess.Popen([sys.executable, "-c", child, model, os.environ["SWEEP_OUT"]])
            Path(os.environ["SWEEP_CHILD_PID"]).write_text(str(p.pid))
            res = {"x": 44.0 + s, "y": 68.0 - s}  # its scores are its own: only the child writes
        elif how == "daemon":  # the same child as a daemon: double fork and setsid, out of the group
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.chdir(model)
                    Path(os.environ["SWEEP_CHILD_PID"]).write_text(str(os.getpid()))
                    t = time.time()
                    while not os.path.exists(os.environ["SWEEP_OUT"]) and time.time() < t + 30:
                        time.sleep(0.05)
                    time.sleep(0.5)
                    open("planted.txt", "w").write("daemon")
                os._exit(0)
            while not Path(os.environ["SWEEP_CHILD_PID"]).exists():
                time.sleep(0.01)
            res = {"x": 44.0 + s, "y": 68.0 - s}
        if how != "daemon":
            res = {"x": 90.0, "y": 90.0}  # a tampered candidate would win
Path(output).write_text(json.dumps(res))
"""


def _sweep(
    tmp: Path,
    base: Path,
    ft: Path,
    out: Path,
    env: dict | None = None,
    cwd: Path | None = None,
    extra: tuple = (),
) -> subprocess.CompletedProcess:
    script = tmp / "eval.py"
    script.write_text(SWEEP_EVAL)
    cands = tmp / "cands.yaml"
    cands.write_text("families:\n  - family: hard\n    grid: [1.0, 3.0]\n    refine: false\n")
    e = {"SWEEP_LOG": str(tmp / "calls.jsonl"), **(env or {})}
    return run_dghard(
        "sweep",
        base,
        ft,
        out,
        "--eval",
        f"{sys.executable} {script} {{model}} {{output}}",
        "--candidates",
        cands,
        "--budget",
        "4",
        "--json",
        "--min-target-retention",
        "0",
        *extra,
        env=e,
        timeout=300,
        cwd=cwd,
    )


@pytest.mark.parametrize("how,cls", [("flip", 3), ("plant", 3), ("rewrite", 7)])
def test_sweep_candidate_changed_by_its_evaluation_is_failed_not_kept(template, tmp_path, how, cls):
    base, ft = fresh_pair(template, tmp_path)
    out = tmp_path / "out"
    r = _sweep(tmp_path, base, ft, out, {"SWEEP_TAMPER_ON": "scale=1.0", "SWEEP_TAMPER": how})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    doc = json.loads(r.stdout)
    rows = {c["name"]: c for c in doc["candidates"]}
    bad = rows["hard scale=1.0"]
    assert bad["status"] == "failed" and "changed the candidate" in bad["message"], bad
    assert doc["winner"]["name"] == "hard scale=3.0"
    assert not (out / "planted.txt").exists()
    v = run_dghard("verify", out)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_child_the_evaluation_leaves_running_cannot_write_into_out(template, tmp_path):
    """The evaluation's own process exited; a child it started (cwd inside the candidate) wrote
    into the winner after the integrity check and the move into OUT: OUT failed verify, and the
    child outlived dghard."""
    base, ft = fresh_pair(template, tmp_path)
    out, pid_file = tmp_path / "out", tmp_path / "child.pid"
    env = {"SWEEP_TAMPER_ON": "scale=3.0", "SWEEP_TAMPER": "late", "SWEEP_CHILD_PID": str(pid_file)}
    r = _sweep(tmp_path, base, ft, out, {**env, "SWEEP_OUT": str(out / "sweep_report.json")})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    doc = json.loads(r.stdout)
    assert doc["winner"]["name"] == "hard scale=3.0"
    row = next(c for c in doc["candidates"] if c["name"] == "hard scale=3.0")
    assert row["status"] == "ok"
    pid = int(pid_file.read_text())
    deadline = time.time() + 40
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
        assert time.time() < deadline, "the evaluation's child outlived the sweep"
        time.sleep(0.1)
    assert not (out / "planted.txt").exists()
    v = run_dghard("verify", out)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_daemon_the_evaluation_double_forks_is_ended_with_it(template, tmp_path):
    """An evaluation that double-forks a daemon (``setsid``: out of its process group, as servers
    and uploaders do) left it running after dghard exited; it rewrote OUT. The reaper the
    command runs under adopts it (a child subreaper) and ends it when the command exits."""
    base, ft = fresh_pair(template, tmp_path)
    out, pid_file = tmp_path / "out", tmp_path / "child.pid"
    env = {"SWEEP_TAMPER_ON": "scale=3.0", "SWEEP_TAMPER": "daemon", "SWEEP_CHILD_PID": str(pid_file)}
    r = _sweep(tmp_path, base, ft, out, {**env, "SWEEP_OUT": str(out / "sweep_report.json")})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    pid = int(pid_file.read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the daemon outlived the sweep"
    time.sleep(1.0)  # it would have written 0.5 s after OUT appeared
    assert not (out / "planted.txt").exists()
    v = run_dghard("verify", out)
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_reaper_ends_descendants_outside_the_group_on_timeout_too(tmp_path):
    from dghard_cli.sweeping.evaluate import run_command

    pid_file = tmp_path / "daemon.pid"
    cmd = (
        f'{sys.executable} -c "import os, time; os.fork() and os._exit(0); os.setsid(); '
        f"os.fork() and os._exit(0); open('{pid_file}', 'w').write(str(os.getpid())); time.sleep(60)\"; "
        "sleep 60"
    )
    run = run_command(cmd, tmp_path, tmp_path / "o.json", tmp_path / "logs", timeout=2.0, label="x")
    assert run.status == "timeout"
    pid = int(pid_file.read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the daemon outlived the timeout"
    pid_file.unlink()  # the second run's daemon writes its own
    run = run_command(cmd.replace("sleep 60", "true").replace("time.sleep(60)", "time.sleep(30)"),
                      tmp_path, tmp_path / "o.json", tmp_path / "logs2", timeout=None, label="y")  # fmt: skip
    assert run.status == "ok" and run.leftovers
    pid = int(pid_file.read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the daemon outlived the command"


def test_keep_candidates_never_keeps_one_its_evaluation_changed(template, tmp_path):
    """--keep-candidates kept a candidate the evaluation had written into (failed, yet kept with
    the evaluation's files: not what its command writes)."""
    base, ft = fresh_pair(template, tmp_path)
    out = tmp_path / "out"
    env = {"SWEEP_TAMPER_ON": "scale=1.0", "SWEEP_TAMPER": "plant"}
    r = _sweep(tmp_path, base, ft, out, env, extra=("--keep-candidates",))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    kept = sorted(p.name for p in (out / "candidates").iterdir()) if (out / "candidates").exists() else []
    assert not [k for k in kept if "scale_1.0" in k or "scale=1.0" in k], kept
    assert not list(out.rglob("planted.txt"))


# -- 1: a path never becomes code ------------------------------------------------------------------


HOSTILE_NAMES = [
    "x{output}$(touch {canary})",
    "y{model}'$(touch {canary})'",
    'q"`touch {canary}`"',
    "s;touch {canary};",
    "n\ntouch {canary}\n",
    "sp ace & {output}{model} $HOME |",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_c1_command_substitutes_each_placeholder_once_quoted(tmp_path, name):
    from dghard_cli.sweeping.evaluate import fill_template as render

    canary = tmp_path / "canary"
    model = tmp_path / name.replace("{canary}", str(canary))
    output = tmp_path / ("out-" + name.replace("{canary}", str(canary)))
    cmd = render(
        f"{sys.executable} -c 'import sys; print(repr(sys.argv[1:]))' {{model}} --o={{output}} {{x}}",
        model,
        output,
    )
    r = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr([str(model), f"--o={output}", "{x}"])
    assert not canary.exists()


def test_c1_sweep_with_out_and_base_named_like_placeholders_runs_no_code(template, tmp_path):
    canary = tmp_path / "canary"  # the evaluation runs in the current directory: tmp_path
    parent = tmp_path / "p"
    parent.mkdir()
    base = parent / "b{output}$(touch canary)"
    ft = parent / "f{model}'$(touch canary)'"
    shutil.copytree(template / "base", base)
    shutil.copytree(template / "ft", ft)
    out = parent / "o{output}`touch canary`"
    r = _sweep(tmp_path, base, ft, out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not canary.exists()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c[0] for c in calls[:2]] == ["BASE", "FT"]
    assert calls[0][1] == str(base.resolve()) and calls[1][1] == str(ft.resolve())
    assert all(Path(c[2]).name == "output" for c in calls)
    assert (out / "sweep_report.json").exists()


# -- 4: patterns and results that would take minutes ------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("target_modules", "([a-z_.0-9]+)+X$"),
        ("exclude_modules", "(.*)*q_projX"),
        ("rank_pattern", {"([a-z_]+)+X": 2}),
        ("alpha_pattern", {"(q|q)+X$": 4}),
        ("layers_pattern", "(a+)+"),
    ],
)
def test_c4_catastrophic_adapter_regexes_never_run(tmp_path, field, value):
    from dghard_cli.testing.synthetic_lora import make_adapter

    ad, _, _ = make_adapter(tmp_path / "adapter", CFG, r=4)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg[field] = value
    if field == "layers_pattern":
        cfg["layers_to_transform"] = [0]
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    r = run_dghard("audit-lora", ad, "--json", timeout=60)
    assert time.monotonic() - t0 < 60
    assert r.returncode == 1, (r.returncode, r.stderr)
    doc = json.loads(r.stdout)
    hits = [
        f for f in doc["findings"] if f["details"].get("key") == field and "cannot be matched" in f["message"]
    ]
    assert hits and hits[0]["level"] == "error", doc["findings"]


def test_c4_guarded_matcher_refuses_nested_quantifiers_and_bounds_time():
    from dghard_cli.io import patterns

    for bad in ["(a+)+$", "(a|aa)+", "(.*)*x", r"(\w+\.?)+!", ".*.*.*.*x", r"(a)\1"]:
        assert patterns.pattern_problem(bad), bad
    for good in [
        r".*\.(q_proj|v_proj)$",
        r"^(?!.*vision).*(q_proj|k_proj)",
        "q_proj",
        r"model\.layers\.\d+\.self_attn\..*",
    ]:
        assert patterns.pattern_problem(good) is None, good
    # the time bound stops a pattern that gets past the static guard
    t0 = time.monotonic()
    with pytest.raises(patterns.PatternTimeout), patterns.bounded("test", budget=0.5):
        patterns.re.match("(a+)+$", "a" * 40 + "b")
    assert time.monotonic() - t0 < 5


def test_c4_lm_eval_results_with_many_tasks_and_exponential_groups(tmp_path):
    many = tmp_path / "many.json"
    many.write_text(
        json.dumps({"results": {f"t{i}": {"acc,none": 0.5 + (i % 7) / 100} for i in range(100_000)}})
    )
    res, tree = {}, {}
    for i in range(40):  # 2^40 paths through 40 diamonds
        tree[f"g{i}"], tree[f"a{i}"], tree[f"b{i}"] = [f"a{i}", f"b{i}"], [f"g{i + 1}"], [f"g{i + 1}"]
        res.update({f"g{i}": {"alias": "g"}, f"a{i}": {"alias": "a"}, f"b{i}": {"alias": "b"}})
    res["g40"] = {"acc,none": 0.5}
    dia = tmp_path / "dia.json"
    dia.write_text(json.dumps({"results": res, "group_subtasks": tree}))
    for f, n in ((many, 100_000), (dia, 1)):
        r = run_dghard("score", "--base", f, "--ft", f, "--candidate", f, "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["benchmarks"]) == n


# -- 5: exit codes as promised ------------------------------------------------------------------------


def test_c5_dev_zero_as_a_file_argument_is_refused_without_reading_it(tmp_path):
    for args in (
        ["report", "/dev/zero"],
        ["score", "--base", "/dev/zero", "--ft", "/dev/zero", "--candidate", "/dev/zero"],
    ):
        r = run_capped(*args, timeout=60)
        assert r.returncode == 2, (args, r.returncode, r.stderr[-500:])
        assert "character device" in one_line_error(r.stderr)


def test_c5_yaml_alias_bomb_is_refused_quickly(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 10):
        bomb += f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]\n"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("method: ties\nbase: b\nmodels: [f]\n" + bomb)

    def cap() -> None:  # a run that tries to expand it fails here instead of taking the machine
        import resource as res

        res.setrlimit(res.RLIMIT_AS, (3 << 30, 3 << 30))

    def cpu_s() -> float:  # the children's CPU time: a loaded machine stretches the wall time only
        use = resource.getrusage(resource.RUSAGE_CHILDREN)
        return use.ru_utime + use.ru_stime

    c0 = cpu_s()
    e = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "dghard_cli", "merge", "--config", str(recipe)],
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=cap,
    )
    assert r.returncode == 2 and "YAML" in one_line_error(r.stderr), r.stderr[-500:]
    assert cpu_s() - c0 < 30


def test_c5_deeply_nested_results_and_yaml(tmp_path):
    deep = tmp_path / "deep.json"
    deep_json(deep)
    r = CliRunner().invoke(app, ["score", "--base", str(deep), "--ft", str(deep), "--candidate", str(deep)])
    assert r.exit_code == 2 and "nested" in one_line_error(r.stderr)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: ties\nbase: b\nmodels: [f]\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    r = CliRunner().invoke(app, ["merge", "--config", str(recipe)])
    assert r.exit_code == 2 and "nested" in one_line_error(r.stderr)


def test_c5_write_protected_out_parent_is_an_input_error(template, tmp_path, monkeypatch):
    base, ft = fresh_pair(template, tmp_path)
    locked = tmp_path / "ro"
    locked.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def deny(path, *a, **k):  # what a read-only directory does to a non-root user
        if str(path).startswith(str(locked) + os.sep):
            raise PermissionError(13, "Permission denied", str(path))
        return None

    monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: deny(p) or real_mkdir(p, *a, **k))
    monkeypatch.setattr(os, "open", lambda p, *a, **k: deny(p) or real_open(p, *a, **k))
    r = CliRunner().invoke(app, ["repair", str(base), str(ft), str(locked / "out")])
    assert r.exit_code == 2, (r.exit_code, r.stderr, r.exception)
    assert "Permission denied" in one_line_error(r.stderr)
    assert not any(locked.iterdir())


def test_c5_disk_full_while_copying_side_files_is_exit_3_and_resumable(template, tmp_path):
    """Side files are copied after the shards: a write limit smaller than the tokenizer fails
    there (as a full disk does); the run exits 3, keeps its journal, and the rerun finishes."""
    base, ft = fresh_pair(template, tmp_path)
    (ft / "tokenizer.json").write_text(json.dumps({"pad": "x" * (2 << 20)}))
    out = tmp_path / "out"

    def limit_writes() -> None:
        import resource as res

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        res.setrlimit(res.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    e = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "dghard_cli", "repair", str(base), str(ft), str(out)]
    r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=120, preexec_fn=limit_writes)
    assert r.returncode == 3, (r.returncode, r.stderr)
    line = one_line_error(r.stderr)
    assert "the file size limit was reached while writing side file tokenizer.json" in line, line
    assert "resume" in line
    assert (tmp_path / ".out.dghard-partial" / "dghard_journal.jsonl").exists() and not out.exists()
    r = subprocess.run(cmd + ["--json"], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["output"]["resumed_shards"]
    assert (out / "tokenizer.json").read_bytes() == (ft / "tokenizer.json").read_bytes()


def test_c5_repeated_ctrl_c_exits_3_and_stays_resumable(tmp_path):
    cfg = ArchConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=1024)
    base, ft = make_pair(tmp_path, cfg, dtype="float32", base_shards=1, ft_shards=3, seed=0)
    out = tmp_path / "out"
    stage = tmp_path / ".out.dghard-partial"
    e = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "dghard_cli", "repair", str(base), str(ft), str(out)]
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not stage.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(40):  # Ctrl-C, then an impatient user keeps pressing it
        if p.poll() is not None:
            break
        p.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _, err = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the run finished before it could be interrupted")
    assert p.returncode == 3, (p.returncode, err)
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert "interrupted" in one_line_error(err)
    r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not stage.exists()


# -- 6: memory at the edges ---------------------------------------------------------------------------


def _peak_rss_mb(args: list[str]) -> tuple[int, float]:
    e = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "dghard_cli", *args, "-q"], env=e, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.returncode == 0, err
    return p.returncode, usage.ru_maxrss / 1024


def test_c6_one_row_matrices_stream_in_blocks(tmp_path):
    """A 1×N matrix (and N×1) is read in pieces: peak RSS grows by less than twice the tensor
    (before: ~7× for repair, ~6× for TIES, as the whole row was one block)."""
    n = 50_000_000  # 200 MB of float32 per tensor
    tensor_mb = n * 4 / 2**20
    small = tmp_path / "small"
    make_pair(small, CFG, dtype="float32", base_shards=1, ft_shards=1, seed=0)
    _, idle = _peak_rss_mb(["repair", str(small / "base"), str(small / "ft"), str(small / "out")])
    for name, shape in (("wide", (1, n)), ("tall", (n, 1))):
        root = tmp_path / name
        for d, seed in (("base", 0), ("ft", 1)):
            (root / d).mkdir(parents=True)
            g = torch.Generator().manual_seed(seed)
            save_file(
                {"model.layers.0.mlp.up_proj.weight": torch.randn(shape, generator=g)},
                str(root / d / "model.safetensors"),
            )
        for cmd in (["repair"], ["merge", "--method", "ties"]):
            target = root / f"out-{cmd[0]}"
            args = [*cmd, str(root / "base"), str(root / "ft")]
            args += [str(target)] if cmd[0] == "repair" else ["--out", str(target)]
            _, peak = _peak_rss_mb(args)
            assert peak - idle < 2 * tensor_mb, (name, cmd, f"peak {peak:.0f} MB, idle {idle:.0f} MB")
            shutil.rmtree(target)
        shutil.rmtree(root)


def test_c6_huge_declared_shape_is_refused_before_any_allocation(tmp_path):
    """A 10^6 × 10^6 bf16 tensor in a sparse file: inspect refuses it from its shape."""
    rows = cols = 10**6
    for d in ("base", "ft"):
        (tmp_path / d).mkdir()
        head = json.dumps(
            {
                "model.layers.0.mlp.up_proj.weight": {
                    "dtype": "BF16",
                    "shape": [rows, cols],
                    "data_offsets": [0, 2 * rows * cols],
                }
            }
        )
        p = tmp_path / d / "model.safetensors"
        write_raw(p, head, b"")
        try:
            os.truncate(p, p.stat().st_size + 2 * rows * cols)
        except OSError:
            pytest.skip("the file system holds no 2 TB sparse files")
    r = run_dghard("inspect", tmp_path / "base", tmp_path / "ft", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    line = one_line_error(r.stderr)
    assert "needs about" in line and "memory" in line


# -- 7: other ------------------------------------------------------------------------------------------


def test_c7_second_run_into_the_same_out_is_told_another_run_holds_it(template, tmp_path):
    import fcntl

    base, ft = fresh_pair(template, tmp_path)
    out = tmp_path / "out"
    with open(tmp_path / ".out.dghard-lock", "w") as fh:  # another run holds OUT
        fh.write("4242\n")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = run_dghard("repair", base, ft, out)
        assert r.returncode == 3, (r.returncode, r.stderr)
        line = one_line_error(r.stderr)
        assert "another dghard run" in line and "4242" in line
        assert not out.exists() and not (tmp_path / ".out.dghard-partial").exists()
    r = run_dghard("repair", base, ft, out, "-q")
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob(".out.dghard-*"))


def test_c7_verify_quick_says_what_it_did_not_check(template, tmp_path):
    base, ft = fresh_pair(template, tmp_path)
    out = tmp_path / "out"
    assert run_dghard("repair", base, ft, out, "-q").returncode == 0
    victim = shard_path(out)
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x01  # same size, different bytes
    victim.write_bytes(bytes(data))
    q = run_dghard("verify", out, "--quick")
    assert q.returncode == 0, q.stderr
    assert "sha256 not checked" in q.stdout and "not checked:" in q.stdout, q.stdout
    assert "shard sizes and sha256" not in q.stdout
    full = run_dghard("verify", out)
    assert full.returncode == 1 and "sha256" in full.stderr


def test_c7_free_space_refusal_states_its_margin(template, tmp_path, monkeypatch):
    from collections import namedtuple

    import dghard_cli.io.output as output

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**6, 10**6))
    r = CliRunner().invoke(
        app, ["repair", str(template / "base"), str(template / "ft"), str(tmp_path / "out")]
    )
    assert r.exit_code == 2, (r.stderr, r.exception)
    line = one_line_error(r.stderr)
    assert "margin" in line and "0.00 GB" not in line and "KB" in line, line
