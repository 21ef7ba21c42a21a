"""A Sandblaster replica: computes gradient sums over portions, stages them on the shards.

Per batch (one evaluation of the full-batch loss at a parameter vector) a replica loads
that vector once, then computes whatever portions the coordinator hands it. It keeps the
gradient sums of the portions the coordinator accepted (first result wins) and, when
asked, stages their sum on every shard under a tag; the coordinator commits the tag into
the batch's gradient vector, or aborts it. So a portion counts exactly once even with
backup copies and dead replicas. The parameters and gradients live in the replica's
parameter host (:mod:`distbelief.host`), flat or partitioned; this actor keeps only which
portions are pending and which were accepted.
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.allocator import keep_freed_memory
from distbelief.devices import CPU, on_device
from distbelief.host import HostFactory


class PortionReplica:
    """Computes portions on its host; stages the accepted ones' gradient sum on the shards
    (plain Python; :data:`SandblasterReplica` is the actor).

    ``x`` and ``y`` are the whole training set (portions are row ranges of it); ``slow``
    makes this replica that many times slower (a straggler, for tests and benchmarks).
    """

    def __init__(self, index: int, host: HostFactory, loss_fn: nn.Module, x: np.ndarray,
                 y: np.ndarray, slow: float = 1.0) -> None:
        torch.set_num_threads(1)
        keep_freed_memory()
        self.index, self.loss_fn, self.slow = index, loss_fn, slow
        self.host = host(replica=index)
        self.device = getattr(self.host, "device", CPU)  # batches go where the host computes
        self.x, self.y = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
        self.batch: int | None = None
        self.pending: set[int] = set()  # computed portions awaiting a verdict
        self.held: list[int] = []  # accepted portions not yet staged

    def where(self) -> str:
        return cluster.node_id()

    def partitions(self) -> list:
        """The partition actors of a model-parallel replica (for tools and fault tests)."""
        return self.host.partitions()

    def compute(self, batch: int, vector: str, portion: int, lo: int, hi: int,
                verdicts: list[tuple[int, bool]]) -> dict:
        """Loss sum and gradient sum over rows ``lo:hi`` at parameters ``vector``.

        ``verdicts`` are the coordinator's ``(portion, keep)`` decisions on portions computed
        here before. Returns the portion, the loss summed over its rows and the row count.
        """
        entered = time.perf_counter()
        self._settle(verdicts)
        fetch_s = 0.0
        if batch != self.batch:
            began = time.perf_counter()
            self.host.load_vector(vector)
            self.batch, self.pending, self.held = batch, set(), []
            fetch_s = time.perf_counter() - began
        began = time.perf_counter()
        rows = hi - lo
        x, y = on_device(self.device, self.x[lo:hi], self.y[lo:hi])
        loss = self.host.forward_backward(x, lambda out: self.loss_fn(out, y) * rows)
        self.host.hold(portion)
        self.pending.add(portion)
        compute_s = time.perf_counter() - began
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * compute_s)
        return {"portion": portion, "loss_sum": loss, "rows": rows, "compute_s": compute_s,
                "fetch_s": fetch_s, "busy_s": time.perf_counter() - entered - fetch_s}

    def push(self, batch: int, tag: str, verdicts: list[tuple[int, bool]]) -> list[int]:
        """Stage the sum of this batch's accepted portions on every shard under ``tag``.

        Returns the portions included; the sum is empty afterwards.
        """
        self._settle(verdicts)
        if batch != self.batch or not self.held:
            return []
        if not self.host.stage(tag):
            raise RuntimeError(f"replica {self.index}: a shard rejected staged gradient {tag} "
                               "(non-finite loss or gradient?)")
        held, self.held = self.held, []
        return held

    def discard(self) -> None:
        """Forget this batch's accepted portions (the coordinator has them recomputed)."""
        self.pending, self.held = set(), []
        self.host.discard()

    def _settle(self, verdicts: list[tuple[int, bool]]) -> None:
        mine = [(p, keep) for p, keep in verdicts if p in self.pending]
        if not mine:
            return
        self.host.settle(mine)
        for p, keep in mine:
            self.pending.discard(p)
            if keep:
                self.held.append(p)


SandblasterReplica = ray.remote(PortionReplica)  # the actor; its methods are remote methods
