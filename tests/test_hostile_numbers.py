"""Hostile numbers, sizes and resources: each class is closed where it starts (see
docs/robustness.md, "Numbers, sizes and resources"). Every test here failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dghard_cli.cli import app
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)


@pytest.fixture()
def pair(tmp_path) -> tuple[Path, Path]:
    make_pair(tmp_path, CFG, dtype="float32", base_shards=1, ft_shards=1, seed=0)
    return tmp_path / "base", tmp_path / "ft"


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(r, code: int = 2) -> str:
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    msg = r.output.strip()
    assert "Traceback" not in msg, msg
    return msg


# --- the lock file ----------------------------------------------------------------------------


def test_lock_file_that_is_a_symlink_says_so(pair, tmp_path):
    base, ft = pair
    (tmp_path / ".out.dghard-lock").symlink_to(tmp_path / "elsewhere")
    msg = one_line_error(invoke("repair", base, ft, tmp_path / "out"))
    assert "symbolic link" in msg and "cannot create files" not in msg
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "out").exists()
