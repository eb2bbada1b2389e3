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


# -- help ------------------------------------------------------------------------------------------

#: Options with a fixed set of values, per command, and the list their help must show.
CHOICES = {
    "repair": {
        "--noise": "median|known",
        "--shrink": "hard|soft|optimal|twoknob",
        "--dtype": "bf16|fp16|fp32|fp64",
        "--route": "auto|gram64|qr32",
        "--device": "auto|cpu|cuda|cuda:N",
    },
    "merge": {
        "--recall-kernel": "linear-cka|rbf-cka|cosine",
        "--recall-pooling": "token|mean",
        "--recall-select": "kmeans|first",
        "--dtype": "bf16|fp16|fp32|fp64",
        "--device": "auto|cpu|cuda|cuda:N",
    },
    "inspect": {"--device": "auto|cpu|cuda|cuda:N"},
    "audit-lora": {"--fail-on": "error|warn|info", "--device": "auto|cpu|cuda|cuda:N"},
    "score": {"--units": "auto|fraction|points"},
    "sweep": {"--device": "auto|cpu|cuda|cuda:N", "--lm-eval-model": "hf|vllm"},
}


def _help(*args: str) -> str:
    from typer.testing import CliRunner

    from dghard_cli.cli import app

    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert r.exit_code == 0, r.output
    return r.output


def _row(text: str, flag: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip("│ *").startswith(flag + " "))


def test_help_of_every_command_lists_choices_and_shows_no_bool_type():
    import typer

    from dghard_cli.cli import app
    from dghard_cli.methods import registry

    commands = sorted(typer.main.get_command(app).commands)
    assert set(CHOICES) <= set(commands) and len(commands) >= 8
    for args in [(), *((c,) for c in commands)]:
        text = _help(*args)
        assert "<bool>" not in text, (args, [ln for ln in text.splitlines() if "<bool>" in ln])
        for flag, listed in CHOICES.get(args[0] if args else "", {}).items():
            row = _row(text, flag)
            assert listed in row and "<str>" not in row, (args, flag, row)
    # flags keep their help, with an empty type column
    assert "Plan only; read headers, run no model." in _row(_help("repair"), "--dry-run")
    # --method: its (long) list is in the help text, every registered method named
    method = _help("merge")
    for name in registry.method_names():
        assert name in method


def test_bad_choice_values_are_one_line_errors_exit_2(tmp_path):
    from conftest import run_dghard

    cases = [
        ("repair", TINY / "base", TINY / "ft", tmp_path / "o", "--noise", "loud"),
        ("repair", TINY / "base", TINY / "ft", tmp_path / "o", "--device", "tpu"),
        (
            "merge",
            "--method",
            "ties",
            TINY / "base",
            TINY / "ft",
            "--out",
            tmp_path / "m",
            "--recall-kernel",
            "x",
        ),
    ]
    for args in cases:
        r = run_dghard(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("dghard: error:"), (
            args,
            r.stderr,
        )
