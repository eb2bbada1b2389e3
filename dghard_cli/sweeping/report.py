"""The sweep's report (``sweep_report.json``) and its frontier plot."""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path

from dghard_cli._version import __version__

SCHEMA_VERSION = 1
FRONTIER_PNG = "sweep_frontier.png"


class SweepReport:
    """How a finished sweep writes its report and plot (a part of ``run._Sweep``)."""

    def plot(self, final: Path, winner: dict | None) -> tuple[str | None, str | None]:
        """(the plot's file name in OUT, None) or (None, why there is none)."""
        missing = "matplotlib is not installed (pip install 'dghard[plot]')"
        try:
            from dghard_cli.sweeping.plot import frontier_png
        except ImportError:
            return None, missing
        try:
            png = frontier_png(self.rows, winner, self.ref_scores, several=len(self.ft_specs) > 1)
        except ImportError:
            return None, missing
        if png is None:
            return None, "% repair or % retention is undefined (no damaged or no improved benchmarks)"
        (final / FRONTIER_PNG).write_bytes(png)
        return FRONTIER_PNG, None

    def report(self, winner: dict | None, reason: str | None, regenerated: bool) -> dict:
        o = self.opts
        rows = []
        for r in self.rows:
            row = {k: v for k, v in r.items() if k not in ("objective", "score", "key")}
            row["benchmarks"] = r["score"]["benchmarks"] if r.get("score") else None
            row["distance"] = (
                None if r["distance"] is None or not math.isfinite(r["distance"]) else r["distance"]
            )
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
                    "repair",
                    "retention",
                    "unchanged_mean_change",
                    "target_retention",
                    "target_retention_mean",
                    "distance",
                    "reproduce",
                )
            }
            win["rewritten_at_end"] = regenerated
        gate = None
        if o.fail_under is not None:
            hm = winner["hm"] if winner else None
            passed = hm is not None and hm >= o.fail_under
            if winner is None:
                why = f"no winner ({reason}), so the gate at {o.fail_under:g} cannot pass"
            elif passed:
                why = f"winner {winner['name']!r}: HM {hm:.2f} >= {o.fail_under:g}"
            else:
                why = f"winner {winner['name']!r}: HM {hm:.2f} is below --fail-under {o.fail_under:g}"
            gate = {"fail_under": o.fail_under, "hm": hm, "passed": passed, "reason": why}
        refs = dict(self.refs)
        for label, ref in refs.items():
            nm = {"base": "BASE", "ft": "FT"}.get(label, f"FT #{label[2:]}")
            sc = self.ref_scores.get(nm)
            if sc:
                ref.update(repair=sc["repair"], retention=sc["retention"], hm=sc["hm"])
        inputs = {"base": self.base_ck.describe()}
        if len(self.ft_cks) == 1:
            inputs["ft"] = self.ft_cks[0].describe()
        else:
            inputs["fts"] = [f.describe() for f in self.ft_cks]
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
                "min_target_retention": self.bar,
                "tie_tolerance": o.tie_tolerance,
                "fail_under": o.fail_under,
                "device": o.device,
                "dtype": o.dtype,
            },
            "candidates_file": self.candidates_source,
            "families": [e.describe() for e in self.active],
            "skipped_families": self.skipped,
            "budget": {
                "total": o.budget,
                "reference_evaluations": self.n_ref_evals,
                "candidate_evaluations": len(self.rows),
                "candidate_budget": self.cand_budget,
                "used": self.n_ref_evals + len(self.rows),
                "run_now": self.run_count,
                "from_cache": self.cached_count,
            },
            "references": refs,
            **({"scoring": self.scoring()} if len(self.ft_specs) > 1 else {}),
            "benchmarks": self.score_doc["benchmarks"],
            "counts": self.score_doc["counts"],
            "candidates": rows,
            "winner": win,
            "no_winner_reason": reason,
            "gate": gate,
            "disk": {
                "peak_bytes": self.disk_peak,
                "candidate_bytes_max": max((r.get("bytes") or 0 for r in self.rows), default=0),
            },
            "timings": {
                "total": round(time.perf_counter() - self.t0, 3),
                "write": round(self.t["write"], 3),
                "distance": round(self.t["distance"], 3),
                "eval": round(self.t["eval"], 3),
            },
            "output": {"path": self.out_arg},
            "warnings": self.warnings + [w for w in self.score_doc["warnings"]],
            **({"notes": list(self.score_doc.get("notes", []))} if len(self.ft_specs) > 1 else {}),
        }

    def scoring(self) -> dict:
        """How the candidates were scored with several fine-tunes: against each benchmark's
        expert, with the targets counted in % retention (one fine-tune: as ``score`` does; the
        report has no ``scoring`` section, so its fields are those of earlier versions)."""
        return {
            "fine_tunes": len(self.ft_cks),
            "reference": "experts",
            "retention_includes_targets": True,
            "unchanged_in_repair": True,
            "experts": {
                k: {**v, "fine_tune": self.ft_specs[v["expert"]]} for k, v in self.expert_choice.items()
            },
        }
