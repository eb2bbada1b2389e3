"""Heavy libraries imported on first use, for the command line's start-up.

``dghard --version`` or ``dghard merge --help`` needs neither torch (about 2 s to import on a
2-core machine) nor numpy, yet most of the package imports them at module level. The console
script therefore calls :func:`defer` before it imports any command: ``import torch`` anywhere
then binds a placeholder module, and the real import runs the first time an attribute of it
is read (``torch.zeros``), once, under a lock, whichever thread gets there first. From then on
the placeholder holds the real module's attributes, so a lookup costs what it always did.

Only the command line does this; ``import dghard_cli`` from a user's program changes nothing
about how torch or numpy are imported. A module-level use of torch (a dtype table, a decorator
such as ``@torch.no_grad()``) still imports it at once: ``tests/test_startup.py`` keeps the
start-up path free of those, and ``DGHARD_DEBUG_IMPORTS=1`` prints where one comes from.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import traceback
import types

#: what :func:`defer` holds back: the libraries a command that computes nothing never needs
HEAVY = ("torch", "numpy")

_lock = threading.RLock()  # reentrant: importing torch imports numpy


class _Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a library not imported yet; the first attribute read
    imports it and copies its namespace in."""

    __real: types.ModuleType | None = None

    def __getattr__(self, attr: str):  # called only for names the placeholder lacks
        return getattr(self._real(), attr)

    def _real(self) -> types.ModuleType:
        with _lock:
            if self.__real is None:
                if os.environ.get("DGHARD_DEBUG_IMPORTS"):  # where a start-up path pulls torch in
                    traceback.print_stack(limit=40, file=sys.stderr)
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]  # the real import starts clean
                try:
                    real = importlib.import_module(self.__name__)
                except BaseException:
                    sys.modules.setdefault(self.__name__, self)
                    raise
                self.__dict__.update(real.__dict__)
                self.__real = real
            return self.__real


def defer(names: tuple[str, ...] = HEAVY) -> None:
    """Put a placeholder for each library in ``names`` that is not imported yet."""
    with _lock:
        for name in names:
            if name not in sys.modules and importlib.util.find_spec(name) is not None:
                sys.modules[name] = _Deferred(name)


def loaded(name: str) -> bool:
    """Whether the library ``name`` has really been imported (not only deferred)."""
    mod = sys.modules.get(name)
    return mod is not None and not isinstance(mod, _Deferred)
