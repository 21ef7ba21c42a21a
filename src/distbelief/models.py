"""The models the CLI trains (any ``nn.Module`` works through the Python API)."""

from __future__ import annotations

from torch import nn


def mlp(features: int, hidden: int, classes: int, seed: int = 0) -> nn.Module:
    """A one-hidden-layer ReLU network (softmax regression if ``hidden == 0``), seeded."""
    import torch

    torch.manual_seed(seed)
    if hidden == 0:
        return nn.Sequential(nn.Linear(features, classes))
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def lc(features: int, channels: int, classes: int, seed: int = 0) -> nn.Module:
    """Two locally connected layers (3-wide windows, untied weights) and a linear readout.

    A perfect-square ``features`` (digits: 64) is read as a one-channel image
    ``(1, s, s)``, anything else as a one-channel sequence ``(1, features)``. The model takes
    flat rows ``(N, features)`` and starts with an ``nn.Unflatten``, so it runs as it is and
    splits spatially (``--partitions K``) into blocks of rows (or of sequence positions).
    """
    import math

    import torch

    from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d

    torch.manual_seed(seed)
    side = math.isqrt(features)
    if side * side == features:
        size, layer = (side, side), LocallyConnected2d
    else:
        size, layer = (features,), LocallyConnected1d
    return nn.Sequential(
        nn.Unflatten(1, (1, *size)),
        layer(1, channels, size, 3, padding=1), nn.ReLU(),
        layer(channels, channels, size, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * math.prod(size), classes))
