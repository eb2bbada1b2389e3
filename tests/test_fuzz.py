"""A short fuzzing pass over the input handling (the script runs long passes)."""

from fuzz_inputs import fuzz  # scripts/ is on pytest's pythonpath (pyproject.toml)


def test_200_mutated_inputs_raise_only_clean_errors():
    res = fuzz(200, seed=7)
    assert res["unexpected"] == 0, res["failures"][:5]
    assert sum(res["outcomes"].values()) == 200
    # the mutations reach both outcomes: some inputs stay valid, most are refused cleanly
    assert any(k.endswith(": ok") for k in res["outcomes"])
    assert any(k.endswith("InputError") for k in res["outcomes"])
