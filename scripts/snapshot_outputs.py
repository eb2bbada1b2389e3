#!/usr/bin/env python3
"""Fingerprint what every command writes, so a restructure can prove it changed no output.

Runs the real command line (in this process, through the Typer app) on ``examples/tiny`` and
on small generated checkpoints and adapters -- repair (each shrinker, ``--lines``), every merge
method, an adapter in and out, inspect, audit-lora, score, verify, report, a short sweep --
and prints one ``sha256  path`` line per output file. Reports are compared with their
run-dependent fields (times, memory, paths, dates, hosts) removed.

    python scripts/snapshot_outputs.py /tmp/snap-before > before.txt
    # ... change the code ...
    python scripts/snapshot_outputs.py /tmp/snap-after > after.txt
    diff before.txt after.txt      # no line: every output byte-identical
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's dghard_cli, whatever is installed
TINY = REPO / "examples" / "tiny"

#: report keys whose values differ from run to run on unchanged code
VOLATILE = re.compile(
    r"(time|timing|seconds|elapsed|duration|rss|memory|date|created|host|pid|started|finished|"
    r"path|dir|argv|command|cwd|version|bytes|eta|speed|_s$)",
    re.I,
)


def _scrub(value, root: str):
    if isinstance(value, dict):
        return {k: ("<volatile>" if VOLATILE.search(k) else _scrub(v, root)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(root, "<ROOT>")
    return value


def fingerprint(path: Path, root: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".json":
        text = data.decode("utf-8", "replace")
        if "report" in path.name or "sweep" in path.name:
            with contextlib.suppress(ValueError):
                text = json.dumps(_scrub(json.loads(text), str(root)), sort_keys=True)
        data = text.replace(str(root), "<ROOT>").encode()
    elif path.suffix in (".md", ".txt", ".yaml", ".html", ".log", ".sh"):
        text = data.decode("utf-8", "replace").replace(str(root), "<ROOT>")
        text = re.sub(r"\d+(\.\d+)? ?(s|ms|MiB|MB|GB|GiB)\b", "<n>", text)
        text = re.sub(r"\d{4}-\d\d-\d\dT[\d:.+Z-]+", "<date>", text)
        data = text.encode()
    return hashlib.sha256(data).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path, help="scratch directory (emptied first)")
    args = ap.parse_args()
    root = args.workdir.resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)

    from typer.testing import CliRunner

    from dghard_cli.cli import app
    from dghard_cli.testing.synthetic import ArchConfig, make_pair
    from dghard_cli.testing.synthetic_lora import make_adapter

    runner = CliRunner()
    outputs: list[Path] = []
    results: list[str] = []

    def run(name: str, *argv: str, out: Path | None = None) -> None:
        res = runner.invoke(app, [str(a) for a in argv], catch_exceptions=False)
        results.append(f"{name}: exit {res.exit_code}")
        if res.exit_code not in (0, 1):  # 1: a gate or check that failed, itself an output
            print(f"{name}: exit {res.exit_code}: {res.stderr.strip()}", file=sys.stderr)
        if out is not None:
            outputs.append(out)
        (root / "stdout").mkdir(exist_ok=True)
        text = res.stdout if "--json" not in argv else ""
        (root / "stdout" / f"{name}.txt").write_text(text)

    cfg = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)
    base, ft1 = make_pair(root / "m1", cfg, ft_shards=3, seed=0)
    _, ft2 = make_pair(root / "m2", cfg, ft_shards=1, seed=0, delta_seed=11)
    _, ft3 = make_pair(root / "m3", cfg, ft_shards=2, seed=0, delta_seed=22)
    ad1, _, _ = make_adapter(root / "ad1", cfg, r=4, targets=("q_proj", "v_proj", "up_proj"), seed=1)
    ad2, _, _ = make_adapter(root / "ad2", cfg, r=4, targets=("q_proj", "v_proj", "up_proj"), seed=2)
    tb, tf = TINY / "base", TINY / "ft"
    o = root / "out"
    o.mkdir()

    run("repair", "repair", tb, tf, o / "repair", "-q", out=o / "repair")
    for shrink in ("soft", "optimal"):
        run(
            f"repair-{shrink}",
            "repair",
            tb,
            tf,
            o / f"repair-{shrink}",
            "--shrink",
            shrink,
            "-q",
            out=o / f"repair-{shrink}",
        )
    run(
        "repair-lines",
        "repair",
        tb,
        tf,
        o / "repair-lines",
        "--lines",
        "0.3,0.6",
        "-q",
        out=o / "repair-lines",
    )
    run("repair-bf16", "repair", tb, tf, o / "repair-bf16", "--dtype", "bf16", "-q", out=o / "repair-bf16")
    merges = [
        ("wise-ft", [ft1], ["--alpha", "0.4"]),
        ("task-arithmetic", [ft1, ft2, ft3], ["--weights", "1,-0.5,0.7"]),
        ("ties", [ft1, ft2, ft3], ["--density", "0.3"]),
        ("dare-linear", [ft1, ft2], ["--density", "0.4", "--seed", "3"]),
        ("dare-ties", [ft1, ft2], ["--density", "0.4", "--seed", "3"]),
        ("slerp", [ft1], ["--t", "0.3"]),
        ("breadcrumbs", [ft1, ft2], []),
        ("della", [ft1, ft2], ["--density", "0.4", "--epsilon", "0.1"]),
        ("model-stock", [ft1, ft2, ft3], []),
        ("dg-hard", [ft1, ft2], ["--weights", "1,1"]),
        ("ties", [ft1, ft2], ["--lines", "0.2,0.6"]),
    ]
    for i, (method, fts, extra) in enumerate(merges):
        d = o / f"merge-{i}-{method}"
        run(f"merge-{i}-{method}", "merge", "--method", method, *extra, base, *fts, "--out", d, "-q", out=d)
    # adapters: in, out, merged
    run(
        "ad-wise",
        "merge",
        "--method",
        "wise-ft",
        "--alpha",
        "0.5",
        base,
        ad1,
        "--out",
        o / "ad-wise",
        "-q",
        out=o / "ad-wise",
    )
    run("ad-lines", "repair", base, ad1, o / "ad-lines", "--lines", "0.3,0.6", "-q", out=o / "ad-lines")
    run(
        "ad-merge",
        "merge",
        "--method",
        "task-arithmetic",
        base,
        ad1,
        "--out",
        o / "ad-merge",
        "--merge",
        "-q",
        out=o / "ad-merge",
    )
    run(
        "ad-ties",
        "merge",
        "--method",
        "ties",
        "--weights",
        "1,1",
        base,
        ad1,
        ad2,
        "--out",
        o / "ad-ties",
        "--rank",
        "8",
        "-q",
        out=o / "ad-ties",
    )
    run("full-peft", "repair", base, ft1, o / "full-peft", "--format", "peft", "-q", out=o / "full-peft")
    # read-only commands
    run("inspect", "inspect", tb, tf, "--json")
    run("inspect-table", "inspect", tb, tf)
    run("audit", "audit-lora", ad1, "--base", base)
    run("audit-json", "audit-lora", ad1, "--base", base, "--json")
    run("verify", "verify", o / "repair")
    run("report", "report", o / "repair")
    ev = root / "eval"
    ev.mkdir()
    (ev / "base.json").write_text(json.dumps({"results": {"a": {"acc": 0.6}, "b": {"acc": 0.7}}}))
    (ev / "ft.json").write_text(json.dumps({"results": {"a": {"acc": 0.4}, "b": {"acc": 0.9}}}))
    (ev / "c.json").write_text(json.dumps({"results": {"a": {"acc": 0.55}, "b": {"acc": 0.85}}}))
    run(
        "score",
        "score",
        "--base",
        ev / "base.json",
        "--ft",
        ev / "ft.json",
        "--candidate",
        f"c={ev / 'c.json'}",
        "--target",
        "b",
    )
    stand_in = REPO / "examples" / "sweep" / "stand_in_eval.py"
    run(
        "sweep", "sweep", tb, tf, o / "sweep", "--budget", "4", "-q",
        "--eval", f"{sys.executable} {stand_in} {{model}} {{output}}",
        out=o / "sweep",
    )  # fmt: skip

    for line in results:
        print("# " + line)
    for d in outputs:
        if not d.exists():
            print(f"missing  {d.relative_to(root)}")
            continue
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            print(f"{fingerprint(f, root)}  {f.relative_to(root)}")
    for f in sorted((root / "stdout").iterdir()):
        print(f"{fingerprint(f, root)}  {f.relative_to(root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
