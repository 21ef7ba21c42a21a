"""A Downpour replica that is itself model-parallel: a group of K partition actors.

:class:`ModelParallelReplica` is a drop-in for :class:`~distbelief.downpour.DownpourReplica`
(same constructor, ``run``, ``finish``, ``where`` and counters): the driver cannot tell them
apart. It keeps the replica's data shard and sampler, and drives a
:class:`~distbelief.modelpar.worker.PartitionGroup` step by step: every ``n_fetch`` steps each
partition fetches its own parameters, every ``n_push`` steps each pushes its own accrued
gradient, and in between each applies its gradient locally (the paper's Algorithm 7.1). The
partitions are this actor's children, so when it dies they die with it and a restart
rebuilds the whole group.
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.config import TrainConfig
from distbelief.downpour import ReplicaLoop
from distbelief.modelpar.plan import PartitionPlan
from distbelief.modelpar.worker import PartitionGroup
from distbelief.ps.plan import ShardPlan


@ray.remote
class ModelParallelReplica(ReplicaLoop):
    """One model replica split over ``partition_plan.num_partitions`` partition actors."""

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 start_step: int = 0, partition_plan: PartitionPlan | None = None) -> None:
        self._setup(index, cfg, loss_fn, len(x), y, start_step)
        self.plan = partition_plan
        self.group = PartitionGroup(model, partition_plan, plan, shards, replica=index)
        self.x = torch.from_numpy(np.asarray(x))
        self.fetches = self.pushes = 0
        self.versions = [0] * plan.shards
        self.fetch_refs: list = []
        self.bytes_sent = 0

    def partitions(self) -> list:
        """The partition actors' handles (for tools and fault tests)."""
        return list(self.group.workers)

    def _fetch(self) -> dict:
        self.fetch_refs = self.group.fetch()  # each partition, before its next round
        return {}

    def _step(self, rows: np.ndarray) -> float:
        rows = torch.from_numpy(rows)
        y = self.y[rows]
        loss = self.group.step(self.x[rows], lambda out: self.loss_fn(out, y))
        if self.fetch_refs:  # done before the forward pass could start, so no wait here
            self.fetches += 1
            for versions in ray.get(self.fetch_refs):
                self.versions = [max(a, b) for a, b in zip(self.versions, versions)]
            self.fetch_refs = []
        return loss

    def _end_step(self, push: bool, local: bool) -> None:
        self.pushes += int(push)
        self.group.end_step(push, self.cfg.lr if local else None)

    def _versions(self) -> list[int]:
        return list(self.versions)

    def _after_run(self, events: list[dict]) -> dict:
        """Counters; each event gets ``boundary_bytes``, the bytes that crossed partition
        boundaries per step over this run (activations up plus gradients down), and
        ``naive_bytes``, what exchanging whole activations would have sent instead."""
        counters = self.counters()  # also waits for the last step's pushes to be sent
        per_step = (counters["boundary_bytes"] - self.bytes_sent) / max(1, len(events))
        self.bytes_sent = counters["boundary_bytes"]
        naive = self.plan.naive_bytes(self.cfg.batch_size, 4)
        for e in events:
            e["boundary_bytes"], e["naive_bytes"] = per_step, naive
        return counters

    def finish(self) -> dict:
        """Every partition pushes what it still accrued and waits until it is applied."""
        return self._combine(self.group.finish())

    def counters(self) -> dict:
        return self._combine(self.group.counters())

    def _combine(self, parts: list[dict]) -> dict:
        return {"fetches": self.fetches, "pushes": self.pushes,
                "rejected": sum(c["rejected"] for c in parts),
                "boundary_bytes": sum(c["bytes_sent"] for c in parts),
                "boundary_messages": sum(c["messages_sent"] for c in parts)}


@ray.remote
class ModelParallelSandblasterReplica:
    """A Sandblaster replica split over partition actors: a drop-in for
    :class:`~distbelief.sandblaster.replica.SandblasterReplica`.

    Each partition fetches its own part of the batch's point, holds its own part of every
    portion's gradient until the coordinator's verdict, and stages its own part of the
    accepted sum under the coordinator's tag (the shards add the parts up); the coordinator
    commits the tag only once every partition has staged, so a portion still counts once.
    """

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, slow: float = 1.0,
                 partition_plan: PartitionPlan | None = None) -> None:
        torch.set_num_threads(1)
        self.index, self.loss_fn, self.slow = index, loss_fn, slow
        self.group = PartitionGroup(model, partition_plan, plan, shards, replica=index)
        self.x, self.y = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
        self.batch: int | None = None
        self.pending: set[int] = set()  # computed portions awaiting a verdict
        self.held: list[int] = []  # accepted portions not yet staged

    def where(self) -> str:
        return cluster.node_id()

    def partitions(self) -> list:
        return list(self.group.workers)

    def compute(self, batch: int, vector: str, portion: int, lo: int, hi: int,
                verdicts: list[tuple[int, bool]]) -> dict:
        """Loss sum over rows ``lo:hi`` at ``vector``; the gradient stays on the partitions."""
        entered = time.perf_counter()
        self._settle(verdicts)
        fetch_s = 0.0
        if batch != self.batch:
            began = time.perf_counter()
            ray.get([w.fetch_vector.remote(vector) for w in self.group.workers])
            self.batch, self.pending, self.held = batch, set(), []
            fetch_s = time.perf_counter() - began
        began = time.perf_counter()
        rows = hi - lo
        y = self.y[lo:hi]
        loss = self.group.step(self.x[lo:hi], lambda out: self.loss_fn(out, y) * rows)
        ray.get([w.hold.remote(portion) for w in self.group.workers])
        self.pending.add(portion)
        compute_s = time.perf_counter() - began
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * compute_s)
        return {"portion": portion, "loss_sum": loss, "rows": rows, "compute_s": compute_s,
                "fetch_s": fetch_s, "busy_s": time.perf_counter() - entered - fetch_s}

    def push(self, batch: int, tag: str, verdicts: list[tuple[int, bool]]) -> list[int]:
        """Every partition stages its part of the accepted portions' sum under ``tag``."""
        self._settle(verdicts)
        if batch != self.batch or not self.held:
            return []
        if not all(ray.get([w.stage.remote(tag) for w in self.group.workers])):
            raise RuntimeError(f"replica {self.index}: a shard rejected staged gradient {tag} "
                               "(non-finite loss or gradient?)")
        held, self.held = self.held, []
        return held

    def discard(self) -> None:
        self.pending, self.held = set(), []
        ray.get([w.discard.remote() for w in self.group.workers])

    def _settle(self, verdicts: list[tuple[int, bool]]) -> None:
        mine = [(p, keep) for p, keep in verdicts if p in self.pending]
        if not mine:
            return
        for w in self.group.workers:
            w.settle.remote(mine)  # ordered before the workers' next calls
        for p, keep in mine:
            self.pending.discard(p)
            if keep:
                self.held.append(p)
