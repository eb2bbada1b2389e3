"""The sweep's families: a candidate is spelled once, as its command's options, and the printed
command is derived from them. Round trip for every family and every merge method of the registry:
options -> argv (``repair_argv``/``merge_argv``) -> the CLI's own parser -> the same options."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
from conftest import run_dghard

from dghard_cli.engine.writer import RunOptions
from dghard_cli.errors import InputError
from dghard_cli.methods import registry
from dghard_cli.sweeping import families
from dghard_cli.sweeping.candidate_file import load_candidates
from dghard_cli.sweeping.candidates import FamilyEntry, kinds
from dghard_cli.sweeping.lines import GroupPoint, parse_entry


def _merge_entries() -> list[tuple[FamilyEntry, int]]:
    """One entry per merge method with a sweep axis (and fixed-parameter variants)."""
    out = []
    for name, kind in kinds().items():
        if kind.command != "merge":
            continue
        n = 1 if kind.fine_tunes == "one" else 2
        for axis in kind.axes:
            lo, hi = kind.ranges[axis]
            out.append((FamilyEntry(family=name, grid=[(lo + hi) / 2], axis=axis, range=(lo, hi)), n))
    out.append(
        (FamilyEntry(family="task-arithmetic", grid=[0.5], axis="lambda", fixed={"weights": [1.0, 0.25]}), 2)
    )
    out.append((FamilyEntry(family="iso-c", grid=[1.2], axis="alpha", fixed={"calibrate": "svc"}), 3))
    return out


def _candidates():
    """(candidate, n_fts) of every family: the built-in candidate file's entries, every merge
    method, the filters' fixed variants, the per-group point and a merge under ``--lines``."""
    entries, _ = load_candidates(None)
    out = []
    for e in entries:
        if e.family == "lines":
            out += [(families.make_candidate(e, p, n_fts=1), 1) for p in e.grid_pairs]
        elif e.applies(1):
            out += [(families.make_candidate(e, v, n_fts=1), 1) for v in e.grid]
    for e, n in _merge_entries():
        out.append((families.make_candidate(e, e.grid[0], n_fts=n), n))
    out.append(
        (
            families.make_candidate(
                FamilyEntry("twoknob", [0.3], axis="b", fixed={"a": 0.9, "scale": 2.0}), 0.3, n_fts=1
            ),
            1,
        )
    )
    out.append((families.make_candidate(FamilyEntry("soft", [0.5], fixed={"sigma": 0.01}), 0.5, n_fts=1), 1))
    shrunk = parse_entry(
        {"family": "lines", "grid": [[0.2, 0.6]], "fixed": {"shrink": "hard", "scale": 1.5}}, 0, "t"
    )
    out.append((families.make_candidate(shrunk, (0.2, 0.6), n_fts=1), 1))
    plain = dataclasses.replace(
        parse_entry({"family": "lines", "grid": [[0.2, 0.6]]}, 0, "t"), num_layers=6, groups=2
    )
    out.append((families.make_candidate(plain, GroupPoint((0.3, 0.5), (0.1, -0.05, 0.2, 0.0)), n_fts=1), 1))
    ties = families.make_candidate(FamilyEntry("ties", [0.3], axis="density"), 0.3, n_fts=2)
    under = dataclasses.replace(plain, merge_params=ties.params, num_layers=None)
    out.append((families.make_candidate(under, (0.25, 0.5), n_fts=2), 2))
    return out


CANDIDATES = _candidates()


def test_every_family_and_method_is_covered():
    names = {c.family for c, _ in CANDIDATES}
    swept = {m for m, k in kinds().items() if k.command == "merge"}
    assert swept <= names and {"hard", "soft", "optimal", "twoknob", "lines"} <= names
    assert {registry.get_method(m).name for m in swept} == swept
    assert any("lines" in c.param_dict and c.command == "merge" for c, _ in CANDIDATES)
    assert any("layer_strengths" in c.param_dict for c, _ in CANDIDATES)


def _parsed(monkeypatch, argv: list[str]):
    """The options the CLI builds from ``argv`` (the library call is stopped there)."""
    import dghard_cli.merging as merging
    import dghard_cli.repairing as repairing

    seen = []

    def capture(*args, **kwargs):
        seen.append(args[-1])
        raise InputError("stopped by the test")

    monkeypatch.setattr(repairing, "repair", capture)
    monkeypatch.setattr(merging, "merge", capture)
    done = run_dghard(*argv[1:])
    assert done.returncode == 2 and "stopped by the test" in done.stderr, done.stderr
    return seen[0]


def _same(a, b) -> None:
    assert a.policy.out_dtype == b.policy.out_dtype
    assert a.lora.merge == b.lora.merge
    assert a.run.device == b.run.device
    assert a.schedule == b.schedule
    if hasattr(a, "spec"):
        assert a.spec == b.spec
        return
    assert registry.get_method(a.method).name == registry.get_method(b.method).name
    for q in registry.params().values():
        if q.name not in ("lines", "layer_strengths"):
            assert registry.given_value(a, q) == registry.given_value(b, q), q.name


@pytest.mark.parametrize("k", range(len(CANDIDATES)), ids=lambda k: CANDIDATES[k][0].label)
@pytest.mark.parametrize(
    "tail",
    [dict(device="auto"), dict(device="cpu", dtype="BF16", merge_adapters=True)],
    ids=["plain", "output"],
)
def test_options_to_argv_to_the_cli_gives_the_same_options(monkeypatch, tmp_path, k, tail):
    cand, n = CANDIDATES[k]
    base, fts, out = "BASE", [f"FT{i}" for i in range(n)], str(tmp_path / "out")
    opts = families.candidate_options(
        cand,
        RunOptions(device=tail["device"]),
        merge_adapters=tail.get("merge_adapters", False),
        dtype=tail.get("dtype"),
    )
    argv = families.reproduce_argv(
        cand,
        base,
        fts,
        out,
        tail["device"],
        merge_adapters=tail.get("merge_adapters", False),
        dtype=tail.get("dtype"),
    )
    assert argv == families.family(cand.family).argv(base, fts, out, opts)
    _same(_parsed(monkeypatch, argv), opts)


def _cand(label_start: str):
    return next(c for c, _ in CANDIDATES if c.label.startswith(label_start))


@pytest.mark.parametrize(
    "start, n, extra, want",
    [
        ("hard scale=1.0", 1, {}, "dghard repair B F0 O --shrink hard --scale 1.0"),
        ("twoknob b=0.3", 1, {}, "dghard repair B F0 O --shrink twoknob --scale 2.0 --a 0.9 --b 0.3"),
        (
            "soft scale=0.5 (sigma=0.01)",
            1,
            {},
            "dghard repair B F0 O --shrink soft --scale 0.5 --noise known --sigma 0.01",
        ),
        (
            "lines 0.2,0.6 (hard scale=1.5)",
            1,
            {},
            "dghard repair B F0 O --lines 0.2,0.6 --shrink hard --scale 1.5",
        ),
        (
            "ties lambda=1.0 (density=0.2)",
            2,
            {"dtype": "BF16", "merge_adapters": True},
            "dghard merge --method ties --weights 1.0,1.0 --lambda 1.0 --density 0.2 B F0 F1 --out O --dtype bf16 --merge",
        ),
        (
            "ties lines=0.25,0.5",
            2,
            {},
            "dghard merge --method ties --weights 1.0,1.0 --lambda 1.0 --density 0.3 --lines 0.25,0.5 B F0 F1 --out O",
        ),
        (
            "lines 0.3,0.5 groups",
            1,
            {},
            "dghard repair B F0 O --layer-strengths embed=0.4,0=0.25,1=0.35,2=0.45,3=0.8,4=0.9,5=1.0,head=0.8",
        ),
    ],
)
def test_printed_commands_read_as_before(start, n, extra, want):
    """The commands a sweep prints are those it printed when each family spelled its own (these
    strings were printed by the code before the families)."""
    argv = families.reproduce_argv(_cand(start), "B", [f"F{i}" for i in range(n)], "O", "auto", **extra)
    assert shlex.join(argv) == want
