"""``merge --core-space``: LoRA experts merged in their shared core space, the result an adapter.

Real PEFT adapters of one tiny Llama (different ranks, scalings and target modules, one of them
on the token embedding). Against independent float64 references written here in numpy:

- the core space itself: every update ``L_i R_i = U M_i Vᵀ`` exactly, ``U``/``V`` orthonormal;
- the "lossless" methods (task arithmetic, Iso-C, STAR, WUDI; ``--lines`` and SVC on top) give
  the full-tensor merge (dghard's ``--merge`` output, itself checked against numpy elsewhere;
  task arithmetic against ``Σ λ w_i ΔW_i`` here) to float32 rounding;
- the elementwise methods (TIES, DARE-TIES) give the method of the cores in the singular bases
  of the stacked factors (the numpy reference builds those bases itself);
- the adapter loads with ``PeftModel.from_pretrained`` and its ``merge_and_unload()`` weights are
  BASE + the reference update; refusals are one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import merge_reference as M
import numpy as np
import pytest
import torch
from conftest import run_dghard

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dghard_cli.engine.writer import RunOptions  # noqa: E402
from dghard_cli.errors import InputError  # noqa: E402
from dghard_cli.lora.output import LoraOutputOptions  # noqa: E402
from dghard_cli.merging import MergeOptions, merge  # noqa: E402
from dghard_cli.methods import dare as dare_mod  # noqa: E402
from dghard_cli.spectral.core_space import core_factors, core_space  # noqa: E402

warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()
SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def make_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    model = get_peft_model(LlamaForCausalLM.from_pretrained(str(base)), LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name or "lora_magnitude" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("core")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES, vocab_size=64, tie_word_embeddings=False)).save_pretrained(
        str(root / "base")
    )
    base = root / "base"
    return {
        "root": root,
        "base": base,
        "a1": make_adapter(
            base, root / "a1", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
        "a2": make_adapter(
            base, root / "a2", 2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
        "a3": make_adapter(
            base, root / "a3", 3, r=4, lora_alpha=16, target_modules=["q_proj", "up_proj", "embed_tokens"]
        ),
        "dora": make_adapter(
            base, root / "dora", 4, r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True
        ),
    }


# -- independent references ----------------------------------------------------------------------


def peft_match(key: str, module: str) -> bool:  # PEFT's get_pattern_key rule
    return re.match(rf"(.*\.)?({key})$", module) is not None


def adapter_factors(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{weight name: (L, R)}`` with ``ΔW = L·R`` (float64), from the files and PEFT's rules."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    t = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for k, v in t.items():
        for a_key, b_key, transposed in (
            ("lora_A", "lora_B", False),
            ("lora_embedding_A", "lora_embedding_B", True),
        ):
            if f".{a_key}." not in k and not k.endswith(f".{a_key}"):
                continue
            module = k.split("base_model.model.", 1)[1].split(f".{a_key}", 1)[0]
            a, b = v.astype(np.float64), t[k.replace(a_key, b_key)].astype(np.float64)
            r = int(a.shape[0])
            pat = [p for p in cfg.get("rank_pattern") or {} if peft_match(p, module)]
            apat = [p for p in cfg.get("alpha_pattern") or {} if peft_match(p, module)]
            r_cfg = cfg["rank_pattern"][pat[0]] if pat else cfg["r"]
            alpha = cfg["alpha_pattern"][apat[0]] if apat else cfg["lora_alpha"]
            assert r == r_cfg
            s = alpha / r
            out[f"{module}.weight"] = (s * a.T, b.T) if transposed else (s * b, a)
    return out


def adapter_delta(path: Path) -> dict[str, np.ndarray]:
    return {k: left @ right for k, (left, right) in adapter_factors(path).items()}


def full_delta(path: Path, base: Path) -> dict[str, np.ndarray]:
    b = load_file(str(base / "model.safetensors"))
    w: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        w.update(load_file(str(f)))
    return {k: w[k].astype(np.float64) - b[k].astype(np.float64) for k in w if k in b}


def np_basis(x: np.ndarray) -> np.ndarray:
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    return u[:, : int(np.sum(s > 1e-6 * s[0]))]


def np_balanced(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(U √S, √S Vᵀ)`` from the SVD of the update ``L R`` itself."""
    u, s, vt = np.linalg.svd(left @ right, full_matrices=False)
    r = left.shape[1]
    return u[:, :r] * np.sqrt(s[:r]), np.sqrt(s[:r])[:, None] * vt[:r]


def np_core_merge(pairs, merge_cores) -> np.ndarray:
    """The update of ``merge_cores`` run on the cores of ``pairs`` [(L_i, R_i)] (numpy, float64):
    bases from the stacked balanced factors of each update, cores ``Uᵀ ΔW_i V``."""
    balanced = [np_balanced(left, right) for left, right in pairs]
    u = np_basis(np.concatenate([p[0] for p in balanced], axis=1))
    v = np_basis(np.concatenate([p[1] for p in balanced], axis=0).T)
    cores = [u.T @ (left @ right) @ v for left, right in pairs]
    return u @ merge_cores(cores) @ v.T


def run_merge(tiny, out: Path, method: str, fts=("a1", "a2", "a3"), **kw) -> dict:
    lora = kw.pop("lora", LoraOutputOptions(core_space=True))
    opts = MergeOptions(method=method, lora=lora, run=RunOptions(quiet=True, overwrite=True), **kw)
    return merge(tiny["base"], [tiny[f] for f in fts], out, opts)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# -- the core space ------------------------------------------------------------------------------


def test_every_update_is_exact_in_the_core_space():
    g = np.random.default_rng(0)
    m, n = 40, 30
    pairs = [(g.normal(size=(m, r)), g.normal(size=(r, n))) for r in (3, 5)]
    pairs.append((np.zeros((m, 0)), np.zeros((0, n))))  # an adapter without the module
    pairs.append((np.zeros((m, 2)), g.normal(size=(2, n))))  # a zero update (B = 0)
    space = core_space([torch.from_numpy(p[0]) for p in pairs], [torch.from_numpy(p[1]) for p in pairs])
    u, v = space.left.numpy(), space.right.numpy()
    # rank of the stacked balanced factors: a zero update (B = 0) adds no direction on either side
    assert space.shape == (8, 8)
    np.testing.assert_allclose(u.T @ u, np.eye(8), atol=1e-12)
    np.testing.assert_allclose(v.T @ v, np.eye(8), atol=1e-12)
    for (left, right), c in zip(pairs, space.cores, strict=True):
        assert c.shape == (8, 8)
        np.testing.assert_allclose(
            u @ c.numpy() @ v.T, left @ right, atol=1e-12 * (1 + np.abs(left @ right).max())
        )
    merged = space.cores[0] - 2 * space.cores[1]
    fac = core_factors(space, merged)
    np.testing.assert_allclose(
        (fac.left @ fac.right).numpy(), pairs[0][0] @ pairs[0][1] - 2 * pairs[1][0] @ pairs[1][1], atol=1e-11
    )
    assert fac.rank == 8 and fac.energy_lost == 0.0


# -- lossless methods: the full-tensor merge ------------------------------------------------------


@pytest.mark.parametrize(
    "method, kw",
    [
        ("task-arithmetic", {"weights": [1.0, 0.5, -0.7], "lam": 0.8}),
        ("iso-c", {"alpha": 1.3}),
        ("star", {}),
        ("wudi", {"extra": {"steps": 20}}),
        ("iso-c", {"schedule": "lines"}),
        ("task-arithmetic", {"extra": {"calibrate": "svc"}}),
    ],
    ids=["task-arithmetic", "iso-c", "star", "wudi", "iso-c-lines", "task-arithmetic-svc"],
)
def test_lossless_methods_give_the_full_tensor_merge(tiny, method, kw):
    from dghard_cli.schedule.spec import parse_lines

    kw = dict(kw)
    if kw.get("schedule") == "lines":
        kw["schedule"] = parse_lines("0.3,0.7")
    root = tiny["root"]
    core_doc = run_merge(tiny, root / f"core-{method}", method, **dict(kw))
    run_merge(tiny, root / f"full-{method}", method, lora=LoraOutputOptions(merge=True), **dict(kw))
    assert core_doc["parameters"]["adapter_route"] == "core-space"
    assert core_doc["parameters"]["core_space_merge"] == "lossless"
    assert core_doc["adapter"]["exact"] is True and core_doc["adapter"]["route"] == "core-space"
    got = adapter_delta(root / f"core-{method}")
    want = full_delta(root / f"full-{method}", tiny["base"])
    changed = {k for k, d in want.items() if np.abs(d).max() > 0}
    assert changed == set(got), "every updated tensor is a LoRA module of the adapter, and only those"
    for k in got:  # the full checkpoint is float32: its update is exact to float32 rounding of W
        w = np.abs(load_file(str(tiny["base"] / "model.safetensors"))[k]).max()
        np.testing.assert_allclose(got[k], want[k], atol=4e-7 * max(1.0, float(w)), err_msg=k)
    if method == "task-arithmetic" and "weights" in kw:  # and against Σ λ w_i ΔW_i itself
        deltas = [adapter_delta(tiny[f]) for f in ("a1", "a2", "a3")]
        for k in got:
            ref = kw["lam"] * sum(w * d.get(k, 0.0) for w, d in zip(kw["weights"], deltas, strict=True))
            assert rel(got[k], ref) < 1e-6, k


# -- elementwise methods: their merge of the cores ------------------------------------------------


@pytest.mark.parametrize("method", ["ties", "dare-ties"])
def test_elementwise_methods_merge_the_cores(tiny, method):
    root = tiny["root"]
    out = root / f"core-{method}"
    w, density, lam = [1.0, 0.6, 1.0], 0.4, 0.9
    doc = run_merge(tiny, out, method, weights=w, density=density, lam=lam)
    assert doc["parameters"]["core_space_merge"] == "cores"
    assert doc["adapter"]["exact"] is True
    got = adapter_delta(out)
    facs = [adapter_factors(tiny[f]) for f in ("a1", "a2", "a3")]
    shapes = {k: (left.shape[0], right.shape[1]) for f in facs for k, (left, right) in f.items()}
    assert set(got) == set(shapes)
    for name, (m, n) in shapes.items():
        pairs = [f.get(name, (np.zeros((m, 0)), np.zeros((0, n)))) for f in facs]

        def merge_cores(cores, name=name):
            zero = np.zeros_like(cores[0])
            if method == "ties":
                return M.ref_ties(zero, cores, w, density, lam)
            return M.ref_dare(zero, cores, w, density, lam, 0, name, dare_mod.CHUNK, ties=True)

        ref = np_core_merge(pairs, merge_cores)
        assert rel(got[name], ref) < 1e-6, name
    # and it is not the full-tensor merge: the report and the summary say so
    r = run_dghard(
        "merge", "--method", method, "--core-space", tiny["base"], tiny["a1"], tiny["a2"],
        "--out", root / f"cli-{method}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"{method} of the cores (Core Space), not {method} of the full tensors" in r.stdout


def test_the_adapter_loads_with_peft_and_merges_to_the_reference(tiny):
    root = tiny["root"]
    out = root / "peft-load"
    run_merge(tiny, out, "ties", weights=[1.0, 1.0, 1.0], density=0.5, lam=1.0)
    want = adapter_delta(out)
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(tiny["base"])), str(out))
    merged = {k: v.detach().double().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    base = load_file(str(tiny["base"] / "model.safetensors"))
    for k, d in want.items():
        np.testing.assert_allclose(merged[k] - base[k].astype(np.float64), d, atol=2e-6, err_msg=k)


def test_a_rank_cap_is_asked_for_and_reported(tiny):
    doc = run_merge(tiny, tiny["root"] / "capped", "ties", lora=LoraOutputOptions(core_space=True, rank=3))
    a = doc["adapter"]
    assert a["exact"] is False and a["cut_by"] == "--rank 3" and a["rank_max"] == 3
    assert 0.0 < a["energy_kept"] < 1.0


@pytest.mark.parametrize(
    "method, fts, lora, message",
    [
        (
            "model-stock",
            ("a1", "a2"),
            LoraOutputOptions(core_space=True),
            "--method model-stock cannot run on the adapters' cores",
        ),
        ("ties", ("a1", "dora"), LoraOutputOptions(core_space=True), "is a DoRA adapter"),
        (
            "ties",
            ("a1", "base"),
            LoraOutputOptions(core_space=True),
            "is a full checkpoint; drop --core-space",
        ),
    ],
    ids=["model-stock", "dora", "full-checkpoint"],
)
def test_refusals_name_the_cause_and_write_nothing(tiny, method, fts, lora, message):
    out = tiny["root"] / f"refused-{method}-{fts[1]}"
    with pytest.raises(InputError, match=message):
        run_merge(tiny, out, method, fts=fts, lora=lora)
    assert not out.exists()


def test_core_space_with_a_full_checkpoint_output_is_refused_by_the_cli(tiny):
    out = tiny["root"] / "refused-merge"
    r = run_dghard(
        "merge",
        "--method",
        "ties",
        "--core-space",
        "--merge",
        tiny["base"],
        tiny["a1"],
        tiny["a2"],
        "--out",
        out,
    )
    assert r.returncode == 2 and "--core-space" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("core", [False, True], ids=["factored", "core-space"])
def test_a_tensor_no_adapter_touches_is_not_read(tiny, monkeypatch, core):
    """Every method gives BASE back where every fine-tune's tensor is BASE's own, so an adapter
    output reads none of it (TIES spent 100 s on the bench's untouched 136 M-entry embedding)."""
    from dghard_cli.io.checkpoint import TensorInfo

    read: list[str] = []
    raw, span = TensorInfo.read_raw, TensorInfo.read_raw_span
    monkeypatch.setattr(
        TensorInfo, "read_raw", lambda self, *a, **k: (read.append(self.name), raw(self, *a, **k))[1]
    )
    monkeypatch.setattr(
        TensorInfo, "read_raw_span", lambda self, *a, **k: (read.append(self.name), span(self, *a, **k))[1]
    )
    lora = LoraOutputOptions(core_space=core, rank=None if core else 64)
    doc = run_merge(tiny, tiny["root"] / f"untouched-{core}", "ties", fts=("a1", "a2"), lora=lora)
    rec = {r["name"]: r for r in doc["tensors"]}
    assert rec["model.embed_tokens.weight"]["written_as"] == "unchanged"
    assert "model.embed_tokens.weight" not in read and "model.layers.0.mlp.up_proj.weight" not in read
    assert any(".lora_A." in n or "lora_A" in n for n in read)  # the adapters themselves were read


def test_a_rank_one_total_merges_its_one_by_k_core(tiny):
    """An elementwise method merges a 1 x k core like any other (it used to fall back to the full
    tensors, where TIES is full-rank); a lossless one takes the full tensors' rank-1 result."""
    root = tiny["root"]
    r1 = make_adapter(tiny["base"], root / "r1", 7, r=1, lora_alpha=2, target_modules=["q_proj"])
    doc = merge(
        tiny["base"],
        [r1],
        root / "r1-ties",
        MergeOptions(method="ties", lora=LoraOutputOptions(core_space=True)),
    )
    q = [r for r in doc["tensors"] if r["name"].endswith("q_proj.weight")]
    assert q and all(r["factor_route"] == "core-space" and r["rank"] == 1 for r in q)
    assert doc["adapter"]["exact"] is True
    got = adapter_delta(root / "r1-ties")
    for name, (left, right) in adapter_factors(r1).items():
        ref = np_core_merge(
            [(left, right)], lambda cores: M.ref_ties(np.zeros_like(cores[0]), cores, [1.0], 0.2, 1.0)
        )
        assert rel(got[name], ref) < 1e-6, name


def test_the_split_of_scale_between_b_and_a_does_not_matter(tiny):
    """B·1e-7 and A·1e7 is the same update: the bases come from balanced factors, so the merge is
    the same (task arithmetic through the core space equalled the full merge only to 0.97 before)."""
    import shutil

    from safetensors.numpy import save_file

    root = tiny["root"]
    skewed = root / "a2-skewed"
    shutil.copytree(tiny["a2"], skewed, dirs_exist_ok=True)
    t = load_file(str(skewed / "adapter_model.safetensors"))
    t = {
        k: (v * 1e-7 if "lora_B" in k else v * 1e7 if "lora_A" in k else v).astype(v.dtype)
        for k, v in t.items()
    }
    save_file(t, str(skewed / "adapter_model.safetensors"), metadata={"format": "pt"})
    for fts in ((tiny["a1"], tiny["a2"]), (tiny["a1"], skewed)):
        tag = fts[1].name
        merge(
            tiny["base"],
            list(fts),
            root / f"gauge-{tag}",
            MergeOptions(lora=LoraOutputOptions(core_space=True)),
        )
    a, b = adapter_delta(root / "gauge-a2"), adapter_delta(root / "gauge-a2-skewed")
    for k in a:
        assert rel(b[k], a[k]) < 1e-6, k


def test_a_whole_copy_of_a_module_another_adapter_adapts_is_refused(tiny):
    root = tiny["root"]
    head = make_adapter(tiny["base"], root / "head-lora", 8, r=2, lora_alpha=4, target_modules=["lm_head"])
    mts = make_adapter(
        tiny["base"],
        root / "head-mts",
        9,
        r=2,
        lora_alpha=4,
        target_modules=["q_proj"],
        modules_to_save=["lm_head"],
    )
    with torch.no_grad():  # modules_to_save copies start as BASE's values: change them, as training would
        from safetensors.numpy import save_file

        t = load_file(str(mts / "adapter_model.safetensors"))
        t = {k: (v + 0.01).astype(v.dtype) if "lm_head" in k else v for k, v in t.items()}
        save_file(t, str(mts / "adapter_model.safetensors"), metadata={"format": "pt"})
    out = root / "refused-mts"
    opts = MergeOptions(lora=LoraOutputOptions(core_space=True))
    with pytest.raises(
        InputError, match="stores a whole copy of 'lm_head', which an adapter adapts with LoRA"
    ):
        merge(tiny["base"], [head, mts], out, opts)
    assert not out.exists()


def test_checks_before_writing_count_only_the_tensors_merged_in_full(tiny, monkeypatch):
    """SVC's dense working set was checked on every matrix, the untouched lm_head included, so
    `--core-space` was refused on a machine that fits every core (STAR's dense SVDs, before STAR
    took the Gram route, were the first case); the full-checkpoint merge, which does compute that
    lm_head, is still refused there."""
    import dghard_cli.engine.working_memory as wm

    monkeypatch.setattr(wm, "machine_memory", lambda device=None: 200_000)  # < SVC of a 64 x 64 matrix
    root = tiny["root"]
    svc = {"extra": {"calibrate": "svc"}}
    doc = run_merge(tiny, root / "small-machine-core", "task-arithmetic", fts=("a1", "a2"), **svc)
    assert doc["adapter"]["exact"] is True
    out = root / "small-machine-full"
    with pytest.raises(InputError, match="lm_head"):
        run_merge(tiny, out, "task-arithmetic", fts=("a1", "a2"), lora=LoraOutputOptions(merge=True), **svc)
    assert not out.exists()
