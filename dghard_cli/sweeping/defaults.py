"""The sweep's defaults, in a module of their own so that the command line can show them in
``dghard sweep --help`` without importing the search."""

from __future__ import annotations

#: evaluations a sweep runs when ``--budget`` is not given
DEFAULT_BUDGET = 16
#: % of the fine-tune's gain every ``--target`` must keep (``--min-target-retention``)
DEFAULT_MIN_TARGET_RETENTION = 90.0
