"""Adapter outputs are exact or loud, and `dghard verify` understands them.

Real PEFT and transformers on one tiny Llama: a DoRA adapter made with ``LoraConfig(use_dora=True)``
and ``get_peft_model``, scaled by WiSE-FT and ``--lines``, must load with
``PeftModel.from_pretrained`` as DoRA and give the logits of a float64 model with
W_base + λ·ΔW_dora (ΔW_dora from PEFT's ``merge_and_unload()``). TIES of two adapters at the
default rank must be refused (exit 2, nothing written) unless ``--rank``/``--allow-lossy`` asks
for the cut. Every adapter directory dghard writes verifies; a tampered one does not.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_dghard

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dghard_cli.engine.writer import RunOptions  # noqa: E402
from dghard_cli.errors import InputError  # noqa: E402
from dghard_cli.io.hub import open_checkpoint  # noqa: E402
from dghard_cli.lora.output import LoraOutputOptions  # noqa: E402
from dghard_cli.merging import MergeOptions, merge  # noqa: E402
from dghard_cli.repairing import RepairOptions, repair  # noqa: E402
from dghard_cli.schedule.spec import parse_lines  # noqa: E402
from dghard_cli.verification import verify_directory  # noqa: E402

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()
SIZES = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def load(path: Path):
    return LlamaForCausalLM.from_pretrained(str(path)).eval()


def make_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    model = get_peft_model(load(base), LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name or "modules_to_save" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES, vocab_size=64, tie_word_embeddings=False)).save_pretrained(
        str(root / "base")
    )
    base = root / "base"
    targets = ["q_proj", "v_proj", "down_proj"]
    return {
        "base": base,
        "dora": make_adapter(
            base, root / "dora", 1, r=4, lora_alpha=8, target_modules=targets, use_dora=True
        ),
        "a1": make_adapter(base, root / "a1", 2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        "a2": make_adapter(base, root / "a2", 3, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        "mts": make_adapter(
            base,
            root / "mts",
            4,
            r=2,
            lora_alpha=4,
            target_modules=["q_proj"],
            modules_to_save=["model.norm"],
        ),
    }


def quiet() -> RunOptions:
    return RunOptions(quiet=True, device="cpu")


def logits(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(x).logits.to(torch.float64).numpy()


def reference(base: Path, adapter: Path, lam) -> np.ndarray:
    """Logits of a float64 model with W_base + λ(name)·ΔW, ΔW from PEFT's merge_and_unload()."""
    merged = PeftModel.from_pretrained(load(base), str(adapter)).merge_and_unload().state_dict()
    base_sd = load(base).state_dict()
    model = load(base).to(torch.float64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in merged.items():
            if name in params:
                params[name].add_(lam(name) * (w.to(torch.float64) - base_sd[name].to(torch.float64)))
    return logits(model, TOKENS)


TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def peft_logits(base: Path, adapter: Path) -> np.ndarray:
    return logits(PeftModel.from_pretrained(load(base), str(adapter)).eval(), TOKENS)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# -- 1. DoRA in, DoRA out, exactly -------------------------------------------------------------------
def test_wise_ft_of_a_dora_adapter_is_an_exact_dora_adapter(tiny, tmp_path):
    """Before: written as plain LoRA (use_dora false) cut to rank r, logits off by ~0.2 of their
    scale, exit 0."""
    out = tmp_path / "half"
    doc = merge(
        str(tiny["base"]),
        [str(tiny["dora"])],
        str(out),
        MergeOptions(method="wise-ft", alpha=0.5, run=quiet()),
    )
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    a = doc["adapter"]
    assert a["route"] == "exact" and a["exact"] is True and a["energy_kept"] == 1.0 and a["dora"] is True
    ref = reference(tiny["base"], tiny["dora"], lambda n: 0.5)
    assert rel(peft_logits(tiny["base"], out), ref) < 1e-5


def test_lines_on_a_dora_adapter_is_an_exact_dora_adapter(tiny, tmp_path):
    out = tmp_path / "lines"
    doc = repair(
        str(tiny["base"]),
        str(tiny["dora"]),
        str(out),
        RepairOptions(spec=None, schedule=parse_lines("0.3,0.6"), run=quiet()),
    )
    assert doc["adapter"]["exact"] is True and doc["adapter"]["dora"] is True
    lam = {r["name"]: r["layer_strength"] for r in doc["tensors"] if "layer_strength" in r}
    ref = reference(tiny["base"], tiny["dora"], lambda n: lam.get(n, 1.0))
    assert rel(peft_logits(tiny["base"], out), ref) < 1e-5


def test_a_dora_and_a_lora_adapter_add_up_exactly_as_dora(tiny, tmp_path):
    out = tmp_path / "sum"
    merge(
        str(tiny["base"]),
        [str(tiny["dora"]), str(tiny["a1"])],
        str(out),
        MergeOptions(method="task-arithmetic", weights=[0.7, -0.4], run=quiet()),
    )
    d1 = PeftModel.from_pretrained(load(tiny["base"]), str(tiny["dora"])).merge_and_unload().state_dict()
    d2 = PeftModel.from_pretrained(load(tiny["base"]), str(tiny["a1"])).merge_and_unload().state_dict()
    base_sd = load(tiny["base"]).state_dict()
    model = load(tiny["base"]).to(torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            b = base_sd[n].to(torch.float64)
            p.add_(0.7 * (d1[n].to(torch.float64) - b) - 0.4 * (d2[n].to(torch.float64) - b))
    assert rel(peft_logits(tiny["base"], out), logits(model, TOKENS)) < 1e-5


# -- 2. a lossy adapter is refused unless asked for ----------------------------------------------------
def test_ties_of_adapters_at_the_default_rank_is_refused_with_the_loss_and_the_ways_out(tiny, tmp_path):
    """Before: written at rank r with exit 0, only an "energy lost" field saying ~40 % was gone."""
    out = tmp_path / "ties"
    args = ["merge", "--method", "ties", "--weights", "1,1", tiny["base"], tiny["a1"], tiny["a2"], "--out"]
    res = run_dghard(*args, out)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert (
        "% of the update's energy" in line
        and "--merge" in line
        and "--rank" in line
        and "--allow-lossy" in line
    )
    assert not out.exists() and not list(tmp_path.glob(".ties*"))
    res = run_dghard(*args, out, "--allow-lossy", "--json")
    assert res.returncode == 0, res.stderr
    a = json.loads(res.stdout)["adapter"]
    assert a["exact"] is False and a["cut_by"] == "--allow-lossy" and 0 < a["energy_kept"] < 1
    assert a["lossy_modules"] == 4 and a["exact_rank"] > 2
    # --rank R asks for the cut; --rank at the exact rank keeps everything
    doc = merge(
        str(tiny["base"]),
        [str(tiny["a1"]), str(tiny["a2"])],
        str(tmp_path / "r2"),
        MergeOptions(method="ties", weights=[1.0, 1.0], run=quiet(), lora=LoraOutputOptions(rank=2)),
    )
    assert doc["adapter"]["exact"] is False and doc["adapter"]["cut_by"] == "--rank 2"
    doc = merge(
        str(tiny["base"]),
        [str(tiny["a1"]), str(tiny["a2"])],
        str(tmp_path / "rx"),
        MergeOptions(
            method="ties", weights=[1.0, 1.0], run=quiet(), lora=LoraOutputOptions(rank=a["exact_rank"])
        ),
    )
    assert doc["adapter"]["exact"] is True and doc["adapter"]["energy_kept"] == pytest.approx(1.0, abs=1e-9)


def test_allow_lossy_with_a_full_checkpoint_is_refused(tiny, tmp_path):
    with pytest.raises(InputError, match="--allow-lossy"):
        merge(
            str(tiny["base"]),
            [str(tiny["a1"])],
            str(tmp_path / "o"),
            MergeOptions(
                method="wise-ft", alpha=0.5, run=quiet(), lora=LoraOutputOptions(merge=True, allow_lossy=True)
            ),
        )


# -- 3. verify understands adapter directories -----------------------------------------------------------
@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("written")
    base = str(tiny["base"])
    merge(
        base, [str(tiny["a1"])], str(root / "exact"), MergeOptions(method="wise-ft", alpha=0.5, run=quiet())
    )
    merge(
        base, [str(tiny["dora"])], str(root / "dora"), MergeOptions(method="wise-ft", alpha=0.5, run=quiet())
    )
    merge(base, [str(tiny["mts"])], str(root / "mts"), MergeOptions(method="wise-ft", alpha=0.5, run=quiet()))
    merge(
        base,
        [str(tiny["a1"]), str(tiny["a2"])],
        str(root / "factored"),
        MergeOptions(method="ties", weights=[1.0, 1.0], run=quiet(), lora=LoraOutputOptions(rank=3)),
    )
    return {k: root / k for k in ("exact", "dora", "mts", "factored")}


def test_every_adapter_dghard_writes_verifies(tiny, written, tmp_path):
    """Before: exit 1 on each ("unreadable report ('dtype')", "tensor 'lm_head.weight' is missing")."""
    base = open_checkpoint(str(tiny["base"]), label="BASE")
    try:
        for name, d in written.items():
            doc = verify_directory(d, deep=True, base=base)
            assert doc["ok"] and doc["kind"] == "peft-lora", name
            assert "file sizes and sha256" in doc["checks"] and any("BASE" in c for c in doc["checks"])
    finally:
        base.close()
    full = tmp_path / "full-ft-adapter"  # the factored route of a full fine-tune (DG-Hard, kept rank)
    repo = Path(__file__).resolve().parent.parent / "examples" / "tiny"
    repair(
        str(repo / "base"),
        str(repo / "ft"),
        str(full),
        RepairOptions(run=quiet(), lora=LoraOutputOptions(format="peft")),
    )
    res = run_dghard("verify", full, "--base", repo / "base")
    assert res.returncode == 0, res.stderr
    assert "PEFT adapter" in res.stdout


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_tampered_adapter_fails_verify_naming_what_is_wrong(tiny, written, tmp_path):
    d = _copy(written["dora"], tmp_path / "byte")
    f = d / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    res = run_dghard("verify", d)
    assert res.returncode == 1 and "sha256" in res.stderr and "adapter_model.safetensors" in res.stderr
    d = _copy(written["mts"], tmp_path / "missing")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(InputError, match="adapter_model.safetensors.*missing"):
        verify_directory(d, deep=True)
    d = _copy(written["exact"], tmp_path / "rank")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["r"] = cfg["lora_alpha"] = cfg["r"] + 1
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    res = run_dghard("verify", d, "--quick")
    assert res.returncode == 1 and "rank" in res.stderr and "q_proj" in res.stderr
    # another base: the shapes of the targeted modules do not match
    other = tmp_path / "other-base"
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**{**SIZES, "hidden_size": 64}, vocab_size=64)).save_pretrained(str(other))
    res = run_dghard("verify", written["exact"], "--base", other)
    assert res.returncode == 1 and "base weight" in res.stderr
