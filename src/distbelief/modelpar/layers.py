"""Locally connected layers: convolution-shaped windows with untied weights.

Each output position has its own filter over a small window of the input, as in the
DistBelief paper's image and speech models. Weights are stored position-first, shape
``(*output_size, out_channels, in_channels, *kernel_size)``, and biases
``(*output_size, out_channels)``, so the parameters of a contiguous block of output positions
are a contiguous slice of each tensor: that is what lets a model partition own just its
block (see :mod:`distbelief.modelpar.spatial`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# einsum subscripts per number of spatial dims: input windows, weight -> output
_SUBSCRIPTS = {1: "ncpk,pock->nop", 2: "nchwij,hwocij->nohw"}


def locally_connected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      stride: Sequence[int]) -> torch.Tensor:
    """Apply untied windows to an already padded input (no padding is added here).

    ``x`` is ``(N, C, *S)`` with one or two spatial dims; ``weight`` is
    ``(*P, O, C, *K)`` and ``bias`` ``(*P, O)`` or None. Output position ``p`` reads the input
    window starting at ``p * stride`` along each axis. ``S`` must hold at least the windows of
    the ``P`` positions; extra input at the far end is ignored. Returns ``(N, O, *P)``.
    """
    dims = len(stride)
    positions, kernel = weight.shape[:dims], weight.shape[dims + 2:]
    windows = x
    for axis, (k, s, p) in enumerate(zip(kernel, stride, positions)):
        windows = windows.narrow(2 + axis, 0, (p - 1) * s + k).unfold(2 + axis, k, s)
    out = torch.einsum(_SUBSCRIPTS[dims], windows, weight)
    if bias is not None:
        out = out + bias.movedim(-1, 0)
    return out


def _tuple(value: int | Sequence[int], dims: int, what: str) -> tuple[int, ...]:
    values = (value,) * dims if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != dims:
        raise ValueError(f"{what} needs {dims} values, got {value!r}")
    return values


class LocallyConnectedNd(nn.Module):
    """Shared body of the 1D and 2D layers; ``dims`` is the number of spatial dims."""

    dims: int

    def __init__(self, in_channels: int, out_channels: int, input_size: int | Sequence[int],
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, bias: bool = True) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.input_size = _tuple(input_size, self.dims, "input_size")
        self.kernel_size = _tuple(kernel_size, self.dims, "kernel_size")
        self.stride = _tuple(stride, self.dims, "stride")
        self.padding = _tuple(padding, self.dims, "padding")
        self.output_size = tuple((n + 2 * p - k) // s + 1 for n, k, s, p in
                                 zip(self.input_size, self.kernel_size, self.stride, self.padding))
        if min(self.output_size) < 1 or min(self.stride) < 1:
            raise ValueError(f"input {self.input_size} with kernel {self.kernel_size}, stride "
                             f"{self.stride}, padding {self.padding} leaves no output positions")
        self.weight = nn.Parameter(torch.empty(*self.output_size, out_channels, in_channels,
                                               *self.kernel_size))
        self.bias = nn.Parameter(torch.empty(*self.output_size, out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in), fan_in = in_channels * window size, as nn.Conv does."""
        bound = 1.0 / math.sqrt(self.in_channels * math.prod(self.kernel_size))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, *input_size)`` -> ``(N, out_channels, *output_size)``."""
        if tuple(x.shape[2:]) != self.input_size or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (N, {self.in_channels}, "
                             f"{', '.join(map(str, self.input_size))}), got {tuple(x.shape)}")
        pad = [p for p in reversed(self.padding) for _ in range(2)]
        return locally_connected(F.pad(x, pad), self.weight, self.bias, self.stride)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, input_size={self.input_size}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"bias={self.bias is not None}")


class LocallyConnected1d(LocallyConnectedNd):
    """Untied 1D windows: ``(N, in_channels, L)`` -> ``(N, out_channels, L_out)``.

    ``L_out = (L + 2 * padding - kernel_size) // stride + 1``; weight is
    ``(L_out, out_channels, in_channels, kernel_size)`` and bias ``(L_out, out_channels)``.
    With every position's weights equal it computes exactly ``nn.Conv1d``.
    """

    dims = 1


class LocallyConnected2d(LocallyConnectedNd):
    """Untied 2D windows: ``(N, in_channels, H, W)`` -> ``(N, out_channels, H_out, W_out)``.

    Sizes follow ``nn.Conv2d``; weight is ``(H_out, W_out, out_channels, in_channels, kh, kw)``
    and bias ``(H_out, W_out, out_channels)``. ``input_size``, ``kernel_size``, ``stride`` and
    ``padding`` take an int or an ``(h, w)`` pair.
    """

    dims = 2
