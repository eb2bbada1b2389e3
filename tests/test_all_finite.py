"""``all_finite``: the one-reduction check every output cast and passthrough uses, against
``torch.isfinite(t).all()`` on the cases a sum could get wrong."""

from __future__ import annotations

import math

import pytest
import torch

from dghard_cli.engine.ops import OutputRangeError, all_finite, cast_out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype):
    big = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(1000, generator=g).to(dtype),
        torch.tensor([], dtype=dtype),
        torch.full((8,), big, dtype=dtype),  # finite values whose sum overflows
        torch.tensor([big, -big, big], dtype=dtype),
        torch.tensor([1.0, math.nan, 2.0], dtype=dtype),
        torch.tensor([1.0, math.inf, 2.0], dtype=dtype),
        torch.tensor([-math.inf, 3.0], dtype=dtype),
        torch.tensor([math.inf, -math.inf], dtype=dtype),  # the sum is NaN, not ±Inf
        torch.tensor([big, big, -math.inf], dtype=dtype),
    ]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t


def test_non_float_and_float8_tensors():
    assert all_finite(torch.arange(10))
    if hasattr(torch, "float8_e4m3fn"):
        assert all_finite(torch.tensor([1.0, 2.0, 448.0]).to(torch.float8_e4m3fn))
        assert not all_finite(torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn))


def test_a_cast_that_overflows_is_still_refused():
    t = torch.tensor([1.0, 3.0e38, 70000.0], dtype=torch.float32)
    with pytest.raises(OutputRangeError, match="beyond F16's range"):
        cast_out(t, "F16", "x")
    with pytest.raises(OutputRangeError, match="beyond BF16's range"):
        cast_out(torch.tensor([3.4e38], dtype=torch.float32), "BF16", "x")
    assert cast_out(torch.full((10,), 60000.0), "F16").dtype == torch.float16  # a sum past F16, no value
