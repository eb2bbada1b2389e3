"""Fine-tunes whose vocabularies were resized differently: the rows shared with BASE are merged,
the rows fine-tune #1 added are #1's (as ``repair`` keeps a fine-tune's new rows); fine-tunes
that add different rows are refused with the reason."""

from __future__ import annotations

import json

import merge_reference as M
import numpy as np
import pytest
from conftest import f64, load_dir, run_dghard
from reference import rel

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.merging import MergeOptions, merge
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=256)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    base, grown = make_pair(root / "a", CFG, ft_shards=2, seed=0, ft_vocab=264)  # adds 8 tokens
    _, same = make_pair(root / "b", CFG, ft_shards=1, seed=0, delta_seed=11)  # BASE's 256 rows
    _, grown2 = make_pair(root / "c", CFG, ft_shards=1, seed=0, delta_seed=22, ft_vocab=270)
    _, grown3 = make_pair(root / "d", CFG, ft_shards=1, seed=0, delta_seed=33, ft_vocab=264)
    return {"base": base, "grown": grown, "same": same, "grown2": grown2, "grown3": grown3}


@pytest.mark.parametrize("method", ["task-arithmetic", "ties"])
def test_shared_rows_merged_new_rows_from_the_finetune_that_added_them(vocab, tmp_path, method):
    w = [1.0, 0.5]
    opts = MergeOptions(method=method, weights=w, run=RunOptions(device="cpu", quiet=True))
    if method == "ties":
        opts.density = 0.3
    doc = merge(vocab["base"], [vocab["grown"], vocab["same"]], tmp_path / "o", opts)
    b, f1, f2 = load_dir(vocab["base"]), load_dir(vocab["grown"]), load_dir(vocab["same"])
    out = load_dir(tmp_path / "o")
    for name, t in b.items():
        if name in VOCAB:
            assert out[name].shape == (264, 64)
            shared = [f64(f1[name])[:256], f64(f2[name])]
            new = out[name][256:]
            assert np.array_equal(new.numpy(), f1[name][256:].numpy())  # fine-tune #1's new rows, as they are
            got = f64(out[name])[:256]
        else:
            shared = [f64(f1[name]), f64(f2[name])]
            got = f64(out[name])
        if method == "ties":
            ref = M.ref_ties(f64(t), shared, w, 0.3, 1.0)
        else:
            ref = M.ref_task_arithmetic(f64(t), shared, w, 1.0)
        assert rel(got, ref) <= 1e-6, name
    recs = {r["name"]: r for r in doc["tensors"]}
    for name in VOCAB:
        assert recs[name]["action"] == "resized" and recs[name]["shared_rows"] == 256
    assert any("fine-tune #2 keeps BASE's 256 rows" in n for n in doc["notes"])
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["vocab_size"] == 264  # config (and tokenizer) from fine-tune #1


def test_equal_added_row_counts_take_finetune_1s_rows(vocab, tmp_path):
    opts = MergeOptions(method="task-arithmetic", run=RunOptions(device="cpu", quiet=True))
    merge(vocab["base"], [vocab["grown"], vocab["grown3"]], tmp_path / "o", opts)
    out, f1 = load_dir(tmp_path / "o"), load_dir(vocab["grown"])
    for name in VOCAB:
        assert np.array_equal(out[name][256:].numpy(), f1[name][256:].numpy())


@pytest.mark.parametrize(
    "order, message",
    [
        (("same", "grown"), "fine-tune #2 adds rows (256 -> 264) and fine-tune #1 does not; list #2 first"),
        (("grown", "grown2"), "fine-tunes #1 and #2 both add rows beyond BASE's 256 (264 vs 270)"),
    ],
)
def test_refused_with_the_reason(vocab, tmp_path, order, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        merge(
            vocab["base"],
            [vocab[k] for k in order],
            tmp_path / "o",
            MergeOptions(method="task-arithmetic", run=RunOptions(device="cpu")),
        )
    assert not (tmp_path / "o").exists()
    res = run_dghard(
        "merge", "--method", "ties", vocab["base"], *(vocab[k] for k in order), "--out", tmp_path / "o"
    )
    assert (
        res.returncode == 2
        and res.stderr.count("\n") == 1
        and "must share one architecture" not in res.stderr
    )
