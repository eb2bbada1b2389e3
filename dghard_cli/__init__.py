"""dghard: repair catastrophic forgetting in fine-tuned checkpoints, after the fact.

Library API (the CLI is a thin layer over these)::

    from dghard_cli import repair, RepairOptions, ShrinkSpec
    report = repair("base/", "ft/", "out/", RepairOptions(spec=ShrinkSpec(scale=1.0)))
"""

__version__ = "0.1.0"

from .errors import CheckFailed, DGHardError, InputError, RuntimeFailure  # noqa: E402
from .merge import MergeOptions, merge  # noqa: E402
from .plan import PolicyOptions  # noqa: E402
from .repair import RepairOptions, repair  # noqa: E402
from .runner import RunOptions  # noqa: E402
from .spectral import ShrinkSpec  # noqa: E402

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
