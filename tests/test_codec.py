"""Gradient wire formats: bfloat16 rounding against torch, non-finite values stay non-finite."""

import numpy as np
import pytest
import torch

from distbelief.ps import codec
from distbelief.ps.optim import CHUNK


def test_bfloat16_rounds_like_torch_and_widens_back():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(2 * CHUNK + 3) * 10.0 ** rng.integers(-30, 30, 2 * CHUNK + 3)
         ).astype(np.float32)
    bits = codec.encode(x, "bfloat16")
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, ref)
    wide = codec.decode_into(bits, np.empty_like(x))
    np.testing.assert_array_equal(wide, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    np.testing.assert_allclose(wide, x, rtol=2.0 ** -8)


@pytest.mark.parametrize("grad_dtype", ["float16", "bfloat16"])
def test_non_finite_values_stay_non_finite(grad_dtype):
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(7, np.float32)
        x[3] = bad
        wide = codec.decode_into(codec.encode(x, grad_dtype), np.empty(7, np.float32))
        assert not codec.all_finite(wide)
        assert np.all(wide[[0, 1, 2, 4, 5, 6]] == 1.0)


def test_float32_is_sent_as_it_is_and_unknown_formats_are_refused():
    x = np.ones(3, np.float32)
    assert codec.encode(x) is x
    with pytest.raises(ValueError, match="unknown gradient dtype"):
        codec.encode(x, "int8")


def test_all_finite_checks_every_chunk():
    x = np.zeros(3 * CHUNK, np.float32)
    assert codec.all_finite(x)
    x[-1] = np.nan
    assert not codec.all_finite(x)
    assert codec.all_finite(np.zeros(0, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_all_finite_is_exact_where_the_squares_overflow(dtype):
    big = np.full(1000, np.finfo(dtype).max / 2, dtype)  # finite, its squares are not
    assert codec.all_finite(big)
    for bad in (np.nan, np.inf, -np.inf):
        x = big.copy()
        x[517] = bad
        assert not codec.all_finite(x)
        assert not codec.all_finite(np.where(np.arange(1000) == 3, bad, 0.5).astype(dtype))
