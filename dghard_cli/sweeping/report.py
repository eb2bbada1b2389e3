"""The sweep's report (``sweep_report.json``) and its frontier plot."""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.sweeping.choose import OBJECTIVE_LABELS, OBJECTIVES, explain_choice
from dghard_cli.sweeping.state import SweepState

SCHEMA_VERSION = 1
FRONTIER_PNG = "sweep_frontier.png"


def plot(s: SweepState, final: Path, winner: dict | None) -> tuple[str | None, str | None]:
    """(the plot's file name in OUT, None) or (None, why there is none)."""
    missing = "matplotlib is not installed (pip install 'dghard[plot]')"
    try:
        from dghard_cli.sweeping.plot import frontier_png
    except ImportError:
        return None, missing
    try:
        png = frontier_png(s.rows, winner, s.ref_scores, several=len(s.ft_specs) > 1)
    except ImportError:
        return None, missing
    if png is None:
        return None, "% repair or % retention is undefined (no damaged or no improved benchmarks)"
    (final / FRONTIER_PNG).write_bytes(png)
    return FRONTIER_PNG, None


def report(s: SweepState, winner: dict | None, reason: str | None, regenerated: bool) -> dict:
    o = s.opts
    rows = []
    for r in s.rows:
        row = {k: v for k, v in r.items() if k not in ("objective", "score", "key")}
        row["benchmarks"] = r["score"]["benchmarks"] if r.get("score") else None
        row["distance"] = None if r["distance"] is None or not math.isfinite(r["distance"]) else r["distance"]
        rows.append(row)
    win = None
    if winner is not None:
        win = {
            k: winner[k]
            for k in (
                "order",
                "name",
                "family",
                "axis",
                "value",
                "params",
                "hm",
                "hm_stderr",
                "vs_best",
                "vs_best_stderr",
                "repair",
                "retention",
                "normalised_accuracy",
                "unchanged_mean_change",
                "target_retention",
                "target_retention_mean",
                "distance",
                "reproduce",
            )
        }
        win["rewritten_at_end"] = regenerated
        win["choice"] = explain_choice(s.rows, winner, s.bar, o.tie_tolerance, o.objective, o.tie_rule)
    gate = None
    if o.fail_under is not None:
        label = OBJECTIVE_LABELS[o.objective]
        value = winner[OBJECTIVES[o.objective]] if winner else None
        passed = value is not None and value >= o.fail_under
        if winner is None:
            why = f"no winner ({reason}), so the gate at {o.fail_under:g} cannot pass"
        elif value is None:
            why = f"winner {winner['name']!r}: {label} is undefined, so the gate at {o.fail_under:g} cannot pass"
        elif passed:
            why = f"winner {winner['name']!r}: {label} {value:.2f} >= {o.fail_under:g}"
        else:
            why = f"winner {winner['name']!r}: {label} {value:.2f} is below --fail-under {o.fail_under:g}"
        gate = {
            "fail_under": o.fail_under,
            "objective": o.objective,
            "value": value,
            "hm": winner["hm"] if winner else None,
            "passed": passed,
            "reason": why,
        }
    refs = dict(s.refs)
    for label, ref in refs.items():
        nm = {"base": "BASE", "ft": "FT"}.get(label, f"FT #{label[2:]}")
        sc = s.ref_scores.get(nm)
        if sc:
            ref.update(repair=sc["repair"], retention=sc["retention"], hm=sc["hm"], hm_stderr=sc["hm_stderr"])
    inputs = {"base": s.base_ck.describe()}
    if len(s.ft_cks) == 1:
        inputs["ft"] = s.ft_cks[0].describe()
    else:
        inputs["fts"] = [f.describe() for f in s.ft_cks]
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "sweep",
        "tool": {"name": "dghard", "version": __version__},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": o.argv,
        "inputs": inputs,
        "eval": {
            "template": o.eval_template,
            "timeout": o.eval_timeout,
            **({"lm_eval": o.lm_eval} if o.lm_eval is not None else {}),
        },
        "options": {
            "targets": list(o.targets),
            "margin": o.margin,
            "metric": o.metric,
            "min_target_retention": s.bar,
            "objective": o.objective,
            "tie_tolerance": o.tie_tolerance,
            "tie_rule": o.tie_rule,
            "fail_under": o.fail_under,
            "device": o.device,
            "dtype": o.dtype,
        },
        "candidates_file": s.candidates_source,
        "families": [e.describe() for e in s.active],
        "skipped_families": s.skipped,
        # the smallest objective difference the evaluation resolves (sweeping/compare.py)
        "resolution": None if s.resolution is None else round(s.resolution, 3),
        "budget": {
            "total": o.budget,
            "reference_evaluations": s.n_ref_evals,
            "candidate_evaluations": len(s.rows),
            "candidate_budget": s.cand_budget,
            "used": s.n_ref_evals + len(s.rows),
            "run_now": s.run_count,
            "from_cache": s.cached_count,
        },
        "references": refs,
        **({"scoring": scoring(s)} if len(s.ft_specs) > 1 else {}),
        "benchmarks": s.score_doc["benchmarks"],
        "counts": s.score_doc["counts"],
        "candidates": rows,
        "winner": win,
        "no_winner_reason": reason,
        "gate": gate,
        "disk": {
            "peak_bytes": s.disk_peak,
            "candidate_bytes_max": max((r.get("bytes") or 0 for r in s.rows), default=0),
        },
        "timings": {
            "total": round(time.perf_counter() - s.t0, 3),
            "write": round(s.t["write"], 3),
            "distance": round(s.t["distance"], 3),
            "eval": round(s.t["eval"], 3),
        },
        "output": {"path": s.out_arg},
        "warnings": s.warnings + [w for w in s.score_doc["warnings"]],
        **({"notes": list(s.score_doc.get("notes", []))} if len(s.ft_specs) > 1 else {}),
    }


def scoring(s: SweepState) -> dict:
    """How the candidates were scored with several fine-tunes: against each benchmark's
    expert, with the targets counted in % retention (one fine-tune: as ``score`` does; the
    report has no ``scoring`` section, so its fields are those of earlier versions)."""
    return {
        "fine_tunes": len(s.ft_cks),
        "reference": "experts",
        "retention_includes_targets": True,
        "unchanged_in_repair": True,
        "experts": {k: {**v, "fine_tune": s.ft_specs[v["expert"]]} for k, v in s.expert_choice.items()},
    }
