"""``dghard report``: show a finished run's report, or render it as one HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dghard_cli.cli.common import JsonOpt, QuietOpt, VerboseOpt, app, emit, run_cli
from dghard_cli.errors import InputError

REPORT_EPILOG = """
**Examples**

    dghard report repaired/dghard_report.json

    dghard report repaired/ --html repair.html          # needs dghard[plot]

    dghard report repaired/dghard_report.json --json
"""


def load_report(path: str | Path) -> tuple[Path, dict]:
    """A ``dghard_report.json`` (or the directory holding one), checked for the schema."""
    from dghard_cli.engine.writer import REPORT_NAME
    from dghard_cli.io.checkpoint import path_exists, read_json_file
    from dghard_cli.io.files import REPORT_LIMIT
    from dghard_cli.report.build import SCHEMA_VERSION

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / REPORT_NAME
    if not path_exists(p):
        raise InputError(f"{path}: no such report file (expected {REPORT_NAME} or a path to one)")
    doc = read_json_file(p, "report", limit=REPORT_LIMIT)
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("summary"), dict)
        or not isinstance(doc.get("tensors"), list)
    ):
        raise InputError(f"{p}: not a dghard report (no 'summary' and 'tensors')")
    version = doc.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise InputError(f"{p}: not a dghard report (no schema_version)")
    if version > SCHEMA_VERSION:
        raise InputError(
            f"{p}: report schema version {version} is newer than this dghard understands "
            f"({SCHEMA_VERSION}); upgrade dghard"
        )
    for i, rec in enumerate(doc["tensors"]):
        if not isinstance(rec, dict) or not isinstance(rec.get("name"), str) or "shape" not in rec:
            raise InputError(f"{p}: tensor record #{i} has no name/shape; the report is damaged")
    return p, doc


@app.command("report", epilog=REPORT_EPILOG)
def report_cmd(
    report: Annotated[
        Path, typer.Argument(help="A dghard_report.json (repair, merge or inspect --json), or its directory.")
    ],
    html: Annotated[
        Optional[Path], typer.Option("--html", help="Write one self-contained HTML page to this file.")
    ] = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Print a finished run's summary, or render its report as an HTML page (heat maps, table, verdict)."""

    from dghard_cli.cli.render import summary_table
    from dghard_cli.io.paths import Output, check_outputs

    def body() -> dict:
        path, doc = load_report(report)
        out: dict = {"report": str(path), "command": doc.get("command"), "method": doc.get("method")}
        if html is not None:
            from dghard_cli.report.html import write_html

            check_outputs([("REPORT", path)], [Output("--html", Path(html))])

            spectra = {
                name: s["singular_values"]
                for name, s in (doc.get("spectra") or {}).items()
                if isinstance(s, dict) and isinstance(s.get("singular_values"), list)
            }
            names = {r["name"] for r in doc["tensors"]}
            spectra = {k: v for k, v in spectra.items() if k in names}
            out["html"] = str(write_html(doc, html, spectra or None))
        out["summary"] = doc["summary"]
        return {"doc": doc, "out": out}

    res = run_cli(body, verbose=verbose)

    def show(console) -> None:
        from rich.text import Text

        console.print(summary_table(res["doc"]))
        if "html" in res["out"]:
            console.print(Text(f"html: {res['out']['html']}"))

    emit(res["out"], as_json=json_out, quiet=quiet, render=show)
