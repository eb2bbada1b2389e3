"""A public multi-task merge benchmark that anyone can rebuild on two CPU cores.

Scenario (``build``): the forgetting benchmark's base (``scripts/forgetting_bench.py``: a
1.29 M-parameter Qwen2 with a 46-token character vocabulary, pretrained from scratch for 2000
steps on ``reverse``, ``sort``, ``double`` and ``lookup``; its model, tokenizer, sampler and
training loop are imported from that script, not copied), then T = 4 **experts**, each fully
fine-tuned from that base on a *different* new skill that the base never saw (not even its
tag), until it masters it:

- ``caesar`` (``C``): shift 3-7 lowercase letters by 3, ``C:abcz>defc``;
- ``atbash`` (``1``): mirror the alphabet (a↔z, b↔y, ...), ``1:abcz>zyxa``;
- ``rotate`` (``2``): move the first letter to the end, ``2:abcd>bcda``;
- ``swap`` (``3``): swap neighbouring letters, ``3:abcde>badce``.

The new tags are characters of the base's vocabulary (``C`` and digits), so the experts keep
the base's architecture and tokenizer and the base is exactly the forgetting benchmark's: the
same seed gives the same bytes, and ``build --base-from FBENCH/base`` copies it instead of
pretraining again (12-20 min of the build). Each expert: 300 AdamW steps of 64 examples of its
skill only, every parameter trained (lr 3e-4, warm-up then cosine), on one thread (the
checkpoints are then the same bit for bit on every run with the same ``--seed``; set
``FBENCH_THREADS=2`` for two). ``build`` fails loudly (exit 1) when an expert does not master
its skill (held-out exact match below 90 points). ``WORKDIR/base`` and ``WORKDIR/expert-SKILL``
are ordinary Hugging Face checkpoints.

``eval MODEL OUT.json`` scores a checkpoint on fixed held-out sets (200 prompts per skill, never
trained on, the same for every seed; the old skills' sets are the forgetting benchmark's):
exact-match accuracy of the greedy answer in points, decided by one teacher-forced pass, with
its binomial standard error, as ``{"skill": {"score": s, "stderr": se}}`` for the four old and
the four new skills, the plain JSON that ``dghard score`` and ``dghard sweep`` read.

Scores of a merge, as in the model-merging literature:

- per-task accuracy of the merged model on each new skill;
- **normalised accuracy**: merged accuracy on task i / expert i's own accuracy on task i,
  averaged over the T tasks (in %), with its standard error: each task's binomial stderr
  propagated through the ratio (the expert's own stderr included) and the mean;
- **old skills kept**: mean accuracy of the merge on the base's four skills, against the base's.

``table WORKDIR`` writes each candidate with the real ``dghard`` CLI, evaluates it, deletes it
and prints one markdown table: each expert alone, every ``dghard merge`` method of all T experts
(defaults, plus a small grid of its strength axis where cheap: the best of the grid by
normalised accuracy is reported and says so), each also with ``--lines A,B`` on a small grid,
the spectral methods ``tsv``, ``iso-c``, ``iso-cts`` when this dghard's ``merge`` has them, and
``dghard sweep BASE EXPERT_1 --merge-ft EXPERT_2..T --dtype bf16`` with its default candidates
at each ``--budgets`` value (the sweep scores each new task against its own expert and the old
skills against the experts, its HM, not normalised accuracy; its winner is then scored here like
every other row). Below the table: the best row's lead over task arithmetic and TIES (each at its
best setting) with the *paired* stderr of the difference (both merges answer the same prompts:
:func:`paired_difference`).

Commands (from the repository root, with ``PYTHONPATH=$PWD`` or dghard installed)::

    python scripts/merge_bench.py build /tmp/mbench --seed 0     # ~27 min on 2 shared cores
    python scripts/merge_bench.py build /tmp/mbench --seed 0 --base-from /tmp/fbench/base
    python scripts/merge_bench.py eval /tmp/mbench/expert-caesar /tmp/caesar.json
    python scripts/merge_bench.py table /tmp/mbench --budgets 16,32
    python scripts/merge_bench.py table /tmp/mbench --families tsv,iso-c,iso-cts --budgets ''
    python scripts/merge_bench.py build /tmp/kbench --scenario facts --base-from /tmp/mbench/base
    python scripts/merge_bench.py eval --scenario facts /tmp/kbench/expert-facts1 /tmp/f1.json
    python scripts/merge_bench.py table /tmp/kbench --budgets 16,32

``build --scenario facts`` builds a second scenario, on which merges keep part of every expert
(docs/benchmarks.md, "Knowledge merge benchmark"): knowledge instead of skills. A fact is a
closed-book lookup in the base's ``lookup`` format with no key-digit pairs, ``K:|xyz>47`` (a random
3-letter key, a random 2-digit value); ``fact_sets()`` draws 200 facts for the base's own pool
(``facts0``) and 200 for each of the tasks ``facts1`` ... ``facts4``, all keys distinct, the same for
every seed. BASE is the plain base continued for 600 steps (lr 1e-3) on the old skills and
``facts0`` (half of each batch), so it already answers closed-book lookups and an expert only adds
facts; each expert trains 400 steps at lr 1e-3, every parameter, on batches that are half its own
facts, a quarter the old skills and a quarter ``facts0`` (replay: the expert learns to leave
the other keys alone). A fact task is scored on its own 200 facts (knowledge is scored on what
was taught); ``eval --scenario facts`` and ``table`` (which reads ``WORKDIR/scenario.json``) use
these tasks. ``build --base-from`` copies the plain base and continues it.

``build --base-sees-tags`` continues BASE's pretraining for 400 steps on the old skills and the new
tags' *format* (their prompts answered by copying the letters: no new skill), so the experts start
from a base that already reads the new tags.

Measured (docs/benchmarks.md, "Multi-task merge benchmark"): on both bases no merge keeps more
than 2.5 points of any new skill; the build took 27 min on a shared 2-core machine, the table 23.

``build --tiny`` builds a miniature scenario in seconds (for tests; it learns little), and
``table --quick`` runs only a few rows (for tests).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _import_forgetting_bench() -> Any:
    name = "forgetting_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


fb = _import_forgetting_bench()

OLD_SKILLS: tuple[str, ...] = fb.SKILLS
TASKS: tuple[str, ...] = ("caesar", "atbash", "rotate", "swap")
TAGS: dict[str, str] = {"caesar": "C", "atbash": "1", "rotate": "2", "swap": "3"}
LETTERS = fb.LETTERS
DIGITS = "0123456789"
EVAL_SEED = 20260101  # new skills' held-out sets (the old skills' are forgetting_bench's)
EVAL_N = fb.EVAL_N
MASTERY = 90.0  # points an expert must reach on its own skill


@dataclass(frozen=True)
class ExpertScale:
    """Fine-tuning schedule of every expert."""

    steps: int
    lr: float
    batch: int


FULL_EXPERT = ExpertScale(steps=300, lr=3e-4, batch=64)
TINY_EXPERT = ExpertScale(steps=10, lr=1e-3, batch=32)
# --base-sees-tags: continued pretraining on the old skills and the new tags' format (answer = the input)
FULL_TAGS = ExpertScale(steps=400, lr=1e-3, batch=64)
TINY_TAGS = ExpertScale(steps=5, lr=1e-3, batch=32)
FORMAT = "-format"  # a sampler skill "TASK-format": TASK's prompt, answered by copying its letters

# --scenario facts: closed-book lookups ``K:|xyz>47`` (no key-digit pairs before ``|``); each fact
# task is its own EVAL_N facts, the base's pool (FACT_POOL) another EVAL_N, all keys distinct
FACT_TASKS: tuple[str, ...] = ("facts1", "facts2", "facts3", "facts4")
FACT_POOL = "facts0"
FACT_SEED = 20260301
FACT_KEY_LEN, FACT_VALUE_LEN = 3, 2
FULL_FACT_EXPERT = ExpertScale(steps=400, lr=1e-3, batch=64)
TINY_FACT_EXPERT = ExpertScale(steps=10, lr=1e-3, batch=32)
# its base: BASE's pretraining continued on the old skills and FACT_POOL (half of each batch)
FULL_FACT_BASE = ExpertScale(steps=600, lr=1e-3, batch=64)
TINY_FACT_BASE = ExpertScale(steps=5, lr=1e-3, batch=32)


@dataclass(frozen=True)
class Scenario:
    """What ``build`` trains the experts on, and what ``eval`` and ``table`` score."""

    name: str
    tasks: tuple[str, ...]
    expert: ExpertScale
    tiny_expert: ExpertScale
    facts_base: bool  # BASE continued on the old skills and FACT_POOL first
    replay: bool  # an expert's batches: half its task, a quarter the old skills, a quarter FACT_POOL

    def expert_skills(self, task: str) -> list[str]:
        """The Sampler's skills (drawn uniformly) of ``task``'s expert."""
        if not self.replay:
            return [task]
        n = len(OLD_SKILLS)
        return [*[task] * (2 * n), *OLD_SKILLS, *[FACT_POOL] * n]


SCENARIOS: dict[str, Scenario] = {
    "skills": Scenario("skills", TASKS, FULL_EXPERT, TINY_EXPERT, facts_base=False, replay=False),
    "facts": Scenario("facts", FACT_TASKS, FULL_FACT_EXPERT, TINY_FACT_EXPERT, facts_base=True, replay=True),
}


# ---------------------------------------------------------------- data


@functools.cache
def fact_sets() -> dict[str, tuple[tuple[str, str], ...]]:
    """EVAL_N facts ``K:|KEY>VALUE`` for FACT_POOL and each fact task: random 3-letter keys, all
    distinct, each with a random 2-digit value (the same for every seed)."""
    rng = random.Random(FACT_SEED)
    names = (FACT_POOL, *FACT_TASKS)
    keys: dict[str, None] = {}
    while len(keys) < EVAL_N * len(names):
        keys["".join(rng.choice(LETTERS) for _ in range(FACT_KEY_LEN))] = None
    ordered = list(keys)
    return {
        name: tuple(
            (f"K:|{k}>", "".join(rng.choice(DIGITS) for _ in range(FACT_VALUE_LEN)))
            for k in ordered[i * EVAL_N : (i + 1) * EVAL_N]
        )
        for i, name in enumerate(names)
    }


def make_example(skill: str, rng: random.Random) -> tuple[str, str]:
    """One ``(prompt, answer)`` pair of a new skill (``caesar`` is forgetting_bench's), an old one,
    or one of a fact set's facts."""
    if skill in (FACT_POOL, *FACT_TASKS):
        return rng.choice(fact_sets()[skill])
    if skill.endswith(FORMAT):
        p, _ = make_example(skill[: -len(FORMAT)], rng)
        return p, p[2:-1]
    if skill in OLD_SKILLS or skill == "caesar":
        return fb.make_example(skill, rng)
    tag = TAGS[skill]
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7)))
    if skill == "atbash":
        return f"{tag}:{s}>", "".join(LETTERS[25 - LETTERS.index(c)] for c in s)
    if skill == "rotate":
        return f"{tag}:{s}>", s[1:] + s[0]
    if skill == "swap":
        pairs = [s[i : i + 2][::-1] for i in range(0, len(s), 2)]
        return f"{tag}:{s}>", "".join(pairs)
    raise ValueError(f"unknown skill {skill!r}")


def eval_sets(tasks: Sequence[str] = TASKS) -> dict[str, list[tuple[str, str]]]:
    """Fixed held-out prompts of the old skills and ``tasks``: the old skills' and caesar's from
    forgetting_bench, the other new skills' here; a fact task's set is its facts (knowledge is
    scored on what was taught)."""
    old = fb.eval_sets()
    out = {s: old[s] for s in (*OLD_SKILLS, "caesar")}
    out.update({t: list(fact_sets()[t]) for t in tasks if t in FACT_TASKS})
    for i, skill in enumerate(TASKS):
        if skill in out:
            continue
        rng = random.Random(EVAL_SEED + i)
        seen: dict[str, str] = {}
        while len(seen) < EVAL_N:
            p, a = make_example(skill, rng)
            seen.setdefault(p, a)
        out[skill] = list(seen.items())
    return {s: out[s] for s in (*OLD_SKILLS, *tasks)}


class Sampler:
    """Training stream of some skills that never repeats a held-out prompt (``fb.train`` reads it)."""

    def __init__(self, skills: Sequence[str], seed: int) -> None:
        self.skills = list(skills)
        self.rng = random.Random(seed)
        self.held = {p for s in eval_sets().values() for p, _ in s}  # the new skills' (no fact's)

    def batch(self, n: int) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while len(out) < n:
            p, a = make_example(self.rng.choice(self.skills), self.rng)
            if p not in self.held:
                out.append((p, a))
        return out


# ---------------------------------------------------------------- evaluation


def evaluate_model(
    model: Any,
    skills: Sequence[str] | None = None,
    tasks: Sequence[str] = TASKS,
    outcomes: dict[str, list[int]] | None = None,
) -> dict[str, dict[str, float]]:
    """Exact-match accuracy (points) and binomial stderr on the held-out sets of the old skills and
    ``tasks`` (or of ``skills`` only), one teacher-forced pass each; ``outcomes`` (when given)
    receives each prompt's 0/1, in the fixed order of the sets (for paired comparisons)."""
    import torch

    sets = eval_sets(tasks)
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for skill in skills or list(sets):
            examples = sets[skill]
            ids, mask, labels = fb.batch_tensors(examples)
            logits = model(input_ids=ids, attention_mask=mask).logits
            pred = logits[:, :-1].argmax(-1)
            gold = labels[:, 1:]
            ok = ((pred == gold) | (gold == -100)).all(dim=1).double()
            if outcomes is not None:
                outcomes[skill] = [int(x) for x in ok.tolist()]
            p = float(ok.mean())
            se = math.sqrt(max(p * (1 - p), 1.0 / len(examples)) / len(examples))
            out[skill] = {"score": round(100 * p, 4), "stderr": round(100 * se, 4)}
    return out


def normalised_accuracy(
    merged: dict[str, dict[str, float]], experts: dict[str, dict[str, float]]
) -> tuple[float, float]:
    """Mean over the tasks of merged/expert accuracy (in %) and its stderr.

    ``merged[t]`` is the merge's score on task t, ``experts[t]`` expert t's own score on t
    (points with binomial stderr). Each ratio r = m/e gets the delta-method stderr
    r·sqrt((se_m/m)² + (se_e/e)²) (se_m/e when m = 0), the tasks are independent, so the
    mean's stderr is sqrt(Σ se_r²)/T.
    """
    ratios: list[float] = []
    var = 0.0
    for t, e in experts.items():
        ev, ese = float(e["score"]), float(e["stderr"])
        if ev <= 0:
            raise ValueError(f"expert of {t!r} scores 0 on its own task: normalised accuracy is undefined")
        mv, mse = float(merged[t]["score"]), float(merged[t]["stderr"])
        r = mv / ev
        se_r = math.hypot(mse / ev, r * ese / ev)
        ratios.append(r)
        var += se_r**2
    n = len(ratios)
    return 100 * sum(ratios) / n, 100 * math.sqrt(var) / n


def paired_difference(
    a: dict[str, list[int]], b: dict[str, list[int]], experts: dict[str, dict[str, float]]
) -> tuple[float, float]:
    """Normalised accuracy of merge A minus that of merge B (points of %) and the stderr of that
    difference from the per-prompt outcomes: both merges answer the same prompts, so per task the
    difference of the means has stderr sd(a_i − b_i)/√n, which is smaller than the two
    stderrs combined when the merges get the same prompts right. Each task's difference is
    divided by the expert's own accuracy e_t (its uncertainty propagated: d_t·se_e/e_t), the
    tasks are independent, the mean's stderr is sqrt(Σ se_t²)/T."""
    diffs: list[float] = []
    var = 0.0
    for t, e in experts.items():
        ev, ese = float(e["score"]) / 100, float(e["stderr"]) / 100
        if ev <= 0:
            raise ValueError(f"expert of {t!r} scores 0 on its own task: normalised accuracy is undefined")
        x, y = a[t], b[t]
        n = len(x)
        d = [xi - yi for xi, yi in zip(x, y, strict=True)]
        mean = sum(d) / n
        sd2 = sum((di - mean) ** 2 for di in d) / (n - 1) if n > 1 else 0.0
        r = mean / ev
        diffs.append(r)
        var += sd2 / n / ev**2 + (r * ese / ev) ** 2
    k = len(diffs)
    return 100 * sum(diffs) / k, 100 * math.sqrt(var) / k


def mean_score(res: dict[str, dict[str, float]], skills: Sequence[str]) -> tuple[float, float]:
    """Mean of the skills' scores and its stderr (independent sets)."""
    m = sum(float(res[s]["score"]) for s in skills) / len(skills)
    se = math.sqrt(sum(float(res[s]["stderr"]) ** 2 for s in skills)) / len(skills)
    return m, se


def cmd_eval(args: argparse.Namespace) -> int:
    fb.set_threads()
    res = evaluate_model(fb.load_model(args.model), tasks=SCENARIOS[args.scenario].tasks)
    text = json.dumps(res, indent=1, sort_keys=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


# ---------------------------------------------------------------- build


def expert_dir(work: Path, task: str) -> Path:
    return work / f"expert-{task}"


def read_scenario(work: Path) -> Scenario:
    """The scenario ``build`` wrote WORKDIR for (``skills`` when it did not say: an older build)."""
    f = work / "scenario.json"
    return SCENARIOS[json.loads(f.read_text())["scenario"]] if f.is_file() else SCENARIOS["skills"]


def _base_stamp(tiny: bool, seed: int, sees_tags: bool, scenario: Scenario) -> dict[str, Any]:
    sc = fb.TINY if tiny else fb.FULL
    tags = (TINY_TAGS if tiny else FULL_TAGS).__dict__ if sees_tags else None
    out = {"scale": sc.__dict__, "seed": seed, "vocab": list(fb.VOCAB), "sees_tags": tags}
    if scenario.facts_base:
        out["facts_base"] = (TINY_FACT_BASE if tiny else FULL_FACT_BASE).__dict__
    return out


def _continue(model: Any, args: argparse.Namespace) -> None:
    """The continued pretraining ``--base-sees-tags`` and the scenario ask for (none by default)."""
    if args.base_sees_tags:
        _see_tags(model, args.tiny, args.seed)
    if SCENARIOS[args.scenario].facts_base:
        _know_facts(model, args.tiny, args.seed)


def _see_tags(model: Any, tiny: bool, seed: int) -> None:
    """Continued pretraining on the old skills and every new tag's format (its prompts, answered by
    copying the letters): the base then reads the new tags without knowing any new skill."""
    ts = TINY_TAGS if tiny else FULL_TAGS
    skills = [*OLD_SKILLS, *(t + FORMAT for t in TASKS)]
    fb.train(model, Sampler(skills, seed * 1000 + 77), ts.steps, ts.lr, ts.batch, "tags")


def _know_facts(model: Any, tiny: bool, seed: int) -> None:
    """Continued pretraining on the old skills and FACT_POOL's facts, half of each batch: the base
    then answers closed-book lookups (its own facts), and an expert only adds facts."""
    fs = TINY_FACT_BASE if tiny else FULL_FACT_BASE
    skills = [*OLD_SKILLS, *[FACT_POOL] * len(OLD_SKILLS)]
    fb.train(model, Sampler(skills, seed * 1000 + 55), fs.steps, fs.lr, fs.batch, "facts-base")


def _fmt(res: dict[str, dict[str, float]]) -> str:
    return "  ".join(f"{k} {v['score']:.1f}" for k, v in res.items())


def _base(args: argparse.Namespace, work: Path) -> Any:
    """BASE: reused when WORKDIR/base was built with the same seed and scale, copied from
    ``--base-from``, else pretrained exactly as forgetting_bench does."""
    sc = fb.TINY if args.tiny else fb.FULL
    base = work / "base"
    stamp = work / "base.stamp.json"
    scenario = SCENARIOS[args.scenario]
    want = _base_stamp(args.tiny, args.seed, args.base_sees_tags, scenario)
    if args.base_from:
        src = Path(args.base_from)
        cfg = json.loads((src / "config.json").read_text())
        got = (cfg.get("hidden_size"), cfg.get("num_hidden_layers"), cfg.get("vocab_size"))
        if got != (sc.hidden, sc.layers, len(fb.VOCAB)):
            raise SystemExit(
                f"{src}: hidden/layers/vocab {got}, expected {(sc.hidden, sc.layers, len(fb.VOCAB))}"
            )
        shutil.rmtree(base, ignore_errors=True)
        if args.base_sees_tags or scenario.facts_base:
            model = fb.load_model(src)
            _continue(model, args)
            fb.save_checkpoint(model, base)
        else:
            shutil.copytree(src, base)
        stamp.write_text(json.dumps({**want, "copied_from": str(src.resolve())}, indent=1) + "\n")
        print(f"base: copied from {src}", flush=True)
    elif (base / "model.safetensors").is_file() and stamp.is_file():
        old = json.loads(stamp.read_text())
        old.pop("copied_from", None)
        if old != want:
            raise SystemExit(f"{base}: built with other settings ({stamp}); use another WORKDIR")
        print(f"base: reusing {base}", flush=True)
    else:
        model = fb.new_model(sc, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"model: Qwen2 {sc.layers} layers, hidden {sc.hidden}, {n_params / 1e6:.2f} M parameters",
            flush=True,
        )
        t0 = time.time()
        fb.train(
            model, fb.Sampler(OLD_SKILLS, args.seed), sc.pretrain_steps, sc.pretrain_lr, sc.batch, "pretrain"
        )
        _continue(model, args)
        fb.save_checkpoint(model, base)
        stamp.write_text(json.dumps(want, indent=1) + "\n")
        print(f"base: pretrained in {time.time() - t0:.0f} s", flush=True)
        return model
    return fb.load_model(base)


def cmd_build(args: argparse.Namespace) -> int:
    fb.set_threads()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    scenario = SCENARIOS[args.scenario]
    tasks = scenario.tasks
    base_model = _base(args, work)
    (work / "scenario.json").write_text(json.dumps({"scenario": scenario.name}) + "\n")
    base_res = evaluate_model(base_model, tasks=tasks)
    (work / "base.json").write_text(json.dumps(base_res, indent=1, sort_keys=True) + "\n")
    print(f"base: {_fmt(base_res)}", flush=True)
    es = scenario.tiny_expert if args.tiny else scenario.expert
    failed: list[str] = []
    for i, task in enumerate(tasks):
        model = copy.deepcopy(base_model)
        t0 = time.time()

        def progress(step: int, model: Any = model, task: str = task) -> None:
            model.eval()
            print(
                f"[{task}]   own skill {evaluate_model(model, [task], tasks)[task]['score']:.1f}", flush=True
            )
            model.train()

        sampler = Sampler(scenario.expert_skills(task), args.seed * 1000 + 101 + i)
        fb.train(model, sampler, es.steps, es.lr, es.batch, task, progress)
        out = expert_dir(work, task)
        shutil.rmtree(out, ignore_errors=True)
        fb.save_checkpoint(model, out)
        res = evaluate_model(model, tasks=tasks)
        (work / f"expert-{task}.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        print(f"expert {task}: {_fmt(res)}  ({time.time() - t0:.0f} s)", flush=True)
        if res[task]["score"] < MASTERY and not args.tiny:
            failed.append(f"{task} {res[task]['score']:.1f}")
    print(f"wrote {work}/base and {len(tasks)} experts; total {time.time() - t_start:.0f} s")
    if failed:
        print(
            f"error: experts below {MASTERY} points on their own skill: {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0


# ---------------------------------------------------------------- table

TA_LAMBDAS = (0.2, 0.4, 0.6, 0.8, 1.0)
LINEAR_LAMBDAS = (0.4, 0.6, 1.0)  # the summing methods other than task arithmetic
DENSITIES = {"ties": (0.2, 0.1, 0.5), "dare-ties": (0.5, 0.2, 0.8), "della": (0.5, 0.3, 0.7)}
LINES_GRID = ((0.2, 0.3), (0.3, 0.6), (0.5, 0.5))
SPECTRAL = ("tsv", "iso-c", "iso-cts")
SPECTRAL_ALPHAS = (1.0, 0.3, 0.6, 1.4, 2.0)  # their scale α (default 1)
#: The merges of 2025-26 (STAR, CART, WUDI, and SVC after task arithmetic and Iso-C), each at its
#: paper's defaults (WUDI also at 50 steps), in this dghard's output dtype; the plain ones also
#: with --lines. Skipped where this dghard has no such method.
NEW_2026: tuple[tuple[str, str, list[str]], ...] = (
    ("star", "defaults (η 40)", ["--method", "star"]),
    ("cart", "defaults (ρ 0.12, λ 2)", ["--method", "cart"]),
    ("wudi", "300 steps (default)", ["--method", "wudi"]),
    ("wudi", "50 steps", ["--method", "wudi", "--steps", "50"]),
    ("task-arithmetic + svc", "λ 1.0, SVC α 0.1", ["--method", "task-arithmetic", "--calibrate", "svc"]),
    ("iso-c + svc", "α 1.0, SVC α 0.1, bf16", ["--method", "iso-c", "--calibrate", "svc", "--dtype", "bf16"]),
)
CALIB_PER_SKILL = 8


@dataclass
class Candidate:
    """One merge: its name, its family (a table row takes the family's best), its setting, its options."""

    name: str
    family: str
    setting: str
    argv: list[str]  # `dghard merge` options; BASE, the experts and --out are added


def merge_methods() -> set[str]:
    """The methods this dghard's ``merge --method`` accepts, read from its ``--help``."""
    env = {**os.environ, "COLUMNS": "4000", "NO_COLOR": "1", "TERM": "dumb"}
    exe = [shutil.which("dghard")] if shutil.which("dghard") else [sys.executable, "-m", "dghard_cli"]
    res = subprocess.run([*exe, "merge", "--help"], text=True, capture_output=True, env=env, check=True)
    m = re.search(r"One of:\s*(.*?)\.\s", res.stdout, re.S)
    if m is None:
        raise SystemExit("dghard merge --help: no 'One of: ...' list of methods")
    return {w.strip() for w in re.sub(r"\s+", " ", m.group(1)).split(",") if w.strip()}


def candidates(methods: set[str], calib: Path, quick: bool = False) -> list[Candidate]:
    """Every merge row's grid: defaults first, then the strength axis; each method also with --lines."""
    out: list[Candidate] = []

    def add(family: str, setting: str, argv: list[str]) -> None:
        name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{family} {setting}").strip("-")
        out.append(Candidate(name, family, setting, argv))

    if quick:
        add("task-arithmetic", "λ 1.0", ["--method", "task-arithmetic"])
        add("ties", "density 0.2", ["--method", "ties"])
        return out
    defaults: list[tuple[str, list[str]]] = []
    for lam in TA_LAMBDAS:
        add("task-arithmetic", f"λ {lam}", ["--method", "task-arithmetic", "--lambda", str(lam)])
    defaults.append(("task-arithmetic", ["--method", "task-arithmetic"]))
    for method in ("ties", "dare-ties", "della"):
        for d in DENSITIES[method]:
            add(method, f"density {d}", ["--method", method, "--density", str(d)])
        defaults.append((method, ["--method", method]))
    for method in ("dare-linear", "breadcrumbs", "dg-hard"):
        for lam in LINEAR_LAMBDAS:
            add(method, f"λ {lam}", ["--method", method, "--lambda", str(lam)])
        defaults.append((method, ["--method", method]))
    add("model-stock", "defaults", ["--method", "model-stock"])
    defaults.append(("model-stock", ["--method", "model-stock"]))
    recall = ["--method", "recall", "--calib", str(calib)]
    add("recall", "defaults, calibration: the skills' prompts", recall)
    defaults.append(("recall", recall))
    for method in SPECTRAL:
        if method in methods:
            # bf16 output: on these experts the float64 Gram route's error bound (~1e-7) exceeds
            # float32's resolution in some matrices, and dghard refuses a float32 output there
            for alpha in SPECTRAL_ALPHAS:
                add(
                    method, f"α {alpha}, bf16", ["--method", method, "--alpha", str(alpha), "--dtype", "bf16"]
                )
            defaults.append((method, ["--method", method, "--dtype", "bf16"]))
    for family, setting, argv in NEW_2026:
        if argv[1] in methods:
            add(family, setting, argv)
            if "+" not in family and family not in {f for f, _ in defaults}:
                defaults.append((family, argv))
    for family, argv in defaults:
        for a, b in LINES_GRID:
            add(f"{family} + --lines", f"A {a}, B {b}", [*argv, "--lines", f"{a},{b}"])
    return out


def write_calibration(path: Path, seed: int, tasks: Sequence[str] = TASKS) -> None:
    """RECALL's calibration pool: training-distribution examples of every skill (no held-out prompt;
    a fact task's examples are its facts)."""
    sampler = Sampler([*OLD_SKILLS, *tasks], seed + 7919)
    samples = [p + a for p, a in sampler.batch(CALIB_PER_SKILL * (len(OLD_SKILLS) + len(tasks)))]
    path.write_text("\n\n".join(samples) + "\n")


class Bench:
    """Writes each candidate with the dghard CLI under WORKDIR/bench, evaluates it, deletes it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.scenario = read_scenario(work)
        self.tasks = self.scenario.tasks
        self.base = work / "base"
        self.experts = [expert_dir(work, t) for t in self.tasks]
        self.root = work / "bench"
        self.results = self.root / "results"
        self.cand = self.root / "candidate"
        self.eval_seconds: list[float] = []
        self.outcomes: dict[str, dict[str, list[int]]] = {}  # name -> task -> each prompt's 0/1
        self.merge_seconds: list[float] = []
        self.script = str(Path(__file__).resolve())

    def eval_template(self) -> str:
        import shlex

        exe = f"{shlex.quote(sys.executable)} {shlex.quote(self.script)}"
        return f"{exe} eval --scenario {self.scenario.name} {{model}} {{output}}"

    def evaluate(self, model: Path, name: str) -> dict[str, dict[str, float]]:
        """In this process (the same function as ``eval``); the JSON is kept under results/."""
        t0 = time.time()
        outcomes: dict[str, list[int]] = {}
        res = evaluate_model(fb.load_model(model), tasks=self.tasks, outcomes=outcomes)
        self.outcomes[name] = outcomes
        (self.results / f"{name}.outcomes.json").write_text(json.dumps(outcomes) + "\n")
        (self.results / f"{name}.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        self.eval_seconds.append(time.time() - t0)
        return res

    def run_candidate(self, c: Candidate) -> dict[str, dict[str, float]] | str:
        """The candidate's scores, or dghard's one-line error when it refuses to write it."""
        shutil.rmtree(self.cand, ignore_errors=True)
        t0 = time.time()
        models = [str(self.base), *(str(e) for e in self.experts)]
        exe = [shutil.which("dghard")] if shutil.which("dghard") else [sys.executable, "-m", "dghard_cli"]
        argv = [*exe, "merge", *c.argv, *models, "--out", str(self.cand), "--quiet"]
        done = subprocess.run(argv, text=True, stderr=subprocess.PIPE)
        self.merge_seconds.append(time.time() - t0)
        if done.returncode != 0:
            shutil.rmtree(self.cand, ignore_errors=True)
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            return f"exit {done.returncode}: {lines[-1] if lines else 'no message'}"
        try:
            return self.evaluate(self.cand, c.name)
        finally:
            shutil.rmtree(self.cand, ignore_errors=True)

    def sweep(
        self, budget: int, ref_files: list[Path]
    ) -> tuple[dict[str, Any], dict[str, dict[str, float]] | None]:
        """``dghard sweep BASE EXPERT_1 --merge-ft EXPERT_2..T``; the winner (if any) evaluated here."""
        out = self.root / f"sweep-{budget}"
        shutil.rmtree(out, ignore_errors=True)
        argv = ["sweep", str(self.base), str(self.experts[0]), str(out)]
        for e in self.experts[1:]:
            argv += ["--merge-ft", str(e)]
        # the evaluation writes points, and an expert's score on another's task can be below one;
        # bf16 output, as the spectral rows (their float32 output is refused on these experts)
        argv += ["--eval", self.eval_template(), "--budget", str(budget), "--units", "points", "--json"]
        argv += ["--dtype", "bf16"]
        argv += ["--base-results", str(ref_files[0])]
        for f in ref_files[1:]:
            argv += ["--ft-results", str(f)]
        doc = json.loads(fb.dghard(argv, capture=True).stdout)
        (self.results / f"sweep-{budget}.report.json").write_text(json.dumps(doc, indent=1) + "\n")
        res = self.evaluate(out, f"sweep-{budget}") if doc.get("winner") else None
        shutil.rmtree(out, ignore_errors=True)
        return doc, res


def _cell(v: float | None, se: float | None = None) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" if se is None else f"{v:.1f} ± {se:.1f}"


def cmd_table(args: argparse.Namespace) -> int:
    fb.set_threads()
    t_start = time.time()
    work = Path(args.workdir).resolve()
    bench = Bench(work)
    tasks = bench.tasks
    for d in (bench.base, *bench.experts):
        if not (d / "config.json").is_file():
            raise SystemExit(f"{d}: no checkpoint; run `build {args.workdir}` first")
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    shutil.rmtree(bench.root, ignore_errors=True)
    bench.results.mkdir(parents=True)
    calib = bench.root / "calib.txt"
    write_calibration(calib, 0, tasks)
    methods = merge_methods()
    missing = [m for m in SPECTRAL if m not in methods]
    notes: list[str] = []
    if missing:
        notes.append(f"{', '.join(missing)}: skipped, this dghard's `merge --method` has no such method.")
        print(notes[-1], flush=True)
    res: dict[str, dict[str, dict[str, float]]] = {"BASE": bench.evaluate(bench.base, "BASE")}
    refused: dict[str, str] = {}
    for t, e in zip(tasks, bench.experts, strict=True):
        res[f"expert-{t}"] = bench.evaluate(e, f"expert-{t}")
    own = {t: res[f"expert-{t}"][t] for t in tasks}
    cands = candidates(methods, calib, quick=args.quick)
    if args.families:
        keep = {f.strip() for f in args.families.split(",") if f.strip()}
        known = {c.family.split(" + ")[0] for c in candidates(methods, calib)}
        if keep - known:
            raise SystemExit(
                f"--families: unknown {', '.join(sorted(keep - known))} (known: {', '.join(sorted(known))})"
            )
        cands = [c for c in cands if c.family.split(" + ")[0] in keep]
    for i, c in enumerate(cands, 1):
        t0 = time.time()
        r = bench.run_candidate(c)
        if isinstance(r, str):
            refused[c.name] = r
            print(f"[table] {i}/{len(cands)} {c.name}: refused, {r}", flush=True)
            continue
        res[c.name] = r
        print(f"[table] {i}/{len(cands)} {c.name}: {_fmt(r)} ({time.time() - t0:.1f} s)", flush=True)
    sweeps: list[tuple[int, dict[str, Any], float]] = []
    ref_files = [bench.results / "BASE.json", *(bench.results / f"expert-{t}.json" for t in tasks)]
    for n in budgets:
        t0 = time.time()
        doc, r = bench.sweep(n, ref_files)
        dt = time.time() - t0
        if r is not None:
            res[f"sweep-{n}"] = r
        sweeps.append((n, doc, dt))
        print(f"[table] sweep --budget {n}: {dt:.0f} s, {doc['budget']['run_now']} evaluations", flush=True)

    def norm(name: str) -> tuple[float | None, float | None]:
        if name not in res:
            return None, None
        try:
            return normalised_accuracy(res[name], own)
        except ValueError:
            return None, None

    def key(name: str) -> tuple[float, float]:
        """Normalised accuracy, then (equal to the tenth shown) the old skills kept."""
        v = norm(name)[0]
        if v is None:
            return (-math.inf, -math.inf)
        return (round(v, 1), mean_score(res[name], OLD_SKILLS)[0])

    base_old = mean_score(res["BASE"], OLD_SKILLS)
    print()
    print("experts on their own skill: " + "  ".join(f"{t} {own[t]['score']:.1f}" for t in tasks))
    print(f"base on the old skills: {_fmt({s: res['BASE'][s] for s in OLD_SKILLS})} (mean {base_old[0]:.1f})")
    fams: dict[str, list[Candidate]] = {}
    for c in cands:
        fams.setdefault(c.family, []).append(c)
    for fam, cs in fams.items():
        if len(cs) > 1:
            grid = ", ".join(
                f"{c.setting}: {'refused' if c.name in refused else _cell(norm(c.name)[0])}" for c in cs
            )
            print(f"{fam}, normalised accuracy by setting: {grid}")
    print()
    head = " | ".join(tasks)
    print(f"| candidate | setting | normalised acc. % | {head} | old skills (base {base_old[0]:.1f}) |")
    print("|---|---|---:|" + "---:|" * len(tasks) + "---:|")

    def row(label: str, setting: str, name: str | None) -> None:
        if name is None:
            print(f"| {label} | {setting} | — |" + " — |" * len(tasks) + " — |")
            return
        r = res[name]
        na, se = norm(name)
        accs = " | ".join(f"{r[t]['score']:.1f}" for t in tasks)
        print(f"| {label} | {setting} | {_cell(na, se)} | {accs} | {_cell(*mean_score(r, OLD_SKILLS))} |")

    row("BASE", "", "BASE")
    for t in tasks:
        row(f"expert {t} alone", "", f"expert-{t}")
    for fam, cs in fams.items():
        ok = [c for c in cs if c.name in res]
        if not ok:
            row(fam, f"refused by dghard: {refused[cs[0].name]}", None)
            continue
        best = max(ok, key=lambda c: key(c.name))
        setting = f"best of {len(ok)}: {best.setting}" if len(ok) > 1 else best.setting
        if len(ok) < len(cs):
            setting += f" ({len(cs) - len(ok)} refused by dghard)"
        row(fam, setting, best.name)
    for n, doc, _dt in sweeps:
        win = doc.get("winner")
        if win:
            hm = win.get("hm")
            row(
                f"dghard sweep --budget {n}",
                f"winner: {win.get('name')} (sweep's HM {_cell(hm)})",
                f"sweep-{n}",
            )
        else:
            reason = doc.get("winner_reason") or doc.get("no_winner_reason") or "see sweep_report.json"
            row(f"dghard sweep --budget {n}", f"no winner: {reason}", None)
    best_of = {
        fam: max((c for c in cs if c.name in res), key=lambda c: key(c.name), default=None)
        for fam, cs in fams.items()
    }
    ranked = sorted((c for c in best_of.values() if c is not None), key=lambda c: key(c.name), reverse=True)
    leaders = ranked[:1] + [c for c in ranked[1:] if c.family in SPECTRAL]
    leaders += [Candidate(f"sweep-{n}", f"dghard sweep --budget {n}", "", []) for n, _d, _t in sweeps]
    peers = [best_of.get("task-arithmetic"), best_of.get("ties")]
    if ranked and any(peers):
        print()
        print("paired differences in normalised accuracy (same prompts; ± the stderr of the difference):")
        seen_pairs = set()
        for a in leaders:
            for b in peers:
                if (
                    b is None
                    or a.name == b.name
                    or (a.name, b.name) in seen_pairs
                    or a.name not in bench.outcomes
                ):
                    continue
                seen_pairs.add((a.name, b.name))
                try:
                    d, se = paired_difference(bench.outcomes[a.name], bench.outcomes[b.name], own)
                except ValueError as exc:
                    print(f"- {a.family} − {b.family}: {exc}")
                    continue
                print(
                    f"- {a.family} ({a.setting or 'winner'}) − {b.family} ({b.setting}): {d:+.1f} ± {se:.1f} "
                    f"({abs(d) / se if se > 0 else math.inf:.1f} stderr)"
                )
    for n, doc, _dt in sweeps:
        cs = doc.get("candidates", [])
        fam_names = sorted({str(c.get("family")) for c in cs})
        print()
        print(f"sweep --budget {n}: {len(cs)} candidates ({', '.join(fam_names)}), scored by the sweep")
        print(
            "(each new task's retention of its own expert's gain, the old skills' repair, their HM), not by normalised"
        )
        win = doc.get("winner")
        if win:
            print(f"accuracy; winner: {(win.get('reproduce') or {}).get('command')}")
        else:
            print(f"accuracy; no winner ({doc.get('no_winner_reason')})")
    for note in notes:
        print()
        print(note)
    total = time.time() - t_start
    ev, mg = bench.eval_seconds, bench.merge_seconds
    print()
    print(
        f"total wall time {total:.0f} s; {len(mg)} merges written ({sum(mg) / max(1, len(mg)):.1f} s each), "
        f"{len(ev)} evaluations here ({sum(ev) / max(1, len(ev)):.1f} s each); "
        + "; ".join(f"sweep --budget {n} {dt:.0f} s" for n, _d, dt in sweeps)
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="BASE (pretrained or reused) and one expert per new skill into WORKDIR")
    b.add_argument("workdir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--tiny", action="store_true", help="a miniature scenario in seconds (tests)")
    b.add_argument(
        "--base-from",
        metavar="DIR",
        help="copy this BASE (forgetting_bench build's WORKDIR/base) instead of pretraining",
    )
    b.add_argument(
        "--base-sees-tags",
        action="store_true",
        help="continue BASE's pretraining on the new tags' format (answer = the input's letters), "
        "not on any new skill",
    )
    b.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="skills",
        help="skills: four new skills (default); facts: four sets of new closed-book facts, from a base "
        "that answers its own (docstring)",
    )
    b.set_defaults(func=cmd_build)
    e = sub.add_parser(
        "eval",
        help="exact-match accuracy in points (0-100) of MODEL on every held-out set, as JSON",
        description="Writes OUTPUT as {skill: {score: points 0-100, stderr: points}}: exact-match accuracy "
        f"of the greedy answer on {EVAL_N} held-out prompts of each old skill ({', '.join(OLD_SKILLS)}) and "
        f"each new one ({', '.join(TASKS)}).",
    )
    e.add_argument("model")
    e.add_argument("output", nargs="?", help="JSON file to write (default: stdout)")
    e.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="skills",
        help=f"the new tasks scored: the skills' ({', '.join(TASKS)}, default) or the facts' "
        f"({', '.join(FACT_TASKS)})",
    )
    e.set_defaults(func=cmd_eval)
    t = sub.add_parser("table", help="write, evaluate and tabulate every dghard merge of WORKDIR's experts")
    t.add_argument("workdir")
    t.add_argument("--budgets", default="16,32", help="dghard sweep budgets, comma-separated (default 16,32)")
    t.add_argument("--quick", action="store_true", help="two merge rows only (tests)")
    t.add_argument(
        "--families",
        help="only these merge methods' rows (comma-separated, e.g. tsv,iso-c; their --lines rows included)",
    )
    t.set_defaults(func=cmd_table)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
