"""`dghard audit-lora`: planted defects, PEFT semantics, numerics against float64 references.

Adapters are written with PEFT's on-disk layout and names directly (safetensors + JSON); PEFT
itself is not needed. Numbers are checked against dense float64 numpy computations.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, f64, load_dir, run_dghard
from safetensors.torch import load_file

from dghard_cli.audit.auditor import AuditOptions, audit_lora
from dghard_cli.errors import InputError
from dghard_cli.lora.config import LoraConfig, pattern_key
from dghard_cli.lora.findings import CODES
from dghard_cli.lora.spectra import (
    dense_blocks,
    effective_rank,
    intruder_dimensions,
    lowrank_spectrum,
    spectrum_stats,
)
from dghard_cli.lora.targets import is_targeted, layer_index
from dghard_cli.testing.synthetic import ArchConfig, make_pair, write_checkpoint
from dghard_cli.testing.synthetic_lora import LINEAR_TARGETS, PREFIX, make_adapter, write_adapter

ARCH = ArchConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
Q0 = "model.layers.0.self_attn.q_proj"
V1 = "model.layers.1.self_attn.v_proj"


def build(tmp_path: Path, name: str = "adapter", **kw) -> tuple[Path, dict, dict]:
    kw.setdefault("targets", LINEAR_TARGETS)
    return make_adapter(tmp_path / name, ARCH, **kw)


def audit(path: Path, base: Path | None = None, **kw) -> dict:
    return audit_lora(str(path), str(base) if base else None, **kw)


def codes(doc: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in doc["findings"]:
        out.setdefault(f["code"], []).append(f["module"])
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    base, _ = make_pair(tmp_path_factory.mktemp("pair"), ARCH, ft_shards=1)
    return base


# -- healthy ------------------------------------------------------------------------------------------
def test_healthy_adapter_passes(tmp_path):
    d, tensors, cfg = build(tmp_path)
    doc = audit(d)
    assert doc["findings"] == [], doc["findings"]
    s = doc["summary"]
    assert (s["failed"], s["exit_code"], s["modules"]) == (False, 0, 14)
    assert doc["schema_version"] == 1 and doc["command"] == "audit-lora"
    # every module's numbers: the dense float64 update computed here
    sd = load_file(str(d / "adapter_model.safetensors"))
    for rec in doc["modules"]:
        a = f64(sd[f"{PREFIX}{rec['module']}.lora_A.weight"])
        b = f64(sd[f"{PREFIX}{rec['module']}.lora_B.weight"])
        delta = 2.0 * b @ a  # alpha 16 / r 8
        sv = np.linalg.svd(delta, compute_uv=False)[: rec["rank"]]
        assert rec["scaling"] == 2.0 and rec["rank"] == 8 and rec["shape"] == list(delta.shape)
        assert rec["delta_norm"] == pytest.approx(np.linalg.norm(delta), rel=1e-12)
        assert rec["top_share"] == pytest.approx(sv[0] ** 2 / np.sum(sv**2), rel=1e-10)
        p = sv / sv.sum()
        assert rec["effective_rank"] == pytest.approx(np.exp(-np.sum(p * np.log(p))), rel=1e-10)
        assert rec["numerical_rank"] == 8


def test_healthy_adapter_against_its_base(tmp_path, base_dir):
    d, _, _ = build(tmp_path, config={"base_model_name_or_path": str(base_dir)})
    doc = audit(d, base_dir, options=AuditOptions(block_bytes=4096))
    assert doc["findings"] == [], doc["findings"]
    base = load_dir(base_dir)
    sd = load_file(str(d / "adapter_model.safetensors"))
    for rec in doc["modules"]:
        w0 = f64(base[rec["module"] + ".weight"])
        delta = (
            2.0
            * f64(sd[f"{PREFIX}{rec['module']}.lora_B.weight"])
            @ f64(sd[f"{PREFIX}{rec['module']}.lora_A.weight"])
        )
        assert rec["base"]["relative_norm"] == pytest.approx(
            np.linalg.norm(delta) / np.linalg.norm(w0), rel=1e-9
        )
        s_ref, cos_ref, n_ref = dense_intruders(w0, w0 + delta, 10, 0.5)
        assert rec["intruders"]["count"] == n_ref
        np.testing.assert_allclose(rec["intruders"]["max_cos"], cos_ref, atol=1e-8)
        np.testing.assert_allclose(rec["intruders"]["sigma"], s_ref, rtol=1e-10)


# -- planted defects ----------------------------------------------------------------------------------
def test_zero_b_is_an_error(tmp_path):
    d, t, cfg = build(tmp_path)
    t[f"{PREFIX}{Q0}.lora_B.weight"].zero_()
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert codes(doc) == {"B_ALL_ZERO": [Q0]}
    assert doc["summary"]["failed"] and doc["summary"]["exit_code"] == 1
    f = doc["findings"][0]
    assert f["level"] == "error" and "never trained" in f["message"]


def test_every_b_zero_is_a_noop_adapter(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    for k in t:
        if ".lora_B." in k:
            t[k].zero_()
    write_adapter(d, t, cfg)
    c = codes(audit(d))
    assert set(c) == {"B_ALL_ZERO", "ADAPTER_NOOP"} and len(c["B_ALL_ZERO"]) == 2


def test_zero_a_is_an_error(tmp_path):
    d, t, cfg = build(tmp_path)
    t[f"{PREFIX}{V1}.lora_A.weight"].zero_()
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"A_ALL_ZERO": [V1]}


def test_nan_and_inf_are_errors(tmp_path):
    d, t, cfg = build(tmp_path)
    t[f"{PREFIX}{Q0}.lora_B.weight"][3, 1] = float("nan")
    t[f"{PREFIX}{Q0}.lora_B.weight"][4, 2] = float("nan")
    t[f"{PREFIX}{V1}.lora_A.weight"][0, 0] = float("inf")
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert codes(doc) == {"NONFINITE": [Q0, V1]}
    by_module = {f["module"]: f["details"] for f in doc["findings"]}
    assert (by_module[Q0]["nan"], by_module[Q0]["inf"]) == (2, 0)
    assert (by_module[V1]["nan"], by_module[V1]["inf"]) == (0, 1)
    assert doc["summary"]["failed"]


def test_inner_shape_mismatch(tmp_path):
    d, t, cfg = build(tmp_path)
    t[f"{PREFIX}{Q0}.lora_A.weight"] = t[f"{PREFIX}{Q0}.lora_A.weight"][:6]
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"AB_SHAPE_MISMATCH": [Q0]}


def test_rank_mismatch_with_config_and_rank_pattern(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj", "v_proj"))
    cfg["r"] = 16
    write_adapter(d, t, cfg)
    c = codes(audit(d))
    assert set(c) == {"RANK_MISMATCH"} and len(c["RANK_MISMATCH"]) == 4
    # a rank_pattern that gives q_proj its real rank leaves only the v_proj modules wrong
    cfg["rank_pattern"] = {"q_proj": 8}
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert codes(doc) == {
        "RANK_MISMATCH": ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
    }
    assert doc["findings"][0]["details"] == {"stored_rank": 8, "configured_rank": 16}


def test_pattern_matching_nothing_is_a_warning(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj", "v_proj"))
    cfg["rank_pattern"] = {"q_pro": 8, "nonexistent_proj": 4}
    cfg["alpha_pattern"] = {"layers.1.self_attn.v_proj": 32}
    write_adapter(d, t, cfg)
    doc = audit(d)
    # "q_pro" is not a dot-separated suffix of any module name (PEFT needs "(.*\.)?q_pro$")
    assert codes(doc) == {"PATTERN_UNMATCHED": [None, None]}
    pats = {f["details"]["pattern"] for f in doc["findings"]}
    assert pats == {"q_pro", "nonexistent_proj"}
    assert not doc["summary"]["failed"]  # warnings pass the default --fail-on error
    assert audit(d, fail_on="warn")["summary"]["failed"]
    # the alpha_pattern that does match changes that module's scaling: 32 / 8
    rec = {r["module"]: r for r in doc["modules"]}
    assert rec[V1]["scaling"] == 4.0 and rec["model.layers.0.self_attn.v_proj"]["scaling"] == 2.0


def test_missing_b_and_missing_a(tmp_path):
    d, t, cfg = build(tmp_path)
    del t[f"{PREFIX}{Q0}.lora_B.weight"]
    del t[f"{PREFIX}{V1}.lora_A.weight"]
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"A_MISSING": [V1], "B_MISSING": [Q0]}


def test_rslora_scaling_is_reported_and_used(tmp_path):
    d, _, cfg = build(tmp_path, r=16, alpha=8, config={"use_rslora": True}, targets=("q_proj",))
    doc = audit(d)
    assert codes(doc) == {"RSLORA_SCALING": [None]}
    f = doc["findings"][0]
    assert f["level"] == "info"
    assert f["details"]["scaling"] == pytest.approx(8 / 4) and f["details"]["standard_scaling"] == 0.5
    sd = load_file(str(d / "adapter_model.safetensors"))
    for rec in doc["modules"]:
        assert rec["scaling"] == pytest.approx(2.0)
        dense = (
            2.0
            * f64(sd[f"{PREFIX}{rec['module']}.lora_B.weight"])
            @ f64(sd[f"{PREFIX}{rec['module']}.lora_A.weight"])
        )
        assert rec["delta_norm"] == pytest.approx(np.linalg.norm(dense), rel=1e-12)
    assert not doc["summary"]["failed"]
    assert audit(d, fail_on="info")["summary"]["failed"]


def _add_dora(t: dict, length_fn=lambda out: out) -> None:
    for k in list(t):
        if k.endswith(".lora_B.weight"):
            out = t[k].shape[0]
            t[k.replace(".lora_B.weight", ".lora_magnitude_vector")] = torch.rand(length_fn(out)) + 0.5


def test_dora_magnitude_present_missing_unexpected_and_misshapen(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj", "v_proj"))
    cfg["use_dora"] = True
    write_adapter(d, t, cfg)
    c = codes(audit(d))
    assert set(c) == {"DORA_MAGNITUDE_MISSING"} and len(c["DORA_MAGNITUDE_MISSING"]) == 4
    _add_dora(t)
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert doc["findings"] == [] and all(r["dora"] for r in doc["modules"])
    cfg["use_dora"] = False
    write_adapter(d, t, cfg)
    c = codes(audit(d))
    assert set(c) == {"DORA_MAGNITUDE_UNEXPECTED"} and len(c["DORA_MAGNITUDE_UNEXPECTED"]) == 4
    cfg["use_dora"] = True
    t[f"{PREFIX}{Q0}.lora_magnitude_vector"] = torch.rand(63) + 0.5
    t[f"{PREFIX}{V1}.lora_magnitude_vector"][0] = -1.0
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"DORA_MAGNITUDE_SHAPE": [Q0], "DORA_MAGNITUDE_NONPOSITIVE": [V1]}


def _embedding_adapter(tmp_path, transposed: bool = False) -> Path:
    r, vocab, dim = 4, ARCH.vocab_size, ARCH.hidden_size
    g = torch.Generator().manual_seed(5)
    ea = torch.randn((r, vocab), generator=g, dtype=torch.float64) * 0.1
    eb = torch.randn((dim, r), generator=g, dtype=torch.float64) * 0.01
    if transposed:
        ea, eb = ea.T, eb.T
    t = {
        f"{PREFIX}model.embed_tokens.lora_embedding_A": ea.float(),
        f"{PREFIX}model.embed_tokens.lora_embedding_B": eb.float(),
    }
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 8,
        "target_modules": ["embed_tokens"],
        "base_model_name_or_path": "tiny-base",
    }
    return write_adapter(tmp_path / ("emb_t" if transposed else "emb"), t, cfg)


def test_embedding_orientation(tmp_path):
    good = audit(_embedding_adapter(tmp_path))
    assert good["findings"] == []
    rec = good["modules"][0]
    assert (rec["kind"], rec["shape"], rec["rank"]) == ("embedding", [ARCH.hidden_size, ARCH.vocab_size], 4)
    bad = audit(_embedding_adapter(tmp_path, transposed=True))
    assert codes(bad) == {"EMBEDDING_ORIENTATION": ["model.embed_tokens"]}
    # the spectrum is still measured, on the factors read the right way round
    assert bad["modules"][0]["delta_norm"] == pytest.approx(rec["delta_norm"], rel=1e-12)


def test_embedding_against_base_uses_vocab_by_dim_layout(tmp_path, base_dir):
    d = _embedding_adapter(tmp_path)
    doc = audit(d, base_dir, options=AuditOptions(block_bytes=2048))
    assert "BASE_SHAPE_MISMATCH" not in codes(doc)
    rec = doc["modules"][0]
    assert rec["base"]["transposed"] is True and rec["base"]["shape"] == [ARCH.vocab_size, ARCH.hidden_size]
    # PEFT's embedding update is (B·A)ᵀ * scaling on the vocab x dim weight; intruders are measured
    # on the out x in orientation (dim x vocab), i.e. left singular vectors of W_baseᵀ
    sd = load_file(str(d / "adapter_model.safetensors"))
    w0 = f64(load_dir(base_dir)["model.embed_tokens.weight"])
    delta = 2.0 * (
        f64(sd[f"{PREFIX}model.embed_tokens.lora_embedding_B"])
        @ f64(sd[f"{PREFIX}model.embed_tokens.lora_embedding_A"])
    )
    s_ref, cos_ref, n_ref = dense_intruders(w0.T, w0.T + delta, 10, 0.5)
    assert rec["intruders"]["count"] == n_ref
    np.testing.assert_allclose(rec["intruders"]["max_cos"], cos_ref, atol=1e-8)


def test_base_shape_mismatch(tmp_path):
    other = ArchConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)  # fmt: skip
    base, _ = make_pair(tmp_path / "other", other, ft_shards=1)
    d, _, _ = build(tmp_path, config={"base_model_name_or_path": str(base)})
    doc = audit(d, base)
    c = codes(doc)
    assert set(c) == {"BASE_SHAPE_MISMATCH"}
    assert len(c["BASE_SHAPE_MISMATCH"]) == 6  # gate/up/down of both layers
    assert doc["summary"]["failed"]


def test_declared_base_name_mismatch(tmp_path, base_dir):
    d, _, _ = build(tmp_path, config={"base_model_name_or_path": "meta-llama/Llama-3.1-8B"})
    doc = audit(d, base_dir, k=0)
    assert codes(doc) == {"BASE_NAME_MISMATCH": [None]}
    assert doc["findings"][0]["details"]["declared"] == "meta-llama/Llama-3.1-8B"
    assert not doc["summary"]["failed"] and audit(d, base_dir, k=0, fail_on="warn")["summary"]["failed"]
    # the same name under a local directory of that name is accepted
    d2, _, _ = build(tmp_path, "a2", config={"base_model_name_or_path": "someorg/" + base_dir.name})
    assert codes(audit(d2, base_dir, k=0)) == {}


def test_declared_revision(tmp_path, base_dir):
    d, _, _ = build(tmp_path, config={"base_model_name_or_path": str(base_dir), "revision": "abc123"})
    assert codes(audit(d, base_dir, k=0)) == {"BASE_REVISION_UNVERIFIED": [None]}
    assert codes(audit(d, base_dir, k=0, base_revision="main")) == {"BASE_REVISION_MISMATCH": [None]}
    assert codes(audit(d, base_dir, k=0, base_revision="abc123")) == {}


def test_module_missing_in_base_and_targeted_modules_without_weights(tmp_path, base_dir):
    d, t, cfg = build(tmp_path, targets=("q_proj",), config={"base_model_name_or_path": str(base_dir)})
    # a module the base does not have (layer 5), and layer 1's q_proj weights lost in the export
    t[f"{PREFIX}model.layers.5.self_attn.q_proj.lora_A.weight"] = t.pop(
        f"{PREFIX}model.layers.1.self_attn.q_proj.lora_A.weight"
    )
    t[f"{PREFIX}model.layers.5.self_attn.q_proj.lora_B.weight"] = t.pop(
        f"{PREFIX}model.layers.1.self_attn.q_proj.lora_B.weight"
    )
    write_adapter(d, t, cfg)
    doc = audit(d, base_dir, k=0)
    c = codes(doc)
    assert c == {"BASE_MODULE_MISSING": ["model.layers.5.self_attn.q_proj"], "MODULE_WEIGHTS_MISSING": [None]}
    f = next(f for f in doc["findings"] if f["code"] == "MODULE_WEIGHTS_MISSING")
    assert f["details"]["examples"] == ["model.layers.1.self_attn.q_proj"]


def test_fan_in_fan_out_disagreeing_with_base(tmp_path, base_dir):
    d, _, _ = build(
        tmp_path,
        targets=("k_proj",),
        config={"fan_in_fan_out": True, "base_model_name_or_path": str(base_dir)},
    )
    doc = audit(d, base_dir)
    c = codes(doc)
    assert set(c) == {"FAN_IN_FAN_OUT_MISMATCH"} and len(c["FAN_IN_FAN_OUT_MISMATCH"]) == 2
    # analysed in the base's own layout: same numbers as without the flag
    rec = doc["modules"][0]
    sd = load_file(str(d / "adapter_model.safetensors"))
    w0 = f64(load_dir(base_dir)[rec["module"] + ".weight"])
    delta = (
        2.0
        * f64(sd[f"{PREFIX}{rec['module']}.lora_B.weight"])
        @ f64(sd[f"{PREFIX}{rec['module']}.lora_A.weight"])
    )
    _, cos_ref, _ = dense_intruders(w0, w0 + delta, 10, 0.5)
    np.testing.assert_allclose(rec["intruders"]["max_cos"], cos_ref, atol=1e-8)


def test_targeting_key_names_and_config_keys(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj", "v_proj"))
    cfg["target_modules"] = ["q_proj", "k_proj"]  # v_proj weights untargeted, k_proj has none
    cfg["lora_aplha"] = 32
    cfg["my_training_note"] = "x"
    write_adapter(d, t, cfg)
    doc = audit(d)
    c = codes(doc)
    assert set(c) == {"MODULE_NOT_TARGETED", "TARGET_UNMATCHED", "CONFIG_KEY_TYPO", "CONFIG_UNKNOWN_KEY"}
    assert c["MODULE_NOT_TARGETED"] == ["model.layers.0.self_attn.v_proj", V1]
    typo = next(f for f in doc["findings"] if f["code"] == "CONFIG_KEY_TYPO")
    assert typo["details"] == {"key": "lora_aplha", "suggestion": "lora_alpha"}


def test_config_keys_of_a_newer_peft_are_never_typos_and_never_fail_warn(tmp_path, monkeypatch):
    """PEFT 0.22 wrote ``"astra_config": null`` into every adapter and the audit called it a typo
    of ``kasa_config``, failing ``--fail-on warn``; a release newer than both this dghard and the
    installed PEFT writes its new fields the same way."""
    from dghard_cli.lora import config_keys as K

    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg.update(astra_config=None, zeta_config=None, mica_config={"rank": 4}, use_dorb=False)
    write_adapter(d, t, cfg)
    monkeypatch.setattr(K, "installed_peft_fields", lambda: None)  # PEFT not installed
    doc = audit(d, fail_on="warn")
    assert codes(doc) == {"CONFIG_UNKNOWN_KEY": [None, None, None]}, doc["findings"]
    assert not doc["summary"]["failed"]
    assert sorted(f["details"]["key"] for f in doc["findings"]) == ["mica_config", "use_dorb", "zeta_config"]
    res = run_dghard("audit-lora", d, "--fail-on", "warn")
    assert res.returncode == 0, res.stderr

    # the installed PEFT knows them: no finding for its fields at their default, info for one set
    newer = K.InstalledPeft("9.0.0", K.KNOWN_KEYS | {"zeta_config", "mica_config", "use_dorb"})
    found = K.key_findings(cfg, newer)
    assert [(f.code, f.details["key"]) for f in found] == [("CONFIG_KEY_UNCHECKED", "mica_config")]
    assert found[0].level == "info" and "installed PEFT 9.0.0" in found[0].message


@pytest.mark.parametrize(
    ("key", "value", "want"),
    [
        ("lora_aplha", 32, "lora_alpha"),  # a transposition
        ("target_module", ["q_proj"], "target_modules"),
        ("layers_to_tranform", [0], "layers_to_transform"),
        ("use_rs_lora", True, "use_rslora"),  # words split differently: one edit
        ("lora_aplha", None, None),  # null: what PEFT writes for a field it does not use
        ("astra_config", {"rank": 1}, None),  # a method's name is not a typo of another's
        ("zeta_config", {"x": 1}, None),
        ("my_training_note", "x", None),
    ],
)
def test_a_typo_is_one_set_word_one_edit_or_two_from_a_known_key(key, value, want):
    from dghard_cli.lora import config_keys as K

    none = K.InstalledPeft("0.0", frozenset())
    found = [f for f in K.key_findings({key: value}, none) if f.code == "CONFIG_KEY_TYPO"]
    assert [f.details["suggestion"] for f in found] == ([want] if want else [])
    if want:
        assert found[0].level == "warn"


def test_edit_distance_against_a_plain_reference():
    from dghard_cli.lora.config_keys import edits

    def ref(a: str, b: str) -> int:  # optimal string alignment, straight from the recurrence
        d = {(i, j): 0 for i in range(-1, len(a) + 1) for j in range(-1, len(b) + 1)}
        for i in range(len(a) + 1):
            d[i, 0] = i
        for j in range(len(b) + 1):
            d[0, j] = j
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (a[i - 1] != b[j - 1]))
                if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                    d[i, j] = min(d[i, j], d[i - 2, j - 2] + 1)
        return d[len(a), len(b)]

    rng = np.random.default_rng(0)
    for _ in range(300):
        a = "".join(rng.choice(list("abc_"), rng.integers(0, 7)))
        b = "".join(rng.choice(list("abc_"), rng.integers(0, 7)))
        assert edits(a, b) == ref(a, b), (a, b)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "astra", "lora_ga"])
def test_adapters_whose_initialisation_modified_the_base_are_refused(base_dir, tmp_path, init):
    """PEFT saves these relative to the base its initialisation modified (Astra and LoRA-GA,
    of PEFT 0.22, were read as plain LoRA before)."""
    from dghard_cli.merging import MergeOptions, merge

    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["init_lora_weights"] = init
    write_adapter(d, t, cfg)
    with pytest.raises(
        InputError, match=f"init_lora_weights='{init}'.*path_initial_model_for_weight_conversion"
    ):
        merge(str(base_dir), [str(d)], str(tmp_path / "out"), MergeOptions("wise-ft", alpha=0.5))
    assert not (tmp_path / "out").exists()


def test_key_prefix_missing_and_adapter_name_left_in(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    write_adapter(d, {k[len(PREFIX) :]: v for k, v in t.items()}, cfg)
    doc = audit(d)
    assert codes(doc) == {"KEY_PREFIX_MISSING": [None]}
    assert doc["findings"][0]["details"]["count"] == 4
    write_adapter(d, {k.replace(".weight", ".default.weight"): v for k, v in t.items()}, cfg)
    assert codes(audit(d)) == {"KEY_ADAPTER_NAME": [None]}


def test_config_invalid_alpha_bias_flags(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["lora_alpha"] = "sixteen"
    cfg["lora_bias"] = True
    write_adapter(d, t, cfg)
    doc = audit(d)
    c = codes(doc)
    assert c["CONFIG_INVALID"] == [None] and len(c["LORA_BIAS_MISSING"]) == 2
    assert doc["modules"][0]["scaling"] is None  # unknown; norms use scaling 1
    cfg["lora_alpha"] = 16
    cfg["lora_bias"] = False
    t[f"{PREFIX}{Q0}.lora_B.bias"] = torch.zeros(64)
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"LORA_BIAS_UNEXPECTED": [Q0]}


def test_tiny_update_vs_peers_and_vs_base(tmp_path, base_dir):
    d, t, cfg = build(tmp_path, config={"base_model_name_or_path": str(base_dir)})
    t[f"{PREFIX}{Q0}.lora_B.weight"] *= 1e-5
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert codes(doc) == {"DELTA_TINY": [Q0]}
    assert doc["findings"][0]["details"]["basis"] == "peers"
    doc = audit(d, base_dir, k=0)
    assert codes(doc) == {"DELTA_TINY": [Q0]}
    f = doc["findings"][0]
    assert f["details"]["basis"] == "base" and f["details"]["relative_norm"] < 1e-6


def test_dead_rank_components_are_reported(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    t[f"{PREFIX}{Q0}.lora_B.weight"][:, 5:] = 0.0
    write_adapter(d, t, cfg)
    doc = audit(d)
    assert codes(doc) == {"RANK_DEFICIENT": [Q0]}
    rec = next(r for r in doc["modules"] if r["module"] == Q0)
    assert rec["numerical_rank"] == 5


def test_modules_to_save(tmp_path, base_dir):
    d, t, cfg = build(tmp_path, targets=("q_proj",), config={"base_model_name_or_path": str(base_dir)})
    cfg["modules_to_save"] = ["lm_head"]
    write_adapter(d, t, cfg)
    assert codes(audit(d)) == {"MODULES_TO_SAVE_MISSING": [None]}
    t[f"{PREFIX}lm_head.weight"] = torch.zeros((ARCH.vocab_size, ARCH.hidden_size))
    write_adapter(d, t, cfg)
    assert codes(audit(d, base_dir, k=0)) == {}
    t[f"{PREFIX}lm_head.weight"] = torch.zeros((ARCH.vocab_size + 8, ARCH.hidden_size))
    t[f"{PREFIX}model.norm.weight"] = torch.ones(ARCH.hidden_size)
    write_adapter(d, t, cfg)
    doc = audit(d, base_dir, k=0)
    assert codes(doc) == {"BASE_SHAPE_MISMATCH": ["lm_head"], "UNRECOGNIZED_TENSOR": [None]}
    assert (
        "vocabulary resized"
        in next(f for f in doc["findings"] if f["code"] == "BASE_SHAPE_MISMATCH")["message"]
    )


def test_conv_factors_are_flattened_like_peft(tmp_path):
    # Conv2d LoRA: A is r x in x kh x kw, B is out x r x 1 x 1; the update is B.flatten(1) @ A.flatten(1)
    g = torch.Generator().manual_seed(2)
    a = torch.randn((4, 3, 3, 3), generator=g)
    b = torch.randn((8, 4, 1, 1), generator=g)
    t = {f"{PREFIX}unet.conv_in.lora_A.weight": a, f"{PREFIX}unet.conv_in.lora_B.weight": b}
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["conv_in"],
        "base_model_name_or_path": "x",
    }
    doc = audit(write_adapter(tmp_path / "conv", t, cfg))
    assert doc["findings"] == []
    rec = doc["modules"][0]
    assert (rec["kind"], rec["shape"]) == ("conv", [8, 27])
    ref = np.linalg.svd(f64(b).reshape(8, 4) @ f64(a).reshape(4, 27), compute_uv=False)[:4]
    np.testing.assert_allclose(rec["singular_values"], ref, rtol=1e-8)


# -- unreadable input: exit 2 -------------------------------------------------------------------------
@pytest.mark.parametrize("r", [0, -3, 10**9, "8", 8.0, True])
def test_absurd_rank_is_refused(tmp_path, r):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["r"] = r
    write_adapter(d, t, cfg)
    with pytest.raises(InputError, match=r"is not a LoRA rank"):
        audit(d)


def test_absurd_rank_pattern_is_refused(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["rank_pattern"] = {"q_proj": 1 << 40}
    write_adapter(d, t, cfg)
    with pytest.raises(InputError, match=r"rank_pattern\['q_proj'\]"):
        audit(d)


def test_pickle_adapter_is_refused_unread(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not a pickle, and never unpickled")
    with pytest.raises(InputError) as e:
        audit(d)
    assert "adapter_model.bin" in str(e.value) and "weights_only=True" in str(e.value)


def test_other_peft_types_and_missing_config_are_refused(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["peft_type"] = "IA3"
    write_adapter(d, t, cfg)
    with pytest.raises(InputError, match="IA3"):
        audit(d)
    (d / "adapter_config.json").unlink()
    with pytest.raises(InputError, match="no adapter_config.json"):
        audit(d)


def test_bad_options_are_refused(tmp_path):
    d, _, _ = build(tmp_path, targets=("q_proj",))
    for kw in ({"fail_on": "fatal"}, {"k": -1}, {"eps": 1.5}, {"device": "tpu"}):
        with pytest.raises(InputError):
            audit(d, **kw)


# -- PEFT's name semantics -----------------------------------------------------------------------------
def test_pattern_key_semantics():
    m = "model.layers.10.self_attn.q_proj"
    assert pattern_key({"q_proj": 1}, m) == "q_proj"
    assert pattern_key({"self_attn.q_proj": 1}, m) == "self_attn.q_proj"
    assert pattern_key({"layers.10.self_attn.q_proj": 1}, m) is not None
    assert pattern_key({"layers.1.self_attn.q_proj": 1}, m) is None  # suffix must start at a dot
    assert pattern_key({"q_pro": 1}, m) is None
    assert pattern_key({r"layers\.1\d\..*q_proj": 1}, m) is not None  # a regex
    assert pattern_key({"proj": 1, "q_proj": 2}, m) == "q_proj"  # "proj" alone is no dotted suffix
    assert pattern_key({".*proj": 1, "q_proj": 2}, m) == ".*proj"  # first match wins


def test_target_semantics():
    cfg = LoraConfig(target_modules=["q_proj", "mlp.down_proj"], layers_to_transform=[0])
    assert is_targeted(cfg, "model.layers.0.self_attn.q_proj")
    assert not is_targeted(cfg, "model.layers.1.self_attn.q_proj")
    assert is_targeted(cfg, "model.layers.0.mlp.down_proj")
    assert not is_targeted(cfg, "model.layers.0.self_attn.k_proj")
    assert layer_index("model.layers.17.mlp.up_proj", None) == 17
    assert layer_index("transformer.h.3.attn.c_attn", ["h"]) == 3
    rx = LoraConfig(target_modules=r".*\.(q|v)_proj")
    assert is_targeted(rx, "model.layers.3.self_attn.v_proj") and not is_targeted(
        rx, "model.layers.3.mlp.up_proj"
    )
    ex = LoraConfig(target_modules=["q_proj"], exclude_modules=["layers.1.self_attn.q_proj"])
    assert is_targeted(ex, "model.layers.0.self_attn.q_proj") and not is_targeted(
        ex, "model.layers.1.self_attn.q_proj"
    )
    al = LoraConfig(target_modules="all-linear")
    assert is_targeted(al, "model.layers.0.mlp.up_proj") and not is_targeted(al, "lm_head")
    assert is_targeted(LoraConfig(), "anything") is None


# -- numerics -------------------------------------------------------------------------------------------
def dense_intruders(w0: np.ndarray, w: np.ndarray, k: int, eps: float):
    """Reference: thin SVDs in float64; best |cos| of W's top-k left singular vectors with all of W0's."""
    u0, _, _ = np.linalg.svd(w0, full_matrices=False)
    u, s, _ = np.linalg.svd(w, full_matrices=False)
    k = min(k, u.shape[1])
    cos = np.abs(u[:, :k].T @ u0).max(axis=1)
    return s[:k], cos, int(np.sum(cos < eps))


@pytest.mark.parametrize("m,n,r", [(300, 200, 16), (64, 512, 8), (40, 40, 40), (7, 90, 12), (90, 5, 3)])
@pytest.mark.parametrize("scale", [2.0, -0.37])
def test_qr_spectrum_matches_dense_svd(m, n, r, scale):
    rng = np.random.default_rng(m * 1000 + n + r)
    b = rng.standard_normal((m, r)) * rng.uniform(0.1, 3, r)
    a = rng.standard_normal((r, n))
    spec = lowrank_spectrum(torch.from_numpy(b), torch.from_numpy(a), scale)
    ref = np.linalg.svd(scale * b @ a, compute_uv=False)[: min(m, n, r)]
    assert spec.singular_values.shape == ref.shape
    np.testing.assert_allclose(spec.singular_values, ref, rtol=1e-8, atol=0)
    assert spec.frobenius == pytest.approx(np.linalg.norm(scale * b @ a), rel=1e-10)


def test_qr_spectrum_of_bf16_factors_and_resolvable_rank():
    g = torch.Generator().manual_seed(3)
    b = (torch.randn((128, 8), generator=g) * 0.01).to(torch.bfloat16)
    a = (torch.randn((8, 96), generator=g) * 0.1).to(torch.bfloat16)
    b[:, 6:] = 0
    spec = lowrank_spectrum(b, a, 2.0)
    ref = np.linalg.svd(2.0 * f64(b) @ f64(a), compute_uv=False)[:8]
    np.testing.assert_allclose(spec.singular_values[:6], ref[:6], rtol=1e-8)
    st = spectrum_stats(spec, 2.0**-8)
    assert st["numerical_rank"] == 6
    assert st["effective_rank"] == pytest.approx(effective_rank(ref), rel=1e-8)
    assert effective_rank(np.ones(5)) == pytest.approx(5.0) and effective_rank(np.zeros(3)) == 0.0


@pytest.mark.parametrize("m,n", [(48, 80), (80, 48), (60, 60)])
@pytest.mark.parametrize("dora", [False, True])
def test_intruder_count_matches_dense_float64(m, n, dora):
    rng = np.random.default_rng(m * 7 + n + dora)
    # a base with a decaying spectrum, and a strong rank-6 update in random directions: some of its
    # directions become top singular vectors of W0 + ΔW unlike any base direction (intruders)
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    d = min(m, n)
    w0 = (u[:, :d] * np.geomspace(10, 0.1, d)) @ v[:, :d].T
    p = rng.standard_normal((m, 6)) * np.array([2.0, 1.6, 1.2, 0.8, 0.4, 0.2])
    q = rng.standard_normal((6, n)) / math.sqrt(n) * 4
    mag = rng.uniform(0.5, 2.0, m) if dora else None
    w = w0 + p @ q
    if dora:
        w = (mag / np.linalg.norm(w, axis=1))[:, None] * w
    s_ref, cos_ref, n_ref = dense_intruders(w0, w, 10, 0.5)
    assert 0 < n_ref < 10, "the planted update should make some, not all, top directions intruders"
    assert np.min(np.abs(cos_ref - 0.5)) > 1e-6
    for rows in (7, 1000):
        res = intruder_dimensions(
            dense_blocks(torch.from_numpy(w0), rows=rows, cols=rows),
            (m, n),
            torch.from_numpy(p),
            torch.from_numpy(q),
            k=10,
            epsilon=0.5,
            magnitude=torch.from_numpy(mag) if dora else None,
        )
        assert res.count == n_ref and res.pool == d
        assert res.intruders == [int(j) for j in np.flatnonzero(cos_ref < 0.5)]
        np.testing.assert_allclose(res.max_cos, cos_ref, atol=1e-9)
        np.testing.assert_allclose(res.sigma, s_ref, rtol=1e-10)
        assert res.base_norm == pytest.approx(np.linalg.norm(w0), rel=1e-12)
        assert res.delta_norm == pytest.approx(np.linalg.norm(w - w0), rel=1e-9)


def test_intruder_pool_is_all_base_vectors_not_just_the_top_k():
    # W0's 20th direction promoted to the top by the update: not an intruder (it is a base vector),
    # although it is unlike every one of the base's top-10 vectors
    rng = np.random.default_rng(11)
    u, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = np.geomspace(5, 0.5, 40)
    w0 = (u * s) @ v.T
    p = u[:, 19:20] * 20.0
    q = v[:, 19:20].T
    res = intruder_dimensions(
        dense_blocks(torch.from_numpy(w0)), (40, 40), torch.from_numpy(p), torch.from_numpy(q), k=10
    )
    assert res.max_cos[0] == pytest.approx(1.0, abs=1e-9) and 0 not in res.intruders
    top10 = np.abs(u[:, :10].T @ u[:, 19]).max()
    assert top10 < 1e-9  # against the base's top-10 alone it would have counted


@pytest.mark.parametrize("shape", [(50, 7), (7, 50), (6, 2, 3)])
@pytest.mark.parametrize("transposed", [False, True])
def test_base_blocks_stream_stored_rows_and_cover_the_matrix(tmp_path, shape, transposed):
    from dghard_cli.audit.base_checks import base_blocks
    from dghard_cli.io.checkpoint import Checkpoint

    w = torch.randn(shape, dtype=torch.float32)
    write_checkpoint(tmp_path / "ck", [("w", w)])
    ck = Checkpoint(tmp_path / "ck")
    ti = ck.tensors["w"]
    calls = []
    real_read = type(ti).read
    stored = w.reshape(shape[0], -1)
    want = stored.T if transposed else stored
    budget = 3 * stored.shape[1] * 8  # three float64 stored rows per block
    try:
        type(ti).read = lambda self, rows=None: calls.append(rows) or real_read(self, rows)
        for axis in (0, 1):
            calls.clear()
            blocks = list(base_blocks(ti, transposed, budget)(axis))
            got = torch.cat(blocks, dim=axis)
            assert torch.equal(got, want)
            if (axis == 0) != transposed:  # along the stored rows: streamed, never the whole tensor
                assert None not in calls and all(r1 - r0 <= 3 for r0, r1 in calls)
            else:
                assert calls == [None]
    finally:
        type(ti).read = real_read
        ck.close()


def test_findings_table_in_docs_matches_codes():
    page = (REPO / "docs" / "audit-lora.md").read_text()
    section = page.split("## Finding codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| (error|warn|info) \|", section, flags=re.M))
    assert rows == {code: level for code, (level, _) in CODES.items()}


# -- the command line -----------------------------------------------------------------------------------
def test_cli_exit_codes_and_json(tmp_path, base_dir):
    d, t, cfg = build(tmp_path, targets=("q_proj", "v_proj"))
    ok = run_dghard("audit-lora", d)
    assert ok.returncode == 0, ok.stderr
    assert "PASS" in ok.stdout and "4 modules" in ok.stdout

    js = run_dghard("audit-lora", d, "--base", base_dir, "--json", "--fail-on", "warn")
    assert js.returncode == 1, js.stderr  # the declared base is not base_dir: a warning
    doc = json.loads(js.stdout)  # stdout is exactly one JSON document
    assert doc["summary"]["exit_code"] == 1 and doc["findings"][0]["code"] == "BASE_NAME_MISMATCH"
    assert all(r["intruders"] is not None for r in doc["modules"])
    assert js.stderr == ""

    t[f"{PREFIX}{Q0}.lora_B.weight"].zero_()
    write_adapter(d, t, cfg)
    bad = run_dghard("audit-lora", d)
    assert bad.returncode == 1 and "B_ALL_ZERO" in bad.stdout and "FAIL" in bad.stdout
    quiet = run_dghard("audit-lora", d, "--quiet")
    assert quiet.returncode == 1 and quiet.stdout == ""


def test_cli_unreadable_input_exits_2(tmp_path):
    d, t, cfg = build(tmp_path, targets=("q_proj",))
    cfg["r"] = 10**7
    write_adapter(d, t, cfg)
    res = run_dghard("audit-lora", d)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "is not a LoRA rank" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"junk")
    res = run_dghard("audit-lora", d, "--json")
    assert res.returncode == 2 and res.stdout == "" and "weights_only=True" in res.stderr
    res = run_dghard("audit-lora", tmp_path / "nope")
    assert res.returncode == 2
