#!/usr/bin/env python3
"""Fuzz dghard's input handling: mutated checkpoints, indexes, configs, adapters and recipes.

Each case copies a small valid input, mutates it (random byte flips, truncations, header and
JSON edits, hostile values) and runs a library entry point on it. The only acceptable outcomes
are success or a ``DGHardError`` (the CLI's one-line exit-2/3 message); any other exception is
a bug, printed with the case's seed so it can be replayed with ``--seed S --cases 1``.

The ``filesystem`` target mutates the file system and the paths instead of bytes (see
:mod:`fuzz_fs`): symlinks to every kind of target, FIFOs, devices, directories where files
belong, shard names that collide with the tool's own outputs, outputs pointed at inputs, and
sizes at the edges. Each of its mutations says which outcome it must have (a symlink out of the
checkpoint must be refused, not followed), and every case is checked for hangs (a per-case
alarm), secrets in the output, modified inputs and leftovers beside OUT.

    python scripts/fuzz_inputs.py --cases 2000                       # a long pass, every target
    python scripts/fuzz_inputs.py --cases 3000 --targets filesystem  # the file-system families
    python scripts/fuzz_inputs.py --cases 200 --seed 7               # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dghard_cli.errors import DGHardError  # noqa: E402
from dghard_cli.testing.synthetic import ArchConfig, make_pair  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_fs  # noqa: E402

CFG = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, vocab_size=40)

HOSTILE_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    2**64 + 7,
    1e308,
    -0.0,
    "",
    "x" * 300,
    "../../etc/passwd",
    "/etc/passwd",
    [],
    {},
    [1, 2, 3],
    [-5, 3],
    [0, 2**62],
    {"a": 1},
    "F32",
    "BF16",
    "F7",
    [2**40, 2**40],
    "\x00",
    10**400,  # no float holds it
    -(10**400),
    float("nan"),
    float("inf"),
    3.3895313892515355e38,  # bfloat16's largest finite value
    3.4028234663852886e38,  # float32's
    ".nan",
    ".inf",
]

#: Extreme finite values planted in tensors (and their negatives).
EXTREME_FINITE = (3.3895313892515355e38, 3.4028234663852886e38, 65504.0, 1e-45)


def _flip_bytes(rng: random.Random, path: Path, region: str) -> None:
    data = bytearray(path.read_bytes())
    if len(data) < 9:
        return
    n = struct.unpack("<Q", data[:8])[0]
    lo, hi = {
        "prefix": (0, 8),
        "header": (8, min(len(data), 8 + n)),
        "data": (min(len(data), 8 + n), len(data)),
    }[region]
    if hi <= lo:
        return
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(lo, hi)
        data[i] = rng.randrange(256)
    path.write_bytes(bytes(data))


def _truncate(rng: random.Random, path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(0, max(1, len(data)))])


def _edit_header(rng: random.Random, path: Path) -> None:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    try:
        head = json.loads(data[8 : 8 + n])
    except ValueError:
        return
    body = data[8 + n :]
    names = [k for k in head if k != "__metadata__"]
    choice = rng.randrange(6)
    if choice == 0 and names:  # a field of a tensor entry
        name = rng.choice(names)
        head[name][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(HOSTILE_VALUES)
    elif choice == 1 and names:  # duplicate a tensor under another name
        name = rng.choice(names)
        head[name + ".dup"] = dict(head[name])
    elif choice == 2:
        head["__metadata__"] = rng.choice(HOSTILE_VALUES)
    elif choice == 3 and names:
        del head[rng.choice(names)]
    elif choice == 4:  # shift every offset
        k = rng.choice([-8, -1, 1, 4, 1 << 20])
        for name in names:
            if isinstance(head[name].get("data_offsets"), list):
                head[name]["data_offsets"] = [
                    o + k if isinstance(o, int) else o for o in head[name]["data_offsets"]
                ]
    else:  # lie about the header length
        raw = json.dumps(head).encode()
        path.write_bytes(struct.pack("<Q", rng.choice([0, 1, len(raw) + 1, 2**40, 2**64 - 1])) + raw + body)
        return
    raw = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _edit_json(rng: random.Random, path: Path) -> None:
    if not path.exists():
        return
    text = path.read_text()
    choice = rng.randrange(5)
    if choice == 0:
        path.write_text(text[: rng.randrange(0, max(1, len(text)))])
        return
    if choice == 1:
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        return
    try:
        doc = json.loads(text)
    except ValueError:
        return
    if choice == 2 and isinstance(doc, dict):
        key = rng.choice(list(doc) or ["x"])
        doc[key] = rng.choice(HOSTILE_VALUES)
    elif (
        choice == 3
        and isinstance(doc, dict)
        and isinstance(doc.get("weight_map"), dict)
        and doc["weight_map"]
    ):
        wm = doc["weight_map"]
        key = rng.choice(list(wm))
        wm[key] = rng.choice(
            ["../x.safetensors", "/etc/passwd", "", "nope.safetensors", 3, None, "a/b.safetensors"]
        )
    else:
        doc = rng.choice(HOSTILE_VALUES)
    path.write_text(json.dumps(doc))


def mutate_checkpoint(rng: random.Random, root: Path) -> str:
    ft = root / "ft"
    shards = sorted(ft.glob("*.safetensors"))
    target = rng.choice(shards)
    kind = rng.choice(
        [
            "flip-prefix",
            "flip-header",
            "flip-data",
            "truncate",
            "edit-header",
            "edit-header",
            "index",
            "config",
            "symlink",
            "empty-shard",
        ]
    )
    if kind.startswith("flip-"):
        _flip_bytes(rng, target, kind[5:])
    elif kind == "truncate":
        _truncate(rng, target)
    elif kind == "edit-header":
        _edit_header(rng, target)
    elif kind == "index":
        _edit_json(rng, ft / "model.safetensors.index.json")
    elif kind == "config":
        _edit_json(rng, ft / "config.json")
    elif kind == "symlink":
        outside = root / "outside.safetensors"
        shutil.move(target, outside)
        target.symlink_to(outside)
    else:
        target.write_bytes(b"")
    return kind


def run_repair(root: Path) -> None:
    from dghard_cli import repair

    repair(root / "base", root / "ft", root / "out")


# -- optional targets: adapters and recipes, when those commands are present --------------


def _adapter_target():
    try:
        from dghard_cli.audit.auditor import audit_lora as run
        from dghard_cli.testing.synthetic_lora import make_adapter
    except ImportError:
        return None

    def prepare(root: Path) -> None:
        make_adapter(root / "adapter", CFG, r=4)

    def mutate(rng: random.Random, root: Path) -> str:
        ad = root / "adapter"
        kind = rng.choice(["config", "flip-header", "truncate", "edit-header", "flip-data"])
        st = next(ad.glob("*.safetensors"))
        if kind == "config":
            _edit_json(rng, ad / "adapter_config.json")
        elif kind == "truncate":
            _truncate(rng, st)
        elif kind == "edit-header":
            _edit_header(rng, st)
        else:
            _flip_bytes(rng, st, kind[5:])
        return "adapter-" + kind

    def execute(root: Path) -> None:
        run(str(root / "adapter"))

    return prepare, mutate, execute


def _recipe_target():
    try:
        from dghard_cli.recipes.recipe import load_recipe as load
    except ImportError:
        return None

    def prepare(root: Path) -> None:
        (root / "recipe.yaml").write_text(
            "method: ties\nbase: base\nmodels:\n  - model: ft\n    weight: 1.0\n  - ft\n"
            "density: 0.3\nlambda: 1.0\nout: merged\n"
        )

    def mutate(rng: random.Random, root: Path) -> str:
        p = root / "recipe.yaml"
        text = p.read_text()
        kind = rng.choice(["truncate", "tag", "garbage", "value", "anchor"])
        if kind == "truncate":
            text = text[: rng.randrange(0, len(text))]
        elif kind == "tag":
            text += rng.choice(
                [
                    "evil: !!python/object/apply:os.system ['echo pwned']\n",
                    "x: !!python/name:os.system\n",
                    "y: !custom 3\n",
                ]
            )
        elif kind == "garbage":
            text = "".join(chr(rng.randrange(1, 255)) for _ in range(rng.randrange(1, 80)))
        elif kind == "value":
            key = rng.choice(
                ["method", "base", "models", "weight", "density", "out", "lambda", "seed", "recall"]
            )
            text += f"{key}: {json.dumps(rng.choice(HOSTILE_VALUES))}\n"
        else:
            text = "a: &a [*a, *a]\n" + text
        p.write_text(text)
        return "recipe-" + kind

    def execute(root: Path) -> None:
        load(root / "recipe.yaml")

    return prepare, mutate, execute


def _numbers_target():
    """Extreme numbers on every output route: extreme finite values in a tensor (bf16 and float32
    maxima, fp16's, the smallest subnormal), extreme strengths, extreme config numbers, and an
    adapter with such values or an extreme ``lora_alpha``, written as a full checkpoint and as an
    adapter. A run must succeed with finite output or fail with a clean error."""
    import torch
    from safetensors.torch import load_file, save_file

    from dghard_cli.testing.synthetic_lora import make_adapter

    def prepare(root: Path) -> None:
        make_adapter(root / "num-adapter", CFG, r=4)

    def mutate(rng: random.Random, root: Path) -> str:
        kind = rng.choice(["tensor", "strength", "config", "adapter-tensor", "adapter-alpha"])
        (root / "num-case.json").write_text(json.dumps({"kind": kind, "seed": rng.randrange(2**31)}))
        if kind in ("tensor", "adapter-tensor"):
            d = root / ("ft" if kind == "tensor" else "num-adapter")
            st = rng.choice(sorted(d.glob("*.safetensors")))
            tensors = load_file(str(st))
            name = rng.choice(sorted(tensors))
            t = tensors[name]
            if t.is_floating_point() and t.numel():
                flat = t.reshape(-1).clone()
                v = rng.choice(EXTREME_FINITE) * rng.choice((1, -1))
                flat[rng.randrange(flat.numel())] = v
                tensors[name] = flat.reshape(t.shape)
                save_file(tensors, str(st), metadata={"format": "pt"})
        elif kind == "config":
            p = root / "ft" / "config.json"
            doc = json.loads(p.read_text())
            key = rng.choice([k for k, v in doc.items() if isinstance(v, (int, float))] or ["x"])
            value = rng.choice([10**400, 10**12, -1, 3.4e38, 2**63])
            doc[key] = value
            p.write_text(json.dumps(doc))
        elif kind == "adapter-alpha":
            p = root / "num-adapter" / "adapter_config.json"
            doc = json.loads(p.read_text())
            doc["lora_alpha"] = rng.choice([1e300, 3.4e38, 1e38, 10**400])
            p.write_text(json.dumps(doc))
        return "numbers-" + kind

    def execute(root: Path) -> None:
        from dghard_cli import MergeOptions, merge, repair
        from dghard_cli.lora.output import LoraOutputOptions

        case = json.loads((root / "num-case.json").read_text())
        rng = random.Random(case["seed"])
        out = root / "num-out"
        ft = root / ("num-adapter" if case["kind"].startswith("adapter") else "ft")
        if case["kind"] == "strength" and ft.name == "ft" and rng.random() < 0.6:
            # strengths taken as a whole, in any position: huge weights, tiny lambdas, huge alphas
            # (--weights 1,1e300 was an internal error where 1e300,1 was refused)
            big = [1e308, 1e300, 3.5e38, 1e38, 1.0, 0.5, 1e-300, 0.0]
            method = rng.choice(["task-arithmetic", "ties", "dare-linear", "dg-hard", "tsv", "wudi", "iso-c"])
            if method in ("tsv", "wudi", "iso-c"):
                opts = MergeOptions(method=method, alpha=rng.choice(big[:5]))
            else:
                weights = [rng.choice(big) for _ in range(2)]
                kw = {"seed": 1} if method == "dare-linear" else {}
                opts = MergeOptions(method=method, weights=weights, lam=rng.choice([*big[:5], 1e-300]), **kw)
            merge(root / "base", [ft, ft], out, opts)
        elif case["kind"] == "strength" or rng.random() < 0.5:
            lam = rng.choice([1e308, 1e38, 1e30, 3.4e38, 1.0])
            fmt = rng.choice(["full", "peft"]) if ft.name == "num-adapter" else "full"
            opts = MergeOptions(method="task-arithmetic", lam=lam, lora=LoraOutputOptions(format=fmt))
            merge(root / "base", [ft], out, opts)
        else:
            repair(root / "base", ft, out)
        for st in out.rglob("*.safetensors"):
            for name, t in load_file(str(st)).items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise AssertionError(f"{st.name}: {name} holds NaN/Inf and the run exited 0")
        text = "".join(p.read_text() for p in out.rglob("*.json"))
        if "NaN" in text or "Infinity" in text:
            raise AssertionError("a JSON file in OUT holds NaN/Infinity")

    return prepare, mutate, execute


#: Hostile numbers and strings for the sweep's options and candidate file (as YAML text).
HOSTILE_YAML = [
    "-1", "0", "-0.0", "1.0e+308", "1" + "0" * 400, "9" * 5000, ".nan", ".inf", "-.inf", "2024-13-45",
    "~", "true", "''", "[]", "{}", "[1, [2]]", "!!python/name:os.system", "&a [*a]", "x" * 300,
]  # fmt: skip
HOSTILE_TEXT = [
    "", " ", ",", "-1", "1,01", "²", "9" * 5000, "0" * 5000 + "1", "GPU-", "MIG-x", "nan", "inf", "1e308",
    "cpu=1e400", "gpu=2.5", "mem=1e30T", "=", "a=b=c", "http://127.0.0.1:8265", "file:///etc", "ray://",
    "[::1", "host:99999999999999999999", "auto", "local", "-oDIR", "-apretrained=x", "--o x", "-C c.yaml",
    "--model_args dtype=x pretrained=y", "'unclosed", "notes.txt", "../../etc/passwd", "x{model}",
    """-a='{"pretrained":"decoy"}'""", """-sa'{"pretrained":"d"}'""", """-a '{"pre\\u0074rained":"d"}'""",
    """--model_args '{"dtype":"float32"}'""", "-a '{dtype: x}'", "-a dtype=x '{\"pretrained\":\"d\"}'",
    "{output}", "{model} {output} {device}", "\x00",
]  # fmt: skip


def _never_sets_pretrained(spec) -> None:
    """An accepted --lm-eval-args never makes lm-eval load another model than the candidate:
    no model argument it would read (key=value or a JSON object's keys) is ``pretrained``."""
    import argparse

    from dghard_cli.sweeping.lm_eval_options import mirror_parser, model_arg_keys, option_table

    table = option_table().table
    assert table is not None
    ns, _ = mirror_parser(table).parse_known_args(list(spec.args))
    keys = [k for vs in getattr(ns, "model_args", []) for k in model_arg_keys(vs)]
    keys += [kv.split("=", 1)[0].strip() for kv in spec.model_args.split(",") if spec.model_args]
    if "pretrained" in keys:
        raise AssertionError(f"--lm-eval-args {spec.args!r} / {spec.model_args!r} sets pretrained")
    assert isinstance(ns, argparse.Namespace)


def _candidates_target():
    """The sweep's candidate file: a valid one (families, a merges block with methods of their
    own) mutated by truncation, tags, garbage and hostile values in every key."""
    from dghard_cli.sweeping.candidate_file import load_candidates

    valid = (
        "families:\n  - family: hard\n    grid: [1.0, 2.0]\n    range: [0.5, 4.0]\n"
        "  - family: lines\n    grid: [[0.2, 0.6]]\n"
        "merges:\n  grid: [0.3, 0.6]\n  range: [0.1, 1.5]\n"
        "  methods:\n    tsv: {grid: [1.0, 1.4], range: [0.5, 3.0]}\n"
        "  density: [0.2, 0.5]\n  lines: [[0.5, 1.0]]\n  tolerance: 0.02\n"
    )
    keys = ["grid", "range", "density", "tolerance", "lines", "family", "methods", "exclude", "refine"]
    # a method both swept with a grid of its own and excluded (it was dropped without a word)
    both = "  exclude: [tsv]\n"

    def prepare(root: Path) -> None:
        (root / "cands.yaml").write_text(valid)

    def mutate(rng: random.Random, root: Path) -> str:
        p = root / "cands.yaml"
        text = p.read_text()
        kind = rng.choice(["truncate", "tag", "garbage", "value", "list-value", "anchor", "excluded"])
        if kind == "excluded":
            text += both
        elif kind == "truncate":
            text = text[: rng.randrange(0, len(text))]
        elif kind == "tag":
            text += "evil: !!python/object/apply:os.system ['echo pwned']\n"
        elif kind == "garbage":
            text = "".join(chr(rng.randrange(1, 255)) for _ in range(rng.randrange(1, 80)))
        elif kind in ("value", "list-value"):
            key = rng.choice(keys)
            v = rng.choice(HOSTILE_YAML)
            v = f"[{v}, 1.0]" if kind == "list-value" else v
            lines = text.splitlines()
            hits = [i for i, ln in enumerate(lines) if ln.strip().startswith(f"{key}:")]
            if hits:
                i = rng.choice(hits)
                indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
                lines[i] = f"{indent}{key}: {v}"
            else:
                lines.append(f"  {key}: {v}")
            text = "\n".join(lines) + "\n"
        else:
            text = "a: &a [*a, *a]\n" + text
        p.write_text(text)
        return "candidates-" + kind

    def execute(root: Path) -> None:
        text = (root / "cands.yaml").read_text()
        try:
            load_candidates(root / "cands.yaml")
        except DGHardError:
            raise
        if text.endswith(both) and "tsv: {grid" in text:
            raise AssertionError("a method under both methods: and exclude: was accepted")

    return prepare, mutate, execute


def _sweep_options_target():
    """The sweep's options: hostile values in a few of them at a time, up to the options' own
    validation (nothing is evaluated): --jobs, --devices, the executor and Ray address, the
    evaluation resources, the lm-eval tasks and arguments, the numbers, --dtype, --units."""
    from dghard_cli.sweeping.lm_eval import LmEvalSpec
    from dghard_cli.sweeping.run import SweepOptions
    from dghard_cli.sweeping.setup import validate
    from dghard_cli.sweeping.state import SweepState

    def prepare(root: Path) -> None:
        pass

    def mutate(rng: random.Random, root: Path) -> str:
        fields = ["jobs", "devices", "executor", "ray_address", "eval_resources", "budget", "eval_timeout",
                  "dtype", "units", "min_target_retention", "tie_tolerance", "margin", "fail_under",
                  "eval_template", "lm_eval_tasks", "lm_eval_args"]  # fmt: skip
        case: dict = {}
        for f in rng.sample(fields, rng.randint(1, 3)):
            if f in ("budget", "jobs"):
                case[f] = rng.choice([0, -1, 2**63, 10**400, True, 1.5, 3])
            elif f in ("eval_timeout", "min_target_retention", "tie_tolerance", "margin", "fail_under"):
                case[f] = rng.choice(["nan", "inf", "-inf", -1.0, 1e308, 0.0, 5.0])
            elif f == "devices":
                case[f] = [rng.choice(HOSTILE_TEXT) for _ in range(rng.randint(1, 2))]
            elif f == "executor":
                case[f] = rng.choice(["ray", "local", "", "Ray", "threads"])
            else:
                case[f] = rng.choice(HOSTILE_TEXT)
        if (
            case.get("ray_address") in ("auto", "local")
            or "ray_address" in case
            and case.get("executor") != "ray"
        ):
            case.pop("ray_address", None)  # never contacts or starts a cluster here
        (root / "sweep-case.json").write_text(json.dumps(case))
        return "sweep-options-" + "+".join(sorted(case))

    def execute(root: Path) -> None:
        case = json.loads((root / "sweep-case.json").read_text())
        for k in ("eval_timeout", "min_target_retention", "tie_tolerance", "margin", "fail_under"):
            if isinstance(case.get(k), str):
                case[k] = float(case[k])
        tasks, args = case.pop("lm_eval_tasks", None), case.pop("lm_eval_args", None)
        if tasks is not None or args is not None:
            spec = LmEvalSpec.parse(tasks if tasks is not None else "arc_easy", args)
            _never_sets_pretrained(spec)
        template = case.pop("eval_template", "python eval.py {model} {output}")
        if case.get("executor") == "ray" and "ray_address" not in case:
            case["executor"] = "local"  # a private Ray cluster takes seconds to start
        opts = SweepOptions(eval_template=template, **case)
        validate(SweepState.create(str(root / "base"), str(root / "ft"), root / "sweep-out", opts))

    return prepare, mutate, execute


TARGETS = ("checkpoint", "adapter", "recipe", "filesystem", "numbers", "candidates", "sweep-options")


def fuzz(cases: int, seed: int, *, verbose: bool = False, only: list[str] | None = None) -> dict:
    """Run ``cases`` mutated inputs; returns counts (``unexpected`` must be 0).

    ``only``: the targets to run (default: all of :data:`TARGETS`), taken in turn.
    """
    rng_master = random.Random(seed)
    targets: list[tuple[str, Callable, Callable, Callable]] = [
        ("checkpoint", lambda root: None, mutate_checkpoint, run_repair)
    ]
    for name, factory in (
        ("adapter", _adapter_target),
        ("recipe", _recipe_target),
        ("numbers", _numbers_target),
        ("candidates", _candidates_target),
        ("sweep-options", _sweep_options_target),
    ):
        t = factory()
        if t is not None:
            targets.append((name, *t))
    targets.append(("filesystem", fuzz_fs.prepare, fuzz_fs.mutate, fuzz_fs.execute))
    if only:
        unknown = [t for t in only if t not in TARGETS]
        if unknown:
            raise SystemExit(f"unknown target {unknown[0]!r}; targets: {', '.join(TARGETS)}")
        targets = [t for t in targets if t[0] in only]
    outcomes: Counter = Counter()
    families: dict[str, Counter] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dghard-fuzz-") as tmp:
        template = Path(tmp) / "template"
        make_pair(template, CFG, dtype="float32", base_shards=1, ft_shards=2, seed=0)
        for _, prepare, _, _ in targets:
            prepare(template)
        for i in range(cases):
            case_seed = rng_master.randrange(2**32)
            rng = random.Random(case_seed)
            name, _, mutate, execute = targets[i % len(targets)]
            root = Path(tmp) / f"case{i}"
            shutil.copytree(template, root, symlinks=True)
            kind = mutate(rng, root)
            outcome = "ok"
            try:
                with fuzz_fs.deadline(fuzz_fs.CASE_SECONDS):
                    execute(root)
            except DGHardError as exc:
                outcome = type(exc).__name__
                if "\n" in str(exc):
                    failures.append(f"case {i} seed {case_seed} ({kind}): multi-line message: {exc!r}")
            except Exception as exc:  # noqa: BLE001 - this is what we hunt for
                outcome = "unexpected"
                failures.append(f"case {i} seed {case_seed} ({kind}): {type(exc).__name__}: {exc}")
                if verbose:
                    traceback.print_exc()
            outcomes[f"{name}: {outcome}"] += 1
            if name == "filesystem":
                families.setdefault(kind.split(":")[0], Counter())[outcome] += 1
                problem = fuzz_fs.check(root, kind, outcome)
                if problem and outcome != "unexpected":
                    failures.append(f"case {i} seed {case_seed} ({kind}): {problem}")
            fuzz_fs.cleanup(root)
    return {
        "cases": cases,
        "targets": [t[0] for t in targets],
        "outcomes": dict(outcomes),
        "filesystem_families": {k: dict(v) for k, v in sorted(families.items())},
        "unexpected": len(failures),
        "failures": failures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--targets", default=None, help=f"comma-separated subset of {', '.join(TARGETS)}")
    args = ap.parse_args()
    t0 = time.time()
    only = [t.strip() for t in args.targets.split(",")] if args.targets else None
    res = fuzz(args.cases, args.seed, verbose=args.verbose, only=only)
    for line in res["failures"]:
        print("UNEXPECTED", line)
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}, indent=2))
    print(f"{res['cases']} cases in {time.time() - t0:.0f} s, {res['unexpected']} unexpected exceptions")
    sys.exit(1 if res["unexpected"] else 0)


if __name__ == "__main__":
    main()
