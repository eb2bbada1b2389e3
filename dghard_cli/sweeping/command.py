"""The evaluation command, built from its template's tokens once.

The template is split into literal text and placeholders (``{model}``, ``{output}``,
``{device}``, ``{split}``) in one pass; the command is the literal text as written with each placeholder replaced, exactly
once, by the shell-quoted (``shlex.quote``) value. Nothing produced by a substitution is ever
looked at again, so a path that itself contains ``{output}``, quotes, ``$(…)``, backticks,
``;`` or a newline stays one literal word: a path can never become code. (Substituting with
``str.replace`` one placeholder after the other re-scans the first substitution, and a model
directory named ``x{output}$(cmd)`` would break out of its quotes.)
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

PLACEHOLDERS = ("model", "output", "device", "split")
_TOKEN = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


@dataclass(frozen=True)
class Template:
    """A parsed template: literal parts and placeholder names, in order."""

    text: str
    parts: tuple[tuple[str, str], ...]  # ("text", literal) | ("var", name)

    @classmethod
    def parse(cls, text: str) -> Template:
        parts: list[tuple[str, str]] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                parts.append(("text", text[pos : m.start()]))
            parts.append(("var", m.group(1)))
            pos = m.end()
        if pos < len(text):
            parts.append(("text", text[pos:]))
        return cls(text, tuple(parts))

    def uses(self, name: str) -> bool:
        return any(kind == "var" and v == name for kind, v in self.parts)

    def fill(self, name: str, value: str) -> str:
        """The template's text with placeholder ``name`` replaced by the quoted ``value`` and
        every other placeholder kept as written (a template still)."""
        out = []
        for kind, v in self.parts:
            out.append(v if kind == "text" else shlex.quote(value) if v == name else "{" + v + "}")
        return "".join(out)

    def render(self, values: Mapping[str, str]) -> str:
        """The shell command: every placeholder replaced once by its quoted value."""
        out = []
        for kind, v in self.parts:
            out.append(v if kind == "text" else shlex.quote(str(values[v])))
        return "".join(out)


def build_command(template: str, **values: str) -> str:
    """``Template.parse(template).render(values)`` (values: ``model=…, output=…, device=…``)."""
    return Template.parse(template).render(values)


#: What ``{split}`` becomes: the split a sweep chooses on, and its held-out split
#: (:mod:`dghard_cli.sweeping.holdout`).
CHOOSE_SPLIT, HELD_OUT_SPLIT = "val", "test"


def uses_split(template: str) -> bool:
    return Template.parse(template).uses("split")


def for_split(template: str, split: str) -> str:
    """``template`` with ``{split}`` replaced (the other placeholders kept); unchanged without it."""
    return Template.parse(template).fill("split", split) if uses_split(template) else template
