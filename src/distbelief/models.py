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
