"""The subspace merges (TSV-M, Iso-C, Iso-CTS) as `dghard sweep` families, and `sweep --dtype`.

The three experts of ``test_sweep_merge`` (one planted task signal each); the stand-in evaluation
there, with a safetensors reader of its own that also decodes bf16 (numpy has no bf16). Every
candidate written by the sweep is compared with the float64 numpy references of
``test_merge_spectral`` (the papers' formulas, full SVDs) and rewritten by its printed command.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_dir, run_dghard
from test_merge_spectral import UBF16, as64, assert_close, ill_conditioned_delta, reference
from test_sweep_merge import FORMULA, Experts, _sweep

from dghard_cli.errors import InputError
from dghard_cli.sweeping.steps import _slug
from dghard_cli.testing.synthetic import ArchConfig, write_checkpoint

# the stand-in evaluation of test_sweep_merge, reading F32 and BF16 tensors with numpy alone
EVAL_SCRIPT = (
    """
import json, struct, sys
from pathlib import Path
import numpy as np

ROOT = Path(__file__).parent
model, output = sys.argv[1], sys.argv[2]

def read(path):
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    out = {}
    for name, e in head.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        if e["dtype"] == "BF16":
            bits = np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(data[a:b], dtype={"F32": "<f4", "F64": "<f8"}[e["dtype"]])
        out[name] = arr.reshape(e["shape"]).astype(np.float64)
    return out

def load(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(read(f))
    return out
"""
    + FORMULA
    + """
sig = np.load(ROOT / "signal.npz")
b, m = load(ROOT / "base"), load(model)
names = [k[2:] for k in sig.files if k.startswith("Q:")]
deltas = {n: m[n] - b[n] for n in names}
Path(output).write_text(json.dumps(benchmarks(deltas, sig, float(sig["q0"]), int(sig["k"]))))
"""
)
SPECTRAL = {
    "families": [
        {"family": "tsv", "grid": [0.6, 1.4], "range": [0.2, 2.0]},
        {"family": "iso-c", "grid": [0.6, 1.4], "range": [0.2, 2.0]},
        {"family": "iso-cts", "grid": [1.0], "refine": False, "fixed": {"common_space_fraction": 0.5}},
    ]
}


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> Experts:
    ex = Experts(tmp_path_factory.mktemp("spectral-experts"))
    ex.script.write_text(EVAL_SCRIPT)
    return ex


@pytest.fixture(scope="module")
def swept(experts, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("swept-spectral") / "merged"
    return _sweep(
        experts, out, budget=10, families=SPECTRAL["families"], dtype="bf16", keep_candidates=True
    ), out


# -- families ------------------------------------------------------------------------------------


def test_the_subspace_merges_are_families_with_their_own_alpha_range():
    from dghard_cli.sweeping.candidate_file import load_candidates, parse_candidates
    from dghard_cli.sweeping.candidates import kinds

    k = kinds()
    for name in ("tsv", "iso-c", "iso-cts"):
        assert k[name].command == "merge" and k[name].axes[0] == "alpha"
        assert k[name].ranges["alpha"] == (0.0, 3.0)  # a scale >= 0, not WiSE-FT's weight in [0, 1]
        assert k[name].default_when == "several"
    assert k["wise-ft"].ranges["alpha"] == (0.0, 1.0)
    assert k["iso-cts"].ranges["common_space_fraction"] == (0.0, 1.0)
    assert "tsv_rank" in k["tsv"].fixed
    # the default set searches them on their strength axis, inside the merges block's range
    entries, _ = load_candidates(None)
    spectral = {e.family: e for e in entries if e.family in ("tsv", "iso-c", "iso-cts")}
    assert set(spectral) == {"tsv", "iso-c", "iso-cts"}
    assert all(e.axis == "alpha" and e.origin == "merges" for e in spectral.values())
    # a candidate file entry: beyond 1 (α 2.5 is inside (0, 3)); past 3 only with a range of one's own
    (e,) = parse_candidates({"families": [{"family": "tsv", "grid": [2.5]}]}, "c.yaml")
    assert e.range == (0.0, 3.0)
    with pytest.raises(InputError, match=r"grid value 3.5 lies outside range \[0, 3\]"):
        parse_candidates({"families": [{"family": "iso-c", "grid": [3.5]}]}, "c.yaml")
    (e,) = parse_candidates({"families": [{"family": "iso-c", "grid": [3.5], "range": [0.5, 5]}]}, "c.yaml")
    assert e.range == (0.5, 5.0)


def test_a_negative_alpha_range_is_refused_when_the_fine_tunes_are_known(experts, tmp_path):
    fam = [{"family": "tsv", "grid": [0.5], "range": [-1.0, 1.0]}]
    with pytest.raises(InputError, match=r"--alpha must be >= 0|--alpha must be in"):
        _sweep(experts, tmp_path / "o", budget=5, families=fam)
    assert not (tmp_path / "o").exists()


# -- the sweep writes them, in the dtype asked, as their printed commands do ----------------------


def test_spectral_candidates_match_the_float64_references(experts, swept):
    doc, out = swept
    assert doc["options"]["dtype"] == "BF16"
    rows = [r for r in doc["candidates"] if r["status"] == "ok"]
    assert {r["family"] for r in rows} == {"tsv", "iso-c", "iso-cts"}, [
        (r["name"], r["status"], r.get("message")) for r in doc["candidates"]
    ]
    assert len(rows) == doc["budget"]["candidate_evaluations"] == 6  # 10 less BASE and 3 experts
    base = as64(load_dir(experts.base))
    fts = [as64(load_dir(f)) for f in experts.fts]
    checked = 0
    for r in rows:  # the winner is OUT, every other candidate kept in OUT/candidates/
        d = (
            out
            if r["order"] == doc["winner"]["order"]
            else out / "candidates" / f"{r['order']:03d}-{_slug(r['name'])}"
        )
        got = load_dir(d)
        assert {str(t.dtype) for n, t in got.items() if t.is_floating_point()} == {"torch.bfloat16"}
        p = r["params"]
        kw = {"alpha": p["alpha"]}
        if r["family"] == "iso-cts":
            kw["fraction"] = p["common_space_fraction"]
        # bf16 output: the entry's rounding, 2^-8 of it, on top of the route's 1e-6
        assert_close(got, reference(r["family"], base, fts, **kw), base, unit=UBF16)
        checked += 1
    assert checked == len(rows)


def test_the_printed_command_carries_dtype_and_rewrites_the_winner_byte_for_byte(swept):
    doc, out = swept
    argv = doc["winner"]["reproduce"]["argv"]
    assert argv[:3] == ["dghard", "merge", "--method"] and argv[3] in ("tsv", "iso-c", "iso-cts")
    assert argv[argv.index("--dtype") + 1] == "bf16" and "--alpha" in argv
    res = run_dghard(*argv[1:], "--quiet")
    assert res.returncode == 0, res.stderr
    again = Path(doc["winner"]["reproduce"]["out"])

    def sha(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names and [sha(out / n) for n in names] == [sha(again / n) for n in names]


def test_the_output_dtype_is_part_of_a_cached_candidate(experts, tmp_path, monkeypatch):
    """The same candidate written in another dtype is another model: its own cache key (no
    --dtype: the key it had before the option existed)."""
    from dghard_cli.sweeping import steps

    seen: list[dict] = []
    real = steps.digest

    def digest(what: dict) -> str:
        if "candidate" in what:
            seen.append(what)
        return real(what)

    monkeypatch.setattr(steps, "digest", digest)
    fam = [{"family": "task-arithmetic", "grid": [0.5], "refine": False}]
    docs = [
        _sweep(experts, tmp_path / str(dt), budget=5, families=fam, dtype=dt) for dt in (None, "fp32", "bf16")
    ]
    keys = {real(w) for w in seen}
    assert len(keys) == 3 and {w.get("dtype") for w in seen} == {None, "F32", "BF16"}
    argvs = [d["candidates"][0]["reproduce"]["argv"] for d in docs]
    assert "--dtype" not in argvs[0] and argvs[1][argvs[1].index("--dtype") + 1] == "fp32"
    assert docs[0]["options"]["dtype"] is None and docs[2]["options"]["dtype"] == "BF16"


def test_a_bad_dtype_is_refused_before_anything_is_written(experts, tmp_path):
    with pytest.raises(InputError, match=r"--dtype 'fp8' is not one of bf16, fp16, fp32, fp64"):
        _sweep(experts, tmp_path / "o", budget=3, dtype="fp8")
    assert not (tmp_path / "o").exists()
    res = run_dghard(
        "sweep", experts.base, experts.fts[0], tmp_path / "o", "--merge-ft", experts.fts[1],
        "--eval", experts.template, "--dtype", "fp8",
    )  # fmt: skip
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--dtype" in res.stderr and not (tmp_path / "o").exists()


# -- a float32 output the Gram route cannot resolve: written by the accurate route -----------------


def test_a_float32_candidate_the_gram_route_cannot_resolve_is_written_at_float32(tmp_path):
    """Σ Δ_i with singular values from 1 down to 3e-6 (test_merge_spectral's ill-conditioned
    matrix, split between two fine-tunes): Iso-C at float32 failed that candidate with the hint
    ``--dtype bf16``; it is now written at float32 by the accurate SVD route and equals the
    float64 reference to float32 rounding. ``dghard sweep --dtype bf16`` still writes bf16."""
    cfg = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    delta = ill_conditioned_delta()
    name = "model.layers.0.mlp.up_proj.weight"
    zero = torch.zeros((64, 32), dtype=torch.float32)
    write_checkpoint(tmp_path / "b", [(name, zero)], config=cfg.to_hf("float32"))
    for i, part in enumerate((0.5 * delta, 0.5 * delta)):
        write_checkpoint(tmp_path / f"f{i}", [(name, part.to(torch.float32))], config=cfg.to_hf("float32"))
    script = tmp_path / "eval.py"
    script.write_text(
        "import json, sys\nopen(sys.argv[2], 'w').write(json.dumps({'task': 60.0, 'skill': 50.0}))\n"
    )
    for i, (task, skill) in enumerate(((40.0, 50.0), (70.0, 50.0), (70.0, 50.0))):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"task": task, "skill": skill}))
    common = [
        "sweep", tmp_path / "b", tmp_path / "f0", "--merge-ft", tmp_path / "f1",
        "--eval", f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{model}} {{output}}",
        "--base-results", tmp_path / "r0.json", "--ft-results", tmp_path / "r1.json",
        "--ft-results", tmp_path / "r2.json", "--budget", "1", "--json",
    ]  # fmt: skip
    fam = tmp_path / "c.yaml"
    fam.write_text("families:\n  - {family: iso-c, grid: [1.0], refine: false}\n")
    res = run_dghard(*common, "--candidates", fam, tmp_path / "o32")
    doc = json.loads(res.stdout)
    (row,) = doc["candidates"]
    assert row["status"] == "ok" and "--dtype" not in row["reproduce"]["argv"], row
    got = load_dir(tmp_path / "o32")[name]
    assert got.dtype == torch.float32
    b = as64(load_dir(tmp_path / "b"))
    fts = [as64(load_dir(tmp_path / f"f{i}")) for i in range(2)]
    assert_close({name: got}, {name: reference("iso-c", b, fts)[name]}, {name: b[name]})
    ok = run_dghard(*common, "--candidates", fam, "--dtype", "bf16", tmp_path / "o16")
    doc = json.loads(ok.stdout)
    (row,) = doc["candidates"]
    assert row["status"] == "ok", row
    assert "--dtype" in row["reproduce"]["argv"]
    # the scoring of several fine-tunes: 'task' against its best expert (60 of 40 -> 70), 'skill'
    # (no expert moved it) in % repair as the share of the base's level kept (50 of 50)
    assert doc["scoring"]["unchanged_in_repair"] is True
    assert abs(row["retention"] - (60 - 40) / (70 - 40) * 100) < 1e-9 and abs(row["repair"] - 100.0) < 1e-9


def test_a_methods_grid_of_its_own_is_searched_as_given_or_refused_never_replaced():
    """A `methods:` entry is what the user asked for: a negative α was dropped from its grid
    (or, with a negative range, the method dropped) and α beyond the declared 3 replaced by
    values inside it, silently."""
    from dghard_cli.sweeping.candidate_file import parse_candidates

    def entry(spec: dict):
        doc = {"merges": {"grid": [0.3], "range": [0.1, 1.5], "methods": {"tsv": spec}}}
        entries = parse_candidates(doc, "c.yaml")
        return next(e for e in entries if e.family == "tsv")

    for spec in ({"grid": [-1.0, 1.0], "range": [-2.0, 3.0]}, {"grid": [-1.5], "range": [-2.0, -1.0]}):
        with pytest.raises(
            InputError, match=r"methods: tsv: range \[-2, .*\] reaches below alpha's lowest value 0"
        ):
            entry(spec)
    e = entry({"grid": [1.0e300], "range": [0.5, 1.7976931348623157e308]})
    assert e.grid == [1.0e300] and e.range == (0.5, 1.7976931348623157e308)
    e = entry({"grid": [1.0, 4.0], "range": [0.5, 5.0]})
    assert e.grid == [1.0, 4.0] and e.range == (0.5, 5.0)
    e = entry({"grid": [1.0]})  # no range of its own: the block's, inside the declared one
    assert e.grid == [1.0] and e.range == (0.1, 1.5)
    with pytest.raises(InputError, match="methods: recall has no strength"):
        parse_candidates(
            {"merges": {"grid": [0.3], "range": [0.1, 1.5], "methods": {"recall": {"grid": [1.0]}}}}, "c.yaml"
        )
