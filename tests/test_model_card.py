"""OUT's README.md: the fine-tune's own model card kept, with base_model and the run's section."""

from __future__ import annotations

import yaml

from dghard_cli import repair
from dghard_cli.report.model_card import compose, declared_base_models, split_front_matter
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)

THEIR_CARD = """---
license: llama3.1
base_model: meta-llama/Llama-3.1-8B
datasets:
- my-org/my-data
---

# my-org/my-finetune

Fine-tuned for support tickets. Not for medical advice.
"""


def _front(card: str) -> dict:
    front, _ = split_front_matter(card)
    assert front is not None, card[:200]
    return yaml.safe_load(front)


def test_the_fine_tunes_card_is_kept_with_its_base_model_and_gets_the_run_section(tmp_path):
    base, ft = make_pair(tmp_path, CFG, ft_files={"README.md": THEIR_CARD})
    doc = repair(base, ft, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    # their front matter line for line, their base_model (not ours), their text, then ours
    assert card.startswith(THEIR_CARD.split("\n---\n")[0] + "\n---\n")
    assert _front(card) == yaml.safe_load(split_front_matter(THEIR_CARD)[0])
    assert "Fine-tuned for support tickets. Not for medical advice." in card
    assert card.index("Not for medical advice") < card.index("## dg-hard output")
    assert "Made by `dghard repair`" in card and "### Result" in card
    assert "base_model kept" in doc["output"]["model_card"]


def test_base_model_is_added_when_their_card_lacks_it(tmp_path):
    card_in = "---\nlicense: mit\ntags:\n- chat\n---\nMy model.\n"
    base, ft = make_pair(tmp_path, CFG, ft_files={"README.md": card_in})
    doc = repair(base, ft, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert _front(card) == {"license": "mit", "tags": ["chat"], "base_model": str(base)}
    assert "My model." in card and "## dg-hard output" in card
    assert declared_base_models(card) == [str(base)]
    assert "base_model" in doc["output"]["model_card"] and "added" in doc["output"]["model_card"]


def test_without_a_card_ours_declares_base_model(tmp_path):
    base, ft = make_pair(tmp_path, CFG)
    doc = repair(base, ft, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    meta = _front(card)
    assert meta["base_model"] == str(base) and "dghard" in meta["tags"]
    assert card.count("\n---\n") == 1 and "# dg-hard output" in card
    assert "no README.md" in doc["output"]["model_card"]


def test_a_card_without_front_matter_gets_ours_in_front_of_its_text(tmp_path):
    base, ft = make_pair(tmp_path, CFG, ft_files={"README.md": "# Mine\n\nJust text.\n"})
    repair(base, ft, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert _front(card)["base_model"] == str(base)
    assert card.index("# Mine") < card.index("## dg-hard output") and "Just text." in card


def test_a_readme_that_is_a_link_out_of_ft_or_a_directory_is_not_read(tmp_path):
    secret = tmp_path / "secret.md"
    secret.write_text("---\nlicense: secret\n---\nprivate words\n")
    base, ft = make_pair(tmp_path / "a", CFG)
    (ft / "README.md").symlink_to(secret)
    doc = repair(base, ft, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "private words" not in card and "secret" not in card
    assert "not a regular file inside" in doc["output"]["model_card"]
    base2, ft2 = make_pair(tmp_path / "b", CFG)
    (ft2 / "README.md").mkdir()
    doc = repair(base2, ft2, tmp_path / "out2")
    assert "not a regular file inside" in doc["output"]["model_card"]
    assert _front((tmp_path / "out2" / "README.md").read_text())["base_model"] == str(base2)


def test_compose_rules_on_odd_front_matter():
    ours = "---\ntags:\n- dghard\n---\n\n# ties output\n\n```json\n# not a heading\n```\n"
    # front matter that is not a YAML mapping is kept verbatim and not edited
    odd = "---\n- just\n- a list\n---\ntext\n"
    card, note = compose(ours, odd, "org/base")
    assert card.startswith(odd.rstrip()) and "base_model" not in card and "not a YAML mapping" in note
    # a base_model list is theirs to keep; our heading is demoted, a fenced '#' line is not
    theirs = "---\nbase_model:\n- a/b\n- c/d\n---\nx\n"
    card, _ = compose(ours, theirs, "org/base")
    assert _front(card)["base_model"] == ["a/b", "c/d"] and "org/base" not in card.split("---")[1]
    assert "\n## ties output\n" in card and "\n# not a heading\n" in card
    # a path that needs YAML quoting stays the same string
    card, _ = compose(ours, None, "/data/models: base #1")
    assert _front(card)["base_model"] == "/data/models: base #1"


def test_front_matter_aliases_are_bounded():
    """A downloaded card's front matter may be a YAML alias bomb: it is not expanded (it reads as
    no mapping, so the card is kept as it is) instead of taking the run's memory and time."""
    from dghard_cli.report.model_card import front_matter_mapping

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 7):  # 9^6 leaves from a few hundred bytes
        ref = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{ref}]")
    assert front_matter_mapping("\n".join(lines) + "\n") is None
    assert front_matter_mapping("base_model: a/b\nlicense: mit\n") == {"base_model": "a/b", "license": "mit"}
