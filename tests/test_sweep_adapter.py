"""``dghard sweep BASE ADAPTER OUT`` on a PEFT LoRA adapter made by real PEFT on a tiny Llama.

Checked: every candidate is written in the format its printed command writes (a ``lines`` schedule
or a WiSE-FT strength as an exact adapter, a spectral cut at a known σ as the merged checkpoint with
``--merge``); the printed reproduction command, run in-process, writes the winner's weight files
byte for byte; every candidate's distance to FT is that of BASE + its ΔW to BASE + FT's ΔW
(float64 references), never 0 for a schedule that changes the update; and the evaluation command
is given full checkpoints only, as FT was evaluated.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import f64, load_dir
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from dghard_cli.cli import app  # noqa: E402
from dghard_cli.sweeping.run import SweepOptions, sweep  # noqa: E402

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()

LAYERS = 3
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=False,
)
P = "base_model.model."

#: Scores a model from its weights: "task" rises with the share p of FT's update it keeps, "general"
#: falls with its energy q; an adapter is scored from its factors, a checkpoint from W − W_base.
#: Each call appends what it was given to seen.txt.
EVAL = """
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file

root = Path(__file__).parent
model, output = Path(sys.argv[1]), sys.argv[2]
base = load_file(str(root / "base.safetensors"))
s = np.load(root / "signal.npz")
if (model / "adapter_config.json").exists():
    kind = "adapter"
    cfg = json.loads((model / "adapter_config.json").read_text())
    sd = load_file(str(model / "adapter_model.safetensors"))
    scale = cfg["lora_alpha"] / cfg["r"]
    def delta(name):
        mod = "base_model.model." + name[: -len(".weight")]
        return scale * (sd[mod + ".lora_B.weight"].astype(np.float64) @ sd[mod + ".lora_A.weight"].astype(np.float64))
else:
    kind = "checkpoint"
    m = load_file(str(model / "model.safetensors"))
    def delta(name):
        return m[name].astype(np.float64) - base[name].astype(np.float64)
with open(root / "seen.txt", "a") as f:
    f.write(kind + "\\n")
num = den = sq = 0.0
for name in s.files:
    d = delta(name)
    num += float(np.sum(d * s[name])); den += float(np.sum(s[name] ** 2)); sq += float(np.sum(d * d))
p, q = num / den, sq / den
Path(output).write_text(json.dumps({"task": 40 + 40 * p, "general": 70 - 30 * q, "chat": 50.0}))
"""

FAMILIES = [
    {"family": "lines", "grid": [[0.6, 0.0], [0.2, 0.6]], "refine": False},
    {"family": "wise-ft", "grid": [0.3], "refine": False},
    {"family": "hard", "grid": [1.0], "fixed": {"noise": "known", "sigma": 0.025}, "refine": False},
]


def lora_deltas(adapter: Path) -> dict[str, np.ndarray]:
    """ΔW = (α/r)·B·A per module (float64), from PEFT's saved file."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            module = key[len(P) : -len(".lora_A.weight")]
            out[f"{module}.weight"] = (
                cfg["lora_alpha"] / cfg["r"] * (f64(sd[f"{P}{module}.lora_B.weight"]) @ f64(sd[key]))
            )
    return out


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def sha256s(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-adapter")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(str(root / "base"))
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(root / "base")),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(root / "ad"))
    deltas = lora_deltas(root / "ad")
    np.savez(root / "signal.npz", **deltas)
    (root / "base.safetensors").write_bytes((root / "base" / "model.safetensors").read_bytes())
    (root / "eval.py").write_text(EVAL)
    opts = SweepOptions(
        eval_template=f"python {root / 'eval.py'} {{model}} {{output}}",
        targets=["task"],
        min_target_retention=50.0,
        budget=2 + 4,
        families=FAMILIES,
        device="cpu",
        plot=False,
    )
    doc = sweep(str(root / "base"), str(root / "ad"), str(root / "out"), opts)
    return root, doc, deltas


def reproduce(row: dict, out: Path | None = None) -> Path:
    """Run a candidate's printed ``dghard …`` command in-process (``out``: in place of the OUT it
    names); returns the directory it wrote."""
    argv = shlex.split(row["reproduce"]["command"])
    assert argv[0] == "dghard" and argv.count(row["reproduce"]["out"]) == 1
    if out is not None:
        argv[argv.index(row["reproduce"]["out"])] = str(out)
    r = CliRunner().invoke(app, argv[1:])
    assert r.exit_code == 0, r.output
    return Path(out or row["reproduce"]["out"])


def test_the_lines_winner_is_the_adapter_its_printed_command_writes(swept):
    root, doc, _ = swept
    win = doc["winner"]
    assert win is not None and win["family"] == "lines", [(r["name"], r["hm"]) for r in doc["candidates"]]
    assert "--merge" not in win["reproduce"]["argv"]
    out = root / "out"
    assert (out / "adapter_config.json").exists() and not (out / "config.json").exists()
    assert json.loads((out / "dghard_report.json").read_text())["argv"] == win["reproduce"]["argv"]
    copy = reproduce(win)
    assert (copy / "adapter_config.json").exists()
    want = sha256s(out)
    assert want and sha256s(copy) == want
    cfg = lambda d: json.loads((d / "adapter_config.json").read_text())  # noqa: E731
    assert cfg(copy) == cfg(out)


def test_each_family_is_written_as_its_command_writes_it(swept):
    root, doc, _ = swept
    merged = {r["name"]: "--merge" in r["reproduce"]["argv"] for r in doc["candidates"]}
    # what the sweep wrote: an adapter (r = 4 factors of two modules a layer) is a small fraction
    # of the full checkpoint a --merge command writes
    full = (root / "base" / "model.safetensors").stat().st_size
    written_full = {r["name"]: r["bytes"] > full for r in doc["candidates"]}
    assert written_full == merged, (written_full, full)
    assert merged == {
        "lines 0.6,0.0": False,
        "lines 0.2,0.6": False,
        "wise-ft alpha=0.3": False,
        "hard scale=1.0 (sigma=0.025)": True,
    }, merged


def test_every_candidates_distance_is_that_of_base_plus_its_update(swept):
    """‖W_c − W_ft‖ / ‖W_ft − W_base‖ over the tensors (float64): W_c = W_base + λ(ℓ)·ΔW for a schedule
    and α·ΔW for WiSE-FT, written as adapters; the known-σ cut, written merged, is measured on the
    checkpoint its printed command writes."""
    root, doc, deltas = swept
    rows = {r["name"]: r for r in doc["candidates"]}
    den = sum(float(np.sum(d * d)) for d in deltas.values())
    for name, (a, b) in {"lines 0.6,0.0": (0.6, 0.0), "lines 0.2,0.6": (0.2, 0.6)}.items():
        num = 0.0
        for t, d in deltas.items():
            lam = a + b * layer_of(t) / (LAYERS - 1)
            num += float(np.sum(((lam - 1.0) * d) ** 2))
        ref = float(np.sqrt(num / den))
        got = rows[name]["distance"]
        assert got > 0 and got == pytest.approx(ref, rel=1e-5, abs=0), (name, got, ref)
    assert rows["wise-ft alpha=0.3"]["distance"] == pytest.approx(0.7, rel=1e-5)
    row = next(r for r in doc["candidates"] if r["family"] == "hard")
    cut, w0 = load_dir(reproduce(row, root / "hard-reproduced")), load_dir(root / "base")
    num = den = 0.0
    for t, w in cut.items():
        ft = f64(w0[t]) + deltas.get(t, 0.0)
        num += float(np.sum((f64(w) - ft) ** 2))
        den += float(np.sum((ft - f64(w0[t])) ** 2))
    ref = float(np.sqrt(num / den))
    assert row["distance"] > 0.01 and row["distance"] == pytest.approx(ref, rel=1e-5), (row["distance"], ref)


def test_the_evaluation_is_given_full_checkpoints_only(swept):
    root, doc, _ = swept
    seen = (root / "seen.txt").read_text().split()
    assert len(seen) == 2 + len(doc["candidates"]) and set(seen) == {"checkpoint"}, seen


def test_a_dora_adapter_sweeps_as_dora_adapters(swept, tmp_path):
    """DoRA strengths stay DoRA: a lines candidate of a DoRA FT is a DoRA adapter, without --merge,
    at distance 1 − λ from FT (W = W_base + λ·ΔW_dora, λ uniform)."""
    root, _, _ = swept
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(root / "base")),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(tmp_path / "dora"))
    for f in ("eval.py", "base.safetensors", "signal.npz"):  # its own seen.txt
        (tmp_path / f).write_bytes((root / f).read_bytes())
    opts = SweepOptions(
        eval_template=f"python {tmp_path / 'eval.py'} {{model}} {{output}}",
        budget=3,
        families=[{"family": "lines", "grid": [[0.6, 0.0]], "refine": False}],
        device="cpu",
        plot=False,
    )
    doc = sweep(str(root / "base"), str(tmp_path / "dora"), str(tmp_path / "out"), opts)
    (row,) = doc["candidates"]
    assert row["status"] == "ok" and "--merge" not in row["reproduce"]["argv"]
    assert row["distance"] == pytest.approx(0.4, rel=1e-5)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["use_dora"] is True
    assert set((tmp_path / "seen.txt").read_text().split()) == {"checkpoint"}


def test_an_svc_follow_up_of_adapters_is_written_as_the_full_merge(swept):
    """``--calibrate svc`` re-weights the merged update's singular values: not linear in the
    adapters, and refused with an adapter output, so the sweep writes such a candidate with
    ``--merge`` (the full checkpoint), while the same task arithmetic without it stays an adapter."""
    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.lora.source import open_ft
    from dghard_cli.sweeping.candidates import FamilyEntry
    from dghard_cli.sweeping.families import make_candidate, writes_adapter

    root, _, _ = swept
    base = Checkpoint(root / "base", label="BASE")
    fts = [open_ft(str(root / "ad"), base=base, label=f"FT #{i}") for i in (1, 2)]
    try:
        entry = FamilyEntry(family="task-arithmetic", grid=[0.5], axis="lambda", fine_tunes="several")
        plain = make_candidate(entry, 0.5, n_fts=2)
        svc = make_candidate(FamilyEntry(**{**entry.__dict__, "fixed": {"calibrate": "svc"}}), 0.5, n_fts=2)
        assert dict(svc.params)["calibrate"] == "svc"
        assert writes_adapter(plain, fts) and not writes_adapter(svc, fts)
    finally:
        for ck in (base, *fts):
            ck.close()
