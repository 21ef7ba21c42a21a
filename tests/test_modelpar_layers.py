"""LocallyConnected1d/2d against a loop-over-positions reference and against nn.Conv."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d, locally_connected


def naive_lc1d(x, weight, bias, stride, padding):
    """One explicit window per output position: out[:, :, p] = w[p] . x[window(p)] + b[p]."""
    (s,), (p,) = stride, padding
    x = F.pad(x, (p, p))
    k = weight.shape[-1]
    cols = [torch.einsum("nck,ock->no", x[:, :, i * s: i * s + k], weight[i])
            + (0 if bias is None else bias[i]) for i in range(weight.shape[0])]
    return torch.stack(cols, dim=-1)


def naive_lc2d(x, weight, bias, stride, padding):
    (sh, sw), (ph, pw) = stride, padding
    x = F.pad(x, (pw, pw, ph, ph))
    kh, kw = weight.shape[-2:]
    rows = []
    for i in range(weight.shape[0]):
        row = []
        for j in range(weight.shape[1]):
            window = x[:, :, i * sh: i * sh + kh, j * sw: j * sw + kw]
            value = torch.einsum("ncij,ocij->no", window, weight[i, j])
            row.append(value + (0 if bias is None else bias[i, j]))
        rows.append(torch.stack(row, dim=-1))
    return torch.stack(rows, dim=-2)


def _check_against_naive(layer, naive, x):
    """Values and gradients (input, weight, bias) of ``layer`` equal the naive loop's."""
    x = x.requires_grad_()
    out = layer(x)
    ref = naive(x, layer.weight, layer.bias, layer.stride, layer.padding)
    assert out.shape == ref.shape == (x.shape[0], layer.out_channels, *layer.output_size)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    upstream = torch.randn_like(out)
    inputs = [x, layer.weight] + ([layer.bias] if layer.bias is not None else [])
    got = torch.autograd.grad(out, inputs, upstream)
    want = torch.autograd.grad(ref, inputs, upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(c_in=st.integers(1, 3), c_out=st.integers(1, 3), length=st.integers(1, 12),
       kernel=st.integers(1, 4), stride=st.integers(1, 4), padding=st.integers(0, 2),
       bias=st.booleans(), batch=st.integers(1, 3))
def test_lc1d_matches_naive_loop(c_in, c_out, length, kernel, stride, padding, bias, batch):
    if length + 2 * padding < kernel:
        with pytest.raises(ValueError, match="no output positions"):
            LocallyConnected1d(c_in, c_out, length, kernel, stride, padding, bias)
        return
    torch.manual_seed(0)
    layer = LocallyConnected1d(c_in, c_out, length, kernel, stride, padding, bias).double()
    _check_against_naive(layer, naive_lc1d, torch.randn(batch, c_in, length, dtype=torch.float64))


@settings(max_examples=20, deadline=None)
@given(c_in=st.integers(1, 2), c_out=st.integers(1, 3), size=st.tuples(*[st.integers(3, 7)] * 2),
       kernel=st.tuples(*[st.integers(1, 3)] * 2), stride=st.tuples(*[st.integers(1, 3)] * 2),
       padding=st.tuples(*[st.integers(0, 1)] * 2), bias=st.booleans())
def test_lc2d_matches_naive_loop(c_in, c_out, size, kernel, stride, padding, bias):
    torch.manual_seed(0)
    layer = LocallyConnected2d(c_in, c_out, size, kernel, stride, padding, bias).double()
    _check_against_naive(layer, naive_lc2d, torch.randn(2, c_in, *size, dtype=torch.float64))


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), (3, 2)])
def test_tied_lc1d_is_conv1d(stride, padding):
    torch.manual_seed(0)
    conv = nn.Conv1d(3, 4, 5, stride=stride, padding=padding).double()
    layer = LocallyConnected1d(3, 4, 17, 5, stride=stride, padding=padding).double()
    with torch.no_grad():
        layer.weight.copy_(conv.weight.expand_as(layer.weight))
        layer.bias.copy_(conv.bias.expand_as(layer.bias))
    x = torch.randn(2, 3, 17, dtype=torch.float64)
    torch.testing.assert_close(layer(x), conv(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("stride,padding", [((1, 1), (0, 0)), ((2, 1), (1, 0)), ((2, 3), (1, 1))])
def test_tied_lc2d_is_conv2d(stride, padding):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, (3, 2), stride=stride, padding=padding).double()
    layer = LocallyConnected2d(2, 3, (9, 8), (3, 2), stride=stride, padding=padding).double()
    with torch.no_grad():
        layer.weight.copy_(conv.weight.expand_as(layer.weight))
        layer.bias.copy_(conv.bias.expand_as(layer.bias))
    x = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    out = layer(x)
    assert out.shape == conv(x).shape
    torch.testing.assert_close(out, conv(x), rtol=0, atol=1e-12)


def test_untied_positions_have_their_own_weights():
    """Changing one position's weights changes that output position only."""
    torch.manual_seed(0)
    layer = LocallyConnected1d(2, 3, 10, 3, padding=1)
    x = torch.randn(4, 2, 10)
    before = layer(x).detach()
    with torch.no_grad():
        layer.weight[6] += 1.0
    changed = (layer(x).detach() - before).abs().amax(dim=(0, 1)) > 0
    assert changed.tolist() == [i == 6 for i in range(10)]


def test_shapes_and_parameter_layout():
    layer = LocallyConnected2d(3, 5, (11, 8), (3, 2), stride=(2, 2), padding=(1, 0), bias=False)
    assert layer.output_size == (6, 4)
    assert layer.weight.shape == (6, 4, 5, 3, 3, 2)
    assert layer.bias is None
    assert layer(torch.randn(7, 3, 11, 8)).shape == (7, 5, 6, 4)
    layer1 = LocallyConnected1d(2, 4, 20, 4, stride=3)
    assert (layer1.output_size, layer1.weight.shape, layer1.bias.shape) == ((6,), (6, 4, 2, 4),
                                                                            (6, 4))
    with pytest.raises(ValueError, match="expected input"):
        layer1(torch.randn(1, 2, 21))


def test_functional_on_a_window_slice_gives_those_positions():
    """What a partition relies on: a block of positions from just the input span it reads."""
    torch.manual_seed(0)
    layer = LocallyConnected1d(2, 3, 30, 4, stride=2, padding=1).double()
    x = torch.randn(2, 2, 30, dtype=torch.float64)
    full = layer(x)
    padded = F.pad(x, (1, 1))
    a, b = 5, 11
    span = padded[:, :, a * 2: (b - 1) * 2 + 4]
    block = locally_connected(span, layer.weight[a:b], layer.bias[a:b], layer.stride)
    torch.testing.assert_close(block, full[:, :, a:b], rtol=0, atol=1e-12)
