"""Warnings about the inputs: BASE and FT swapped (metadata, or the weights), different dtypes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import f64, load_dir, run_dghard

from dghard_cli import RepairOptions, RunOptions, repair
from dghard_cli.engine import input_checks
from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.io.safetensors_format import parse_dtype_option
from dghard_cli.testing.synthetic import ArchConfig, DeltaModel, make_pair

CFG = ArchConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128)
#: a fine-tune made with weight decay (every matrix shrunk by 0.2 %) and a small update
DECAYED = DeltaModel(decay=0.002, noise=2e-4)


def _swap_warnings(doc: dict) -> list[str]:
    return [w for w in doc["summary"]["warnings"] if "look swapped" in w]


@pytest.fixture(scope="module")
def decayed(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("decayed"), CFG, delta=DECAYED)


def test_the_along_base_share_matches_a_float64_reference(decayed, tmp_path):
    base, ft = decayed
    doc = repair(base, ft, tmp_path / "out")
    b, f = load_dir(base), load_dir(ft)
    got = {r["name"]: r["delta_dot_base"] for r in doc["tensors"] if "delta_dot_base" in r}
    assert len(got) == 16
    for name, dot in got.items():
        d = f64(f[name]) - f64(b[name])
        assert dot == pytest.approx(float(np.sum(d * f64(b[name]))), rel=1e-9)
    shares = input_checks.along_base_shares(doc["tensors"])
    assert max(shares) < -1.0  # the decayed fine-tune, in order: it shrank along W_base
    assert not _swap_warnings(doc)


def test_swapped_inputs_are_flagged_from_the_weights(decayed, tmp_path):
    base, ft = decayed
    r = run_dghard("repair", ft, base, tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "look swapped" in ln]
    assert len(lines) == 1 and lines[0].startswith("dghard: warning: BASE and FT look swapped"), r.stderr
    assert "in 16 of 16 matrices" in lines[0]
    doc = json.loads(r.stdout)
    assert _swap_warnings(doc) == [lines[0][len("dghard: warning: ") :]]
    assert "look swapped" in (tmp_path / "out" / "README.md").read_text()


def test_a_swap_of_a_fine_tune_without_weight_decay_is_not_guessed(tmp_path):
    base, ft = make_pair(tmp_path, CFG, delta=DeltaModel(noise=2e-4))
    shares = input_checks.along_base_shares(repair(ft, base, tmp_path / "o")["tensors"])
    assert -2.0 < float(np.median(shares)) < 0.0  # −1 − s with s ≈ 0: no evidence either way
    assert not _swap_warnings(repair(ft, base, tmp_path / "o2"))


def test_metadata_naming_the_other_input_is_decisive_even_in_a_dry_run(tmp_path):
    src_base, src_ft = make_pair(tmp_path, CFG)
    # BASE's config says it was loaded from the fine-tune's directory: they are swapped
    cfg = json.loads((src_base / "config.json").read_text())
    (src_base / "config.json").write_text(json.dumps({**cfg, "_name_or_path": str(src_ft)}))
    doc = repair(src_base, src_ft, tmp_path / "out", RepairOptions(run=RunOptions(dry_run=True)))
    (w,) = _swap_warnings(doc)
    assert "BASE's metadata names" in w and str(src_ft) in w
    # a model card's base_model naming FT by its Hub id's last part counts as well
    b2, f2 = make_pair(tmp_path / "two", CFG)
    f2 = f2.rename(f2.parent / "Tiny-Chat-7B")
    (b2 / "README.md").write_text("---\nbase_model: some-org/Tiny-Chat-7B\n---\nA card.\n")
    assert _swap_warnings(repair(b2, f2, tmp_path / "out2", RepairOptions(run=RunOptions(dry_run=True))))
    # FT naming BASE confirms the order: nothing said
    b3, f3 = make_pair(tmp_path / "three", CFG)
    (f3 / "README.md").write_text(f"---\nbase_model: {b3}\n---\n")
    assert not _swap_warnings(repair(b3, f3, tmp_path / "out3", RepairOptions(run=RunOptions(dry_run=True))))


def test_names_input_rules(tmp_path):
    a, b = make_pair(tmp_path, CFG)
    from dghard_cli.io.hub import open_checkpoint

    base, ft = open_checkpoint(str(a)), open_checkpoint(str(b))
    assert input_checks.names_input(str(b), ft, base)  # as given
    assert input_checks.names_input(str(b) + "/", ft, base)
    assert input_checks.names_input("someone/ft", ft, base)  # same last component, BASE's differs
    assert not input_checks.names_input("someone/base", ft, base)
    assert not input_checks.names_input("", ft, base)


def test_different_dtypes_are_named_with_the_output_dtype(tmp_path, capsys):
    base16, _ = make_pair(tmp_path / "bf16", CFG, dtype="bfloat16")
    _, ft32 = make_pair(tmp_path / "fp32", CFG, dtype="float32")
    doc = repair(base16, ft32, tmp_path / "out", RepairOptions(run=RunOptions(notices=True)))
    (w,) = [x for x in doc["summary"]["warnings"] if "BASE is" in x]
    assert w.startswith("BASE is bf16 and FT fp32:") and "the output is fp32 (the fine-tune's dtype" in w
    err = capsys.readouterr().err
    assert err.count("dghard: warning: BASE is bf16 and FT fp32") == 1
    opts = RepairOptions(policy=PolicyOptions(out_dtype=parse_dtype_option("bf16")))
    doc = repair(base16, ft32, tmp_path / "out2", opts)
    assert any("the output is bf16 (as --dtype asks)" in x for x in doc["summary"]["warnings"])
    # same dtypes: nothing said
    b, f = make_pair(tmp_path / "same", CFG, dtype="bfloat16")
    assert not [x for x in repair(b, f, tmp_path / "out3")["summary"]["warnings"] if "BASE is" in x]


def test_merges_flag_a_fine_tune_that_looks_like_the_base(decayed, tmp_path):
    from dghard_cli import MergeOptions, merge

    base, ft = decayed
    in_order = merge(base, [ft], tmp_path / "a", MergeOptions(method="task-arithmetic"))
    assert not _swap_warnings(in_order)
    b, f = load_dir(base), load_dir(ft)
    name = "model.layers.0.mlp.up_proj.weight"
    rec = next(r for r in in_order["tensors"] if r["name"] == name)
    d = f64(f[name]) - f64(b[name])
    assert rec["delta_dot_bases"][0] == pytest.approx(float(np.sum(d * f64(b[name]))), rel=1e-4)
    (w,) = _swap_warnings(merge(ft, [base], tmp_path / "b", MergeOptions(method="task-arithmetic")))
    assert w.startswith("BASE and FT look swapped")
    (w,) = _swap_warnings(merge(ft, [base], tmp_path / "c", MergeOptions(method="dg-hard")))
    assert w.startswith("BASE and FT look swapped")


def test_the_chunked_float64_dot_matches_numpy():
    import torch

    from dghard_cli.methods.dg_hard import _dot64

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 53, generator=g, dtype=torch.float64)
    b = torch.randn(37, 80, generator=g).to(torch.bfloat16)[:, 10:63]  # a column block: strided
    ref = float(np.sum(x.numpy() * b.to(torch.float64).numpy()))
    for chunk in (1, 7, 53, 1 << 20):
        assert float(_dot64(x, b, chunk)) == pytest.approx(ref, rel=1e-12)
