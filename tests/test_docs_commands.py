"""The example commands in README.md and docs/ run as written.

Every ``dghard …`` command line in a ```bash or ```console block that uses ``examples/`` is run
in a subprocess (``python -m dghard_cli``, PYTHONPATH = the repository), page by page in the
order written (README first), so a command may use what an earlier one wrote; a command shown
twice runs once. ``/tmp/…`` paths are rewritten to a temporary directory and the working
directory is a temporary one holding links to ``examples/``, ``configs/`` and ``scripts/``, so
nothing is written into the repository or the real ``/tmp``. A command is expected to exit 0, or N when it ends with the
comment ``# exit N``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = ("examples", "configs", "scripts")

#: Commands that cannot run offline (Hugging Face Hub ids), by their text as written: skipped.
NEEDS_NETWORK: dict[str, str] = {}

#: Rewrites that keep the run short without changing what the command exercises.
SHORTER = {
    "--budget 12": "--budget 3",  # the sweep example: 2 references + 1 candidate
    "--budget 16": "--budget 4",  # the layer-strengths sweep: 2 references + 2 lines points
    # the grid and the first compass steps; the per-group stage runs in tests/test_sweep_lines.py
    "--budget 26 --refine groups": "--budget 7 --refine groups",
    # the parallel examples (local jobs, a local Ray cluster): 2 references + 2 candidates, at once
    "--budget 8 --jobs 2": "--budget 4 --jobs 2",
}


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    text: str
    expect: int
    shown: tuple[str, ...] = ()  # a console block's output lines under the command


#: Output lines that differ from run to run (or machine to machine): never compared.
VOLATILE = re.compile(
    r"^\s*(time|peak RSS|timings?|\[dghard\]|ETA)\b|\d+(\.\d+)? s\b|MiB|MB/s|GB/s|\.\.\.|…|^\s*$"
)


def _norm(line: str) -> str:
    return " ".join(line.split())


#: Decimals a CPU's vector kernels move: RECALL's weights come from float32 forward passes, and on
#: the shipped example AVX-512 and AVX2 kernels give 0.463 and 0.465 (docs/merge.md says so).
NUMBER = re.compile(r"^-?\d+\.\d+$")
FLOAT32_SPREAD = 0.005


def _close(shown: str, got: set[str]) -> bool:
    """``shown`` printed, up to FLOAT32_SPREAD in each decimal number of a table row."""
    want = shown.split()
    for line in got:
        have = line.split()
        if len(have) == len(want) and all(
            a == b or (NUMBER.match(a) and NUMBER.match(b) and abs(float(a) - float(b)) <= FLOAT32_SPREAD)
            for a, b in zip(want, have, strict=True)
        ):
            return True
    return False


def _logical_lines(block: list[tuple[int, str]]):
    """Join backslash continuations; yields (first line number, text)."""
    start, parts = None, []
    for no, line in block:
        if start is None:
            start = no
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(p.strip() for p in parts)
        start, parts = None, []
    if parts:
        yield start, " ".join(p.strip() for p in parts)


def doc_commands(path: Path) -> list[DocCommand]:
    found: list[DocCommand] = []
    lang, block = None, []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and lang is None:
            lang, block = fence.group(1) or "text", []
            continue
        if fence and lang is not None:
            if lang in ("bash", "console"):
                found += _commands_in_block(path, lang, block)
            lang = None
            continue
        if lang is not None:
            block.append((no, line))
    return found


def _commands_in_block(path: Path, lang: str, block: list[tuple[int, str]]) -> list[DocCommand]:
    out = []
    shown: dict[int, list[str]] = {}
    current = None
    for no, text in _logical_lines(block):
        if lang == "console":
            if not text.startswith("$ "):
                if current is not None:
                    shown[current].append(text)
                continue  # printed output
            current = no
            shown[no] = []
            text = text[2:]
        expect = 0
        m = re.search(r"#\s*exit (\d+)\s*$", text)
        if m:
            expect = int(m.group(1))
        for part in text.split("&&"):
            part = part.strip()
            if part.startswith("dghard ") and "examples/" in part:
                out.append(DocCommand(path.relative_to(REPO).as_posix(), no, part, expect))
    return [
        DocCommand(c.page, c.line, c.text, c.expect, tuple(shown.get(c.line, ())))
        if c.text.startswith("dghard ")
        else c
        for c in out
    ]


COMMANDS = {p.relative_to(REPO).as_posix(): doc_commands(p) for p in PAGES}
RUNNABLE = [page for page, cmds in COMMANDS.items() if cmds]  # README.md first


def test_commands_are_found():
    # the extraction itself: the quick start's repair and a documented failure are seen
    readme = [c.text for c in COMMANDS["README.md"]]
    assert "dghard repair examples/tiny/base examples/tiny/ft /tmp/repaired" in readme
    assert any(c.expect == 2 for c in COMMANDS["docs/merge.md"])
    for text in NEEDS_NETWORK:
        assert any(c.text == text for cmds in COMMANDS.values() for c in cmds), f"stale entry: {text}"


def test_example_paths_exist():
    # a cheap guard, no process started: every examples/ path a command names is in the repository
    for cmds in COMMANDS.values():
        for c in cmds:
            for arg in shlex.split(c.text, comments=True):
                for path in re.findall(r"(?<![\w/])examples/[\w./-]+", arg):
                    assert (REPO / path).exists(), f"{c.page}:{c.line}: {path} does not exist"


def _argv(text: str, tmp: Path) -> list[str]:
    for old, new in SHORTER.items():
        text = text.replace(old, new)
    args = [a.replace("/tmp/", f"{tmp}/") for a in shlex.split(text, comments=True)]
    assert args[0] == "dghard"
    return [sys.executable, "-m", "dghard_cli", *args[1:]]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """One working directory and one /tmp stand-in for the module, and the commands already run.

    Pages repeat commands (the quick start's repair reappears in repair.md, report.md and
    verify.md); each runs once, and a page that needs its output finds it.
    """
    root = tmp_path_factory.mktemp("docs")
    work, tmp = root / "work", root / "tmp"
    work.mkdir()
    tmp.mkdir()
    for name in LINKED:
        (work / name).symlink_to(REPO / name, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return {"work": work, "tmp": tmp, "env": env, "done": set()}


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE)
def test_page_commands_run(page, sandbox):
    for c in COMMANDS[page]:
        key = tuple(a for a in shlex.split(c.text, comments=True) if a not in ("-q", "--quiet"))
        if key in sandbox["done"] or c.text in NEEDS_NETWORK:
            continue
        res = subprocess.run(
            _argv(c.text, sandbox["tmp"]),
            cwd=sandbox["work"],
            env=sandbox["env"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == c.expect, (
            f"{c.page}:{c.line}: `{c.text}` exited {res.returncode}, expected {c.expect}\n"
            f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        )
        sandbox["done"].add(key)
        # the sample output shown under it is what the command prints (what does not vary)
        printed = (res.stdout + "\n" + res.stderr).replace(f"{sandbox['tmp']}/", "/tmp/")
        lines = [_norm(line) for line in printed.splitlines()]
        # a line the terminal wrapped: up to 3 consecutive lines joined
        got = {" ".join(lines[i : i + k]) for k in (1, 2, 3) for i in range(len(lines))}
        shown = c.shown if not any(k in c.text for k in SHORTER) else ()  # a shortened run prints less
        stale = [
            line
            for line in shown
            if not VOLATILE.search(line) and _norm(line) not in got and not _close(_norm(line), got)
        ]
        assert not stale, f"{c.page}:{c.line}: `{c.text}` no longer prints {stale}\n{printed[-3000:]}"


def test_readme_library_example_runs(sandbox):
    readme = (REPO / "README.md").read_text()
    code = re.search(r"^## Library\n.*?^```python\n(.*?)^```$", readme, flags=re.S | re.M).group(1)
    res = subprocess.run(
        [sys.executable, "-c", code.replace("/tmp/", f"{sandbox['tmp']}/")],
        cwd=sandbox["work"],
        env=sandbox["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("noise bulk found in 16 of 16 matrices") and lines[1:3] == ["4.0", "wise-ft"]
    assert "no such directory" in lines[3]
