"""Setting a sweep up: its options checked and its candidate file read (:func:`validate`), its
inputs opened and OUT checked, the entries that apply chosen and the budget split
(:func:`open_inputs`)."""

from __future__ import annotations

import math
from pathlib import Path

from dghard_cli._version import __version__
from dghard_cli.errors import InputError
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.output import check_out_path
from dghard_cli.io.paths import Output, check_outputs
from dghard_cli.lora.source import is_adapter, open_ft
from dghard_cli.sweeping.cache import input_identity
from dghard_cli.sweeping.candidate_file import load_candidates, parse_candidates
from dghard_cli.sweeping.choose import OBJECTIVES
from dghard_cli.sweeping.defaults import DEFAULT_MIN_TARGET_RETENTION
from dghard_cli.sweeping.evaluate import check_template
from dghard_cli.sweeping.execution import plan_execution
from dghard_cli.sweeping.families import check_entry, degenerate_on_adapters
from dghard_cli.sweeping.lines import bind_entries as bind_lines
from dghard_cli.sweeping.state import SweepState


def effective_bar(min_target_retention: float | None, n_fts: int) -> float | None:
    """The target bar in force: the one given, else 90 % with one fine-tune and none with several
    (there the targets are part of % retention, so HM already weighs them)."""
    if min_target_retention is not None:
        return min_target_retention
    return DEFAULT_MIN_TARGET_RETENTION if n_fts == 1 else None


def validate(s: SweepState) -> None:
    o = s.opts
    check_template(o.eval_template)
    if isinstance(o.budget, bool) or not isinstance(o.budget, int) or o.budget < 1:
        raise InputError(f"--budget must be a whole number >= 1, got {o.budget!r}")
    if o.eval_timeout is not None and not (math.isfinite(o.eval_timeout) and o.eval_timeout > 0):
        raise InputError(f"--eval-timeout must be a number of seconds > 0, got {o.eval_timeout}")
    for name, v in (
        ("--min-target-retention", o.min_target_retention),
        ("--tie-tolerance", o.tie_tolerance),
        ("--tie-rule", o.tie_rule),
    ):
        if v is not None and not math.isfinite(v):
            raise InputError(f"{name} must be finite, got {v}")
    if o.objective not in OBJECTIVES:
        raise InputError(f"--objective {o.objective!r} is not one of {', '.join(OBJECTIVES)}")
    if o.tie_tolerance < 0:
        raise InputError(f"--tie-tolerance must be >= 0 points, got {o.tie_tolerance}")
    if not 0 <= o.tie_rule <= 10:
        raise InputError(f"--tie-rule must be a number of standard errors in [0, 10], got {o.tie_rule}")
    if o.margin is not None and not (math.isfinite(o.margin) and o.margin >= 0):
        raise InputError(f"--margin must be a finite number >= 0, got {o.margin}")
    if o.fail_under is not None and not math.isfinite(o.fail_under):
        raise InputError(f"--fail-under must be finite, got {o.fail_under}")
    if len(o.ft_results) > len(s.ft_specs):
        raise InputError(
            f"--ft-results given {len(o.ft_results)} times but there are {len(s.ft_specs)} fine-tune(s)"
        )
    for p in [o.base_results, *o.ft_results]:
        if p is not None and not Path(p).expanduser().exists():
            raise InputError(f"results {p}: no such file or directory")
    from dghard_cli.scoring.results import SCALES

    if o.dtype is not None:
        from dghard_cli.io.safetensors_format import parse_dtype_option

        o.dtype = parse_dtype_option(o.dtype)

    if o.units not in SCALES:
        raise InputError(f"--units {o.units!r} is not one of {', '.join(SCALES)}")
    for r in o.refine:
        if r != "groups":
            raise InputError(f"--refine {r!r} is not one of: groups")
    s.slots, s.devices = plan_execution(o)
    if o.families is not None:
        s.entries = parse_candidates({"families": o.families}, "SweepOptions.families")
        s.candidates_source = "SweepOptions.families"
    else:
        s.entries, s.candidates_source = load_candidates(o.candidates)


def open_inputs(s: SweepState) -> None:
    s.base_ck = open_checkpoint(s.base_spec, label="BASE")
    s.ft_cks = []
    for i, spec in enumerate(s.ft_specs):
        label = "FT" if i == 0 else f"--merge-ft {spec}"
        s.ft_cks.append(open_ft(spec, base=s.base_ck, label=label))
    # LoRA adapters: evaluated as full merged checkpoints; each candidate written as an adapter
    # where that is exact, else merged (steps.py, families.writes_adapter)
    s.adapters = any(is_adapter(f) for f in s.ft_cks)
    check_out_path(s.out, [s.base_ck.path, *[f.path for f in s.ft_cks]], overwrite=s.opts.overwrite)
    given = [("--base-results", s.opts.base_results)]
    given += [("--ft-results", r) for r in s.opts.ft_results]
    check_outputs(given, [Output("OUT", s.out, is_dir=True, replaces=True)])
    if s.stage.exists() and not s.stage.is_dir():
        raise InputError(f"{s.stage} exists and is not a directory; remove it")
    n = len(s.ft_cks)
    s.bar = effective_bar(s.opts.min_target_retention, n)
    s.active = []
    s.skipped = []
    for e in s.entries:
        if s.adapters and degenerate_on_adapters(e):
            s.skipped.append(
                {
                    **e.describe(),
                    "skipped": "a LoRA adapter's update has only r non-zero singular values, so the "
                    "unknown-noise cut is undefined on it",
                }
            )
        elif e.applies(n) and e.origin == "merges":
            try:  # one entry per registered method: one that cannot take these inputs is skipped
                check_entry(e, n, f"{s.candidates_source}: merges ({e.family})")
            except InputError as exc:
                s.skipped.append({**e.describe(), "skipped": str(exc)})
            else:
                s.active.append(e)
        elif e.applies(n):
            check_entry(e, n, f"{s.candidates_source}: families[{e.index}] ({e.family})")
            s.active.append(e)
        else:
            s.skipped.append(
                {
                    **e.describe(),
                    "skipped": f"applies with {e.fine_tunes or e.kind.default_when} fine-tune(s), given {n}",
                }
            )
    if not s.active:
        raise InputError(
            f"{s.candidates_source}: no candidate family applies to {n} fine-tune(s) "
            "(repair shrinkers and wise-ft take one; the other merge methods apply with several)"
        )
    s.warnings += bind_lines(
        s.active,
        s.skipped,
        s.base_ck,
        s.ft_cks[0],
        refine_groups="groups" in s.opts.refine,
    )
    s.identity = {
        "base": input_identity(s.base_ck),
        "fts": [input_identity(f) for f in s.ft_cks],
        "template": s.opts.eval_template,
        "dghard": __version__,
    }
    s.n_ref_evals = (s.opts.base_results is None) + sum(1 for i in range(n) if i >= len(s.opts.ft_results))
    s.cand_budget = s.opts.budget - s.n_ref_evals
    if s.cand_budget < 1:
        raise InputError(
            f"--budget {s.opts.budget} leaves no evaluation for a candidate: evaluating BASE and the "
            f"fine-tune(s) takes {s.n_ref_evals} (give --base-results/--ft-results, or a larger --budget)"
        )


def close(s: SweepState) -> None:
    for ck in [s.base_ck, *s.ft_cks]:
        if ck is not None:
            ck.close()
