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
def test_hub_ids_that_are_not_org_name(template, tmp_path, spec):
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
