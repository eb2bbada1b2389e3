"""dghard: repair catastrophic forgetting in fine-tuned checkpoints, after the fact.

The public API (the CLI is a thin layer over it): one function per command, ``repair``,
``merge``, ``sweep``, ``inspect``, ``audit_lora``, ``score`` and ``verify``, each returning the
document the command prints with ``--json``; their options (``RepairOptions``,
``MergeOptions``, ``SweepOptions``, ``InspectOptions``, ``AuditOptions``, with ``RunOptions``,
``PolicyOptions``, ``ShrinkSpec``, ``RecallOptions``) and the errors they raise
(``InputError``: bad input, exit 2; ``CheckFailed``: exit 1; ``RuntimeFailure`` and
``Interrupted``: exit 3; all ``DGHardError``). Each function's docstring has an example::

    from dghard_cli import repair, RepairOptions, ShrinkSpec
    report = repair("base/", "ft/", "out/", RepairOptions(spec=ShrinkSpec(scale=1.0)))
"""

import os as _os

# OpenMP threads that spin while waiting turn LAPACK's eigensolver 10-100x slower whenever
# anything else wants a core -- the pipeline's own reader and writer threads included
# (measured here: torch.linalg.eigh of an 896x896 Gram matrix, 13.4 s spinning vs 0.13 s
# passive, on 2 busy cores). Passive waiting costs nothing measurable on an idle machine.
# Only effective when dghard is imported before torch starts its thread pool; a user's own
# setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

from pathlib import Path as _Path  # noqa: E402

from dghard_cli.audit.auditor import AuditOptions, audit_lora  # noqa: E402
from dghard_cli.engine.plan import PolicyOptions  # noqa: E402
from dghard_cli.engine.runner import RunOptions  # noqa: E402
from dghard_cli.errors import CheckFailed, DGHardError, InputError, Interrupted, RuntimeFailure  # noqa: E402
from dghard_cli.inspection import InspectOptions, inspect_pair  # noqa: E402
from dghard_cli.io.verify import verify_dir  # noqa: E402
from dghard_cli.merge import MergeOptions, merge  # noqa: E402
from dghard_cli.methods.calibration import RecallOptions  # noqa: E402
from dghard_cli.repair import RepairOptions, repair  # noqa: E402
from dghard_cli.score.scoring import score_files  # noqa: E402
from dghard_cli.spectral.spectrum import ShrinkSpec  # noqa: E402
from dghard_cli.sweep.run import SweepOptions, sweep  # noqa: E402


def inspect(base: str | _Path, ft: str | _Path, options: InspectOptions | None = None) -> dict:
    """The spectrum of every weight delta of FT against BASE and what ``repair`` would do to
    it, without writing a model (``dghard inspect``); returns the report-schema document.

    Example::

        from dghard_cli import InspectOptions, inspect
        doc = inspect("base/", "ft/", InspectOptions(matrices=4, plot_dir="plots/"))
        print(doc["summary"]["verdict"])
    """
    return inspect_pair(base, ft, options)


def score(base: str | _Path, ft: str | _Path, candidates: list[str], **options) -> dict:
    """% repair, % retention and their HM of each candidate's evaluation results against
    BASE's and FT's (``dghard score``). ``options``: ``targets``, ``margin``, ``metric``,
    ``scale`` (the units: auto, fraction or points), ``subtasks``, ``fail_under``.

    Example::

        from dghard_cli import score
        doc = score("eval/base.json", "eval/ft.json", ["repaired=eval/repaired.json"], targets=["gsm8k"])
        print(doc["best"])
    """
    return score_files(base, ft, candidates, **options)


def verify(directory: str | _Path, *, quick: bool = False) -> dict:
    """Re-check a written model directory as ``dghard verify`` does (headers, index, hashes
    against its report; with ``quick`` no tensor is read); InputError names the first problem.

    Example::

        from dghard_cli import verify
        print(verify("out/")["checks"])
    """
    return verify_dir(_Path(directory), deep=not quick, use_report=True)


__all__ = [
    "__version__",
    "repair",
    "RepairOptions",
    "merge",
    "MergeOptions",
    "RecallOptions",
    "sweep",
    "SweepOptions",
    "inspect",
    "InspectOptions",
    "audit_lora",
    "AuditOptions",
    "score",
    "verify",
    "RunOptions",
    "PolicyOptions",
    "ShrinkSpec",
    "DGHardError",
    "InputError",
    "CheckFailed",
    "RuntimeFailure",
    "Interrupted",
]
