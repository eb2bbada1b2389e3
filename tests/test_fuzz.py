"""A short fuzzing pass over the input handling (the script runs long passes)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from fuzz_inputs import fuzz  # noqa: E402


def test_200_mutated_inputs_raise_only_clean_errors():
    res = fuzz(200, seed=7)
    assert res["unexpected"] == 0, res["failures"][:5]
    assert sum(res["outcomes"].values()) == 200
    # the mutations reach both outcomes: some inputs stay valid, most are refused cleanly
    assert any(k.endswith(": ok") for k in res["outcomes"])
    assert any(k.endswith("InputError") for k in res["outcomes"])
