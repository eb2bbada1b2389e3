"""The output's model card: the fine-tune's own ``README.md``, kept, with the run's section added.

A fine-tune's card carries what the output must keep: its license, its Hub metadata (the YAML
front matter between ``---`` lines), its description. So OUT's ``README.md`` is the fine-tune's
card, unchanged, followed by a section about the run (:func:`dghard_cli.report.build.model_card`),
and the front matter gains one entry when it lacks it: ``base_model: <BASE as given>``, the Hub's
model-card metadata for "derived from". The rules:

- the fine-tune's card has front matter that is a YAML mapping: kept line for line; a
  ``base_model`` it declares is kept as it is (theirs names the model the fine-tune was trained
  from, which is what the key means); when it has none, ``base_model: BASE`` is appended to it;
- it has no front matter: ours is put in front of its text (``base_model`` and the tags
  ``dghard`` and the method);
- its front matter is not a YAML mapping: kept verbatim and not edited (nothing is added);
- it has no ``README.md``, or one that may not be read (not a regular file inside FT, larger
  than the side-file limit, not UTF-8): the card is ours alone, with ``base_model``.

What was done is one line in the report (``output.model_card``).
"""

from __future__ import annotations

import yaml

from dghard_cli.errors import InputError
from dghard_cli.io.limits import parse_yaml

#: The heading the run's section gets inside the fine-tune's card.
SECTION_PREFIX = "#"


def split_front_matter(text: str) -> tuple[str | None, str]:
    """``(front matter, rest)`` of a Markdown card: the lines between a first line ``---`` and
    the next ``---`` (or ``...``) line; ``(None, text)`` when the card has none."""
    body = text[1:] if text.startswith("\ufeff") else text
    lines = body.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        return None, text
    for i in range(1, len(lines)):
        if lines[i].strip() in ("---", "..."):
            return "".join(lines[1:i]), "".join(lines[i + 1 :])
    return None, text


def front_matter_mapping(front: str | None) -> dict | None:
    """The front matter as a mapping, or None when it is absent or not a YAML mapping."""
    if front is None:
        return None
    try:  # bounded: a downloaded card's front matter may be an alias bomb
        doc = parse_yaml(front, "README.md front matter")
    except (yaml.YAMLError, InputError, RecursionError, ValueError):
        return None
    if doc is None:
        return {}
    return doc if isinstance(doc, dict) else None


def declared_base_models(text: str | None) -> list[str]:
    """The ``base_model`` entries a card's front matter declares (a string or a list of them)."""
    if text is None:
        return []
    meta = front_matter_mapping(split_front_matter(text)[0])
    value = (meta or {}).get("base_model")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def _yaml_entry(key: str, value: str) -> str:
    return yaml.safe_dump({key: value}, allow_unicode=True, default_flow_style=False, width=10**6)


def _demoted(section: str) -> str:
    """Our card's Markdown with every heading one level deeper (it becomes a section)."""
    out = []
    fence = False
    for line in section.splitlines():
        if line.startswith("```"):
            fence = not fence
        out.append(SECTION_PREFIX + line if not fence and line.startswith("#") else line)
    return "\n".join(out)


def compose(ours: str, theirs: str | None, base_model: str, why_not: str | None = None) -> tuple[str, str]:
    """``(README.md, note)``: the card OUT gets from ours and the fine-tune's (see the module).

    ``ours`` is :func:`dghard_cli.report.build.model_card`'s card (front matter and body);
    ``theirs`` the fine-tune's README (None: it has none, ``why_not`` says why).
    """
    our_front, our_body = split_front_matter(ours)
    entry = _yaml_entry("base_model", base_model)
    if theirs is None:
        front = entry + (our_front or "")
        card = f"---\n{front}---\n{our_body}"
        what = (
            "the fine-tune has no README.md" if why_not in (None, "absent") else f"FT's README.md {why_not}"
        )
        return card, f"written by dghard ({what}); base_model: {base_model}"
    section = _demoted(our_body.strip("\n"))
    their_front, their_body = split_front_matter(theirs)
    meta = front_matter_mapping(their_front)
    tail = "\n\n" + section + "\n"
    if their_front is None:
        front = entry + (our_front or "")
        card = f"---\n{front}---\n{theirs.rstrip()}{tail}"
        return (
            card,
            f"the fine-tune's card, with front matter added (base_model: {base_model}) and the run's section",
        )
    if meta is None:
        card = theirs.rstrip() + tail
        return (
            card,
            "the fine-tune's card (its front matter is not a YAML mapping: kept as it is) and the run's section",
        )
    if "base_model" in meta:
        head = their_front
        note = "the fine-tune's card (its base_model kept) and the run's section"
    else:
        head = their_front + ("" if not their_front or their_front.endswith("\n") else "\n") + entry
        note = f"the fine-tune's card, base_model: {base_model} added, and the run's section"
    card = f"---\n{head}---\n{their_body.rstrip()}{tail}"
    return card, note
