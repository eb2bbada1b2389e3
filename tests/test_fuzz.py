"""A short fuzzing pass over the input handling (the script runs long passes)."""

from fuzz_inputs import fuzz  # scripts/ is on pytest's pythonpath (pyproject.toml)


def test_200_mutated_inputs_raise_only_clean_errors():
    res = fuzz(200, seed=7)
    assert res["unexpected"] == 0, res["failures"][:5]
    assert sum(res["outcomes"].values()) == 200
    # the mutations reach both outcomes: some inputs stay valid, most are refused cleanly
    assert any(k.endswith(": ok") for k in res["outcomes"])
    assert any(k.endswith("InputError") for k in res["outcomes"])


def test_the_sweeps_options_and_candidate_file_raise_only_clean_errors():
    """Hostile values in the sweep's options (--jobs, --devices, Ray addresses and resources,
    lm-eval tasks and arguments, numbers) and its candidate file; found a task name of 5000
    digits raising OSError (file name too long) before the fix."""
    res = fuzz(600, seed=2, only=["candidates", "sweep-options"])
    assert res["unexpected"] == 0, res["failures"][:5]
    for target in ("candidates", "sweep-options"):
        assert res["outcomes"].get(f"{target}: InputError", 0) > 50
        assert res["outcomes"].get(f"{target}: ok", 0) > 0
