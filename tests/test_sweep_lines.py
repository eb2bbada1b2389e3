"""The ``lines`` family of ``dghard sweep`` (layer-wise strengths α, β; ``--refine groups``):
every candidate scored as the float64 reference of its parameters says, the 2-D compass search
and the per-group coordinate search as pure functions of the results (deterministic, resumed
without evaluating anything twice), the printed commands writing the winner byte for byte."""

from __future__ import annotations

import json
import math

import pytest
from conftest import interrupt_hanging_sweep, run_dghard
from test_sweep import BUDGET, Pair, ref_hm, ref_layer_strength

from dghard_cli.errors import InputError
from dghard_cli.sweeping import lines as L
from dghard_cli.sweeping.candidate_file import parse_candidates
from dghard_cli.sweeping.families import make_candidate, reproduce_argv, write_candidate
from dghard_cli.sweeping.run import SweepOptions, staging_path, sweep
from dghard_cli.sweeping.search import coarse_order, next_round

# one coarse point, a coarse compass (steps 0.25, then done) and the per-group stage after it
LINES_ONLY = """
families:
  - family: lines
    grid: [[0.3, 0.5]]
    step: 0.25
    tolerance: 0.25
"""
GROUPS_BUDGET = 12  # base, FT, lines 0.3,0.5, four compass probes, five per-group probes


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    p = Pair(tmp_path_factory.mktemp("lines sweep"))
    (p.root / "lines.yaml").write_text(LINES_ONLY)
    return p


@pytest.fixture(scope="module")
def grouped(pair, tmp_path_factory):
    pair.reset_calls()
    out = tmp_path_factory.mktemp("grouped") / "out"
    doc = sweep(
        pair.base,
        pair.ft,
        out,
        SweepOptions(
            eval_template=pair.template,
            budget=GROUPS_BUDGET,
            candidates=pair.root / "lines.yaml",
            refine=["groups"],
        ),
    )
    return doc, out, pair.calls()


def test_lines_candidates_score_as_the_reference_says_and_groups_follow(pair, grouped):
    doc, out, calls = grouped
    assert len([c for c in calls if c[0] == "done"]) == GROUPS_BUDGET == doc["budget"]["used"]
    rows = doc["candidates"]
    names = [r["name"] for r in rows]
    assert names[0] == "lines 0.3,0.5"
    compass = [r for r in rows if r["axis"] == "lines" and r["phase"] == "refine"]
    groups = [r for r in rows if r["axis"] == "layer_strengths"]
    # the (α, β) stage: the four neighbours of the best at step 0.25 of the range, then done
    assert sorted(tuple(r["params"]["lines"]) for r in compass) == [
        (0.05, 0.5),
        (0.3, 0.25),
        (0.3, 0.75),
        (0.55, 0.5),
    ]
    assert len(groups) == GROUPS_BUDGET - 2 - 1 - 4
    best_pair = max((r for r in rows if r["axis"] == "lines"), key=lambda r: (r["hm"], -r["distance"]))[
        "params"
    ]["lines"]
    # per-group points start at the best (α, β): the embeddings first, +0.25 of group_range;
    # every later point moves one group of an earlier point (or of the start) by a step
    assert groups[0]["params"]["offsets"] == [0.25, 0.0, 0.0]
    earlier = [(0.0, 0.0, 0.0)]
    for r in groups:
        assert r["params"]["lines_base"] == best_pair
        off = tuple(r["params"]["offsets"])
        assert all(-0.5 <= d <= 0.5 for d in off)
        assert any(sum(x != y for x, y in zip(off, q, strict=True)) == 1 for q in earlier), off
        earlier.append(off)
    base_s, ft_s = pair.base_scores, pair.ft_scores
    for r in rows:
        assert r["status"] == "ok", r
        fam = r["family"]
        ref = ref_hm(base_s, ft_s, pair.scores(pair.filtered(fam, r["params"])))
        assert abs(r["hm"] - ref) < 1e-4, (r["name"], r["hm"], ref)
    # the per-group schedule written is λ(ℓ) of the best pair plus the group's offset
    for r in groups:
        a, b = r["params"]["lines_base"]
        emb, blk, head = r["params"]["offsets"]
        want = {"embed": a + emb, "0": a + b / 2 + blk, "head": a + b + head}
        for place, lam in want.items():
            name = {"embed": "model.embed_tokens.weight", "0": "model.layers.0.mlp.up_proj.weight"}.get(
                place, "lm_head.weight"
            )
            assert abs(ref_layer_strength(name, r["params"]) - lam) < 1e-6, (r["name"], place)
    assert doc["winner"]["hm"] == max(r["hm"] for r in rows)
    fam = {f["family"]: f for f in doc["families"]}["lines"]
    assert fam["refine_groups"] is True and fam["num_layers"] == 1


def test_the_lines_winner_is_written_byte_for_byte_by_its_command(grouped, tmp_path):
    doc, out, _ = grouped
    argv = doc["winner"]["reproduce"]["argv"]
    assert argv[:2] == ["dghard", "repair"] and ("--lines" in argv or "--layer-strengths" in argv)
    again = tmp_path / "again"
    # the printed command writes beside OUT (OUT holds the winner): redirect it to `again`
    r = run_dghard(*[str(again) if a == str(out) + "-reproduced" else a for a in argv[1:]], "--quiet")
    assert r.returncode == 0, r.stderr
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in again.glob("*.safetensors"))
    for name in shards:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_a_per_group_candidate_is_reproduced_by_its_printed_command(pair, tmp_path):
    from typer.testing import CliRunner

    from dghard_cli.cli import app

    (e,) = parse_candidates({"families": [{"family": "lines", "grid": [[0.2, 0.6]]}]}, "x")
    e.num_layers = 1
    cand = make_candidate(e, L.GroupPoint(base=(0.2, 0.6), offsets=(0.1, -0.05, 0.2)), n_fts=1)
    assert cand.param_dict["layer_strengths"] == "embed=0.3,0=0.45,head=1.0"
    assert cand.label == "lines 0.2,0.6 groups(embed+0.1, 0-0.05, head+0.2)"
    argv = reproduce_argv(cand, str(pair.base), [str(pair.ft)], str(tmp_path / "a"), "cpu")
    assert argv[5:7] == ["--layer-strengths", "embed=0.3,0=0.45,head=1.0"]
    write_candidate(cand, str(pair.base), [str(pair.ft)], tmp_path / "a", device="cpu", argv=argv)
    args = [str(tmp_path / "b") if a == str(tmp_path / "a") else a for a in argv[1:]]
    res = CliRunner().invoke(app, [*args, "--quiet"])
    assert res.exit_code == 0, res.output
    for p in (tmp_path / "a").glob("*.safetensors"):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name
    rep = json.loads((tmp_path / "b" / "dghard_report.json").read_text())
    assert rep["parameters"]["layer_strengths"] == cand.param_dict["layer_strengths"]


def test_an_interrupted_lines_sweep_resumes_and_takes_the_same_steps(pair, grouped, tmp_path):
    doc0, _, _ = grouped
    pair.reset_calls()
    out = tmp_path / "resumed"
    args = [
        "sweep", pair.base, pair.ft, out, "--eval", pair.template, "--budget", GROUPS_BUDGET,
        "--candidates", pair.root / "lines.yaml", "--refine", "groups",
    ]  # fmt: skip
    proc, env = interrupt_hanging_sweep(args, pair.root / "hanging", hang_after=9, wait=120)
    assert proc.returncode == 3, proc.stderr
    finished = [n for what, n in pair.calls() if what == "done"]
    assert len(finished) == 9  # base, FT and seven candidates: into the per-group stage
    assert sum(1 for n in finished if "groups(" in n) == 2
    assert staging_path(out).is_dir()

    pair.reset_calls()
    r = run_dghard(*args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    second = [n for what, n in pair.calls() if what == "done"]
    assert not set(second) & set(finished) and len(second) == GROUPS_BUDGET - 9
    assert [c["name"] for c in doc["candidates"]] == [c["name"] for c in doc0["candidates"]]
    assert doc["winner"]["name"] == doc0["winner"]["name"]


# -- the search as pure functions ---------------------------------------------------------------


def test_compass_search_finds_the_optimum_of_a_concave_surface_and_stops():
    (e,) = parse_candidates(
        {"families": [{"family": "lines", "grid": [[0.2, 0.6], [0.5, 0.2]], "tolerance": 0.01}]}, "x"
    )
    peak = (0.37, 0.41)

    def obj(p) -> tuple:
        return (
            1,
            -((p[0] - peak[0]) ** 2) - 2 * (p[1] - peak[1]) ** 2 - 0.5 * (p[0] - peak[0]) * (p[1] - peak[1]),
        )

    coarse = coarse_order([e], 1)
    evaluated: dict = {}
    seen = []
    for _ in range(80):
        batch = next_round(
            [e], 1, coarse, evaluated, sum(1 for c in coarse if c.params in evaluated), 2,
            lambda _e: max(evaluated.values()) if evaluated else None,
        )  # fmt: skip
        if not batch:
            break
        assert len(batch) <= 4  # a compass step: at most the four neighbours, at once
        for cand, _ in batch:
            seen.append(cand.value)
            evaluated[cand.params] = obj(cand.value)
    assert len(seen) < 60  # stops by itself once the step is below the tolerance
    assert len(set(seen)) == len(seen)  # never the same point twice
    best = max(seen, key=obj)
    assert math.dist(best, peak) < 0.02, best
    assert all(0 <= a <= 1 and 0 <= b <= 1 for a, b in seen)
    # a pure function: the same results give the same probe
    again = L.refine_probe(e, L.entry_points(e, evaluated))
    assert again is None


def test_compass_probe_units():
    pts = {(0.5, 0.5): (1, 0.0)}
    assert L.compass_probe(pts, (0, 0), (1, 1), 0.1, 0.02) == (0.6, 0.5)
    pts.update({(0.6, 0.5): (1, -1.0), (0.4, 0.5): (1, -1.0), (0.5, 0.6): (1, -1.0)})
    assert L.compass_probe(pts, (0, 0), (1, 1), 0.1, 0.02) == (0.5, 0.4)
    pts[(0.5, 0.4)] = (1, -1.0)
    assert L.compass_probe(pts, (0, 0), (1, 1), 0.1, 0.02) == (0.55, 0.5)  # the step halves
    # at a boundary the clipped neighbour is the point itself and is skipped
    assert L.compass_probe({(0.0, 1.0): (1, 0.0)}, (0, 0), (1, 1), 0.1, 0.02) == (0.1, 1.0)
    assert L.compass_probe({(0.2, 0.2): None}, (0, 0), (1, 1), 0.1, 0.02) is None  # nothing succeeded
    # rounding noise does not create 2.8e-17
    pts = {(0.1, 0.3): (1, 0.0), (0.2, 0.3): (1, -1.0)}
    assert L.compass_probe(pts, (0, 0), (1, 1), 0.1, 0.02) == (0.0, 0.3)
    # one step: every unevaluated neighbour at the current step, α+ α− β+ β−
    assert L.compass_probes({(0.5, 0.5): (1, 0.0)}, (0, 0), (1, 1), 0.1, 0.02) == [
        (0.6, 0.5),
        (0.4, 0.5),
        (0.5, 0.6),
        (0.5, 0.4),
    ]


def test_group_schedules():
    assert L.group_ranges(24, 4) == [(0, 5), (6, 11), (12, 17), (18, 23)]
    assert L.group_ranges(3, 4) == [(0, 0), (1, 1), (2, 2)]
    assert L.group_names(10, 3) == ["embed", "0-2", "3-5", "6-9", "head"]
    s = L.group_schedule(L.GroupPoint((0.0, 0.9), (0.1, 0.0, 0.2, -0.1)), 4, 2)
    assert s.spec == "embed=0.1,0=0.0,1=0.3,2=0.8,3=1.1,head=0.8"  # λ(ℓ) = 0.9·ℓ/3 + δ of ℓ's group
    flat = L.group_schedule(L.GroupPoint((0.5, 0.0), (0.0, 0.1, 0.1, 0.0)), 4, 2)
    assert flat.spec == "embed=0.5,0-3=0.6,head=0.5"  # equal neighbours: one range


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"family": "lines", "grid": [0.2, 0.6]}, "is not a pair [alpha, beta]"),
        ({"family": "lines", "grid": [[0.2, 1.6]]}, "lies outside range"),
        ({"family": "lines", "grid": {"alpha": [0.1]}}, "exactly 'alpha' and 'beta'"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "axis": "alpha"}, "unknown key 'axis'"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "fixed": {"alpha": 1}}, "cannot be fixed for lines"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "fixed": {"shrink": "magic"}}, "--shrink 'magic'"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "range": {"alpha": [1, 0]}}, "low < high"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "groups": 0}, "'groups' must be a whole number"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "group_range": [0.1, 0.5]}, "must contain 0"),
        ({"family": "lines", "grid": [[0.2, 0.6]], "fine_tunes": "several"}, "exactly one fine-tune"),
    ],
)
def test_lines_entry_errors_name_the_entry(entry, message):
    with pytest.raises(InputError) as e:
        parse_candidates({"families": [entry]}, "c.yaml")
    assert message in str(e.value) and str(e.value).startswith("c.yaml: families[0] (lines)")


def test_grid_product_form_and_refine_option_errors(pair, tmp_path):
    (e,) = parse_candidates(
        {"families": [{"family": "lines", "grid": {"alpha": [0.1, 0.3], "beta": [0.5, 0.7]}}]}, "x"
    )
    assert e.grid_pairs == [(0.1, 0.5), (0.1, 0.7), (0.3, 0.5), (0.3, 0.7)]
    no_lines = tmp_path / "c.yaml"
    no_lines.write_text("families:\n  - {family: hard, grid: [1.0]}\n")
    for opts, message in (
        (dict(candidates=no_lines, refine=["groups"]), "--refine groups refines the lines family"),
        (dict(candidates=no_lines, refine=["layers"]), "--refine 'layers' is not one of: groups"),
    ):
        with pytest.raises(InputError, match=message):
            sweep(pair.base, pair.ft, tmp_path / "out", SweepOptions(eval_template=pair.template, **opts))
        assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()
    assert BUDGET > 0  # the shared fixture module is importable (and its pair reused)


def test_the_lines_family_is_skipped_where_no_layer_depth_can_be_read(pair, tmp_path):
    import torch
    from conftest import load_dir

    from dghard_cli.testing.synthetic import write_checkpoint

    cfg = json.loads((pair.ft / "config.json").read_text())
    extra = "model.adapter_gate.weight"  # in no layer stack, neither embedding nor head
    b, f = load_dir(pair.base), load_dir(pair.ft)
    write_checkpoint(tmp_path / "b", [*b.items(), (extra, torch.ones(8))], shards=1, config=cfg)
    write_checkpoint(tmp_path / "f", [*f.items(), (extra, torch.full((8,), 2.0))], shards=2, config=cfg)
    cands = tmp_path / "c.yaml"
    cands.write_text(
        "families:\n  - {family: lines, grid: [[0.3, 0.5]]}\n  - {family: hard, grid: [1.0], refine: false}\n"
    )
    given = {}
    for name, scores in (("base", pair.base_scores), ("ft", pair.ft_scores)):
        given[name] = tmp_path / f"{name}.json"
        given[name].write_text(json.dumps(scores))
    opts = dict(
        eval_template=pair.template,
        budget=3,
        candidates=cands,
        base_results=given["base"],
        ft_results=[given["ft"]],
    )
    doc = sweep(tmp_path / "b", tmp_path / "f", tmp_path / "out", SweepOptions(**opts))
    assert [c["family"] for c in doc["candidates"]] == ["hard"]
    (skip,) = doc["skipped_families"]
    assert skip["family"] == "lines" and f"layer depth of tensor '{extra}'" in skip["skipped"]
    assert any("the lines family was skipped" in w for w in doc["warnings"])
    with pytest.raises(InputError, match=f"--refine groups: cannot tell the layer depth of tensor '{extra}'"):
        sweep(tmp_path / "b", tmp_path / "f", tmp_path / "out2", SweepOptions(**opts, refine=["groups"]))
    assert not (tmp_path / "out2").exists()
