"""Every table and line ``dghard`` prints on a terminal (rich), one module per command family.

The library returns documents (dicts); the commands in :mod:`dghard_cli.cli` hand them to these
functions. Nothing outside ``dghard_cli.cli`` imports rich. The renderers live in
:mod:`~dghard_cli.cli.render_checkpoint` (the report summary, inspect, merge, the dry-run plan,
verify, adapter outputs), :mod:`~dghard_cli.cli.render_score`, :mod:`~dghard_cli.cli.render_sweep`
and :mod:`~dghard_cli.cli.render_audit`; this module re-exports what the commands import, so
the output of all commands is still found from one place.
"""

from __future__ import annotations

from dghard_cli.cli.render_audit import render_findings
from dghard_cli.cli.render_checkpoint import (
    is_adapter_doc,
    render_adapter,
    render_inspect,
    render_merge,
    render_plan,
    render_report,
    render_verify,
    summary_table,
)
from dghard_cli.cli.render_score import render_score
from dghard_cli.cli.render_sweep import json_lines, progress_printer, render_sweep

__all__ = [
    "is_adapter_doc",
    "json_lines",
    "progress_printer",
    "render_adapter",
    "render_findings",
    "render_inspect",
    "render_merge",
    "render_plan",
    "render_report",
    "render_score",
    "render_sweep",
    "render_verify",
    "summary_table",
]
