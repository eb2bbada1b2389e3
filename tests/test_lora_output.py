"""The pure pieces of LoRA outputs: exact low-rank factors, PEFT key matching, the adapter view's
blocked reads. Float64 numpy references; PEFT's matching rule written out here."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import f64

from dghard_cli.lora.writer import adapter_config, module_names, pattern_key, target_modules
from dghard_cli.spectral.lowrank import factorize, factorize_product


def peft_rank_match(key: str, module: str) -> bool:  # PEFT 0.21's get_pattern_key rule
    return re.match(rf"(.*\.)?({key})$", module) is not None


def peft_013_match(key: str, module: str) -> bool:  # PEFT 0.13's rule
    return re.match(rf".*\.{key}$", module) is not None


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
@pytest.mark.parametrize("cap", [None, 3])
def test_factorize_is_the_exact_truncated_svd(shape, cap):
    g = np.random.default_rng(0)
    m, n = shape
    low = g.standard_normal((m, 5)) @ g.standard_normal((5, n))
    d = low + (0 if cap is None else 0.05 * g.standard_normal((m, n)))
    fac = factorize(torch.from_numpy(d).to(torch.float32), cap, block_bytes=8 * 20 * 7)
    u, s, vt = np.linalg.svd(f64(torch.from_numpy(d).to(torch.float32)))
    k = 5 if cap is None else 3
    assert fac.rank == k and fac.left.shape == (m, k) and fac.right.shape == (k, n)
    best = (u[:, :k] * s[:k]) @ vt[:k]
    got = f64(fac.left) @ f64(fac.right)
    assert np.max(np.abs(got - best)) < 1e-9 * np.max(np.abs(d))
    assert fac.energy_lost == pytest.approx(float(np.sum(s[k:] ** 2) / np.sum(s**2)), abs=1e-12)
    assert np.allclose(fac.sigma[:k], s[:k], rtol=1e-9)


def test_factorize_of_zero_and_factorize_product():
    z = factorize(torch.zeros(6, 4))
    assert z.rank == 0 and z.left.shape == (6, 0) and z.energy_kept == 1.0
    g = np.random.default_rng(1)
    b, a = g.standard_normal((30, 6)), g.standard_normal((6, 40))
    fac = factorize_product(torch.from_numpy(b), torch.from_numpy(a), 4)
    u, s, vt = np.linalg.svd(b @ a)
    assert np.max(np.abs(f64(fac.left) @ f64(fac.right) - (u[:, :4] * s[:4]) @ vt[:4])) < 1e-10 * s[0]
    assert fac.energy_lost == pytest.approx(float(np.sum(s[4:6] ** 2) / np.sum(s[:6] ** 2)), rel=1e-9)
    full = factorize_product(torch.from_numpy(b), torch.from_numpy(a))
    assert full.rank == 6 and np.allclose(f64(full.left) @ f64(full.right), b @ a, atol=1e-10)


NAMES = [
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.11.self_attn.q_proj.weight",
    "model.vision.layers.1.self_attn.q_proj.weight",
    "lm_head.weight",
]


def test_rank_pattern_keys_match_their_module_alone_under_peft_rules():
    modules = module_names(NAMES)
    for m in ("model.layers.1.self_attn.q_proj", "model.layers.11.self_attn.q_proj", "lm_head"):
        key = pattern_key(m, modules)
        assert [x for x in modules if peft_rank_match(key, x)] == [m], (m, key)
    # unambiguous in the model: the name without its first part, which PEFT 0.13 matches too
    key = pattern_key("model.layers.11.self_attn.q_proj", modules)
    assert key == r"layers\.11\.self_attn\.q_proj" and peft_013_match(key, "model.layers.11.self_attn.q_proj")
    # "layers.1.self_attn.q_proj" also ends model.vision.layers.1...: anchored full name instead
    assert pattern_key("model.layers.1.self_attn.q_proj", modules).startswith("^")


def test_target_modules_list_or_regex():
    modules = module_names(NAMES)
    assert target_modules(["model.layers.11.self_attn.q_proj"], modules) == [
        "model.layers.11.self_attn.q_proj"
    ]
    t = target_modules(
        ["layers.1.self_attn.q_proj"], module_names(["layers.1.self_attn.q_proj.weight", *NAMES])
    )
    assert isinstance(t, str) and re.fullmatch(t, "layers.1.self_attn.q_proj")
    assert not re.fullmatch(t, "model.layers.1.self_attn.q_proj")
    cfg = adapter_config(
        ranks={"model.layers.1.self_attn.q_proj": 8, "model.layers.11.self_attn.q_proj": 8, "lm_head": 3},
        modules=modules,
        modules_to_save=[],
        bias="none",
        fan_in_fan_out=False,
        base_model="b",
        revision=None,
        task_type="CAUSAL_LM",
        tie_embeddings=False,
    )
    assert cfg["r"] == cfg["lora_alpha"] == 8 and cfg["rank_pattern"] == cfg["alpha_pattern"] == {
        "^lm_head": 3
    }


def test_adapter_view_reads_in_blocks_the_same(tmp_path, monkeypatch):
    """An adapted tensor read whole, in small compute blocks, or by rows gives the same bytes."""
    import dghard_cli.lora.view as src
    from dghard_cli.io.hub import open_checkpoint
    from dghard_cli.lora.source import open_ft
    from dghard_cli.testing.synthetic import ArchConfig, make_pair
    from dghard_cli.testing.synthetic_lora import make_adapter

    arch = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    base, _ = make_pair(tmp_path / "pair", arch, ft_shards=1)
    ad, tensors, cfg = make_adapter(tmp_path / "ad", arch, r=4, alpha=8, targets=("q_proj", "down_proj"))
    b = open_checkpoint(str(base))
    view = open_ft(str(ad), base=b)
    name = "model.layers.0.mlp.down_proj.weight"
    whole = view.tensors[name].read()
    monkeypatch.setattr(src, "COMPUTE_BLOCK_BYTES", 8 * 48 * 3)
    assert torch.equal(view.tensors[name].read(), whole)
    assert torch.equal(view.tensors[name].read((5, 17)), whole[5:17])
    pre = "base_model.model.model.layers.0.mlp.down_proj."
    want = f64(b.read(name)) + 2.0 * f64(tensors[pre + "lora_B.weight"]) @ f64(tensors[pre + "lora_A.weight"])
    assert np.array_equal(f64(whole), want.astype(np.float32).astype(np.float64))
    assert view.tensors["model.layers.0.mlp.up_proj.weight"] is b.tensors["model.layers.0.mlp.up_proj.weight"]
    view.close()
    b.close()


def test_large_updates_spill_to_disk_and_give_the_same_adapter(tmp_path, monkeypatch):
    import dghard_cli.lora.route_factored as factored
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.lora.output import LoraOutputOptions
    from dghard_cli.repairing import RepairOptions, repair
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    arch = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    base, ft = make_pair(tmp_path / "pair", arch, ft_shards=2)
    opts = RepairOptions(run=RunOptions(quiet=True, device="cpu"), lora=LoraOutputOptions(format="peft"))
    repair(str(base), str(ft), str(tmp_path / "mem"), opts)
    monkeypatch.setattr(factored, "SPILL_BYTES", 0)
    seen = []
    real = factored.DeltaStore.blocks

    def blocks(self):
        seen.append(self.path is not None)
        yield from real(self)

    monkeypatch.setattr(factored.DeltaStore, "blocks", blocks)
    repair(str(base), str(ft), str(tmp_path / "disk"), opts)
    assert True in seen  # the tall matrices (wide ones are factored from memory)
    name = "adapter_model.safetensors"
    assert (tmp_path / "disk" / name).read_bytes() == (tmp_path / "mem" / name).read_bytes()
    assert not list((tmp_path / "disk").glob("dghard-spool-*"))


def test_certified_range_finder_is_exact_or_declines():
    from dghard_cli.spectral.lowrank import factorize_certified

    g = np.random.default_rng(2)
    low = g.standard_normal((300, 6)) @ g.standard_normal((6, 40)) * np.logspace(0, -3, 40)

    def blocks_of(x):
        t = torch.from_numpy(x).to(torch.float32)
        return lambda: (t[r : r + 64] for r in range(0, t.shape[0], 64))

    fac = factorize_certified(blocks_of(low), (300, 40), 20)
    u, s, vt = np.linalg.svd(f64(torch.from_numpy(low).to(torch.float32)))
    assert fac is not None and fac.rank == 6
    assert np.max(np.abs(f64(fac.left) @ f64(fac.right) - low)) < 1e-6 * np.max(np.abs(low))
    assert np.allclose(fac.sigma[:6], s[:6], rtol=1e-6)
    assert fac.energy_lost < 1e-12
    noisy = low + 1e-3 * g.standard_normal((300, 40))  # full rank: no certificate at width 20
    assert factorize_certified(blocks_of(noisy), (300, 40), 20) is None


def test_an_adapter_output_honours_report_and_the_output_path_rule(tmp_path):
    """Before: an adapter output ignored --report: `--report FT/config.json` exited 0 (the rule
    that no output lands on an input was never checked) and the report went only into OUT."""
    from conftest import run_dghard

    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    arch = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    base, ft = make_pair(tmp_path / "pair", arch)
    (ft / "tokenizer.json").write_text('{"version": "1.0"}')  # copied into the adapter output
    before = (ft / "config.json").read_bytes()
    out = tmp_path / "out"
    for target, words in (
        (ft / "config.json", "inside FT"),
        (out / "adapter_config.json", "writes itself"),
        (out / "tokenizer.json", "writes itself"),
    ):
        res = run_dghard("repair", base, ft, out, "--format", "peft", "--report", target)
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert not out.exists()
    assert (ft / "config.json").read_bytes() == before
    res = run_dghard("repair", base, ft, out, "--format", "peft", "--report", tmp_path / "r.json", "-q")
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["output"]["format"] == "peft" and not (out / "dghard_report.json").exists()
    inside = tmp_path / "out2"
    res = run_dghard(
        "repair", base, ft, inside, "--format", "peft", "--report", inside / "sub" / "r.json", "-q"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads((inside / "sub" / "r.json").read_text())["output"]["format"] == "peft"
