"""Hostile numbers, sizes and resources: each class is closed where it starts (see
docs/robustness.md, "Numbers, sizes and resources"). Every test here failed before its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dghard_cli.cli import app
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)


@pytest.fixture()
def pair(tmp_path) -> tuple[Path, Path]:
    make_pair(tmp_path, CFG, dtype="float32", base_shards=1, ft_shards=1, seed=0)
    return tmp_path / "base", tmp_path / "ft"


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(r, code: int = 2) -> str:
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    msg = r.output.strip()
    assert "Traceback" not in msg, msg
    return msg


# --- the lock file ----------------------------------------------------------------------------


def test_lock_file_that_is_a_symlink_says_so(pair, tmp_path):
    base, ft = pair
    (tmp_path / ".out.dghard-lock").symlink_to(tmp_path / "elsewhere")
    msg = one_line_error(invoke("repair", base, ft, tmp_path / "out"))
    assert "symbolic link" in msg and "cannot create files" not in msg
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "out").exists()


# --- report JSON is always strict JSON --------------------------------------------------------


def test_reports_never_hold_nan_or_infinity_literals():
    import json

    from dghard_cli.io.report_json import json_text

    doc = {"a": float("inf"), "b": [float("nan"), -float("inf"), 1.5], "c": {"d": (float("nan"),)}}
    text = json_text(doc)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"literal {c}")) == {
        "a": None,
        "b": [None, None, 1.5],
        "c": {"d": [None]},
    }
    assert (
        json_text({"x": 1.0, "y": [1, "s", None]})
        == json.dumps({"x": 1.0, "y": [1, "s", None]}, indent=2) + "\n"
    )


# --- one number reader: integers past float range, NaN, Inf ---------------------------------

BIG = "1" + "0" * 400


def lm_eval(value: str) -> str:
    return '{"results": {"arc_easy": {"acc,none": ' + value + ', "alias": "arc_easy"}}}'


def test_results_file_with_an_integer_past_float_range_names_the_key(tmp_path):
    for name, v in (("base", "0.5"), ("ft", BIG), ("c", "0.6")):
        (tmp_path / f"{name}.json").write_text(lm_eval(v))
    r = invoke(
        "score",
        "--base",
        tmp_path / "base.json",
        "--ft",
        tmp_path / "ft.json",
        "--candidate",
        tmp_path / "c.json",
    )
    msg = one_line_error(r)
    assert "results.arc_easy.acc,none" in msg and "too large" in msg


@pytest.mark.parametrize(
    "which, doc",
    [
        ("ft", lm_eval("1.7e308")),
        ("c", lm_eval("-1.7e308")),
        ("c", '{"results": {"arc_easy": {"acc,none": 0.6, "acc_stderr,none": 1.7e308}}}'),
        ("c", '{"arc_easy": 1e13}'),
        ("c", '{"arc_easy": {"score": 0.6, "stderr": 1e300}}'),
    ],
)
def test_extreme_finite_scores_are_refused_where_results_are_read(tmp_path, which, doc):
    """Finite scores near ±1.7e308 used to reach the scoring's arithmetic (differences, ratios,
    harmonic means, sqrt(se_b² + se_f²)) and come out as inf/NaN; no benchmark reports them."""

    for name, v in (("base", "0.5"), ("ft", "0.4"), ("c", "0.45")):
        (tmp_path / f"{name}.json").write_text(lm_eval(v))
    (tmp_path / f"{which}.json").write_text(doc)
    args = [
        "--base",
        tmp_path / "base.json",
        "--ft",
        tmp_path / "ft.json",
        "--candidate",
        tmp_path / "c.json",
    ]
    msg = one_line_error(invoke("score", *args, "--json"))
    assert f"{which}.json" in msg and "'arc_easy'" in msg and "beyond what any benchmark" in msg
    assert "e+" in msg and "Infinity" not in msg


def test_in_memory_scores_have_the_same_bound():
    from dghard_cli.errors import InputError
    from dghard_cli.scoring.metrics import score_candidates

    with pytest.raises(InputError, match="beyond what any benchmark"):
        score_candidates({"a": 50.0}, {"a": 1.7e308}, {"c": {"a": 40.0}})
    with pytest.raises(InputError, match="standard error"):
        score_candidates({"a": 50.0}, {"a": (40.0, 1e300)}, {"c": {"a": 40.0}})


@pytest.mark.parametrize(
    "value, why",
    [
        (BIG, "too large for a float"),
        (f"-{BIG}", "too large for a float"),
        (".nan", "not a finite"),
        (".inf", "not a finite"),
        ("-.inf", "not a finite"),
    ],
)
def test_recipe_numbers_past_float_range_or_not_finite_are_refused_with_the_key(pair, tmp_path, value, why):
    base, ft = pair
    recipe = tmp_path / "r.yml"
    recipe.write_text(
        f"models:\n  - model: {ft}\n    parameters:\n      weight: {value}\n"
        f"merge_method: linear\nbase_model: {base}\ndtype: float32\n"
    )
    msg = one_line_error(invoke("merge", "--config", recipe, "--out", tmp_path / "out"))
    assert "models[0].parameters.weight" in msg and why in msg
    assert not (tmp_path / "out").exists()


def test_config_json_integer_past_float_range_is_refused(pair, tmp_path):
    import json

    base, ft = pair
    cfg = json.loads((ft / "config.json").read_text())
    text = json.dumps(cfg)[:-1] + f', "rope_theta": {BIG}}}'
    (ft / "config.json").write_text(text)
    msg = one_line_error(invoke("repair", base, ft, tmp_path / "out"))
    assert "rope_theta" in msg and "too large" in msg


# --- one finiteness rule at the cast to the output dtype -------------------------------------


def test_cast_out_refuses_finite_values_the_output_dtype_cannot_hold():
    import torch

    from dghard_cli.engine.ops import OutputRangeError, cast_out

    f32max = torch.tensor([torch.finfo(torch.float32).max, 1.0])
    with pytest.raises(OutputRangeError, match="'w'.*BF16"):
        cast_out(f32max, "BF16", "w")
    with pytest.raises(OutputRangeError, match="F16"):
        cast_out(torch.tensor([70000.0]), "F16", "w")
    bf16max = torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16)
    assert torch.equal(cast_out(bf16max.float(), "BF16", "w"), bf16max)  # the extreme itself fits
    nan = torch.tensor([float("nan")])
    assert torch.isnan(cast_out(nan, "F16", "w")).all()  # already non-finite: the caller's concern


@pytest.mark.parametrize("lam, dtype", [("1e+308", "fp32"), ("1e+30", "fp16")])
def test_finite_lambda_whose_product_overflows_is_an_option_error(pair, tmp_path, lam, dtype):
    base, ft = pair
    out = tmp_path / "out"
    r = invoke(
        "merge", base, ft, "--method", "task-arithmetic", "--lambda", lam, "--dtype", dtype, "--out", out
    )
    msg = one_line_error(r).splitlines()[-1]
    assert "--lambda" in msg and "NaN" not in msg and "checkpoint" not in msg
    assert not out.exists()


# --- the adapter route: the same finiteness rule where its tensors are written ---------------


@pytest.mark.parametrize("case", ["nan-factor", "alpha-overflow"])
@pytest.mark.parametrize("fmt", [("--format", "peft"), ()])
def test_adapter_output_never_holds_nan_or_inf(tmp_path, case, fmt):
    from dghard_cli.testing.synthetic_lora import make_adapter, write_adapter

    arch = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    base, _ = make_pair(tmp_path / "pair", arch, ft_shards=1)
    ad, tensors, cfg = make_adapter(tmp_path / "ad", arch, r=4, alpha=8, targets=("q_proj",))
    if case == "nan-factor":
        next(iter(tensors.values()))[0, 0] = float("nan")
    else:
        cfg["lora_alpha"] = 1e300  # alpha / r overflows float32
    write_adapter(ad, tensors, cfg)
    out = tmp_path / "out"
    msg = one_line_error(invoke("merge", base, ad, "--method", "wise-ft", "--out", out, *fmt))
    assert "q_proj" in msg and "NaN/Inf" in msg
    assert not out.exists()


# --- pattern tables in time linear in their size ----------------------------------------------

MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.10.mlp.down_proj",
    "model.layers.1.mlp.up_proj",
    "lm_head",
    "model.embed_tokens",
]
KEYS = [
    "q_proj", "layers.1.self_attn.q_proj", "self_attn.q_proj", "layers.1", "mlp.down_proj", "layers.1.mlp.up.proj",
    "x.layers.0.self_attn.q_proj", "lm_head", "model.embed_tokens", "embed_tokens", "1.mlp", "layers\\.1\\..*",
    ".*q_proj", "up_proj|down_proj", "model.layers.1.self.attn.q.proj", "ayers.0.self_attn.q_proj", "mlp.up_proj",
]  # fmt: skip


def test_pattern_table_matches_exactly_as_peft_does():
    import itertools
    import random

    from dghard_cli.io.patterns import peft_key_match
    from dghard_cli.lora.config import pattern_key, pattern_table

    rng = random.Random(0)
    for n in (1, 2, 3, 5, len(KEYS)):
        for keys in itertools.islice(itertools.permutations(KEYS, n), 40) if n < 4 else [rng.sample(KEYS, n)]:
            table = dict.fromkeys(keys, 1)
            for m in MODULES:
                want = next((k for k in keys if peft_key_match(k, m)), None)
                assert pattern_key(table, m) == want, (keys, m)
            used = {i for i, k in enumerate(keys) if any(peft_key_match(k, m) for m in MODULES)}
            assert pattern_table(table).matched(MODULES) == used


def test_100000_rank_pattern_keys_are_read_and_matched_in_under_2_s():
    import time

    from dghard_cli.lora.config import parse_config

    raw = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
    raw["rank_pattern"] = {f"layers.{i}.self_attn.q_proj": 4 for i in range(100_000)}
    raw["rank_pattern"]["layers.99999.self_attn.q_proj"] = 2
    t0 = time.perf_counter()
    cfg, _ = parse_config(raw, "adapter_config.json")
    ranks = [cfg.rank_for(m) for m in MODULES * 20]
    assert time.perf_counter() - t0 < 2.0
    assert ranks[:2] == [4, 4] and cfg.rank_for("model.layers.99999.self_attn.q_proj") == 2


# --- sizes from files are bounded before they are used -----------------------------------------


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**12), ("n_layer", 10**12)])
def test_absurd_layer_count_in_config_is_refused_before_allocating(pair, tmp_path, key, value):
    import json

    base, ft = pair
    for d in (base, ft):
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("num_hidden_layers", None)
        cfg.pop("n_layer", None)
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    r = invoke("repair", base, ft, tmp_path / "out", "--lines", "0.2,0.6", "--device", "cpu")
    msg = one_line_error(r)
    assert key in msg and "absurd" in msg


def test_absurd_layer_index_in_a_tensor_name_is_refused_before_allocating():
    from dghard_cli.architecture import model_depth
    from dghard_cli.errors import InputError

    names = ["model.layers.0.mlp.up_proj.weight", f"model.layers.{10**12}.mlp.up_proj.weight"]
    with pytest.raises(InputError, match="1000000000000"):
        model_depth(names, None)
    with pytest.raises(InputError, match="absurdly large"):
        model_depth(["model.layers." + "9" * 5000 + ".mlp.up_proj.weight"], None)
    assert model_depth(["model.layers.0.a", "model.layers.1.a"], {"num_hidden_layers": 2}).num_layers == 2
    with pytest.raises(InputError, match="block 1 is missing"):
        model_depth(["model.layers.0.a", "model.layers.2.a"], None)


# --- OS resources: exhaustion is a runtime failure, many models are refused up front -----------


def test_too_many_open_files_is_a_runtime_failure_not_a_bad_shard(pair, tmp_path, monkeypatch):
    import errno

    from dghard_cli.io import files

    base, ft = pair
    real_open = files.os.open

    def emfile(path, *a, **k):
        if str(path).endswith(".safetensors") and str(ft) in str(path):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, *a, **k)

    monkeypatch.setattr(files.os, "open", emfile)
    msg = one_line_error(invoke("repair", base, ft, tmp_path / "out"), code=3)
    assert "Too many open files" in msg and "ulimit -n" in msg and "not at fault" in msg


def test_a_merge_of_more_models_than_the_open_file_limit_allows_succeeds(tmp_path):
    """60 fine-tunes (2 shards each: 121 shard files) under `ulimit -n 64`: shards are opened
    on use and at most a bounded number stay open (io/checkpoint.py's descriptor pool). This
    merge used to be refused up front ("at most 1 can be merged at once")."""
    import subprocess
    import sys

    import numpy as np
    import torch
    from conftest import _child_env
    from safetensors.numpy import load_file as np_load

    from dghard_cli.testing.synthetic import write_checkpoint

    cfg = ArchConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=32)
    base, _ = make_pair(tmp_path / "pair", cfg, dtype="float32", base_shards=2, ft_shards=1, seed=0)
    b = {k: v for p in sorted(base.glob("*.safetensors")) for k, v in np_load(p).items()}
    config = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    fts, deltas = [], []
    for i in range(60):
        d = {k: torch.randn(v.shape, generator=g, dtype=torch.float32) * 1e-2 for k, v in b.items()}
        ft = tmp_path / f"ft{i:02d}"
        write_checkpoint(ft, [(k, torch.from_numpy(b[k]) + d[k]) for k in b], shards=2, config=config)
        fts.append(ft)
        deltas.append({k: v.double().numpy() for k, v in d.items()})
    out = tmp_path / "out"

    def low_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    args = ["merge", base, *fts, "--method", "task-arithmetic", "--lambda", "0.5", "--out", out, "--quiet"]
    r = subprocess.run(
        [sys.executable, "-m", "dghard_cli", *map(str, args)],
        env=_child_env(None),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=low_limit,
    )
    assert r.returncode == 0, r.stderr
    got = {k: v for p in out.glob("*.safetensors") for k, v in np_load(p).items()}
    fts64 = [{k: b[k].astype(np.float64) + dd[k] for k in b} for dd in deltas]
    for k, v in b.items():  # independent float64 reference: BASE + λ Σ (FT_i − BASE)
        b64 = v.astype(np.float64)
        want = b64 + 0.5 * sum(f[k] - b64 for f in fts64)
        np.testing.assert_allclose(
            got[k].astype(np.float64), want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max())
        )


# --- finite bf16 extremes whose difference overflows float32 ----------------------------------

EXTREME = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture()
def extreme_pair(tmp_path) -> tuple[Path, Path]:
    """A bf16 pair, finite everywhere, with BASE = −3e38 and FT = +3e38 at one entry."""
    from safetensors.torch import load_file, save_file

    base, ft = make_pair(tmp_path, CFG, dtype="bfloat16", base_shards=1, ft_shards=1, seed=0)
    for d, v in ((base, -3e38), (ft, 3e38)):
        f = next(d.glob("*.safetensors"))
        t = load_file(f)
        t[EXTREME][0, 0] = v
        save_file(t, f, metadata={"format": "pt"})
    return base, ft


@pytest.mark.parametrize("method, n_ft", [("task-arithmetic", 1), ("ties", 2), ("dare", 1)])
def test_a_delta_of_finite_extremes_that_overflows_float32_is_not_blamed_on_nan(
    extreme_pair, tmp_path, method, n_ft
):
    base, ft = extreme_pair
    out = tmp_path / "out"
    msg = one_line_error(invoke("merge", base, *[ft] * n_ft, "--method", method, "--out", out))
    assert EXTREME in msg and "Δ = FT − BASE" in msg and "overflows float32" in msg
    assert "NaN" not in msg and "--dtype fp64" in msg
    assert not out.exists()


def test_the_suggested_float64_merge_and_a_repair_of_finite_extremes_succeed(extreme_pair, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file as np_load

    base, ft = extreme_pair
    out = tmp_path / "out"
    r = invoke(
        "merge", base, ft, "--method", "task-arithmetic", "--lambda", "0.5", "--dtype", "fp64", "--out", out
    )
    assert r.exit_code == 0, r.output

    def f64(d):  # bf16 widened exactly, from the raw bits
        from safetensors.torch import load_file

        return {k: v.double().numpy() for k, v in load_file(next(d.glob("*.safetensors"))).items()}

    b, f = f64(base), f64(ft)
    got = {k: v for p in out.glob("*.safetensors") for k, v in np_load(p).items()}
    want = b[EXTREME] + 0.5 * (f[EXTREME] - b[EXTREME])
    np.testing.assert_allclose(got[EXTREME], want, rtol=1e-12, atol=0)
    assert got[EXTREME][0, 0] == 0.0 and np.isfinite(got[EXTREME]).all()
    r = invoke("repair", base, ft, tmp_path / "rep")
    assert r.exit_code == 0, r.output
    assert "NaN" not in r.output


# --- disk full while side files, the model card or the report are written ---------------------


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("what", ["side file", "model card", "report"])
@pytest.mark.parametrize("cmd", ["repair", "merge", "adapter"])
def test_disk_full_while_writing_side_files_is_exit_3_naming_the_file(tmp_path, monkeypatch, cmd, what):
    import errno

    from dghard_cli.testing.synthetic_lora import make_adapter, write_adapter

    arch = ArchConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    base, ft = make_pair(tmp_path / "pair", arch, ft_shards=1)
    (ft / "tokenizer.json").write_text("{}")
    if cmd == "adapter":
        ft, tensors, cfg = make_adapter(tmp_path / "ad", arch, r=4, alpha=8, targets=("q_proj",))
        write_adapter(ft, tensors, cfg)
        (ft / "tokenizer.json").write_text("{}")
    before = {d: _tree(d) for d in (base, ft)}
    target = {"side file": "tokenizer.json", "model card": "README.md", "report": "dghard_report.json"}[what]
    real_open = open

    def full_open(path, mode="r", *a, **k):  # the low-level write into OUT's stage fails
        if Path(str(path)).name in (target, f"{target}.tmp") and any(c in mode for c in "wxa"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full_open)
    monkeypatch.setattr("io.open", full_open)  # pathlib writes through io.open
    out = tmp_path / "out"
    if cmd == "repair":
        r = invoke("repair", base, ft, out)
    elif cmd == "merge":
        r = invoke("merge", base, ft, ft, "--method", "task-arithmetic", "--out", out)
    else:
        r = invoke("merge", base, ft, "--method", "wise-ft", "--out", out)
    monkeypatch.undo()
    msg = one_line_error(r, code=3).splitlines()[-1]
    assert "disk full while writing" in msg and target in msg and "--resume" in msg, msg
    assert not out.exists()
    partial = tmp_path / ".out.dghard-partial"
    assert partial.is_dir() and not (partial / target).exists()  # nothing half-written, resumable
    assert {d: _tree(d) for d in (base, ft)} == before  # inputs untouched
    again = invoke(*(["repair", base, ft, out] if cmd == "repair" else
                     ["merge", base, *([ft, ft] if cmd == "merge" else [ft]),
                      "--method", "task-arithmetic" if cmd == "merge" else "wise-ft", "--out", out]))  # fmt: skip
    assert again.exit_code == 0, again.output
    assert (out / "README.md").exists() and not partial.exists()


def test_disk_full_while_taking_the_lock_is_exit_3_not_a_bad_out(pair, tmp_path, monkeypatch):
    import errno

    from dghard_cli.io import lock

    base, ft = pair
    real = lock.os.open

    def full(path, *a, **k):
        if str(path).endswith(".dghard-lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, *a, **k)

    monkeypatch.setattr(lock.os, "open", full)
    msg = one_line_error(invoke("repair", base, ft, tmp_path / "out"), code=3)
    assert "disk full while writing the lock file" in msg and "choose an OUT" not in msg


# --- the sweep's options and candidate file -------------------------------------------------------


def test_a_device_index_of_thousands_of_digits_is_refused_not_an_internal_error(pair, tmp_path):
    """--devices of 5000 digits hit Python's integer-string limit: "internal error: ValueError"."""
    base, ft = pair
    r = invoke("sweep", base, ft, tmp_path / "o", "--eval", "true {model} {output}", "--devices", "9" * 5000)
    assert "a 5000-digit index" in one_line_error(r)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["1e300", "inf", "-1", "9" * 5000])
def test_a_number_from_the_environment_out_of_range_is_refused_before_anything_runs(
    pair, tmp_path, monkeypatch, value
):
    """DGHARD_RAY_START_TIMEOUT_S=1e300 overflowed inside Ray ("internal error: OverflowError")
    after the cluster had started; -1 or inf was silently replaced by 120 s."""
    pytest.importorskip("ray")
    base, ft = pair
    monkeypatch.setenv("DGHARD_RAY_START_TIMEOUT_S", value)
    r = invoke("sweep", base, ft, tmp_path / "o", "--eval", "true {model} {output}", "--executor", "ray")
    msg = one_line_error(r)
    assert "DGHARD_RAY_START_TIMEOUT_S must be a number of seconds from 0.1 to 86400" in msg, msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text,why",
    [
        ("families:\n  - family: hard\n    grid: [" + "9" * 5000 + "]\n", "integer string conversion"),
        ("families:\n  - family: hard\n    when: 2024-13-45\n", "month must be in 1..12"),
        ("merges:\n  grid: [1" + "0" * 400 + "]\n  range: [0, 1]\n", "integer too large for a float"),
    ],
)
def test_candidate_file_numbers_that_python_cannot_build_are_refused(pair, tmp_path, text, why):
    """A YAML integer of 5000 digits or a timestamp of month 13 raised ValueError while the file
    was built into objects (an internal error)."""
    base, ft = pair
    (tmp_path / "c.yaml").write_text(text)
    args = (
        "sweep",
        base,
        ft,
        tmp_path / "o",
        "--eval",
        "true {model} {output}",
        "--candidates",
        tmp_path / "c.yaml",
    )
    msg = one_line_error(invoke(*args))
    assert "c.yaml" in msg and why in msg, msg


def test_a_merges_block_number_past_float_range_is_not_a_number():
    """parse_block's own number check raised OverflowError on 10**400 (the file reader caught it
    first on the command line; the library's parse_candidates did not)."""
    from dghard_cli.errors import InputError
    from dghard_cli.sweeping.candidate_file import parse_candidates

    for doc in (
        {"families": [{"family": "hard", "grid": [10**400]}]},
        {"merges": {"grid": [0.5], "range": [0, 1], "density": [10**400]}},
        {"merges": {"grid": [0.5], "range": [0, 1], "lines": [[10**400, 1]]}},
    ):
        with pytest.raises(InputError):
            parse_candidates(doc, "c.yaml")


# --- strengths taken as a whole, never by position -------------------------------------------


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dare-linear", "breadcrumbs", "dg-hard"])
@pytest.mark.parametrize("weights", ["1,1e300", "1e300,1"])
def test_a_huge_weight_is_refused_or_merged_whatever_its_position(pair, tmp_path, method, weights):
    """``--weights 1,1e300`` was an internal error (torch's ``add_(x, alpha=1e300)`` on a float32
    accumulator) while ``1e300,1`` was refused: the outcome depended on the weight's position."""
    base, ft = pair
    extra = ["--seed", "1"] if method.startswith("dare") else []
    r = invoke(
        "merge", "--method", method, "--weights", weights, *extra, base, ft, ft, "--out", tmp_path / "o"
    )
    msg = one_line_error(r)
    assert "internal error" not in msg
    # the merge overflows float32 (1e300·Δ), or, for TIES' weighted mean, whose scale does not
    # matter, the small weight would vanish beside the large one in float32 (it did, silently)
    assert ("overflow" in msg and "lower the strengths" in msg) or "a ratio torch.float32 cannot hold" in msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("method", "same"),
    [
        ("task-arithmetic", ["--weights", "1,1"]),
        ("dg-hard", ["--weights", "1,1"]),
        ("ties", ["--weights", "1,1", "--lambda", "1e-300"]),  # a weighted mean: λ alone scales it
    ],
)
def test_huge_weights_times_a_tiny_lambda_are_the_finite_merge_they_denote(pair, tmp_path, method, same):
    """``--weights 1e300,1e300 --lambda 1e-300``: each task vector's coefficient λ·w is 1, the
    same merge as ``--weights 1,1`` (it was an internal error); TIES' mean does not depend on
    the weights' scale."""
    from safetensors.numpy import load_file

    base, ft = pair
    outs = {}
    for name, args in (
        ("huge", ["--weights", "1e300,1e300", "--lambda", "1e-300"]),
        ("plain", same),
    ):
        r = invoke(
            "merge", "--method", method, *args, base, ft, ft, "--dtype", "fp64", "--out", tmp_path / name
        )
        assert r.exit_code == 0, r.output
        outs[name] = {}
        for f in sorted((tmp_path / name).glob("*.safetensors")):
            outs[name].update(load_file(f))
    assert outs["huge"].keys() == outs["plain"].keys()
    for k in outs["plain"]:
        np.testing.assert_allclose(outs["huge"][k], outs["plain"][k], rtol=1e-12, atol=0, err_msg=k)


def test_effective_strengths_keep_the_coefficients_and_the_bits_in_range():
    import torch

    from dghard_cli.errors import InputError
    from dghard_cli.methods.coefficients import effective_strengths
    from dghard_cli.methods.task_arithmetic import task_arithmetic_delta
    from dghard_cli.methods.ties import ties_delta

    assert effective_strengths([0.3, 2.0], 0.7, torch.float32) == ([0.3, 2.0], 0.7)  # in range: as given
    ws, lam = effective_strengths([1e300, 2e300], 1e-300, torch.float32)
    assert ws == [0.5, 1.0] and lam == pytest.approx(2.0)
    assert effective_strengths([1e30, 1.0], 3.0, torch.float32, scale_free=True) == ([1e30, 1.0], 3.0)
    assert effective_strengths([1e-300, 1e-300], 1e300, torch.float32) == ([1.0, 1.0], pytest.approx(1.0))
    with pytest.raises(InputError, match="ratio torch.float32 cannot hold"):  # 1e-300 would vanish
        effective_strengths([1.0, 1e300], 3.0, torch.float32, scale_free=True)
    rng = np.random.default_rng(0)
    d = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(2)]
    got = task_arithmetic_delta([torch.from_numpy(x) for x in d], [1e300, 3e300], 1e-300)
    want = d[0].astype(np.float64) + 3 * d[1].astype(np.float64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    # TIES' weighted disjoint mean with weights (1e39, 3e39), beyond float32: the same as (1, 3)
    t = [torch.from_numpy(x) for x in d]
    got = ties_delta([x.clone() for x in t], [1e39, 3e39], 1.0).numpy().astype(np.float64)
    d64 = [x.astype(np.float64) for x in d]
    sign = np.where(d64[0] + 3 * d64[1] >= 0, 1.0, -1.0)
    agree = [(np.sign(x) == sign) & (x != 0) for x in d64]
    num = d64[0] * agree[0] + 3 * d64[1] * agree[1]
    den = agree[0] * 1.0 + agree[1] * 3.0
    want = np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("columns", ["99999999999999999999", "9" * 5000, "-3", "1e9", "0"])
def test_a_terminal_size_no_terminal_has_is_ignored(pair, tmp_path, monkeypatch, columns):
    """COLUMNS=99999999999999999999 made even ``dghard --help`` an OverflowError traceback
    (rich sizes its buffers from it): a size outside 1..10000 is ignored, as if unset."""
    from conftest import run_dghard_process

    r = run_dghard_process("--help", env={"COLUMNS": columns, "LINES": columns})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-500:]
    monkeypatch.setenv("COLUMNS", columns)
    base, ft = pair
    r = invoke("repair", base, ft, tmp_path / "o")
    assert r.exit_code == 0, r.output
