"""The method registry: a method added as one module in dghard_cli.methods reaches every surface
(validation, report parameters, recipe keys, the reproduction command, the merge itself)."""

from __future__ import annotations

import pkgutil
import sys
import types

import merge_reference as M
import pytest
import torch
from conftest import f64, load_dir
from reference import rel

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.merging import MergeOptions, merge, resolve_parameters
from dghard_cli.methods import registry
from dghard_cli.recipes.recipe import top_keys
from dghard_cli.sweeping.candidates import Candidate
from dghard_cli.sweeping.families import reproduce_argv
from dghard_cli.testing.synthetic import ArchConfig, make_pair

CFG = ArchConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2, vocab_size=128)
MODULE = "dghard_cli.methods._added_for_test"


def _added_module() -> types.ModuleType:
    """What an engineer would write as dghard_cli/methods/<name>.py: a kernel, a parameter, a method."""
    from dghard_cli.methods.merge_ops import ElementwiseMergeOp, Kernel
    from dghard_cli.methods.registry import NUMBER, MergeMethod, Param, in_range

    class GainKernel(Kernel):
        def __init__(self, weights, gain):
            self.weights, self.gain = list(weights), gain

        def block(self, deltas):
            return sum(w * d for w, d in zip(self.weights, deltas, strict=True)) * self.gain

    mod = types.ModuleType(MODULE)
    mod.PARAMS = (
        Param("gain", NUMBER, "gained: multiplies the summed delta, 0..4 (default 2).", default=2.0,
              check=in_range(0.0, 4.0, "gain"), sweep_range=(0.0, 4.0)),
    )  # fmt: skip
    mod.MERGE_METHODS = (
        MergeMethod(
            "gained",
            ("weights", "gain"),
            lambda p, ctx: ElementwiseMergeOp(lambda job: GainKernel(p["weights"], p["gain"]), ctx.device),
            sweep_axes=("gain",),
            sweep_fixed=("weights",),
        ),
    )
    return mod


@pytest.fixture
def added(monkeypatch):
    real = pkgutil.iter_modules

    def iter_modules(path=None, prefix=""):
        yield from real(path, prefix)
        if path is not None and any(str(p).endswith("methods") for p in path):
            yield pkgutil.ModuleInfo(None, MODULE.rsplit(".", 1)[1], False)

    monkeypatch.setitem(sys.modules, MODULE, _added_module())
    monkeypatch.setattr(registry.pkgutil, "iter_modules", iter_modules)
    registry.registry.cache_clear()
    yield
    registry.registry.cache_clear()


def test_builtin_surfaces_are_derived_in_their_historic_order():
    assert registry.method_names() == (
        "wise-ft", "task-arithmetic", "ties", "dare", "dare-linear", "dare-ties", "recall", "dg-hard",
        # then the method modules, in module-name order
        "breadcrumbs", "breadcrumbs-ties", "della", "della-linear", "iso-c", "iso-cts", "star", "cart",
        "model-stock", "slerp", "tsv", "wudi",
    )  # fmt: skip
    assert [p.name for p in registry.scalar_params()] == [
        "alpha",
        "weights",
        "lambda",
        "density",
        "seed",
        "scale",
        # then the method modules' (breadcrumbs, della, iso, low_rank, slerp, tsv, wudi)
        "gamma",
        "epsilon",
        "common_space_fraction",
        "eta",
        "rank_ratio",
        "t",
        "tsv_rank",
        "steps",
        # then the common ones (the SVC post-step's floor)
        "svc_alpha",
    ]
    keys = list(top_keys())
    assert keys[:4] == ["method", "base", "models", "out"]
    assert keys[4:11] == ["alpha", "lambda", "density", "seed", "scale", "calib", "recall"]


def test_an_added_method_reaches_every_surface(added, tmp_path):
    assert "gained" in registry.method_names()
    assert "gain" in top_keys()
    p = resolve_parameters(MergeOptions(method="gained", extra={"gain": 1.5}), 2)
    assert p == {"method": "gained", "weights": [1.0, 1.0], "gain": 1.5}
    assert resolve_parameters(MergeOptions(method="gained"), 1)["gain"] == 2.0
    with pytest.raises(InputError, match=r"--gain must be in \[0, 4\]"):
        resolve_parameters(MergeOptions(method="gained", extra={"gain": 9.0}), 1)
    with pytest.raises(InputError, match="--gain does not apply to --method ties"):
        resolve_parameters(MergeOptions(method="ties", extra={"gain": 1.0}), 2)
    cand = Candidate(
        0, "gained", "merge", "gain", 1.5, (("gain", 1.5), ("method", "gained"), ("weights", (1.0, 0.5)))
    )
    argv = reproduce_argv(cand, "B", ["F1", "F2"], "OUT", "auto")
    assert argv == ["dghard", "merge", "--method", "gained", "--weights", "1.0,0.5", "--gain", "1.5",
                    "B", "F1", "F2", "--out", "OUT"]  # fmt: skip

    base, ft1 = make_pair(tmp_path / "a", CFG, seed=0)
    _, ft2 = make_pair(tmp_path / "b", CFG, seed=0, delta_seed=5)
    opts = MergeOptions(
        method="gained", weights=[1.0, 0.5], extra={"gain": 1.5}, run=RunOptions(device="cpu")
    )
    doc = merge(base, [ft1, ft2], tmp_path / "out", opts)
    assert doc["parameters"]["gain"] == 1.5 and doc["merge"] == {"method_tensors": len(doc["tensors"])}
    b, fs, out = load_dir(base), [load_dir(ft1), load_dir(ft2)], load_dir(tmp_path / "out")
    for name in b:
        ref = M.ref_task_arithmetic(f64(b[name]), [f64(f[name]) for f in fs], [1.0, 0.5], 1.5)
        assert out[name].dtype == torch.float32
        assert rel(f64(out[name]), ref) <= 1e-6, name
