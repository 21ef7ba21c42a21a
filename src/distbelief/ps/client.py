"""What a replica (or the driver) uses to talk to the shards: fetch and push, all at once.

Every call goes to all S shards concurrently (one Ray call each, submitted back to back)
and is waited for together, never one shard after another. Pushes are not waited for at
all until the next push, so sending overlaps the next mini-batch's compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray

from distbelief.ps.plan import ShardPlan


class PSClient:
    """Fetch into and push from one flat float32 vector laid out by ``plan``."""

    def __init__(self, shards: Sequence[ray.actor.ActorHandle], plan: ShardPlan,
                 replica: int = -1) -> None:
        if len(shards) != plan.shards:
            raise ValueError(f"plan has {plan.shards} shards, got {len(shards)} handles")
        self.shards = list(shards)
        self.plan = plan
        self.replica = replica
        self.versions = [0] * plan.shards
        self.fetches = 0
        self.pushes = 0
        self.rejected = 0
        self._in_flight: list[ray.ObjectRef] = []

    def fetch_into(self, flat: np.ndarray) -> list[int]:
        """Overwrite ``flat`` (shape ``(numel,)``) with every shard's slice; returns versions."""
        replies = ray.get([s.fetch.remote() for s in self.shards])
        bounds = self.plan.bounds
        for lo, hi, (_, part) in zip(bounds, bounds[1:], replies):
            flat[lo:hi] = part
        self.versions = [v for v, _ in replies]
        self.fetches += 1
        return self.versions

    def push(self, flat_grad: np.ndarray) -> None:
        """Send each shard its slice of ``flat_grad``; Ray copies the slices at submission."""
        self.wait()
        bounds = self.plan.bounds
        self._in_flight = [
            shard.push.remote(flat_grad[lo:hi], version, self.replica)
            for shard, lo, hi, version in zip(self.shards, bounds, bounds[1:], self.versions)
        ]
        self.pushes += 1

    def wait(self) -> None:
        """Block until the last push is applied (or rejected) by every shard."""
        if self._in_flight:
            accepted = ray.get(self._in_flight)
            self.rejected += accepted.count(False)
            self._in_flight = []
