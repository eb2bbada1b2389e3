"""The terminal output of ``dghard sweep``: the candidates table, the budget, the winner and
its reproduction command, and the per-event progress lines printed while the sweep runs.

Takes the sweep document (a dict) or progress events and prints them with rich; relies on
nothing else. :mod:`dghard_cli.cli.render` is the public entry.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

# -- sweep ---------------------------------------------------------------------------------------


def _fmt_sweep(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else f"{v:{spec}}"


def _vs_best(r: dict, tied: set[str]) -> str:
    """The objective's difference from the best ± its (paired) stderr; ``=`` marks the tie set."""
    d, se = r.get("vs_best"), r.get("vs_best_stderr")
    if d is None:
        return "—"
    text = f"{d:+.1f}" + (f" ± {se:.1f}" if se is not None and d != 0 else "")
    return text + (" =" if r["name"] in tied else "")


def render_sweep(console: Console, doc: dict) -> None:

    b = doc["budget"]
    norm = doc["options"].get("objective") == "normalised-accuracy"  # its column, when it chose
    t = Table(title="dghard sweep", box=None, header_style="bold")
    for col in (
        "#",
        "candidate",
        "phase",
        "status",
        "repair %",
        "retention %",
        "HM",
        "vs best",
        *(["norm. acc. %"] if norm else []),
        "target %",
        "dist. to FT",
        "time s",
    ):
        t.add_column(col, justify="left" if col in ("candidate", "phase", "status") else "right")
    win = doc["winner"]["order"] if doc["winner"] else None
    tied = set((doc["winner"] or {}).get("choice", {}).get("tie_set", []))
    for r in doc["candidates"]:
        secs = sum(v for v in (r.get("seconds") or {}).values() if isinstance(v, (int, float)))
        mark = " ★" if r["order"] == win else ""
        status = r["status"] + (" (cached)" if r["cached"] else "")
        if r["status"] == "ok" and r.get("feasible") is False:
            status += " (below target bar)"
        t.add_row(
            str(r["order"]),
            Text(r["name"] + mark),
            r["phase"],
            status,
            _fmt_sweep(r["repair"]),
            _fmt_sweep(r["retention"]),
            _fmt_sweep(r["hm"]) + (f" ± {r['hm_stderr']:.1f}" if r.get("hm_stderr") is not None else ""),
            _vs_best(r, tied),
            *([_fmt_sweep(r.get("normalised_accuracy"))] if norm else []),
            _fmt_sweep(r["target_retention_mean"]),
            _fmt_sweep(r["distance"], ".3f"),
            f"{secs:.1f}",
        )
    console.print(t)
    for r in doc["candidates"]:
        if r["status"] != "ok":
            console.print(Text(f"  #{r['order']} {r['name']}: {r['message']}"))
    console.print(
        Text(
            f"evaluations: {b['used']} of --budget {b['total']} ({b['reference_evaluations']} for the references, "
            f"{b['candidate_evaluations']} candidates; {b['from_cache']} from the cache)"
        )
    )
    w = doc["winner"]
    if w:
        console.print(
            Text(
                f"winner: {w['name']}  HM {_fmt_sweep(w['hm'])}"
                + (f" ± {w['hm_stderr']:.1f}" if w.get("hm_stderr") is not None else "")
                + f"  repair {_fmt_sweep(w['repair'])} %  retention "
                f"{_fmt_sweep(w['retention'])} %"
                + (
                    f"  normalised accuracy {_fmt_sweep(w.get('normalised_accuracy'))} %"
                    if doc["options"].get("objective") == "normalised-accuracy"
                    else ""
                )
                + (
                    f"  target {_fmt_sweep(w['target_retention_mean'])} %"
                    if doc["options"]["targets"]
                    else ""
                )
            )
        )
        if w.get("choice"):
            console.print(Text(f"  chosen: {w['choice']['reason']}"))
        h = doc.get("holdout")
        if h and h.get("status") == "ok":
            hw, opt = h["winner"], h["optimism"]
            console.print(
                Text(
                    f"  held-out ({h['split']}): HM {_fmt_sweep(hw['hm'])}"
                    + (f" ± {hw['hm_stderr']:.1f}" if hw.get("hm_stderr") is not None else "")
                    + (f"  optimism {opt:+.1f}" if opt is not None else "")
                    + (f" ± {h['optimism_stderr']:.1f}" if h.get("optimism_stderr") is not None else "")
                    + f" (chosen on {h['chosen_on']})"
                )
            )
        console.print(Text(f"reproduce: {w['reproduce']['command']}"))
        if w["reproduce"].get("out"):
            console.print(
                Text(
                    f"  (writes a copy to {w['reproduce']['out']}: {doc['output']['path']} already holds "
                    "this checkpoint)"
                )
            )
    else:
        console.print(Text(f"no winner: {doc['no_winner_reason']}"))
    console.print(
        Text(
            f"output: {doc['output']['path']} (sweep_report.json"
            + (", " + doc["plot"] if doc.get("plot") else "")
            + ")"
        )
    )
    for warning in doc["warnings"]:
        console.print(Text(f"warning: {warning}"))
    for note in doc.get("notes", []):
        console.print(Text(f"note: {note}"))
    g = doc.get("gate")
    if g:
        console.print(Text(f"gate: {'PASS' if g['passed'] else 'FAIL'}: {g['reason']}"))


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


_LABELS = {"retention": "retention", "normalised-accuracy": "normalised accuracy"}


def _best_value(best: dict) -> str:
    """``HM x``, or the objective's value when the sweep maximises another (``--objective``)."""
    if best.get("objective") in _LABELS:
        return f"{_LABELS[best['objective']]} {_fmt_sweep(best.get('value'))} %"
    return f"HM {_fmt_sweep(best['hm'])}"


def _progress_tail(ev: dict) -> str:
    """``· 2 running, 5 queued, best NAME (HM x), ETA …`` from an event's progress fields."""
    if "done" not in ev:
        return ""
    parts = []
    if ev.get("running"):
        parts.append(f"{len(ev['running'])} running")
    if ev.get("queued"):
        parts.append(f"{ev['queued']} queued")
    if ev.get("best"):
        parts.append(f"best {ev['best']['name']} ({_best_value(ev['best'])})")
    if ev.get("eta_s") is not None and (ev.get("running") or ev.get("queued") or ev["done"] < ev["budget"]):
        parts.append(f"ETA {_eta(ev['eta_s'])}")
    return (" · " + ", ".join(parts)) if parts else ""


def _candidate_line(ev: dict) -> str:
    r = ev["row"]
    head = f"[dghard] sweep {ev['order']}/{ev['budget']} {r['name']} ({r['phase']})"
    if r["status"] == "ok":
        tail = f"HM {_fmt_sweep(r['hm'])} (repair {_fmt_sweep(r['repair'])} %, retention {_fmt_sweep(r['retention'])} %)"
        if r.get("feasible") is False:
            worst = min(
                (v for v in (r.get("target_retention") or {}).values() if v is not None), default=None
            )
            bar = ev.get("min_target_retention")
            tail += f"; cannot win: target retention {_fmt_sweep(worst)} % is below" + (
                f" --min-target-retention {bar:g} %" if bar is not None else " the bar"
            )
    else:
        tail = f"{r['status']}: {r['message']}"
    secs = sum(v for v in (r.get("seconds") or {}).values() if isinstance(v, (int, float)))
    when = "cached" if r["cached"] else f"{secs:.1f} s"
    on = f" on device {r['device']}" if r.get("device") is not None else ""
    return f"{head}: {tail} [{when}{on}]"


class ProgressLines:
    """Progress as plain lines (logs, pipes): one per reference and per finished candidate, the
    counts of running and queued evaluations, the best so far and an ETA after each."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "info":
            self.console.print(Text(f"[dghard] sweep: {ev['message']}"))
        elif kind == "reference":
            if ev["source"] == "given":
                self.console.print(Text(f"[dghard] sweep: {ev['name']}: results from {ev['path']}"))
            else:
                how = "cached" if ev["source"] == "cached" else f"evaluated in {ev['seconds']:.1f} s"
                self.console.print(
                    Text(f"[dghard] sweep: {ev['name']} {how} ({ev['benchmarks']} benchmarks)")
                )
        elif kind == "evaluating" and (ev.get("reference") or ev.get("slots", 1) > 1):
            on = f" on device {ev['device']}" if ev.get("device") is not None else ""
            self.console.print(Text(f"[dghard] sweep: evaluating {ev['name']}{on} ..."))
        elif kind == "candidate":
            self.console.print(Text(_candidate_line(ev) + _progress_tail(ev)))

    def close(self) -> None:
        pass


class ProgressTable(ProgressLines):
    """Progress on a terminal: the lines above scroll, and below them a live table of the
    running evaluations (elapsed time, device), the counts, the best so far and the ETA."""

    def __init__(self, console: Console) -> None:
        super().__init__(console)
        from rich.live import Live

        self.state: dict = {}
        self.started: dict[str, float] = {}
        self.live = Live(console=console, get_renderable=self.table, refresh_per_second=2, transient=True)
        self.live.start()

    def __call__(self, ev: dict) -> None:
        import time

        if "done" in ev:
            self.state = ev
        if ev["kind"] == "evaluating" and "done" in ev:
            self.started[ev["name"]] = time.time()
        if ev["kind"] == "candidate":
            self.started.pop(ev["row"]["name"], None)
            self.console.print(Text(_candidate_line(ev)))
        elif ev["kind"] == "finished":
            self.close()
        elif ev["kind"] != "evaluating" or ev.get("reference"):
            super().__call__(ev)

    def table(self):  # noqa: ANN201 - a rich renderable
        import time

        from rich.console import Group

        st = self.state
        t = Table(box=None, show_header=True, header_style="bold")
        t.add_column("running")
        t.add_column("for", justify="right")
        now = time.time()
        for name in st.get("running", []):
            t.add_row(Text(name), _eta(now - self.started.get(name, now)))
        if not st:
            return t
        best = st.get("best")
        line = (
            f"done {st['done']}/{st['budget']} · running {len(st.get('running', []))} · queued "
            f"{st.get('queued', 0)} · best {best['name'] + ' ' + _best_value(best) if best else '—'}"
            f" · ETA {_eta(st.get('eta_s'))}"
        )
        return Group(t, Text(line, style="bold"))

    def close(self) -> None:
        if self.live.is_started:
            self.live.stop()


def progress_printer(console: Console) -> ProgressLines:
    """The progress display of a sweep: a live table on a terminal, plain lines elsewhere."""
    return ProgressTable(console) if console.is_terminal else ProgressLines(console)


class JsonLines:
    """Progress as one JSON object per line (``--json``: CI logs), with the same fields."""

    def __init__(self, console: Console) -> None:
        self.file = console.file

    def __call__(self, ev: dict) -> None:
        from dghard_cli.io.report_json import json_text

        ev = dict(ev)
        if "row" in ev:  # the row as the report has it, less what only the report needs
            ev["row"] = {
                k: v for k, v in ev["row"].items() if k not in ("score", "objective", "key", "log_tail")
            }
        self.file.write(json_text(ev, indent=None, default=str))
        self.file.flush()

    def close(self) -> None:
        pass


def json_lines(console: Console) -> JsonLines:
    return JsonLines(console)
