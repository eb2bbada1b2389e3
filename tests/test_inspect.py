"""``dghard inspect``, the plots, the HTML page and ``dghard report`` against float64 references."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, f64, load_dir, run_dghard, run_dghard_process
from reference import ref_mp_median, ref_weights
from scipy import integrate

from dghard_cli.engine.plan import PolicyOptions
from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.inspection import InspectOptions, inspect_pair
from dghard_cli.repairing import RepairOptions, repair
from dghard_cli.testing.synthetic import ArchConfig, make_pair, write_checkpoint

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, checking the signature."""
    assert data[:8] == PNG_SIG
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def ref_mp_cdf(x: float, beta: float) -> float:
    a, b = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
    if x <= a:
        return 0.0
    if x >= b:
        return 1.0

    def density(t: float) -> float:
        return math.sqrt(max((b - t) * (t - a), 0.0)) / (2 * math.pi * beta * t)

    return integrate.quad(density, a, x, limit=200, epsabs=1e-13)[0]


def ref_matrix(delta: np.ndarray) -> dict:
    """Everything inspect reports about one delta, from a float64 numpy SVD."""
    s = np.linalg.svd(delta, compute_uv=False)
    m, n = delta.shape
    big, small = max(m, n), min(m, n)
    beta = small / big
    w, tau = ref_weights(s, delta.shape)
    med = float(np.median(s))
    noise = med / math.sqrt(big * ref_mp_median(beta))
    edge = noise * (math.sqrt(big) + math.sqrt(small))
    half = s[: max(2, s.size // 2)]
    slope = np.polyfit(np.log(np.arange(1, half.size + 1)), np.log(half), 1)[0]
    return {
        "sigma": s,
        "tau": tau,
        "median_sv": med,
        "noise": noise,
        "rank_kept": int(np.count_nonzero(w)),
        "energy_kept": float(np.sum(s[w > 0] ** 2) / np.sum(s**2)),
        "delta_norm": float(np.linalg.norm(delta)),
        "mp_edge": edge,
        "share_above_mp_edge": float(np.count_nonzero(s > edge) / small),
        "slope": float(slope),
        "bulk_x": np.sort(s[s <= tau] ** 2 / (big * noise**2)),
        "beta": beta,
    }


def ref_ks(xs: np.ndarray, beta: float) -> float:
    n = xs.size
    f = np.array([ref_mp_cdf(float(x), beta) for x in xs])
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - f), np.max(f - (i - 1) / n)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return make_pair(root, ArchConfig(), dtype="float32", ft_shards=3, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numbers_match_float64_svd(tmp_path, dtype):
    b, f = make_pair(tmp_path, ArchConfig(), dtype=dtype, ft_shards=2, seed=5)
    sel = r"layers\.1\.mlp\.down_proj|embed_tokens"  # one wide, one tall
    doc = inspect_pair(b, f, InspectOptions(device="cpu", matrices=sel))
    base, ft = load_dir(b), load_dir(f)
    recs = {r["name"]: r for r in doc["tensors"]}
    analysed = [r for r in doc["tensors"] if r["action"] == "method"]
    assert len(analysed) == 16
    for r in analysed:
        ref = ref_matrix(f64(ft[r["name"]]) - f64(base[r["name"]]))
        assert r["rank_kept"] == ref["rank_kept"] == r["spikes"]
        assert r["tau"] == pytest.approx(ref["tau"], rel=1e-10)
        assert r["median_sv"] == pytest.approx(ref["median_sv"], rel=1e-10)
        assert r["noise_level"] == pytest.approx(ref["noise"], rel=1e-10)
        assert r["energy_kept"] == pytest.approx(ref["energy_kept"], abs=1e-10)
        assert r["delta_norm"] == pytest.approx(ref["delta_norm"], rel=1e-12)
        assert r["mp_edge"] == pytest.approx(ref["mp_edge"], rel=1e-10)
        assert r["share_above_mp_edge"] == ref["share_above_mp_edge"]
        assert r["powerlaw_slope"] == pytest.approx(ref["slope"], rel=1e-8)
        assert r["beta"] == pytest.approx(ref["beta"], rel=1e-15)
        assert r["bulk"] == (r["ks_distance"] <= 0.1)
    # the KS distance to the MP law, against scipy quadrature, on the selected matrices
    assert set(doc["spectra"]) == {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"}
    for name, spec in doc["spectra"].items():
        ref = ref_matrix(f64(ft[name]) - f64(base[name]))
        sig = np.array(spec["singular_values"])
        assert spec["shape"] == list(ft[name].shape)
        assert np.max(np.abs(sig - ref["sigma"])) <= 1e-9 * ref["sigma"][0]
        assert recs[name]["ks_distance"] == pytest.approx(ref_ks(ref["bulk_x"], ref["beta"]), abs=1e-8)


def test_top_n_selection_and_no_spectra_by_default(pair):
    b, f = pair
    doc = inspect_pair(b, f, InspectOptions(device="cpu"))
    assert doc["spectra"] == {} and "plots" not in doc and "html" not in doc
    doc = inspect_pair(b, f, InspectOptions(device="cpu", matrices=3))
    base, ft = load_dir(b), load_dir(f)
    norms = {
        n: float(np.linalg.norm(f64(ft[n]) - f64(base[n])))
        for n in ft
        if ft[n].ndim == 2 and ft[n].numel() >= 1024
    }
    top3 = sorted(norms, key=lambda n: -norms[n])[:3]
    assert set(doc["spectra"]) == set(top3)
    with pytest.raises(InputError, match="--matrices"):
        inspect_pair(b, f, InspectOptions(device="cpu", matrices="("))


def test_inspect_says_what_repair_says(pair, tmp_path):
    b, f = pair
    doc = inspect_pair(b, f, InspectOptions(device="cpu", policy=PolicyOptions(exclude=["lm_head"])))
    rep = repair(
        b,
        f,
        tmp_path / "out",
        RepairOptions(policy=PolicyOptions(exclude=["lm_head"]), run=RunOptions(device="cpu")),
    )
    assert doc["summary"]["verdict"] == rep["summary"]["verdict"]
    for key in ("energy_kept", "rank_kept_median", "bulk_found_tensors", "method_tensors", "actions"):
        assert doc["summary"][key] == pytest.approx(rep["summary"][key], rel=1e-9), key
    rrec = {r["name"]: r for r in rep["tensors"]}
    for r in doc["tensors"]:
        assert r["action"] == rrec[r["name"]]["action"]
        if "rank_kept" in r:
            assert r["rank_kept"] == rrec[r["name"]]["rank_kept"]
            assert r["tau"] == pytest.approx(rrec[r["name"]]["tau"], rel=1e-9)


def test_lora_like_delta_is_flagged(tmp_path):
    b, f = make_pair(tmp_path, ArchConfig(), dtype="float32", ft_shards=1)
    base = load_dir(b)
    g = torch.Generator().manual_seed(1)
    tensors = []
    for name, t in base.items():
        if t.ndim == 2 and "layers.0." in name:
            bm = torch.randn(t.shape[0], 4, generator=g) * 0.05
            am = torch.randn(4, t.shape[1], generator=g) * 0.05
            t = t + bm @ am
        tensors.append((name, t.clone()))
    lora = tmp_path / "lora_ft"
    write_checkpoint(lora, tensors, config=json.loads((f / "config.json").read_text()))
    doc = inspect_pair(b, lora, InspectOptions(device="cpu"))
    flagged = {r["name"] for r in doc["tensors"] if r.get("reason") == "low-rank"}
    assert flagged == {n for n, t in base.items() if t.ndim == 2 and "layers.0." in n}
    assert all(r["low_rank"] == 4 for r in doc["tensors"] if r["name"] in flagged)
    unchanged = [r for r in doc["tensors"] if r.get("reason") == "unchanged"]
    assert len(unchanged) == 16 - len(flagged)
    assert doc["summary"]["low_rank_tensors"] == 7
    rep = repair(b, lora, tmp_path / "out", RepairOptions(run=RunOptions(device="cpu")))
    assert doc["summary"]["verdict"] == rep["summary"]["verdict"]
    assert doc["summary"]["warnings"] == rep["summary"]["warnings"]


def test_cli_plot_html_json(pair, tmp_path):
    b, f = pair
    plots, page = tmp_path / "plots", tmp_path / "inspect.html"
    r = run_dghard(
        "inspect", b, f, "--plot", plots, "--html", page, "--matrices", "2", "--json", "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document
    files = sorted(Path(p).name for p in doc["plots"]["files"])
    assert len(doc["spectra"]) == 2
    assert files == sorted(
        ["heatmap_rank_kept.png", "heatmap_energy_kept.png"] + [f"spectrum_{n}.png" for n in doc["spectra"]]
    )
    import matplotlib.image as mpimg

    for name in files:
        data = (plots / name).read_bytes()
        w, h = png_size(data)
        img = mpimg.imread(plots / name)
        assert img.shape[:2] == (h, w) and w >= 300 and h >= 100
        assert float(img[..., :3].std()) > 0.01  # not a blank canvas
    text = page.read_text()
    imgs = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(imgs) == 4  # two heat maps, two spectra
    for data in imgs:
        png_size(base64.b64decode(data))
    s = doc["summary"]
    assert f"{100 * s['energy_kept']:.1f} %" in text
    assert f"{s['bulk_found_tensors']} of {s['method_tensors']} matrices" in text
    assert s["verdict"].replace("'", "&#x27;") in text
    for rec in doc["tensors"]:
        if rec["action"] == "method":
            assert f"<td class='name'>{rec['name']}</td>" in text
            assert f"{rec['tau']:.4g}" in text
    assert doc["html"] == str(page)


def test_heatmap_grid_and_names():
    from dghard_cli.report.plots import heatmap_grid, module_order, parse_layer_module

    assert parse_layer_module("model.layers.12.mlp.down_proj.weight") == (12, "mlp.down_proj")
    assert parse_layer_module("transformer.h.3.attn.c_attn.weight") == (3, "attn.c_attn")
    assert parse_layer_module("bert.encoder.layer.7.attention.self.query.weight") == (
        7,
        "attention.self.query",
    )
    assert parse_layer_module("model.embed_tokens.weight") is None
    assert sorted(
        ["mlp.up_proj", "self_attn.v_proj", "mlp.gate_proj", "self_attn.q_proj"], key=module_order
    ) == [
        "self_attn.q_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ]
    recs = [
        {"name": "model.layers.1.mlp.up_proj.weight", "action": "method", "rank_kept": 7, "energy_kept": 0.5},
        {
            "name": "model.layers.0.mlp.up_proj.weight",
            "action": "method",
            "rank_kept": 3,
            "energy_kept": 0.25,
        },
        {
            "name": "model.layers.0.self_attn.q_proj.weight",
            "action": "kept-ft",
            "reason": "low-rank",
            "rank_kept": 4,
        },
        {"name": "model.layers.0.input_layernorm.weight", "action": "kept-ft", "reason": "1-d"},
    ]
    layers, modules, grid, labels = heatmap_grid(recs, "rank_kept")
    assert layers == [0, 1] and modules == ["self_attn.q_proj", "mlp.up_proj"]
    assert grid[0, 1] == 3 and grid[1, 1] == 7 and np.isnan(grid[0, 0]) and np.isnan(grid[1, 0])
    assert labels[0][0] == "LoRA" and labels[1][0] == ""
    _, _, grid, _ = heatmap_grid(recs, "energy_kept")
    assert grid[1, 1] == 50.0


def test_mp_density_is_the_derivative_of_the_cdf():
    from dghard_cli.report.plots import mp_density

    for beta in (0.1, 0.37, 1.0):
        a, b = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
        total = integrate.quad(
            lambda x, beta=beta: float(mp_density(np.array([x]), beta)[0]), a, b, limit=200
        )[0]
        assert total == pytest.approx(1.0, abs=1e-6)
        for x in np.linspace(a, b, 7)[1:-1]:
            assert float(mp_density(np.array([x]), beta)[0]) == pytest.approx(
                (ref_mp_cdf(x + 1e-6, beta) - ref_mp_cdf(x - 1e-6, beta)) / 2e-6, rel=1e-5
            )


def test_report_html_from_a_finished_repair(pair, tmp_path):
    b, f = pair
    out = tmp_path / "rep"
    rep = repair(b, f, out, RepairOptions(run=RunOptions(device="cpu")))
    page = tmp_path / "r.html"
    r = run_dghard("report", out / "dghard_report.json", "--html", page, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["html"] == str(page) and doc["summary"]["verdict"] == rep["summary"]["verdict"]
    text = page.read_text()
    assert len(re.findall(r'src="data:image/png;base64,', text)) == 2  # heat maps; no spectra in a report
    assert f"{100 * rep['summary']['energy_kept']:.1f} %" in text
    assert "dghard repair: dg-hard" in text
    for rec in rep["tensors"]:
        if rec["action"] == "method":
            assert f"<td class='name'>{rec['name']}</td>" in text
    from dghard_cli.cli.report import load_report

    assert load_report(out)[1] == rep  # the directory holding the report
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 99, "summary": {}, "tensors": []}))
    r = run_dghard("report", bad, "--html", tmp_path / "x.html")
    assert r.returncode == 2 and "newer" in r.stderr and not (tmp_path / "x.html").exists()
    bad.write_text("{}")
    with pytest.raises(InputError, match="not a dghard report"):
        load_report(bad)


def test_missing_matplotlib_is_exit_2_naming_the_extra(pair, tmp_path):
    """A fresh interpreter whose PYTHONPATH puts a broken matplotlib first (so: a process)."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    b, f = pair
    env = {"PYTHONPATH": f"{fake}{os.pathsep}{REPO}"}
    r = run_dghard_process("inspect", b, f, "--plot", tmp_path / "p", env=env)
    assert r.returncode == 2, r.stderr
    assert "dghard[plot]" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p").exists()
    r = run_dghard_process("inspect", b, f, "--json", env=env)  # without plots, no matplotlib needed
    assert r.returncode == 0 and json.loads(r.stdout)["command"] == "inspect"


def test_html_page_may_go_into_the_plot_directory_being_created(tmp_path):
    pytest.importorskip("matplotlib")
    example = REPO / "examples" / "tiny"
    plots = tmp_path / "new" / "plots"
    doc = inspect_pair(
        example / "base",
        example / "ft",
        InspectOptions(plot_dir=plots, html=plots / "report.html", quiet=True),
    )
    assert (plots / "report.html").is_file() and doc["plots"]["files"]
    with pytest.raises(InputError, match="does not exist"):
        inspect_pair(
            example / "base",
            example / "ft",
            InspectOptions(html=tmp_path / "elsewhere" / "report.html", quiet=True),
        )
