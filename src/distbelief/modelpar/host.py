"""The partitioned parameter host: one replica's model split over K partition actors.

A :class:`PartitionedHost` drives a :class:`~distbelief.modelpar.worker.PartitionGroup` step
by step: each partition fetches, pushes, applies locally and stages its own parameters only
(flat ranges on the shards); boundary tensors go from partition to partition, and only the
model's output comes back here. The partitions are started by the replica that builds this
host, so when it dies they die with it and a restart rebuilds the whole group. It implements
:class:`~distbelief.host.ParamHost`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import ray
import torch
from torch import nn

from distbelief.host import GradClip, LossOf
from distbelief.modelpar.plan import PartitionPlan
from distbelief.modelpar.worker import PartitionGroup
from distbelief.ps.plan import ShardPlan


class PartitionedHost:
    """``model`` split by ``partition_plan``; each partition talks to ``shards`` itself, and
    computes its forward in ``precision`` (bfloat16: boundary tensors travel in bfloat16).
    With ``clip`` > 0 (``--clip-grad-norm``) each step waits for the partitions' squared
    gradient norms and has them scale their gradients by
    :func:`~distbelief.host.clip_scale` of the whole model's norm, as
    :class:`~distbelief.ps.host.FlatHost` does with its one buffer."""

    event_fields: dict = {}

    def __init__(self, model: nn.Module, plan: ShardPlan, shards: list,
                 partition_plan: PartitionPlan, precision: str = "float32",
                 clip: float = 0.0, replica: int = -1) -> None:
        self.partition_plan = partition_plan
        self.itemsize = 2 if precision == "bfloat16" else 4  # of a boundary tensor's values
        self.group = PartitionGroup(model, partition_plan, plan, shards, replica=replica,
                                    precision=precision)
        self.workers = self.group.workers
        self.fetches = self.pushes = 0
        self._versions = [0] * plan.shards
        self.fetch_refs: list = []
        self.bytes_sent = 0
        self.batch_rows = 0  # rows of the last forward pass
        self.clipping = GradClip(clip)

    def partitions(self) -> list:
        return list(self.workers)

    # Downpour

    def fetch(self, upcoming: Callable[[], np.ndarray] | None = None) -> dict:
        self.fetch_refs = self.group.fetch()  # each partition, before its next round
        return {}

    def prefetch(self, upcoming: Callable[[], np.ndarray] | None = None) -> None:
        """Each partition sends its next fetch now, after its last push before it (the
        replica calls this, as for :class:`~distbelief.ps.host.FlatHost`); the partition
        waits for it at the fetching step, while the steps between compute."""
        self.group.prefetch()

    def forward_backward(self, x: torch.Tensor, loss_of: LossOf) -> float:
        self.batch_rows = len(x)
        loss = self.group.step(x, loss_of)
        if self.fetch_refs:  # done before the forward pass could start, so no wait here
            self.fetches += 1
            for versions in ray.get(self.fetch_refs):
                self._versions = [max(a, b) for a, b in zip(self._versions, versions)]
            self.fetch_refs = []
        return loss

    def end_step(self, push: bool, local_lr: float | None, fetch_next: bool) -> None:
        self.pushes += int(push)
        scale = self.clipping.scale(self.group.grad_norm()) if self.clipping.clip else 1.0
        self.group.end_step(push, local_lr, scale)

    def versions(self) -> list[int]:
        return list(self._versions)

    def after_run(self, events: list[dict]) -> dict:
        """Counters; each event gets ``boundary_bytes``, the bytes that crossed partition
        boundaries per step over this run (activations up plus gradients down), and
        ``naive_bytes``, what exchanging whole activations would have sent instead."""
        counters = self.counters()  # also waits for the last step's pushes to be sent
        per_step = (counters["boundary_bytes"] - self.bytes_sent) / max(1, len(events))
        self.bytes_sent = counters["boundary_bytes"]
        naive = self.partition_plan.naive_bytes(self.batch_rows, self.itemsize)
        for e in events:
            e["boundary_bytes"], e["naive_bytes"] = per_step, naive
        self.clipping.annotate(events)
        return counters

    def finish(self, push: bool, fetch_next: bool = False) -> dict:
        """Every partition pushes what it still accrued and waits until it is applied."""
        return self._combine(self.group.finish())

    def counters(self) -> dict:
        return self._combine(self.group.counters())

    def _combine(self, parts: list[dict]) -> dict:
        return {"fetches": self.fetches, "pushes": self.pushes,
                "rejected": sum(c["rejected"] for c in parts),
                "boundary_bytes": sum(c["bytes_sent"] for c in parts),
                "boundary_messages": sum(c["messages_sent"] for c in parts),
                **self.clipping.counters()}

    # Sandblaster: the shards add up the partitions' staged parts; the coordinator commits a
    # tag only once every partition has staged, so a portion still counts once.

    def load_vector(self, name: str) -> None:
        ray.get([w.fetch_vector.remote(name) for w in self.workers])

    def hold(self, portion: int) -> None:
        ray.get([w.hold.remote(portion) for w in self.workers])

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        for w in self.workers:
            w.settle.remote(verdicts)  # ordered before the workers' next calls

    def stage(self, tag: str) -> bool:
        return all(ray.get([w.stage.remote(tag) for w in self.workers]))

    def discard(self) -> None:
        ray.get([w.discard.remote() for w in self.workers])
