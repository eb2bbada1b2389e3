"""dghard: repair catastrophic forgetting in fine-tuned checkpoints, after the fact.

Library API (the CLI is a thin layer over these)::

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

from dghard_cli.engine.plan import PolicyOptions  # noqa: E402
from dghard_cli.engine.runner import RunOptions  # noqa: E402
from dghard_cli.errors import CheckFailed, DGHardError, InputError, RuntimeFailure  # noqa: E402
from dghard_cli.merge import MergeOptions, merge  # noqa: E402
from dghard_cli.repair import RepairOptions, repair  # noqa: E402
from dghard_cli.spectral.spectrum import ShrinkSpec  # noqa: E402

__all__ = [
    "__version__",
    "repair",
    "RepairOptions",
    "merge",
    "MergeOptions",
    "RunOptions",
    "PolicyOptions",
    "ShrinkSpec",
    "DGHardError",
    "InputError",
    "CheckFailed",
    "RuntimeFailure",
]
