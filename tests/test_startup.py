"""Start-up: ``dghard --version`` and ``dghard COMMAND --help`` import neither torch nor numpy
(cli/deferred.py holds them back, cli/__init__.py imports only the command that runs), and the
deferred libraries still work, once, from any thread. Each check runs a fresh interpreter:
the process's imports are the subject. The time itself is measured by scripts/bench_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

from dghard_cli.cli import COMMANDS


def _python(
    code: str, *, cwd: Path | None = None, extra_path: Path | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        os.pathsep.join(str(p) for p in (extra_path, REPO) if p) + os.pathsep + env.get("PYTHONPATH", "")
    )
    env.pop("DGHARD_DEBUG_IMPORTS", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _entrypoint_runs(lines: list[list[str]]) -> tuple[dict, subprocess.CompletedProcess]:
    """Run the console entry point on each argv in one fresh interpreter; its exit codes and
    whether torch and numpy were imported, with the process."""
    res = _python(
        f"""
        import json, sys
        from dghard_cli.cli import deferred, entrypoint
        codes = []
        for argv in {lines!r}:
            sys.argv = ["dghard", *argv]
            try:
                entrypoint()
            except SystemExit as e:
                codes.append(e.code or 0)
        print(json.dumps({{"codes": codes, "torch": deferred.loaded("torch"), "numpy": deferred.loaded("numpy")}}),
              file=sys.stderr)
        """
    )
    return json.loads(res.stderr.strip().splitlines()[-1]), res


def test_importing_the_package_loads_neither_torch_nor_numpy():
    res = _python(
        """
        import json, sys
        import dghard_cli, dghard_cli.cli
        print(json.dumps(sorted(m for m in ("torch", "numpy") if m in sys.modules)))
        """
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []


def test_version_and_every_help_load_neither_torch_nor_numpy():
    """The console entry point on --version, --help and each COMMAND --help, in one process."""
    lines = [["--version"], ["--help"], *[[c, "--help"] for c in COMMANDS]]
    doc, res = _entrypoint_runs(lines)
    assert doc["codes"] == [0] * len(lines), res.stderr
    assert (doc["torch"], doc["numpy"]) == (False, False), (
        "a start-up path imports torch or numpy: run `DGHARD_DEBUG_IMPORTS=1 dghard --version` to see where"
    )
    top_help = res.stdout.split("Usage:")[1]  # the first help printed: `dghard --help`
    assert all(c in top_help for c in COMMANDS), top_help  # `dghard --help` still lists every command


def test_a_command_imports_only_its_own_module():
    res = _python(
        """
        import json, sys
        from dghard_cli.cli import entrypoint
        sys.argv = ["dghard", "score", "--help"]
        try:
            entrypoint()
        except SystemExit:
            pass
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("dghard_cli.cli."))), file=sys.stderr)
        """
    )
    loaded = set(json.loads(res.stderr.strip().splitlines()[-1]))
    others = {f"dghard_cli.cli.{m}" for c, m in COMMANDS.items() if c != "score"}
    assert "dghard_cli.cli.score" in loaded
    assert not loaded & others, loaded & others


def test_a_deferred_library_works_and_is_imported_once_from_racing_threads(tmp_path):
    """Eight threads read an attribute of a deferred module at once: its import runs once, every
    thread sees the real module's values, and ``import`` afterwards gives the same objects."""
    (tmp_path / "slowlib.py").write_text(
        textwrap.dedent(
            """
            import time
            RUNS = globals().get("RUNS", 0) + 1
            time.sleep(0.3)  # a slow import: the threads below all arrive while it runs
            def answer():
                return 42
            """
        )
    )
    res = _python(
        """
        import json, sys, threading
        from dghard_cli.cli import deferred
        deferred.defer(("slowlib", "torch"))
        import slowlib
        assert not deferred.loaded("slowlib")
        got = []
        threads = [threading.Thread(target=lambda: got.append(slowlib.answer())) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        import slowlib as again
        import torch
        x = torch.arange(4, dtype=torch.float64)
        print(json.dumps({"got": got, "runs": sys.modules["slowlib"].RUNS, "same": again.answer is slowlib.answer,
                          "loaded": deferred.loaded("slowlib"), "torch": float(x.sum()),
                          "numpy": float(x.numpy().sum())}))
        """,
        extra_path=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc == {"got": [42] * 8, "runs": 1, "same": True, "loaded": True, "torch": 6.0, "numpy": 6.0}


def test_a_failed_import_stays_deferred_and_fails_again_the_same_way(tmp_path):
    (tmp_path / "brokenlib.py").write_text("raise ImportError('brokenlib needs a compiler')\n")
    res = _python(
        """
        from dghard_cli.cli import deferred
        deferred.defer(("brokenlib",))
        import brokenlib
        for _ in range(2):
            try:
                brokenlib.anything
            except ImportError as e:
                print(e)
        """,
        extra_path=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["brokenlib needs a compiler"] * 2


def test_the_console_script_repairs_the_example_with_torch_deferred(tmp_path):
    """A real run through the entry point: the deferred torch is imported by the pipeline's
    threads and the main thread alike, and the output verifies."""
    out = tmp_path / "repaired"
    res = _python(
        f"""
        import sys
        from dghard_cli.cli import entrypoint
        for argv in (["repair", "examples/tiny/base", "examples/tiny/ft", {str(out)!r}, "-q"], ["verify", {str(out)!r}]):
            sys.argv = ["dghard", *argv]
            try:
                entrypoint()
            except SystemExit as e:
                if e.code:
                    raise
        """
    )
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout


def test_an_existing_out_is_refused_before_torch_is_imported(tmp_path):
    """Re-running the quick start paid the torch import (~3 s) to say that OUT exists."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    example = REPO / "examples" / "tiny"
    lines = [
        ["repair", str(example / "base"), str(example / "ft"), str(out)],
        ["merge", "--method", "wise-ft", str(example / "base"), str(example / "ft"), "--out", str(out)],
        ["sweep", str(example / "base"), str(example / "ft"), str(out), "--eval", "e {model} {output}"],
    ]
    doc, res = _entrypoint_runs(lines)
    assert (doc["codes"], doc["torch"]) == ([2, 2, 2], False), res.stderr
    assert res.stderr.count("exists and is not empty; pass --overwrite to replace it") == 3, res.stderr


def test_importing_the_package_sets_torch_allocation_defaults_a_user_setting_wins():
    """OMP_WAIT_POLICY=PASSIVE and THP_MEM_ALLOC_ENABLE=1 (huge pages for torch's large CPU
    buffers) are set before torch starts, unless the user set them."""
    code = "import os, dghard_cli; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["PASSIVE", "1"], run.stderr
    env.update(OMP_WAIT_POLICY="ACTIVE", THP_MEM_ALLOC_ENABLE="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["ACTIVE", "0"], run.stderr
