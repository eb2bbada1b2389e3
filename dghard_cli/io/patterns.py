"""Regular expressions from adapter configs, matched as PEFT matches them, with a guard.

``target_modules``/``exclude_modules`` (a string is a regex, ``re.fullmatch``), the keys of
``rank_pattern``/``alpha_pattern`` (``re.match(rf"(.*\\.)?({key})$", name)``) and
``layers_pattern`` come from a downloaded file. Python's ``re`` backtracks, so a pattern such
as ``(a+)+$`` takes time exponential in the length of the name it is tried against: a hostile
config could hang the tool. Two guards:

1. **Before use** (:func:`pattern_problem`): a pattern is parsed (by ``re``'s own parser) and
   refused when it has a *nested quantifier* — a repeat (``*``, ``+``, ``{m,n}`` with n > 1)
   whose body holds another repeat or an alternation, the shape of every exponential case —,
   a backreference, more than :data:`MAX_REPEATS` unbounded repeats (polynomial blow-up:
   ``.*.*.*.*x``), or more than :data:`MAX_PATTERN_CHARS` characters. Real PEFT configs
   (``.*\\.(q_proj|v_proj)$``, ``^(?!.*vision).*attn.*``) pass.
2. **While matching** (:func:`bounded`): matching runs under a wall-clock budget when called on
   the main thread (``re`` checks for signals while it backtracks, so a SIGALRM stops it);
   a pattern that still exceeds the budget raises :class:`PatternTimeout`.

Callers turn a refused pattern into a config finding or a one-line InputError; it is never run.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator

from dghard_cli.errors import InputError

try:  # Python 3.11+
    import re._constants as _c  # type: ignore[import-not-found]
    import re._parser as _p  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

#: Longest pattern accepted from a config.
MAX_PATTERN_CHARS = 1000
#: Most unbounded repeats (``*``, ``+``, ``{m,}``) in one pattern.
MAX_REPEATS = 3
#: Wall-clock budget of one bounded matching section (seconds).
MATCH_BUDGET_S = 5.0

_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_UNBOUNDED = _c.MAXREPEAT


class PatternTimeout(InputError):
    """A pattern took longer than its matching budget (catastrophic backtracking): exit 2."""


#: Seconds each pattern has spent matching so far (its budget is shared by all the names).
_SPENT: dict[str, float] = {}


def _subpatterns(op, av) -> list:
    """The parsed sub-sequences of one node of ``re``'s parse tree."""
    if op in _REPEATS:
        return [av[2]]
    if op == _c.SUBPATTERN:
        return [av[-1]]
    if op == _c.BRANCH:
        return list(av[1])
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return [av[1]]
    if op == getattr(_c, "ATOMIC_GROUP", None):
        return [av]
    if op == _c.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    return []


def _walk(seq) -> Iterator[tuple]:
    stack = [seq]
    while stack:
        for op, av in stack.pop():
            yield op, av
            stack.extend(_subpatterns(op, av))


def _risky_body(seq) -> bool:
    """Does a repeated body hold a repeat (max > 1) or an alternation?"""
    for op, av in _walk(seq):
        if op in _REPEATS and av[1] > 1:
            return True
        if op == _c.BRANCH:
            return True
    return False


#: A pattern of word characters, ``-`` and dots only: each dot matches one character, nothing
#: else is special, so it is valid and cannot backtrack (checked without parsing it).
PLAIN_PATTERN = re.compile(r"[\w\-.]+", re.ASCII)


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` may not be matched against module names (None: it may)."""
    if not isinstance(pattern, str):
        return "it is not a string"
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"it is longer than {MAX_PATTERN_CHARS} characters"
    if PLAIN_PATTERN.fullmatch(pattern):  # literal characters and "." only: no repeat, no group
        return None
    try:
        parsed = _p.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"it is not a valid regular expression ({exc})"
    unbounded = 0
    for op, av in _walk(list(parsed)):
        if op in (_c.GROUPREF, _c.GROUPREF_EXISTS):
            return "it uses a backreference"
        if op in _REPEATS and av[1] > 1:
            if av[1] == _UNBOUNDED:
                unbounded += 1
            if _risky_body(av[2]):
                return (
                    "it has a nested quantifier (a repeated group that holds a repeat or an "
                    "alternation), which can backtrack catastrophically"
                )
    if unbounded > MAX_REPEATS:
        return f"it has more than {MAX_REPEATS} unbounded repeats, which can backtrack for minutes"
    return None


def reset_budgets() -> None:
    """Give every pattern a fresh budget (called when a new config is read)."""
    _SPENT.clear()


@contextlib.contextmanager
def bounded(what: str, key: str | None = None, budget: float = MATCH_BUDGET_S) -> Iterator[None]:
    """Run the body under a wall-clock budget (main thread only; elsewhere: unbounded).

    With ``key`` (the pattern) the budget is shared by every call with that key, so one pattern
    tried against many names gets ``budget`` seconds in all. Raises :class:`PatternTimeout`
    naming ``what`` when the budget is spent.
    """
    message = f"{what}: matching took longer than {budget:g} s (catastrophic backtracking?); fix the pattern"
    left = budget - _SPENT.get(key, 0.0) if key is not None else budget
    if left <= 0:
        raise PatternTimeout(message)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
        raise PatternTimeout(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, left)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if key is not None:
            if len(_SPENT) > 10_000:
                _SPENT.clear()
            _SPENT[key] = _SPENT.get(key, 0.0) + time.perf_counter() - t0
        if old_timer[0]:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def peft_fullmatch(pattern: str, name: str) -> bool:
    """``target_modules``/``exclude_modules`` as a string: PEFT's ``re.fullmatch``."""
    return re.fullmatch(pattern, name) is not None


def peft_key_match(key: str, name: str) -> bool:
    """A ``rank_pattern``/``alpha_pattern`` key: PEFT's ``re.match(rf"(.*\\.)?({key})$", name)``."""
    return re.match(rf"(.*\.)?({key})$", name) is not None
