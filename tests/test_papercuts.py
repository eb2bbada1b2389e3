"""What a newcomer with LoRA adapters and mergekit recipes trips on, each checked as they would hit it.

Real PEFT and transformers where the point is about them: an adapter output must load with
``AutoPeftModelForCausalLM`` from another working directory; messages and shipped files point at
nothing outside the product.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dghard_cli.cli import app

REPO = Path(__file__).resolve().parent.parent
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()

SIZES = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def tiny_llama(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**SIZES, vocab_size=64, tie_word_embeddings=False)).save_pretrained(
        str(path)
    )
    return path


def tiny_adapter(base: Path, out: Path, seed: int = 1) -> Path:
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(base)), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    return out


# -- item 4: pointers to nothing ---------------------------------------------------------------------------
def shipped_text_files():
    for root in ("dghard_cli", "docs"):
        for p in sorted((REPO / root).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".txt", ".html"):
                yield p
    yield from (REPO / "README.md", REPO / "CHANGELOG.md")


def test_nothing_shipped_cites_the_spec_or_files_outside_the_repository():
    bad = re.compile(r"\bSPEC\b(?!\.md\b)(?![_A-Za-z])|SPEC\.md|\.\./shared|§\s*\d")
    hits = []
    for p in shipped_text_files():
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if "--layer-strengths SPEC" in line or "paper's §" in line:
                continue  # a metavariable, and the paper's own section
            if bad.search(line):
                hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


def test_sweep_unit_warnings_name_no_option_sweep_lacks():
    from dghard_cli.scoring import scales
    from dghard_cli.scoring.results import ResultFile, Score

    def rf(name: str, units: dict[str, str]) -> ResultFile:
        scores = {k: Score(50.0, None) for k in units}
        return ResultFile(source=name, format="plain", scale="mixed", scores=scores, units=units)

    base = rf("base.json", {"a": "fraction", "b": "points"})  # mixes fractions and points
    ft = rf("ft.json", {"a": "points", "b": "points"})  # a read in another unit than in base
    score_notes = scales.notes(base, [("FT", ft)])
    sweep_notes = scales.notes(base, [("FT", ft)], units_option=None)
    assert any("pass --units" in n for n in score_notes)
    assert sweep_notes and not any("--units" in n and "dghard score" not in n for n in sweep_notes)
    assert any("dghard score --units" in n for n in sweep_notes)


def test_an_adapter_output_loads_with_auto_peft_from_any_directory(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    base = tiny_llama(work / "base")
    tiny_adapter(base, work / "ad")
    monkeypatch.chdir(work)
    r = cli("merge", "--method", "wise-ft", "--alpha", "0.5", "base", "ad", "--out", "weaker", "--quiet")
    assert r.exit_code == 0, r.output
    out = work / "weaker"
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base.resolve())
    card = (out / "README.md").read_text()
    assert f"base_model: {base.resolve()}" in card and "absolute path" in card
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    model = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    ref = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(base)), str(out)).eval()
    x = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


def test_an_adapter_of_a_hub_base_keeps_the_hub_id(tmp_path):
    from dghard_cli.io.checkpoint import Checkpoint
    from dghard_cli.lora.assemble import base_reference

    snapshot = tiny_llama(tmp_path / "cache" / "snapshots" / "abc")
    ck = Checkpoint(snapshot, source="org/tiny-llama")
    assert base_reference(ck) == ("org/tiny-llama", "hub id")
    ck = Checkpoint(snapshot, source=str(snapshot))
    assert base_reference(ck) == (str(snapshot.resolve()), "absolute path")


# -- item 6: a merge does not claim to be its first fine-tune ------------------------------------------------
FT1_ALONE = {
    "scenario_note.json": '{"note": "FT #1 was trained on legal text"}',
    "trainer_state.json": '{"global_step": 1200}',
    "training_args.json": '{"learning_rate": 2e-5}',
    "README.md": "---\nlicense: mit\n---\n# FT #1, a legal-text fine-tune\n",
}
SHARED = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}", "chat_template.jinja": "{{ m }}"}


@pytest.fixture(scope="module")
def two_fts(tmp_path_factory):
    from dghard_cli.testing.synthetic import ArchConfig, make_pair

    root = tmp_path_factory.mktemp("sides")
    cfg = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, vocab_size=64)
    base, ft1 = make_pair(root / "a", cfg, ft_shards=1, seed=0, ft_files={**FT1_ALONE, **SHARED})
    _, ft2 = make_pair(root / "b", cfg, ft_shards=1, seed=0, delta_seed=3)
    return base, ft1, ft2


def test_a_merge_of_several_copies_only_what_every_input_shares(two_fts, tmp_path):
    base, ft1, ft2 = two_fts
    out = tmp_path / "merged"
    r = cli(
        "merge", "--method", "task-arithmetic", str(base), str(ft1), str(ft2), "--out", str(out), "--quiet"
    )
    assert r.exit_code == 0, r.output
    names = {p.name for p in out.iterdir()}
    assert {"config.json", *SHARED} <= names
    assert not {"scenario_note.json", "trainer_state.json", "training_args.json"} & names
    card = (out / "README.md").read_text()
    assert "legal-text" not in card and "license: mit" not in card  # FT #1's card is not the merge's
    assert f"copied from FT #1 (`{ft1}`): " in card and "tokenizer.json" in card
    assert f"not copied from FT #1 (`{ft1}`) (they describe that model alone): " in card
    assert "scenario_note.json, trainer_state.json, training_args.json" in card
    doc = json.loads((out / "dghard_report.json").read_text())
    assert "FT #1's card" not in doc["output"]["model_card"] and "not used" in doc["output"]["model_card"]


def test_a_repair_keeps_its_fine_tunes_side_files_and_card(two_fts, tmp_path):
    base, ft1, _ = two_fts
    out = tmp_path / "repaired"
    r = cli("repair", str(base), str(ft1), str(out), "--quiet")
    assert r.exit_code == 0, r.output
    names = {p.name for p in out.iterdir()}
    assert {"scenario_note.json", "trainer_state.json", *SHARED} <= names
    card = (out / "README.md").read_text()
    assert "legal-text" in card and f"copied from FT (`{ft1}`): " in card


# -- item 7: small things a newcomer trips on --------------------------------------------------------------
def test_readme_says_report_html_needs_the_plot_extra():
    row = next(
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| [`report`]")
    )
    assert "pip install 'dghard[plot]'" in row


def test_report_html_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import builtins

    tiny = REPO / "examples" / "tiny"
    out = tmp_path / "rep"
    assert cli("repair", tiny / "base", tiny / "ft", out, "--quiet").exit_code == 0
    real = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    r = cli("report", out, "--html", tmp_path / "r.html")
    assert r.exit_code == 2 and "pip install 'dghard[plot]'" in r.output


def test_the_merge_summary_title_does_not_wrap_at_80_columns(tmp_path, monkeypatch):
    tiny = REPO / "examples" / "tiny"
    monkeypatch.chdir(tmp_path)  # a short OUT: the table is narrower than its title
    r = cli(
        "merge", "--method", "breadcrumbs-ties", tiny / "base", tiny / "ft", tiny / "ft", "--out", "m",
        env={"COLUMNS": "80"},
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "dghard merge: breadcrumbs-ties" in r.output
    assert not any(line.strip() == "dghard merge:" for line in r.output.splitlines())


def test_docs_sweep_example_table_is_the_default_candidates_order():
    """docs/sweep.md's example is the real output: the default candidate file's first family
    (the lines family) is what the sweep tries first, and every family in the table is in it."""
    import yaml

    text = (REPO / "docs" / "sweep.md").read_text()
    table = text[text.index("dghard sweep\n") :].split("evaluations:")[0].splitlines()[2:]
    rows = [line.split()[1] for line in table if line.strip()]
    families = [
        f["family"]
        for f in yaml.safe_load((REPO / "dghard_cli/data/sweep-default.yaml").read_text())["families"]
    ]
    assert rows[0] == families[0] == "lines"
    assert set(rows) <= set(families)


def test_merge_help_fits_80_columns_with_the_method_parameters_in_panels():
    r = cli("merge", "--help", env={"COLUMNS": "80", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert not [line for line in lines if "…" in line]  # no option name or help word cut short
    assert all(len(line) <= 80 for line in lines)
    panels = [line for line in lines if line.startswith("╭─ ")]
    assert any(p.startswith("╭─ Parameters of recall ─") for p in panels)
    assert any(p.startswith("╭─ Parameters of every method ─") for p in panels)
    assert all(re.match(r"^╭─ .* ─+╮$", p) for p in panels), panels  # no panel title cut short
    assert len(lines) < 240


#: How the help's summary names each registered merge method (its variants share the name).
SUMMARY_NAMES = {
    "wise-ft": "WiSE-FT", "task-arithmetic": "task arithmetic", "ties": "TIES", "dare-linear": "DARE",
    "dare-ties": "DARE", "recall": "RECALL", "dg-hard": "DG-Hard", "breadcrumbs": "Breadcrumbs",
    "breadcrumbs-ties": "Breadcrumbs", "della": "DELLA", "della-linear": "DELLA", "iso-c": "Iso-C",
    "iso-cts": "Iso-CTS", "model-stock": "Model Stock", "slerp": "SLERP", "tsv": "TSV-M", "star": "STAR", "cart": "CART", "wudi": "WUDI",
}  # fmt: skip


def test_the_merge_summary_names_every_registered_method():
    """`dghard --help` and `merge --help` summarised the merges without TSV-M, Iso-C and Iso-CTS."""
    from dghard_cli.methods import registry

    missing = set(registry.methods()) - set(SUMMARY_NAMES)
    assert not missing, f"name the new method(s) {missing} in merge's docstring and here"
    top = " ".join(cli("--help", env={"COLUMNS": "400", "TERM": "dumb"}).output.split())
    own = " ".join(cli("merge", "--help", env={"COLUMNS": "400", "TERM": "dumb"}).output.split())
    for text in (top, own):
        for name in SUMMARY_NAMES.values():
            assert name in text, (name, text[:600])


# -- item 5: mergekit's model+lora references, read through the adapter reader ------------------------------
def test_a_mergekit_model_plus_lora_reference_is_the_adapter_as_fine_tune(tmp_path):
    from safetensors.torch import load_file

    base = tiny_llama(tmp_path / "base")
    a1, a2 = tiny_adapter(base, tmp_path / "a1", seed=1), tiny_adapter(base, tmp_path / "a2", seed=2)
    recipe = tmp_path / "mk.yml"
    recipe.write_text(
        f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
        f"  - model: {base}+{a1}\n    parameters: {{weight: 1.0}}\n"
        f"  - model: {base}+{a2}\n    parameters: {{weight: 0.5}}\n"
    )
    r = cli("merge", "--config", recipe, "--out", tmp_path / "from-recipe", "--quiet")
    assert r.exit_code == 0, r.output
    r = cli(
        "merge",
        "--method",
        "task-arithmetic",
        "--weights",
        "1,0.5",
        base,
        a1,
        a2,
        "--out",
        tmp_path / "direct",
    )
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "from-recipe" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "direct" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(base)), str(tmp_path / "from-recipe"))


def test_a_model_plus_lora_reference_on_another_model_is_one_line(tmp_path):
    recipe = tmp_path / "mk.yml"
    recipe.write_text(
        "merge_method: task_arithmetic\nbase_model: org/base\nmodels:\n  - model: org/other+org/adapter\n"
    )
    r = cli("merge", "--config", recipe, "--out", tmp_path / "m")
    assert r.exit_code == 2
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "'org/other', which is not base_model ('org/base')" in lines[0], r.output
