"""A partition's Sandblaster protocol: per batch, fetch its part of the point once; hold each
portion's gradient until the coordinator's verdict; stage the sum of the accepted ones under
a tag on the shards (which add the partitions' parts up)."""

from __future__ import annotations

import numpy as np

from distbelief.modelpar.core import PartitionCore


class PartitionStaging(PartitionCore):
    """Sandblaster portions on one partition's parameters (its ``accrued`` is the batch sum)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, np.ndarray] = {}  # portion -> its gradient, until the verdict

    def fetch_vector(self, vector: str) -> None:
        """Load this partition's part of Sandblaster vector ``vector``; start a new batch."""
        self._load(self.client.fetch_vector_ranges(vector, self.ranges))
        self.held = {}
        self.accrued[:] = 0.0

    def hold(self, portion: int) -> None:
        """Keep the gradient just computed as ``portion``'s, until its verdict."""
        grad = np.zeros_like(self.accrued)
        self._add_grads(grad)
        self.held[portion] = grad
        self.part.zero_grad()

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        """Add the accepted portions' gradients to the batch sum; forget the others."""
        for portion, keep in verdicts:
            grad = self.held.pop(portion, None)
            if grad is not None and keep:
                self.accrued += grad

    def stage(self, tag: str) -> bool:
        """Add the accepted sum into what the shards stage under ``tag``; empty it."""
        ok = self.client.stage_ranges(tag, self.ranges, self.accrued)
        self.accrued[:] = 0.0
        return ok

    def discard(self) -> None:
        self.held = {}
        self.accrued[:] = 0.0
