"""mergekit recipes run unchanged: ``dghard merge --config mergekit.yml --out OUT``.

The recipes are written the way mergekit's own examples and model cards write them (hub ids,
the base listed among the models with no parameters, top-level ``parameters``, ``dtype``);
the tests substitute local generated checkpoints for the hub ids and check every output tensor
against the float64 references of tests/merge_reference.py with mergekit's semantics (its
defaults: density 1, normalize per method, ...). What dghard does not do is one line, exit 2,
naming the key, nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import merge_reference as M
import numpy as np
import pytest
import yaml
from conftest import f64, load_dir, run_dghard
from reference import rel
from typer.testing import CliRunner

from dghard_cli.cli import app
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.methods.dare import CHUNK
from dghard_cli.recipes.mergekit import translate
from dghard_cli.recipes.recipe import load_recipe
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)
HUB = {
    "base": "mistralai/Mistral-7B-v0.1",
    "a": "OpenPipe/mistral-ft-optimized-1218",
    "b": "mlabonne/NeuralHermes-2.5-Mistral-7B",
    "c": "teknium/OpenHermes-2.5-Mistral-7B",
}


def four_checkpoints(root, cfg: ArchConfig, seed: int, delta_seeds: tuple[int, int]) -> dict:
    """BASE and fine-tunes a (2 shards), b and c (1 shard each), as paths and numpy arrays."""
    base, a = make_pair(root / "a", cfg, ft_shards=2, seed=seed)
    _, b = make_pair(root / "b", cfg, ft_shards=1, seed=seed, delta_seed=delta_seeds[0])
    _, c = make_pair(root / "c", cfg, ft_shards=1, seed=seed, delta_seed=delta_seeds[1])
    paths = {"base": base, "a": a, "b": b, "c": c}
    return {
        "root": root,
        "paths": paths,
        "arrays": {k: {n: t.numpy() for n, t in load_dir(p).items()} for k, p in paths.items()},
    }


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return four_checkpoints(tmp_path_factory.mktemp("mergekit"), CFG, seed=0, delta_seeds=(11, 22))


def local(text: str, tree) -> str:
    """The recipe with its hub ids replaced by the generated checkpoints."""
    for key, hub in HUB.items():
        text = text.replace(hub, str(tree["paths"][key]))
    return text


def run_recipe(tree, tmp_path, text: str, *extra: str):
    path = tmp_path / "mergekit.yml"
    path.write_text(local(text, tree))
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["merge", "--config", str(path), "--out", str(out), "--json", *extra])
    return res, out


def merged_by(tree, tmp_path, text: str, *extra: str) -> tuple[dict, Path]:
    """Run the recipe, which must succeed: its ``--json`` document and OUT."""
    res, out = run_recipe(tree, tmp_path, text, *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), out


def check(tree, out, ref_fn, tol=1e-6):
    merged = load_dir(out)
    arr = tree["arrays"]
    assert set(merged) == set(arr["base"])
    for name, b in arr["base"].items():
        ref = ref_fn(name, b, {k: arr[k][name] for k in ("a", "b", "c")})
        e = rel(f64(merged[name]), ref)
        assert e <= tol, f"{name}: {e:.2e}"


def d64(x):
    return x.astype(np.float64)


# -- each family, written as mergekit's examples write it ------------------------------------

LINEAR = """\
models:
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      weight: 1.0
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      weight: 0.3
  - model: teknium/OpenHermes-2.5-Mistral-7B
    parameters:
      weight: 0.5
merge_method: linear
dtype: float32
"""


def test_linear_is_a_weighted_average(tree, tmp_path):
    doc, out = merged_by(tree, tmp_path, LINEAR)
    assert doc["method"] == "task-arithmetic"
    check(tree, out, lambda n, b, f: (1.0 * d64(f["a"]) + 0.3 * d64(f["b"]) + 0.5 * d64(f["c"])) / 1.8)


def test_linear_of_base_and_one_finetune_is_wise_ft(tree, tmp_path):
    text = """\
merge_method: linear
base_model: mistralai/Mistral-7B-v0.1
models:
  - model: mistralai/Mistral-7B-v0.1
    parameters: {weight: 0.6}
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters: {weight: 0.4}
dtype: float32
"""
    doc, out = merged_by(tree, tmp_path, text)
    assert doc["method"] == "wise-ft" and doc["parameters"]["alpha"] == pytest.approx(0.4)
    check(tree, out, lambda n, b, f: 0.6 * d64(b) + 0.4 * d64(f["a"]))


TIES = """\
models:
  - model: mistralai/Mistral-7B-v0.1
    # no parameters necessary for base model
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      density: 0.5
      weight: 0.5
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      density: 0.5
      weight: 0.3
merge_method: ties
base_model: mistralai/Mistral-7B-v0.1
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""


def test_ties_as_in_mergekits_readme(tree, tmp_path):
    doc, out = merged_by(tree, tmp_path, TIES)
    assert doc["method"] == "ties" and doc["parameters"]["weights"] == [0.5, 0.3]
    assert doc["parameters"]["density"] == 0.5 and doc["parameters"]["normalize"] is True
    assert next(iter(load_dir(out).values())).dtype.__str__() == "torch.float16"  # dtype: float16
    check(
        tree,
        out,
        lambda n, b, f: M.ref_ties(d64(b), [d64(f["a"]), d64(f["b"])], [0.5, 0.3], 0.5, 1.0),
        tol=1e-3,  # float16 output
    )


def test_task_arithmetic_with_normalize_and_lambda(tree, tmp_path):
    text = """\
merge_method: task_arithmetic
base_model: mistralai/Mistral-7B-v0.1
models:
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      weight: 1.0
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      weight: -0.5
parameters:
  normalize: true
  lambda: 0.8
dtype: float32
"""
    _, out = merged_by(tree, tmp_path, text)
    # mergekit: (Σ w_i Δ_i) / Σ w_i · λ
    check(
        tree,
        out,
        lambda n, b, f: d64(b) + 0.8 * ((d64(f["a"]) - d64(b)) - 0.5 * (d64(f["b"]) - d64(b))) / 0.5,
    )


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
def test_dare_families_and_their_mergekit_defaults(tree, tmp_path, method):
    text = f"""\
models:
  - model: mistralai/Mistral-7B-v0.1
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      density: 0.53
      weight: 0.4
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      density: 0.53
      weight: 0.3
merge_method: {method}
base_model: mistralai/Mistral-7B-v0.1
parameters:
  int8_mask: true
dtype: float32
"""
    doc, out = merged_by(tree, tmp_path, text)
    ties = method == "dare_ties"
    assert doc["method"] == method.replace("_", "-")
    if ties:
        assert doc["parameters"]["normalize"] is False  # mergekit's dare_ties default: the disjoint sum

    def ref(name, b, f):
        parts = []
        for i, k in enumerate(("a", "b")):
            keep = M.dare_keep(0, name, i, 0.53, b.size, CHUNK).reshape(b.shape)
            parts.append(np.where(keep, (d64(f[k]) - d64(b)) / 0.53, 0.0))
        if ties:
            return d64(b) + M.elect(parts, [0.4, 0.3], normalize=False)
        return d64(b) + 0.4 * parts[0] + 0.3 * parts[1]

    check(tree, out, ref)


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_breadcrumbs_families(tree, tmp_path, method):
    text = f"""\
merge_method: {method}
base_model: mistralai/Mistral-7B-v0.1
models:
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      weight: 1.0
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      weight: 0.5
parameters:
  density: 0.9
  gamma: 0.01
dtype: float32
"""
    _, out = merged_by(tree, tmp_path, text)
    ties = method == "breadcrumbs_ties"

    def ref(name, b, f):
        return M.ref_breadcrumbs(
            d64(b), [d64(f["a"]), d64(f["b"])], [1.0, 0.5], 0.9, 0.01, 1.0, ties=ties, normalize=False
        )

    check(tree, out, ref)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_families(tree, tmp_path, method):
    text = f"""\
merge_method: {method}
base_model: mistralai/Mistral-7B-v0.1
models:
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters: {{weight: 0.6, density: 0.5, epsilon: 0.1}}
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters: {{weight: 0.4, density: 0.5, epsilon: 0.1}}
parameters:
  lambda: 1.1
dtype: float32
"""
    _, out = merged_by(tree, tmp_path, text)
    ties = method == "della"

    def ref(name, b, f):
        return M.ref_della(
            b, [f["a"], f["b"]], [0.6, 0.4], 0.5, 0.1, 1.1, 0, name, CHUNK, ties=ties, normalize=True
        )

    check(tree, out, ref)


SLERP = """\
models:
  - model: OpenPipe/mistral-ft-optimized-1218
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
merge_method: slerp
base_model: OpenPipe/mistral-ft-optimized-1218
parameters:
  t: 0.35
dtype: float32
"""


def test_slerp(tree, tmp_path):
    _, out = merged_by(tree, tmp_path, SLERP)
    check(tree, out, lambda n, b, f: M.ref_slerp(d64(f["a"]), d64(f["b"]), 0.35))


def test_model_stock(tree, tmp_path):
    text = """\
models:
  - model: OpenPipe/mistral-ft-optimized-1218
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
  - model: teknium/OpenHermes-2.5-Mistral-7B
merge_method: model_stock
base_model: mistralai/Mistral-7B-v0.1
parameters:
  filter_wise: false
dtype: float32
"""
    _, out = merged_by(tree, tmp_path, text)
    check(tree, out, lambda n, b, f: M.ref_model_stock(d64(b), [d64(f[k]) for k in "abc"]))


def test_mergekit_defaults_are_mergekits(tree):
    """No density: mergekit keeps every entry (density 1), not dghard's 0.2."""
    doc = translate(yaml.safe_load(TIES.replace("      density: 0.5\n", "")), "r")
    assert doc["density"] == 1.0 and doc["normalize"] is True
    assert translate(yaml.safe_load(SLERP), "r") == {
        "dtype": "float32",
        "base": {"model": HUB["a"]},
        "method": "slerp",
        "models": [{"model": HUB["b"]}],
        "t": 0.35,
    }
    doc = translate({"merge_method": "della", "base_model": "x/b", "models": [{"model": "x/a@v2"}]}, "r")
    assert doc["models"] == [{"model": "x/a", "revision": "v2", "weight": 1.0}]
    assert (doc["density"], doc["epsilon"], doc["normalize"], doc["lambda"]) == (1.0, 0.15, True, 1.0)


def test_relative_paths_resolve_against_the_current_directory(tree, tmp_path, monkeypatch):
    monkeypatch.chdir(tree["root"])
    sub = tmp_path / "recipes"
    sub.mkdir()
    p = sub / "m.yml"
    p.write_text("merge_method: slerp\nbase_model: a/base\nmodels: [{model: a/ft}]\nparameters: {t: 0.5}\n")
    r = load_recipe(p)
    assert r.mergekit and r.method == "slerp"
    assert r.base.spec == str(tree["root"] / "a" / "base")


# -- what dghard does not do: one line, exit 2, naming the key, nothing written -------------

REFUSED = {
    "slices": (
        "slices:\n  - sources:\n      - model: mistralai/Mistral-7B-v0.1\n        layer_range: [0, 24]\n"
        "merge_method: passthrough\ndtype: float16\n",
        "passthrough stacks layers (a frankenmerge)",
    ),
    "passthrough": ("merge_method: passthrough\nmodels: [{model: mistralai/Mistral-7B-v0.1}]\n", "passthrough"),
    "moe": (
        "base_model: mistralai/Mistral-7B-v0.1\ngate_mode: hidden\nexperts:\n"
        "  - source_model: OpenPipe/mistral-ft-optimized-1218\n",
        "'gate_mode' is a mergekit-moe",
    ),
    "tokenizer": (TIES + "tokenizer_source: union\n", "'tokenizer_source: union' asks for tokenizer surgery"),
    "tokenizer-other-model": (TIES + "tokenizer_source: OpenPipe/mistral-ft-optimized-1218\n", "asks for tokenizer surgery"),
    "chat-template": (TIES + "chat_template: chatml\n", "'chat_template'"),
    "lora": (SLERP.replace("NeuralHermes-2.5-Mistral-7B\n", "NeuralHermes-2.5-Mistral-7B+some/lora\n", 1), "LoRA"),
    "unknown-method": (SLERP.replace("merge_method: slerp", "merge_method: karcher"), "karcher (the mean on the sphere) is not in dghard; the nearest is linear"),
    "not-mergekit-method": (SLERP.replace("merge_method: slerp", "merge_method: frobnicate"), "'frobnicate' is not one dghard runs"),
    "no-rescale": (TIES.replace("merge_method: ties", "merge_method: dare_ties").replace("normalize: true", "rescale: false"), "'rescale: false'"),
    "no-base": (TIES.replace("base_model: mistralai/Mistral-7B-v0.1\n", ""), "needs 'base_model'"),
    "slerp-three": (SLERP.replace("merge_method", "  - model: teknium/OpenHermes-2.5-Mistral-7B\nmerge_method", 1), "one other model; got 2"),
    "slerp-no-t": (SLERP.replace("parameters:\n  t: 0.35\n", ""), "needs 't'"),
    "unknown-parameter": (SLERP.replace("t: 0.35", "t: 0.35\n  lambda: 2"), "'lambda' is not a parameter of merge_method slerp"),
    "unknown-key": (SLERP + "output_dir: x\n", "unknown mergekit key 'output_dir'"),
    "two-slices": (
        "slices:\n  - sources:\n      - {model: mistralai/Mistral-7B-v0.1, layer_range: [0, 1]}\n"
        "  - sources:\n      - {model: OpenPipe/mistral-ft-optimized-1218, layer_range: [1, 2]}\n"
        "merge_method: passthrough\n",
        "'slices' has 2 slices",
    ),
    "partial-slice": (
        "slices:\n  - sources:\n      - {model: OpenPipe/mistral-ft-optimized-1218, layer_range: [0, 1]}\n"
        "      - {model: mlabonne/NeuralHermes-2.5-Mistral-7B, layer_range: [0, 1]}\n"
        "merge_method: slerp\nbase_model: OpenPipe/mistral-ft-optimized-1218\nparameters: {t: 0.5}\n",
        "takes layers [0, 1) of models with 2 layers",
    ),
    "uneven-slice": (
        "slices:\n  - sources:\n      - {model: OpenPipe/mistral-ft-optimized-1218, layer_range: [0, 2]}\n"
        "      - {model: mlabonne/NeuralHermes-2.5-Mistral-7B, layer_range: [1, 2]}\n"
        "merge_method: slerp\nbase_model: OpenPipe/mistral-ft-optimized-1218\nparameters: {t: 0.5}\n",
        "take parts of models",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_one_line_naming_the_key(tree, tmp_path, case):
    text, message = REFUSED[case]
    res, out = run_recipe(tree, tmp_path, text)
    assert res.exit_code == 2, (res.output, res.exception)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dghard: error: mergekit recipe"), res.stderr
    assert message in lines[0], lines[0]
    assert not out.exists()


def test_out_is_required_and_the_real_cli(tree, tmp_path):
    path = tmp_path / "m.yml"
    path.write_text(local(SLERP, tree))
    res = run_dghard("merge", "--config", path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--out OUT is required with the mergekit recipe" in res.stderr
    res = run_dghard("merge", "--config", path, "--out", tmp_path / "o", "--quiet")
    assert res.returncode == 0, res.stderr
    merged = load_dir(tmp_path / "o")
    assert len(merged) == len(tree["arrays"]["base"])
    # the report says what ran, with mergekit's values
    doc = json.loads((tmp_path / "o" / "dghard_report.json").read_text())
    assert doc["method"] == "slerp" and doc["parameters"]["t"] == 0.35


def test_translate_pure_errors():
    with pytest.raises(InputError, match="needs at least 2 models besides base_model"):
        translate({"merge_method": "model_stock", "base_model": "x/b", "models": ["x/a"]}, "r")
    with pytest.raises(InputError, match="weights sum to 0"):
        translate(
            {"merge_method": "linear", "models": [{"model": "x/a", "parameters": {"weight": 1}},
                                                  {"model": "x/b", "parameters": {"weight": -1}}]},
            "r",
        )  # fmt: skip
    with pytest.raises(InputError, match="scales the whole model"):
        translate(
            {
                "merge_method": "linear",
                "parameters": {"normalize": False, "weight": 1.0},
                "models": ["x/a", "x/b"],
            },
            "r",
        )
    assert math.isclose(
        translate(
            {"merge_method": "task_arithmetic", "base_model": "x/b", "parameters": {"normalize": True},
             "models": [{"model": "x/a", "parameters": {"weight": 0.25}}]},
            "r",
        )["lambda"],
        4.0,
    )  # fmt: skip


# -- parameters that vary by layer and tensor (gradients, filters), one slice over every layer --

DEEP = ArchConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, vocab_size=128)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return four_checkpoints(tmp_path_factory.mktemp("deep"), DEEP, seed=5, delta_seeds=(6, 7))


def gradient(values: list[float], x: float) -> float:
    """A gradient's value at layer fraction x: piecewise-linear over evenly spaced points."""
    return float(np.interp(x * (len(values) - 1), np.arange(len(values)), values))


def layer_fraction(name: str, layers: int = 4) -> float:
    import re

    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) / (layers - 1) if m else 0.0  # embeddings, final norm, lm_head: 0


GRADIENT_SLERP = """\
slices:
  - sources:
      - model: OpenPipe/mistral-ft-optimized-1218
        layer_range: [0, 4]
      - model: mlabonne/NeuralHermes-2.5-Mistral-7B
        layer_range: [0, 4]
merge_method: slerp
base_model: OpenPipe/mistral-ft-optimized-1218
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: float32
"""


@pytest.mark.parametrize(
    "line",
    ["tokenizer_source: base", "tokenizer_source: mistralai/Mistral-7B-v0.1", "tokenizer: {source: base}"],
)
def test_tokenizer_source_base_is_a_no_op_when_every_model_shares_the_vocabulary(tree, tmp_path, line):
    res, out = run_recipe(tree, tmp_path, TIES + line + "\n")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["parameters"]["tokenizer_source"].startswith("base: every model has BASE's vocabulary")
    assert "tokenizer_source" in (out / "README.md").read_text()


def test_tokenizer_source_base_with_another_vocabulary_is_one_line(tmp_path):
    cfg = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, vocab_size=64)
    base, a = make_pair(tmp_path / "a", cfg, ft_shards=1, seed=0, ft_vocab=72)
    _, b = make_pair(tmp_path / "b", cfg, ft_shards=1, seed=0, delta_seed=2)
    text = TIES.replace(HUB["base"], str(base)).replace(HUB["a"], str(a)).replace(HUB["b"], str(b))
    path = tmp_path / "r.yml"
    path.write_text(text + "tokenizer_source: base\n")
    res = CliRunner().invoke(app, ["merge", "--config", str(path), "--out", str(tmp_path / "m")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "FT #1" in lines[0] and "72 tokens, BASE 64" in lines[0], res.output
    assert not (tmp_path / "m").exists()


#: mergekit 0.1.5's merge methods (its docs/merge_methods.md) that dghard does not run
MERGEKIT_ONLY = ("nuslerp", "multislerp", "karcher", "sce", "ram", "ramplus_tl", "nearswap", "arcee_fusion")


@pytest.mark.parametrize("method", MERGEKIT_ONLY)
def test_a_mergekit_method_dghard_lacks_names_the_nearest_dghard_method(method):
    from dghard_cli.methods import registry

    doc = yaml.safe_load(SLERP.replace("merge_method: slerp", f"merge_method: {method}"))
    with pytest.raises(InputError) as e:
        translate(doc, "r.yml")
    msg = str(e.value)
    assert "\n" not in msg and f"merge_method {method}:" in msg
    nearest = msg.split("the nearest is ")[1].split(" ")[0]
    assert nearest in registry.method_names() or nearest == "linear"  # linear: mergekit's own, mapped


def test_a_gradient_recipe_prints_no_tensors_values_as_the_recipes(deep, tmp_path):
    """The terminal summary and the model card say the weights vary, not one tensor's weights."""
    path = tmp_path / "mergekit.yml"
    path.write_text(local(MERGEKIT_README_TIES, deep))
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["merge", "--config", str(path), "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "weights=varies per tensor (see the report)" in res.output
    assert "weights=[" not in res.output
    card = (out / "README.md").read_text()
    assert '"weights": "varies per tensor (see the report)"' in card
    report = json.loads((out / "dghard_report.json").read_text())
    assert "weights" in report["parameters"]["varies_per_tensor"]
    assert "lambda" not in report["parameters"]["varies_per_tensor"]


def test_gradient_slerp_over_one_slice_runs_unchanged(deep, tmp_path):
    """The slerp recipe most merges on the Hub start from: t per layer, by filter."""
    doc, out = merged_by(deep, tmp_path, GRADIENT_SLERP)
    assert doc["parameters"]["per_tensor"].startswith("varies by tensor")

    def t_of(name):
        x = layer_fraction(name)
        if "self_attn" in name:
            return gradient([0, 0.5, 0.3, 0.7, 1], x)
        if "mlp" in name:
            return gradient([1, 0.5, 0.7, 0.3, 0], x)
        return 0.5

    by = {r["name"]: r for r in doc["tensors"]}
    assert by["model.layers.1.self_attn.q_proj.weight"]["parameters"]["t"] == pytest.approx(
        t_of("model.layers.1.self_attn.q_proj.weight")
    )
    assert len({round(r["parameters"]["t"], 6) for r in doc["tensors"]}) > 4
    check(deep, out, lambda n, b, f: M.ref_slerp(d64(f["a"]), d64(f["b"]), t_of(n)))


MERGEKIT_README_TIES = """\
models:
  - model: mistralai/Mistral-7B-v0.1
    # no parameters necessary for base model
  - model: OpenPipe/mistral-ft-optimized-1218
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: mlabonne/NeuralHermes-2.5-Mistral-7B
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: teknium/OpenHermes-2.5-Mistral-7B
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: mistralai/Mistral-7B-v0.1
parameters:
  normalize: true
  int8_mask: true
dtype: float32
"""


def test_ties_with_density_and_weight_gradients_and_filters(deep, tmp_path):
    """mergekit's README TIES example: one density per model, gradients, a filtered weight."""
    doc, out = merged_by(deep, tmp_path, MERGEKIT_README_TIES)

    def ref(name, b, f):
        x = layer_fraction(name)
        dens = [gradient([1, 0.7, 0.1], x), 0.5, 0.33]
        w = [1.0, gradient([0, 0.3, 0.7, 1], x), 0.5 if "mlp" in name else 0.0]
        parts = []
        for k, d in zip("abc", dens, strict=True):
            delta = d64(f[k]) - d64(b)
            parts.append(np.where(M.topk_mask(delta, d), delta, 0.0))
        return d64(b) + M.elect_and_mean(parts, w)

    check(deep, out, ref)
    rec = next(r for r in doc["tensors"] if r["name"] == "model.layers.2.mlp.up_proj.weight")
    assert rec["parameters"]["weights"] == pytest.approx([1.0, gradient([0, 0.3, 0.7, 1], 2 / 3), 0.5])
    assert rec["kept"][2] == int(0.33 * math.prod(rec["shape"]))


def test_per_tensor_values_are_checked_before_anything_is_written(deep, tmp_path):
    """A gradient that reaches an invalid value in some layer: one line naming that tensor."""
    text = MERGEKIT_README_TIES.replace("density: [1, 0.7, 0.1]", "density: [1, 0.7, 0]")
    res, out = run_recipe(deep, tmp_path, text)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tensor 'model.layers.3." in lines[0] and "--density" in lines[0], res.stderr
    assert not out.exists()


def test_command_line_options_win_over_the_recipes_gradients(deep, tmp_path):
    doc, out = merged_by(deep, tmp_path, GRADIENT_SLERP, "--t", "0.25")
    assert all("t" not in r["parameters"] for r in doc["tensors"])
    check(deep, out, lambda n, b, f: M.ref_slerp(d64(f["a"]), d64(f["b"]), 0.25))


def test_the_library_runs_a_recipe_as_the_command_does(tree, tmp_path):
    """``run_recipe(path, out=…)`` (mergekit's ``run_merge(config)``): the same bytes as
    ``dghard merge --config``, and a caller's value wins over the recipe's, as an option does."""
    import hashlib

    from dghard_cli.recipes.options import run_recipe as library_run

    _, by_cli = merged_by(tree, tmp_path, TIES)
    path = tmp_path / "again.yml"
    path.write_text(local(TIES, tree))
    doc = library_run(path, out=tmp_path / "lib", run=RunOptions(quiet=True))
    shards = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.glob("*.safetensors")}  # noqa: E731
    assert shards(tmp_path / "lib") == shards(by_cli) and shards(by_cli)
    assert doc["parameters"]["density"] == 0.5
    doc = library_run(path, out=tmp_path / "lib2", params={"density": 0.2}, run=RunOptions(quiet=True))
    assert doc["parameters"]["density"] == 0.2 and doc["parameters"]["weights"] == [0.5, 0.3]
