"""What the commands print: tables sized to their content in logs, help that lists choices."""

from __future__ import annotations

import json

from conftest import REPO, run_dghard

TINY = REPO / "examples" / "tiny"


def _padded(text: str) -> list[str]:
    return [line for line in text.splitlines() if line != line.rstrip()]


def test_tables_in_a_log_are_as_wide_as_their_content(tmp_path):
    # stdout is a pipe here, as in CI logs: rich must not pad rows to a 200-column console
    r = run_dghard("inspect", TINY / "base", TINY / "ft", env={"COLUMNS": ""})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines and not _padded(r.stdout), _padded(r.stdout)[:3]
    assert max(map(len, lines)) <= 200
    row = next(line for line in lines if line.lstrip().startswith("tensors"))
    assert row == row.rstrip() and len(row) < 60  # "tensors  21 (method 16, kept-ft 5)", not padded
    # repair's summary (a long verdict line) and score's tables: no padding either
    out = tmp_path / "out"
    r = run_dghard("repair", TINY / "base", TINY / "ft", out, env={"COLUMNS": ""})
    assert r.returncode == 0 and r.stdout and not _padded(r.stdout), _padded(r.stdout)[:3]
    files = []
    for name, doc in (
        ("b", {"x": 50.0, "y": 60.0}),
        ("f", {"x": 40.0, "y": 70.0}),
        ("c", {"x": 45.0, "y": 65.0}),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        files.append(tmp_path / f"{name}.json")
    r = run_dghard(
        "score", "--base", files[0], "--ft", files[1], "--candidate", files[2], env={"COLUMNS": ""}
    )
    assert r.returncode == 0 and r.stdout and not _padded(r.stdout), _padded(r.stdout)[:3]


def test_columns_sets_the_wrap_width_of_a_log(tmp_path):
    r = run_dghard("inspect", TINY / "base", TINY / "ft", env={"COLUMNS": "60"})
    assert r.returncode == 0, r.stderr
    assert max(map(len, r.stdout.splitlines())) <= 60 and not _padded(r.stdout)
