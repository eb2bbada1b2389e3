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

from __future__ import annotations

import os as _os

# OpenMP threads that spin while waiting turn LAPACK's eigensolver 10-100x slower whenever
# anything else wants a core -- the pipeline's own reader and writer threads included
# (measured here: torch.linalg.eigh of an 896x896 Gram matrix, 13.4 s spinning vs 0.13 s
# passive, on 2 busy cores). Passive waiting costs nothing measurable on an idle machine.
# Only effective when dghard is imported before torch starts its thread pool; a user's own
# setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch maps its large CPU buffers on 2 MB boundaries and asks for transparent huge pages
# (where the kernel offers them: "always" or "madvise"), so a new buffer costs one page fault
# per 2 MB instead of per 4 KB: task arithmetic on the 0.5B-shaped bench 4.3 -> 3.4 s, TIES
# 13.6 -> 12.3 s, peak RSS within 2 %. Read once, at torch's first allocation; a user's
# setting wins.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from importlib import import_module as _import_module  # noqa: E402
from pathlib import Path as _Path  # noqa: E402
from typing import TYPE_CHECKING as _TYPE_CHECKING  # noqa: E402

from dghard_cli._version import __version__  # noqa: E402

#: where each public name is defined. No submodule shares a name with a public function
#: (``repairing``, ``merging``, ``sweeping``, ``scoring`` hold ``repair``, ``merge``, ``sweep``
#: and ``score``), so importing a submodule never hides a function. Nothing is imported until a
#: name is used (PEP 562), so
#: ``import dghard_cli`` -- and ``dghard --version`` or ``--help`` -- loads neither torch nor
#: numpy; ``from dghard_cli import repair`` imports the repair stack then.
_EXPORTS = {
    "AuditOptions": "dghard_cli.audit.auditor",
    "audit_lora": "dghard_cli.audit.auditor",
    "PolicyOptions": "dghard_cli.engine.plan",
    "RunOptions": "dghard_cli.engine.writer",
    "CheckFailed": "dghard_cli.errors",
    "DGHardError": "dghard_cli.errors",
    "InputError": "dghard_cli.errors",
    "Interrupted": "dghard_cli.errors",
    "RuntimeFailure": "dghard_cli.errors",
    "InspectOptions": "dghard_cli.inspection",
    "MergeOptions": "dghard_cli.merging",
    "merge": "dghard_cli.merging",
    "RecallOptions": "dghard_cli.methods.calibration",
    "RepairOptions": "dghard_cli.repairing",
    "repair": "dghard_cli.repairing",
    "ShrinkSpec": "dghard_cli.spectral.spectrum",
    "SweepOptions": "dghard_cli.sweeping.run",
    "sweep": "dghard_cli.sweeping.run",
}

if _TYPE_CHECKING:  # what static tools see; at run time each name is imported on first use
    from dghard_cli.audit.auditor import AuditOptions, audit_lora
    from dghard_cli.engine.plan import PolicyOptions
    from dghard_cli.engine.writer import RunOptions
    from dghard_cli.errors import CheckFailed, DGHardError, InputError, Interrupted, RuntimeFailure
    from dghard_cli.inspection import InspectOptions
    from dghard_cli.merging import MergeOptions, merge
    from dghard_cli.methods.calibration import RecallOptions
    from dghard_cli.repairing import RepairOptions, repair
    from dghard_cli.spectral.spectrum import ShrinkSpec
    from dghard_cli.sweeping.run import SweepOptions, sweep


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dghard_cli' has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value  # the next use is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def inspect(base: str | _Path, ft: str | _Path, options: InspectOptions | None = None) -> dict:
    """The spectrum of every weight delta of FT against BASE and what ``repair`` would do to
    it, without writing a model (``dghard inspect``); returns the report-schema document.

    Example::

        from dghard_cli import InspectOptions, inspect
        doc = inspect("base/", "ft/", InspectOptions(matrices=4, plot_dir="plots/"))
        print(doc["summary"]["verdict"])
    """
    from dghard_cli.inspection import inspect_pair

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
    from dghard_cli.scoring.run import score_files

    return score_files(base, ft, candidates, **options)


def verify(directory: str | _Path, *, quick: bool = False, base: str | _Path | None = None) -> dict:
    """Re-check a written model directory as ``dghard verify`` does (headers, index, hashes
    against its report; with ``quick`` no tensor is read); InputError names the first problem.

    Example::

        from dghard_cli import verify
        print(verify("out/")["checks"])
    """
    from dghard_cli.verification import verify_directory

    if base is None:
        return verify_directory(_Path(directory), deep=not quick)
    from dghard_cli.io.hub import open_checkpoint

    base_ck = open_checkpoint(str(base), label="BASE")  # an adapter directory, checked against BASE
    try:
        return verify_directory(_Path(directory), deep=not quick, base=base_ck)
    finally:
        base_ck.close()


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
