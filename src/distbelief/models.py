"""The models the CLI trains (any ``nn.Module`` works through the Python API)."""

from __future__ import annotations

from torch import nn


def mlp(features: int, hidden: int, classes: int, seed: int = 0) -> nn.Sequential:
    """A one-hidden-layer ReLU network, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
