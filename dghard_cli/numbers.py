"""Bounded readers for the numbers that options and candidate files hold.

Every number a user (or a downloaded file, or the environment) gives goes through one of these
before arithmetic: an integer beyond float range (a YAML grid of 10**400), a digit string past
Python's integer-string limit (a device index of 5000 digits), NaN and Inf are refused as bad
input, never raised as ``OverflowError`` or ``ValueError`` from deep inside a command.
"""

from __future__ import annotations

import math
import os

from dghard_cli.errors import InputError

#: Digits an index (a device, a position) may have: far beyond any machine, far below the
#: interpreter's integer-string limit.
MAX_INDEX_DIGITS = 6


def is_finite_number(v: object) -> bool:
    """A finite int or float (not a bool), representable as a float (10**400 is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def index(text: str, what: str) -> int:
    """A whole number ``0 <= n < 10**MAX_INDEX_DIGITS`` written in ASCII digits; InputError
    naming ``what`` otherwise."""
    t = text.strip()
    if not (t.isascii() and t.isdigit()):
        raise InputError(f"{what}: {text!r} is not a whole number (0, 1, 2, ...)")
    t = t.lstrip("0") or "0"
    if len(t) > MAX_INDEX_DIGITS:
        raise InputError(f"{what}: a {len(t)}-digit index; no machine has that many")
    return int(t)


def env_number(name: str, default: float, *, low: float, high: float, what: str = "a number") -> float:
    """The number in environment variable ``name``, ``default`` when it is unset or blank.

    A value outside ``[low, high]``, NaN, Inf or no number at all is InputError naming the
    variable and the range: ignoring it ran with a value the user did not ask for, and an
    unbounded one overflowed inside a library (``DGHARD_RAY_START_TIMEOUT_S=1e300`` reached
    Ray's timeout arithmetic as an OverflowError). ``high`` is each variable's cap: far beyond
    any real use, far below what the code it reaches can convert.
    """
    raw = os.environ.get(name, "")
    text = raw.strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        shown = text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"
        raise InputError(f"{name} must be {what} from {low:g} to {high:g}, got {shown!r}")
    return value


def flag_value(v: object) -> str:
    """A value as a command line spells it: a float by ``repr`` (it reads back to the same
    float), a list or tuple comma-joined, anything else by ``str``."""
    if isinstance(v, (list, tuple)):
        return ",".join(flag_value(x) for x in v)
    if isinstance(v, float):
        return repr(v)
    return str(v)
