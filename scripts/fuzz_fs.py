"""File-system and path mutations for ``scripts/fuzz_inputs.py`` (the ``filesystem`` target).

Byte mutations inside regular files cannot find what a hostile download does with the file
system itself. Each case here copies a valid BASE/FT pair (and a LoRA adapter), applies one
mutation from a family, runs ``repair`` — or, for the adapter's mutations, ``audit_lora`` on it,
a WiSE-FT ``merge`` of BASE and the adapter written as an adapter, or the same merge written as
a full checkpoint (``--merge``, which also copies the adapter's tokenizer files) — and checks:

- the outcome is one the mutation allows (``expect``): a symlink out of the checkpoint, a
  FIFO, a device or a directory where a file belongs must be *refused* (InputError), not
  followed; a symlink that stays inside must still work;
- no hang: every case runs under an alarm (:data:`CASE_SECONDS`);
- no secret in the output: a canary sits in a file beside the checkpoint and in the
  environment (``/proc/self/environ``); no file of a successful OUT may contain it;
- inputs untouched, and nothing left beside OUT (staging, lock) after a refusal; a successful
  OUT passes ``verify``.

Families (the first word of a case's kind): ``symlink`` (to an outside file, /proc/self/environ,
/etc/shadow, /dev/zero, a directory, a FIFO, nothing, itself, a sibling checkpoint, a copy
inside), ``fifo``, ``device``, ``directory``, ``collide`` (a shard named like a file dghard
writes into OUT), ``outpath`` (OUT or ``--report`` on an input or on another output) and
``size`` (empty files, limits ±1, deep nesting, a 65 MB tokenizer, zero-size tensors, 1×N and
N×1 matrices, a declared 10^12-element tensor, a shape product that overflows, null metadata).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dghard_cli.errors import InputError

CANARY = "dghard-fuzz-secret-5d1e77"
CASE_SECONDS = 30
SIDE_FILES = {
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}),
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "generation_config.json": json.dumps({"do_sample": False}),
    "special_tokens_map.json": json.dumps({"eos_token": "</s>"}),
}
RESERVED = [
    "README.md",
    "dghard_report.json",
    "dghard_journal.jsonl",
    "dghard_journal.jsonl.tmp",
    "sweep_report.json",
    "sweep_frontier.png",
    "model.safetensors.index.json",
]
INDEX = "model.safetensors.index.json"
OK, ERR = frozenset({"ok"}), frozenset({"InputError"})

#: per case: what was done and what must happen (keyed by the case directory)
_PLAN: dict[str, dict] = {}


class Hang(Exception):
    """A case ran past its alarm."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after ``seconds``: a blocking open (a FIFO) or a runaway loop raises :class:`Hang`."""

    def on_alarm(signum, frame):  # noqa: ARG001
        raise Hang(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def prepare(template: Path) -> None:
    from dghard_cli.testing.synthetic import ArchConfig
    from dghard_cli.testing.synthetic_lora import make_adapter

    if not (template / "adapter").exists():
        make_adapter(
            template / "adapter",
            ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, vocab_size=40),
            r=4,
        )
    (template / "adapter" / "tokenizer.json").write_text(SIDE_FILES["tokenizer.json"])
    (template / "secret.txt").write_text(json.dumps({"token": CANARY}))
    os.environ["DGHARD_FUZZ_CANARY"] = CANARY  # what /proc/self/environ would leak


# -- helpers ---------------------------------------------------------------------------------------


def _slot(rng: random.Random, root: Path, adapter: bool) -> tuple[str, Path]:
    if adapter:
        slots = {"adapter-config": "adapter_config.json", "adapter-weights": "adapter_model.safetensors"}
        if _PLAN[str(root)]["target"] != "audit":  # only a run that writes OUT reads the tokenizer
            slots["adapter-side"] = "tokenizer.json"
        name = rng.choice(sorted(slots))
        return name, root / "adapter" / slots[name]
    ft = root / "ft"
    name = rng.choice(["shard", "index", "config", "side"])
    if name == "shard":
        return name, rng.choice(sorted(ft.glob("*.safetensors")))
    if name == "index":
        return name, ft / INDEX
    if name == "config":
        return name, ft / "config.json"
    side = rng.choice(sorted(SIDE_FILES))
    return f"side/{side}", ft / side


def _replace_with_link(path: Path, target: str | Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _header(p: Path) -> tuple[dict, bytes]:
    data = p.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_raw(p: Path, head: dict, body: bytes) -> None:
    hb = json.dumps(head).encode()
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + body)


def _add_tensors(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    shard = sorted(d.glob("*.safetensors"))[0]
    t = load_file(str(shard))
    t.update(tensors)
    save_file(t, str(shard), metadata={"format": "pt"})
    idx = d / INDEX
    if idx.exists():
        doc = json.loads(idx.read_text())
        doc["weight_map"].update({k: shard.name for k in tensors})
        idx.write_text(json.dumps(doc))


def _add_raw_entry(d: Path, name: str, entry: dict, extra_bytes: int) -> None:
    """A header entry whose data is ``extra_bytes`` of zeros (a sparse tail when large)."""
    shard = sorted(d.glob("*.safetensors"))[0]
    head, body = _header(shard)
    head[name] = dict(entry, data_offsets=[len(body), len(body) + extra_bytes])
    _write_raw(shard, head, body)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size + extra_bytes)
    idx = d / INDEX
    if idx.exists():
        doc = json.loads(idx.read_text())
        doc["weight_map"][name] = shard.name
        idx.write_text(json.dumps(doc))


def _sparse(path: Path, size: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def _deep(path: Path, depth: int) -> None:
    path.unlink(missing_ok=True)
    path.write_text("[" * depth + "]" * depth)


# -- families --------------------------------------------------------------------------------------


def _symlink(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    slot, path = _slot(rng, root, adapter)
    kinds: dict[str, Callable[[], tuple[str | Path, frozenset]]] = {
        "outside-secret": lambda: (root / "secret.txt", ERR),
        "proc-environ": lambda: ("/proc/self/environ", ERR),
        "etc-shadow": lambda: ("/etc/shadow" if os.path.exists("/etc/shadow") else "/etc/passwd", ERR),
        "dev-zero": lambda: ("/dev/zero", ERR),
        "dev-null": lambda: ("/dev/null", ERR),
        "dir-outside": lambda: (_mkdir(root / "somedir"), ERR),
        "dir-inside": lambda: (_mkdir(path.parent / "subdir"), ERR),
        "fifo-outside": lambda: (_mkfifo(root / "pipe"), ERR),
        "fifo-inside": lambda: (_mkfifo(path.parent / ".pipe"), ERR),
        "dangling": lambda: (root / "nothing-here", ERR),
        "loop": lambda: (path.name, ERR),
        "sibling-checkpoint": lambda: (os.path.relpath(root / "base" / "config.json", path.parent), ERR),
        "inside-copy-relative": lambda: (_copy_inside(path), OK),
        "inside-copy-absolute": lambda: ((path.parent / _copy_inside(path)).resolve(), OK),
        "inside-via-dotdot": lambda: (f"../{path.parent.name}/{_copy_inside(path)}", OK),
    }
    kind = rng.choice(sorted(kinds))
    target, expect = kinds[kind]()
    _replace_with_link(path, target)
    return f"symlink:{slot}:{kind}", expect


def _mkdir(p: Path) -> Path:
    p.mkdir(exist_ok=True)
    (p / "file.json").write_text("{}")
    return p


def _mkfifo(p: Path) -> Path:
    if not p.exists():
        os.mkfifo(p)
    return p


def _copy_inside(path: Path) -> str:
    copy = path.parent / f".copy-{path.name}"
    if not copy.exists():
        shutil.copy2(path, copy)
    return copy.name


def _fifo(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    slot, path = _slot(rng, root, adapter)
    path.unlink()
    os.mkfifo(path)
    return f"fifo:{slot}", ERR


def _device(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    slot, path = _slot(rng, root, adapter)
    which = rng.choice(["null", "zero", "urandom"])
    path.unlink()
    if os.geteuid() == 0:
        minor = {"null": 3, "zero": 5, "urandom": 9}[which]
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, minor))
    else:  # without root: the system's own device, through a link
        path.symlink_to(f"/dev/{which}")
    return f"device:{slot}:{which}", ERR


def _directory(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    slot, path = _slot(rng, root, adapter)
    path.unlink()
    path.mkdir()
    full = rng.random() < 0.5
    if full:
        (path / "model.safetensors").write_bytes(b"\0" * 16)
    return f"directory:{slot}:{'full' if full else 'empty'}", ERR


def _collide(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    ft = root / "ft"
    name = rng.choice(RESERVED)
    shard = rng.choice(sorted(ft.glob("*.safetensors")))
    doc = json.loads((ft / INDEX).read_text())
    shard.rename(ft / name)
    if name != INDEX:  # renaming onto the index replaces it: the index is then not JSON
        doc["weight_map"] = {k: (name if v == shard.name else v) for k, v in doc["weight_map"].items()}
        (ft / INDEX).write_text(json.dumps(doc))
    return f"collide:{name}", ERR


def _outpath(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    ft, base, out = root / "ft", root / "base", root / "out"
    shard = sorted(ft.glob("*.safetensors"))[0]
    plan = _PLAN[str(root)]
    if adapter:
        return _outpath_adapter(rng, root, plan)
    choices: dict[str, Callable[[], frozenset]] = {
        "report-on-ft-shard": lambda: _set(plan, report=shard) or ERR,
        "report-inside-ft": lambda: _set(plan, report=ft / "new.json") or ERR,
        "report-on-base-config": lambda: _set(plan, report=base / "config.json") or ERR,
        "report-on-model-card": lambda: _set(plan, report=out / "README.md") or ERR,
        "report-on-output-shard": lambda: _set(plan, report=out / shard.name) or ERR,
        "report-on-output-side-file": lambda: _set(plan, report=out / "tokenizer.json") or ERR,
        "report-on-out-itself": lambda: _set(plan, report=out) or ERR,
        "report-through-link-into-ft": lambda: (
            _set(plan, report=_link(root / "rlink", ft / "config.json")) or ERR
        ),
        "report-in-out": lambda: _set(plan, report=out / "report.json") or OK,
        "report-elsewhere": lambda: _set(plan, report=root / "elsewhere.json") or OK,
        "out-is-ft": lambda: _set(plan, out=ft) or ERR,
        "out-inside-ft": lambda: _set(plan, out=ft / "sub") or ERR,
        "out-contains-inputs": lambda: _set(plan, out=root) or ERR,
        "out-through-link-to-ft": lambda: _set(plan, out=_link(root / "olink", ft)) or ERR,
    }
    kind = rng.choice(sorted(choices))
    return f"outpath:{kind}", choices[kind]()


def _outpath_adapter(rng: random.Random, root: Path, plan: dict) -> tuple[str, frozenset]:
    """OUT and ``--report`` against an adapter FT and the files an adapter output holds."""
    ad, out = root / "adapter", root / "out"
    choices: dict[str, Callable[[], frozenset]] = {
        "report-on-adapter-config": lambda: _set(plan, report=ad / "adapter_config.json") or ERR,
        "report-on-adapter-weights": lambda: _set(plan, report=ad / "adapter_model.safetensors") or ERR,
        "report-inside-adapter": lambda: _set(plan, report=ad / "new.json") or ERR,
        "report-on-model-card": lambda: _set(plan, report=out / "README.md") or ERR,
        "report-on-output-tokenizer": lambda: _set(plan, report=out / "tokenizer.json") or ERR,
        "report-in-out": lambda: _set(plan, report=out / "sub" / "report.json") or OK,
        "report-elsewhere": lambda: _set(plan, report=root / "elsewhere.json") or OK,
        "out-is-adapter": lambda: _set(plan, out=ad) or ERR,
        "out-inside-adapter": lambda: _set(plan, out=ad / "sub") or ERR,
        "out-through-link-to-adapter": lambda: _set(plan, out=_link(root / "olink", ad)) or ERR,
    }
    if plan["target"] == "adapter-out":  # files only an adapter output holds
        choices["report-on-output-adapter-config"] = lambda: (
            _set(plan, report=out / "adapter_config.json") or ERR
        )
        choices["report-on-output-adapter-weights"] = lambda: (
            _set(plan, report=out / "adapter_model.safetensors") or ERR
        )
    kind = rng.choice(sorted(choices))
    return f"outpath:adapter:{kind}", choices[kind]()


def _set(plan: dict, **kw: object) -> None:
    plan.update(kw)


def _link(p: Path, target: Path) -> Path:
    p.symlink_to(target)
    return p


def _size(rng: random.Random, root: Path, adapter: bool) -> tuple[str, frozenset]:
    ft, base = root / "ft", root / "base"
    if adapter:
        what = rng.choice(["empty-config", "empty-weights", "deep-config", "config-over-limit"])
        ad = root / "adapter"
        if what == "empty-config":
            (ad / "adapter_config.json").write_text("")
        elif what == "empty-weights":
            (ad / "adapter_model.safetensors").write_bytes(b"")
        elif what == "deep-config":
            _deep(ad / "adapter_config.json", rng.choice([100, 5000, 200_000]))
        else:
            _sparse(ad / "adapter_config.json", 16 * 1024 * 1024 + 1)
        return f"size:adapter-{what}", ERR
    cases: dict[str, Callable[[], frozenset]] = {
        "empty-shard": lambda: _empty(rng.choice(sorted(ft.glob("*.safetensors")))) or ERR,
        "empty-index": lambda: _empty(ft / INDEX) or ERR,
        "empty-config": lambda: _empty(ft / "config.json") or ERR,
        "empty-side-file": lambda: _empty(ft / rng.choice(sorted(SIDE_FILES))) or OK,
        "config-over-limit": lambda: _sparse(ft / "config.json", 16 * 1024 * 1024 + 1) or ERR,
        "config-at-limit": lambda: _pad_json(ft / "config.json", 16 * 1024 * 1024) or OK,
        "index-over-limit": lambda: _sparse(ft / INDEX, 64 * 1024 * 1024 + 1) or ERR,
        "deep-config": lambda: _deep(ft / "config.json", rng.choice([100, 5000, 200_000])) or ERR,
        "deep-index": lambda: _deep(ft / INDEX, rng.choice([100, 5000, 200_000])) or ERR,
        "large-side-file": lambda: (
            _sparse(ft / "tokenizer.json", 65 * 1024 * 1024 + rng.randrange(4096)) or OK
        ),
        "zero-size-tensors": lambda: (
            _both(base, ft, {"z.rows": torch.zeros(0, 8), "z.vec": torch.zeros(0)}) or OK
        ),
        "one-row-and-one-column": lambda: _both(base, ft, _thin(rng)) or OK,
        "declared-10e12-elements": lambda: _huge(base, ft) or ERR,
        "shape-product-overflows": lambda: (
            _add_raw_entry(ft, "z.overflow", {"dtype": "F32", "shape": [2**40, 2**40, 0]}, 0) or ERR
        ),
        "metadata-null": lambda: _metadata_null(ft) or OK,
    }
    what = rng.choice(sorted(cases))
    return f"size:{what}", cases[what]()


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _pad_json(p: Path, size: int) -> None:
    text = p.read_text()
    p.write_text(text + " " * (size - len(text.encode())))


def _both(base: Path, ft: Path, tensors: dict[str, torch.Tensor]) -> None:
    _add_tensors(base, tensors)
    _add_tensors(ft, {k: v + 0.5 if v.numel() else v for k, v in tensors.items()})


def _thin(rng: random.Random) -> dict[str, torch.Tensor]:
    n = rng.randrange(1025, 5000)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return {
        "model.thin.row.weight": torch.randn((1, n), generator=g),
        "model.thin.col.weight": torch.randn((n, 1), generator=g),
    }


def _huge(base: Path, ft: Path) -> None:
    entry = {"dtype": "BF16", "shape": [10**6, 10**6]}
    for d in (base, ft):
        _add_raw_entry(d, "model.huge.weight", entry, 2 * 10**12)


def _metadata_null(ft: Path) -> None:
    shard = sorted(ft.glob("*.safetensors"))[0]
    head, body = _header(shard)
    head["__metadata__"] = None
    _write_raw(shard, head, body)


FAMILIES: dict[str, Callable[[random.Random, Path, bool], tuple[str, frozenset]]] = {
    "symlink": _symlink,
    "fifo": _fifo,
    "device": _device,
    "directory": _directory,
    "collide": _collide,
    "outpath": _outpath,
    "size": _size,
}


def mutate(rng: random.Random, root: Path) -> str:
    for name, text in SIDE_FILES.items():  # the fine-tune's tokenizer and friends, to be copied
        (root / "ft" / name).write_text(text)
    family = rng.choice(sorted(FAMILIES))
    adapter = family in ("symlink", "fifo", "device", "directory", "size", "outpath") and rng.random() < 0.3
    target = "repair"
    if adapter:  # the adapter read by the auditor, or as FT by a merge (an adapter out, or a full one)
        target = rng.choice(["adapter-out", "adapter-full"] + ([] if family == "outpath" else ["audit"]))
    plan = {"target": target, "out": root / "out", "report": None}
    _PLAN[str(root)] = plan
    kind, expect = FAMILIES[family](rng, root, adapter)
    plan["expect"] = expect
    plan["digest"] = {d: _digest(root / d) for d in ("base", "ft", "adapter")}
    return kind


def execute(root: Path) -> None:
    plan = _PLAN[str(root)]
    if plan["target"] == "audit":
        from dghard_cli.audit.auditor import audit_lora

        audit_lora(str(root / "adapter"))
        return
    if plan["target"] in ("adapter-out", "adapter-full"):
        from dghard_cli.engine.writer import RunOptions
        from dghard_cli.lora.output import LoraOutputOptions
        from dghard_cli.merging import MergeOptions, merge

        lora = LoraOutputOptions(merge=plan["target"] == "adapter-full")
        opts = MergeOptions("wise-ft", alpha=0.5, lora=lora, run=RunOptions(report_path=plan["report"]))
        merge(root / "base", [root / "adapter"], plan["out"], opts)
        return
    from dghard_cli import repair
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.repairing import RepairOptions

    opts = RepairOptions(run=RunOptions(report_path=plan["report"]))
    repair(root / "base", root / "ft", plan["out"], opts)


def _digest(d: Path) -> str:
    """Names, kinds and contents of a tree, reading regular files only (never a FIFO or device)."""
    h = hashlib.sha256()
    if not d.exists():
        return ""
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        h.update(f"{p.relative_to(d)}:{stat.S_IFMT(st.st_mode)}".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            if st.st_size > 16 * 1024 * 1024:  # sparse giants: size and time
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            else:
                h.update(p.read_bytes())
    return h.hexdigest()


def check(root: Path, kind: str, outcome: str) -> str | None:
    """Why this case's result is wrong (None: it is right)."""
    plan = _PLAN[str(root)]
    if outcome not in plan["expect"]:
        return f"outcome {outcome}, but this mutation must give {' or '.join(sorted(plan['expect']))}"
    for d in ("base", "ft", "adapter"):
        if _digest(root / d) != plan["digest"][d]:
            return f"input {d} was modified"
    if plan["target"] == "audit":
        return None
    out = Path(plan["out"])
    inputs = [root / "ft", root / "adapter", root]
    leftovers = sorted(p.name for p in out.parent.glob(f".{out.name}.dghard-*"))
    if leftovers:
        return f"left {leftovers[0]} beside OUT"
    if outcome != "ok":
        if out.exists() and out not in inputs and out.resolve() not in [p.resolve() for p in inputs]:
            return "OUT exists after a refusal"
        return None
    if plan["report"] is not None and not Path(plan["report"]).is_file():
        return "--report was not written"
    if plan["target"] != "adapter-out":  # an adapter output is checked by loading it below
        from dghard_cli.io.verify import verify_dir

        try:
            verify_dir(out, use_report=True)
        except InputError as exc:
            return f"OUT does not verify: {exc}"
    else:
        from dghard_cli.lora.adapter import open_adapter

        try:
            open_adapter(str(out)).weights.close()
        except InputError as exc:
            return f"the adapter written to OUT does not open: {exc}"
    for p in out.rglob("*"):
        if p.is_file() and CANARY.encode() in p.read_bytes():
            return f"the secret reached OUT ({p.name})"
    if (
        kind == "size:large-side-file"
        and (out / "tokenizer.json").stat().st_size != (root / "ft" / "tokenizer.json").stat().st_size
    ):
        return "the large side file was not copied in full"
    return None


def cleanup(root: Path) -> None:
    _PLAN.pop(str(root), None)
    shutil.rmtree(root, ignore_errors=True)
