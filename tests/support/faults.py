"""Faults a test injects from inside a replica's own code.

Ray's workers cannot import ``support``, so this module travels by value with what uses it.
"""

from __future__ import annotations

import sys

import ray
import torch

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NaNEvery(torch.nn.Module):
    """Cross-entropy that turns NaN on every k-th call (each replica counts its own)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.calls = k, 0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = torch.nn.functional.cross_entropy(out, y)
        return loss * float("nan") if self.calls % self.k == 0 else loss
