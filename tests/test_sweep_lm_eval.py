"""``dghard sweep --lm-eval``: lm-evaluation-harness as the sweep's evaluation, end to end.

A tiny Llama (hidden 32, 2 layers, a word-level tokenizer of 20 words, all saved with
``save_pretrained`` so that lm-eval's hf backend loads it offline) is trained on one local
multiple-choice task (``animals``); its fine-tune is trained further on another (``colours``).
Both tasks are lm-eval YAML files over local JSON lines under a temporary ``--include_path``.
lm_eval must be installed (the ``test`` extra has it): these tests fail, not skip, without it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_dghard

from dghard_cli.errors import InputError
from dghard_cli.sweeping import lm_eval as L
from dghard_cli.sweeping.command import build_command

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON only; the Hub is never asked

COLOURS = [("sky", "blue"), ("grass", "green"), ("blood", "red"), ("sun", "yellow")]
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack")]
WORDS = ["the", "is", "says", *[w for pair in COLOURS + ANIMALS for w in pair]]


def _sentences(pairs: list[tuple[str, str]], verb: str) -> list[str]:
    return [f"the {a} {verb} {b}" for a, b in pairs]


def _train(model, sentences: list[str], tok, steps: int, lr: float) -> None:
    ids = torch.tensor([tok.encode(s) for s in sentences])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _task(root: Path, name: str, pairs: list[tuple[str, str]], verb: str) -> None:
    choices = [b for _, b in pairs]
    data = root / f"{name}.jsonl"
    with open(data, "w") as fh:
        for k in range(3):  # 12 documents, the choices rotated
            for a, b in pairs:
                shown = choices[k:] + choices[:k]
                fh.write(
                    json.dumps({"q": f"the {a} {verb}", "choices": shown, "gold": shown.index(b)}) + "\n"
                )
    (root / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("lm eval")  # a space in every path: quoting is tested
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    _train(model, _sentences(ANIMALS, "says"), tok, steps=60, lr=1e-2)
    model.save_pretrained(root / "base", safe_serialization=True)
    tok.save_pretrained(root / "base")
    _train(model, _sentences(COLOURS, "is"), tok, steps=60, lr=3e-2)  # the fine-tune
    model.save_pretrained(root / "ft", safe_serialization=True)
    tok.save_pretrained(root / "ft")
    tasks = root / "tasks"
    tasks.mkdir()
    _task(tasks, "colours", COLOURS, "is")
    _task(tasks, "animals", ANIMALS, "says")
    return {"root": root, "base": root / "base", "ft": root / "ft", "tasks": tasks}


def test_a_sweep_evaluated_by_lm_eval_reads_its_scores_and_writes_the_winner(models):
    out = models["root"] / "out"
    r = run_dghard(
        "sweep",
        models["base"],
        models["ft"],
        out,
        "--lm-eval",
        "colours",
        "--lm-eval",
        "animals",
        "--lm-eval-args",
        f"--include_path {shlex.quote(str(models['tasks']))} --batch_size 8 --model_args dtype=float32",
        "--budget",
        "3",
        "--margin",
        "1",
        "--jobs",  # BASE and FT evaluated at once: lm-eval's start-up is most of this test's time
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    lm = doc["eval"]["lm_eval"]
    assert lm["tasks"] == ["colours", "animals"] and lm["model"] == "hf"
    assert lm["model_args"] == "dtype=float32"
    assert lm["device"] in ("cpu", "cuda:0")
    assert doc["eval"]["template"].startswith(f"{shlex.quote(sys.executable)} -m lm_eval --model hf ")
    assert doc["budget"]["used"] == 3 and doc["budget"]["run_now"] == 3  # BASE, FT, one candidate
    assert all(ref["status"] == "ok" for ref in doc["references"].values())
    assert [c["status"] for c in doc["candidates"]] == ["ok"]
    # lm-eval's results (under {output}/<model dir>/results_<time>.json) read with its acc metric:
    # 12 documents, 4 choices; the base knows the animals, the fine-tune the colours, not the animals
    scores = {bm["name"]: (bm["base"], bm["ft"], bm["partition"]) for bm in doc["benchmarks"]}
    assert set(scores) == {"colours", "animals"}
    for base, ft, _ in scores.values():
        assert round(base * 12 / 100, 9).is_integer()
        assert round(ft * 12 / 100, 9).is_integer()
    assert scores["colours"][0] < scores["colours"][1] and scores["colours"][2] == "improved"
    assert doc["winner"] is not None, doc["no_winner_reason"]
    assert (out / "sweep_report.json").is_file() and list(out.glob("*.safetensors"))
    assert json.loads((out / "sweep_report.json").read_text())["eval"]["lm_eval"] == lm


def test_the_template_runs_this_interpreters_lm_eval_with_quoted_paths():
    spec = L.LmEvalSpec.parse(
        ["arc_easy,hellaswag"], "--batch_size auto --model_args 'dtype=bfloat16,max_length=2048'", None
    )
    assert spec.tasks == ("arc_easy", "hellaswag") and spec.model_args == "dtype=bfloat16,max_length=2048"
    t = L.template(spec, "cuda:0")
    assert t == (
        f"{shlex.quote(sys.executable)} -m lm_eval --model hf --model_args pretrained={{model}},"
        "dtype=bfloat16,max_length=2048 --tasks arc_easy,hellaswag --output_path {output} "
        "--device cuda:0 --batch_size auto"
    )
    cmd = shlex.split(build_command(t, model="/m dir/x'y", output="/o dir/r"))
    assert cmd[cmd.index("--model_args") + 1] == "pretrained=/m dir/x'y,dtype=bfloat16,max_length=2048"
    assert cmd[cmd.index("--output_path") + 1] == "/o dir/r"
    vllm = L.template(L.LmEvalSpec.parse("gsm8k", None, "vllm"), "cpu")
    assert "--model vllm --model_args pretrained={model} --tasks gsm8k" in vllm


@pytest.mark.parametrize(
    "args, message",
    [
        ("--output_path /x", "--output_path is set by the sweep"),
        ("--tasks a", "--tasks is set by --lm-eval"),
        ("--device=cuda", "--device is set by the sweep's --device"),
        ("--model_args pretrained=x", "pretrained=... is set by the sweep"),
        ("--limit '3", "No closing quotation"),
        ("--out x", "--out abbreviates --output_path; spell it out"),
        ("--model_a dtype=float32", "--model_a abbreviates --model_args"),
    ],
)
def test_lm_eval_args_that_the_template_owns_are_refused(args, message):
    with pytest.raises(InputError, match=message):
        L.LmEvalSpec.parse("arc_easy", args)


@pytest.mark.parametrize(
    "args, owned",
    [
        ("-a=pretrained=x", "pretrained=..."),
        ("-apretrained=x", "pretrained=..."),
        ("--model_args dtype=x pretrained=y", "pretrained=..."),  # nargs "+": both are model_args
        ("-oDIR", "--output_path"),
        ("-o=DIR", "--output_path"),
        ("--o DIR", "--output_path"),
        ("-Mvllm", "--model"),
        ("-wMvllm", "--model"),  # a flag joined to an option
        ("-tTASK", "--tasks"),
        ("--d cuda", "--device"),
        ("-C run.yaml", "--config"),
    ],
)
def test_lm_eval_args_are_read_as_lm_eval_reads_them(args, owned):
    """lm-eval's short, glued and 3-letter spellings passed the filter (which knew long names and
    long abbreviations): every candidate evaluated as another model, results written outside OUT,
    tasks appended."""
    with pytest.raises(InputError, match=re.escape(owned)):
        L.LmEvalSpec.parse("arc_easy", args)


def test_lm_eval_args_that_lm_eval_itself_would_refuse_are_refused_up_front():
    with pytest.raises(InputError, match="ambiguous option: --conf"):
        L.LmEvalSpec.parse("arc_easy", "--conf x")
    spec = L.LmEvalSpec.parse("arc_easy", "-L 3 -adtype=float32 --include_path /tmp -sx")
    assert spec.args == ("-L", "3", "-adtype=float32", "--include_path", "/tmp", "-sx")


@pytest.mark.parametrize(
    "args",
    [
        """-a='{"pretrained":"decoy"}'""",
        """-sa'{"pretrained":"decoy"}'""",
        """--model_args '{"dtype":"float32","pretrained":"decoy"}'""",
        """--model_args='{"pre\\u0074rained":"decoy"}'""",  # a JSON escape lm-eval decodes
    ],
)
def test_json_model_args_are_read_as_lm_eval_reads_them(args):
    """lm-eval merges a JSON object given to --model_args over the template's
    pretrained={model}: every evaluation loaded the decoy, and the sweep chose on its scores."""
    with pytest.raises(InputError, match=re.escape("pretrained=...")):
        L.LmEvalSpec.parse("arc_easy", args)


def test_lm_eval_args_read_as_lm_evals_merge_dict_action_reads_them():
    """Only the first value of a --model_args may be JSON; later ones are key=value pairs whose
    values may hold braces (lm-eval accepts them). An option without its value is refused in
    one line (it was an internal error)."""
    spec = L.LmEvalSpec.parse(
        "arc_easy", """-a dtype=bfloat16 'chat_template_args={"enable_thinking":false}'"""
    )
    assert "dtype=bfloat16" in spec.model_args
    with pytest.raises(InputError, match="expected key=value"):  # lm-eval fails on it: JSON only first
        L.LmEvalSpec.parse("arc_easy", """-a dtype=float32 '{"pretrained":"decoy"}'""")
    for bare in ("--num_fewshot", "--limit", "-a"):
        with pytest.raises(InputError, match="needs a value|lm-eval would refuse it"):
            L.LmEvalSpec.parse("arc_easy", bare)


def test_json_model_args_without_pretrained_pass_through_whole():
    spec = L.LmEvalSpec.parse("arc_easy", """--model_args '{"dtype": "float32"}' -a max_length=64""")
    assert spec.model_args == "max_length=64"
    assert spec.args == ("--model_args", '{"dtype": "float32"}')
    assert """--model_args '{"dtype": "float32"}'""" in L.template(spec, "cpu")
    with pytest.raises(InputError, match="not valid JSON"):
        L.LmEvalSpec.parse("arc_easy", """-a '{dtype: float32}'""")


def test_the_option_table_is_the_installed_lm_evals():
    """A canary on the pinned lm-eval: the table read from its parser is the built-in one (which
    stands in only where that release's table cannot be read)."""
    from dghard_cli.sweeping import lm_eval_options as O

    version, table, why = O.read_installed()
    assert why is None and table is not None, why
    assert dict(table) == dict(O.BUILT_IN_OPTIONS)
    assert O.option_table().table == table and O.option_table().version == version


def test_an_lm_eval_whose_options_differ_is_read_or_refused_in_one_line(monkeypatch):
    from dghard_cli.sweeping import lm_eval_options as O

    def installed(version, table, why=None):
        monkeypatch.setattr(O, "read_installed", lambda python=None: (version, table, why))
        O.option_table.cache_clear()

    try:
        # a newer release with a new spelling of the output path: read from it, refused
        newer = tuple((o + ("--out_dir",) if "--output_path" in o else o, n) for o, n in O.BUILT_IN_OPTIONS)
        installed("0.5.0", newer)
        with pytest.raises(InputError, match="--out_dir is lm-eval's --output_path"):
            L.LmEvalSpec.parse("arc_easy", "--out_dir /elsewhere")
        # its table cannot be read: the built-in one stands in for its own release only
        installed(O.BUILT_IN_RELEASE, None, "ImportError: no _cli")
        assert L.LmEvalSpec.parse("arc_easy", "-L 3").args == ("-L", "3")
        installed("0.5.0", None, "ImportError: no _cli")
        with pytest.raises(InputError) as e:
            L.LmEvalSpec.parse("arc_easy", "-L 3")
        msg = str(e.value)
        assert "lm-eval 0.5.0" in msg and f"lm-eval=={O.BUILT_IN_RELEASE}" in msg and "\n" not in msg
        assert L.LmEvalSpec.parse("arc_easy").args == ()  # nothing to read: nothing refused
        # a release without an option the template writes
        installed("0.5.0", tuple((o, n) for o, n in O.BUILT_IN_OPTIONS if "--device" not in o))
        with pytest.raises(InputError, match="has no --device"):
            L.LmEvalSpec.parse("arc_easy", "-L 3")
    finally:
        O.option_table.cache_clear()


def test_a_task_that_is_a_file_must_be_a_task_yaml(tmp_path):
    """--lm-eval notes.txt counted as a task (an existing file) and failed after evaluating."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a task\n")
    with pytest.raises(InputError, match="a file that is not a task YAML"):
        L.LmEvalSpec.parse(str(notes))
    with pytest.raises(InputError, match="no such task file or directory"):
        L.LmEvalSpec.parse(str(tmp_path / "missing.yaml"))
    (tmp_path / "t.yaml").write_text("task: t\n")
    assert L.LmEvalSpec.parse(f"{tmp_path / 't.yaml'},arc_*").tasks == (str(tmp_path / "t.yaml"), "arc_*")


def test_an_unknown_task_is_refused_before_anything_runs(models, tmp_path):
    out = tmp_path / "out"
    r = run_dghard(
        "sweep",
        models["base"],
        models["ft"],
        out,
        "--lm-eval",
        "colours,colors",
        "--lm-eval-args",
        f"--include_path {shlex.quote(str(models['tasks']))}",
    )
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "lm-eval knows no task 'colors'" in line and "did you mean colours" in line
    assert list(tmp_path.iterdir()) == []  # no evaluation, no staging directory, no OUT


def test_eval_and_lm_eval_exactly_one_and_vllm_needs_vllm(models, tmp_path, monkeypatch):
    base, ft, out = models["base"], models["ft"], tmp_path / "out"
    cases = [
        (["--eval", "true {model} {output}", "--lm-eval", "colours"], "--eval and --lm-eval are both given"),
        ([], "give an evaluation: --eval"),
        (["--lm-eval-args", "--limit 3"], "--lm-eval-args needs --lm-eval"),
        (["--eval", "true {model} {output}", "--lm-eval-model", "hf"], "--lm-eval-model goes with --lm-eval"),
        (["--lm-eval", "colours", "--lm-eval-model", "tgi"], "--lm-eval-model 'tgi' is not one of hf, vllm"),
    ]
    # vllm is not installed here (were it installed, this run still sees it missing)
    real_find_spec = L.importlib.util.find_spec
    monkeypatch.setattr(
        L.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a)
    )
    cases.append((["--lm-eval", "colours", "--lm-eval-model", "vllm"], "vllm is not installed"))
    for extra, message in cases:
        r = run_dghard("sweep", base, ft, out, *extra)
        assert r.returncode == 2, (extra, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
    assert list(tmp_path.iterdir()) == []


def test_lm_eval_is_installed_and_its_task_lookup_is_cheap_for_include_path_tasks(models):
    import time

    t0 = time.perf_counter()
    unknown, close, known = L.unknown_tasks(["colours", "animals"], str(models["tasks"]))
    assert (unknown, known) == ([], 2)  # found among the include_path's tasks: the built-ins not indexed
    assert time.perf_counter() - t0 < 60
