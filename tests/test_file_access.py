"""The robustness layers on their own: file access, bounded parsers, output paths, the OUT lock,
the sweep's command builder and candidate snapshots (end-to-end rows: test_hostile_inputs.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io import files, limits
from dghard_cli.io.lock import OutLock, lock_path
from dghard_cli.io.paths import Output, check_outputs, check_shard_names
from dghard_cli.sweeping import integrity
from dghard_cli.sweeping.command import Template, build_command


def _no_block(seconds: float = 5.0):
    """Fail (instead of hanging the suite) if the body blocks."""

    def on_alarm(signum, frame):
        raise AssertionError("blocked")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _done() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)


# -- files ----------------------------------------------------------------------------------------


def test_regular_file_inside_its_root_is_read(tmp_path):
    (tmp_path / "d").mkdir()
    p = tmp_path / "d" / "a.json"
    p.write_text('{"x": [1, 2]}')
    assert files.read_json(p, what="a", roots=(files.realpath(tmp_path / "d"),)) == {"x": [1, 2]}
    (tmp_path / "d" / "link.json").symlink_to("a.json")  # a link that stays inside
    assert files.read_json(tmp_path / "d" / "link.json", what="a", roots=files.input_roots(tmp_path / "d"))


@pytest.mark.parametrize("kind", ["fifo", "dir", "outside", "dangling", "loop", "dev"])
def test_anything_but_a_regular_file_inside_is_refused_without_blocking(tmp_path, kind):
    d = tmp_path / "d"
    d.mkdir()
    p = d / "config.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    elif kind == "outside":
        (tmp_path / "secret").write_text("{}")
        p.symlink_to(tmp_path / "secret")
    elif kind == "dangling":
        p.symlink_to(d / "nothing")
    elif kind == "loop":
        p.symlink_to("config.json")
    else:
        p.symlink_to("/dev/zero")
    _no_block()
    try:
        with pytest.raises(InputError) as e:
            files.read_json(p, what="config.json", roots=files.input_roots(d))
    finally:
        _done()
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_size_limit_is_checked_before_reading(tmp_path):
    p = tmp_path / "big.json"
    with open(p, "wb") as fh:
        fh.truncate(10**12)  # sparse: reading it would take forever
    with pytest.raises(InputError, match="larger than the 1 MiB limit"):
        files.read_bytes(p, what="config", limit=1 << 20)


def test_hub_snapshot_roots_are_the_snapshot_and_the_blob_store(tmp_path):
    snap = tmp_path / "models--o--n" / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (tmp_path / "models--o--n" / "blobs").mkdir()
    assert files.input_roots(snap) == (snap.resolve(), (tmp_path / "models--o--n" / "blobs").resolve())
    assert files.input_roots(tmp_path) == (tmp_path.resolve(),)


def test_copy_input_copies_in_full(tmp_path):
    src = tmp_path / "t.json"
    src.write_bytes(os.urandom(3 << 20))
    n = files.copy_input(src, tmp_path / "copy", what="tokenizer")
    assert n == 3 << 20 and (tmp_path / "copy").read_bytes() == src.read_bytes()


# -- limits ---------------------------------------------------------------------------------------


def test_json_depth_and_element_limits():
    assert limits.parse_json("[[[1]]]", "x", max_depth=3) == [[[1]]]
    with pytest.raises(InputError, match="nested deeper"):
        limits.parse_json("[[[[1]]]]", "x", max_depth=3)
    with pytest.raises(InputError, match="nested deeper"):
        limits.parse_json("[" * 100_000 + "]" * 100_000, "x")  # the parser's own recursion
    with pytest.raises(InputError, match="more than 10 values"):
        limits.parse_json(str(list(range(20))), "x", max_elements=10)


def test_yaml_alias_bomb_recursion_and_depth_are_refused_before_construction():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]\n" for i in range(1, 9)
    )
    t0 = time.monotonic()
    with pytest.raises(InputError, match="expands to more than"):
        limits.parse_yaml(bomb, "recipe")
    assert time.monotonic() - t0 < 5
    with pytest.raises(InputError, match="recursive alias"):
        limits.parse_yaml("a: &a [*a]\n", "recipe")
    with pytest.raises(InputError, match="nested deeper"):
        limits.parse_yaml("x: " + "[" * 200 + "]" * 200, "recipe")
    assert limits.parse_yaml("a: &a {k: 1}\nb: *a\n", "recipe") == {"a": {"k": 1}, "b": {"k": 1}}


# -- output paths ---------------------------------------------------------------------------------


def test_output_path_rule(tmp_path):
    ft = tmp_path / "ft"
    ft.mkdir()
    (ft / "config.json").write_text("{}")
    ins = [("FT", ft)]
    for bad in (ft / "config.json", ft / "new.json", ft):
        with pytest.raises(InputError):
            check_outputs(ins, [Output("--report", bad)])
    with pytest.raises(InputError, match="contains FT"):
        check_outputs(ins, [Output("OUT", tmp_path, is_dir=True, replaces=True)])
    check_outputs(ins, [Output("--plot", tmp_path, is_dir=True)])  # PNGs beside an input: fine
    out = tmp_path / "out"
    with pytest.raises(InputError, match="writes itself"):
        check_outputs(
            ins,
            [
                Output("OUT", out, is_dir=True, writes=frozenset({"README.md"})),
                Output("--report", out / "README.md"),
            ],
        )
    with pytest.raises(InputError, match="same path"):
        check_outputs(ins, [Output("--html", tmp_path / "x"), Output("--plot", tmp_path / "x", is_dir=True)])
    link = tmp_path / "link"
    link.symlink_to(ft)
    with pytest.raises(InputError):
        check_outputs(ins, [Output("--report", link / "r.json")])
    check_outputs(ins, [Output("OUT", out, is_dir=True), Output("--report", out / "r.json")])
    with pytest.raises(InputError, match="writes into OUT"):
        check_shard_names(["model-1.safetensors", "README.md"], "index")


# -- the lock -------------------------------------------------------------------------------------


def test_one_run_per_out_and_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    with OutLock(out):
        assert lock_path(out).exists()
        code = (
            "import sys; from dghard_cli.io.lock import OutLock\n"
            "try:\n    OutLock(sys.argv[1]).acquire()\nexcept Exception as e:\n    print(e); sys.exit(3)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env)
        assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout and "another dghard run" in r.stdout
        with pytest.raises(RuntimeFailure, match="another dghard run"):
            OutLock(out).acquire()
    assert not lock_path(out).exists()
    lock_path(out).write_text("99999\n")  # left by a run that was killed: not held, so reusable
    with OutLock(out):
        pass


# -- the sweep's command --------------------------------------------------------------------------


def test_template_is_tokenised_once():
    t = Template.parse("run {model} --out={output} {other} {model}")
    assert t.uses("model") and t.uses("output")
    cmd = build_command("run {model} --out={output} {x}", model="/a/{output}$(x)", output="/o p/'q'")
    assert cmd == "run '/a/{output}$(x)' --out='/o p/'\"'\"'q'\"'\"'' {x}"


# -- candidate snapshots --------------------------------------------------------------------------


def test_snapshot_notices_every_change(tmp_path):
    d = tmp_path / "cand"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"abcdef")
    (d / "config.json").write_text("{}")
    snap = integrity.snapshot(d)
    assert integrity.changed(d, snap) is None and integrity.verify_hashes(d, snap) is None
    st = (d / "model.safetensors").stat()
    time.sleep(0.05)  # past the file system's timestamp granularity (a few ms)
    with open(d / "model.safetensors", "r+b") as fh:
        fh.write(b"X")
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back
    assert "modified" in integrity.changed(d, snap)  # the change time cannot be put back
    snap = integrity.snapshot(d)
    (d / "planted").write_text("x")
    assert "added" in integrity.changed(d, snap)
