"""A Sandblaster replica: computes gradient sums over portions, stages them on the shards.

Per batch (one evaluation of the full-batch loss at a parameter vector) a replica fetches
that vector once, then computes whatever portions the coordinator hands it. It keeps the
gradient sums of the portions the coordinator accepted (first result wins) and, when
asked, stages their sum on every shard under a tag; the coordinator commits the tag into
the batch's gradient vector, or aborts it. So a portion counts exactly once even with
backup copies and dead replicas.
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.flat import FlatModel
from distbelief.ps.plan import ShardPlan


@ray.remote
class SandblasterReplica:
    """Holds a model copy; computes portions; stages accumulated gradients on the shards."""

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, slow: float = 1.0) -> None:
        torch.set_num_threads(1)
        self.index, self.loss_fn, self.plan, self.shards = index, loss_fn, plan, shards
        self.flat = FlatModel(model, plan)
        self.x, self.y = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
        self.slow = slow
        self.batch: int | None = None
        self.accrued = torch.zeros_like(self.flat.grad)
        self.held: list[int] = []
        self.pending: int | None = None  # the last computed portion, awaiting its verdict
        self.pending_grad = torch.zeros_like(self.flat.grad)

    def where(self) -> str:
        return cluster.node_id()

    def compute(self, batch: int, vector: str, portion: int, lo: int, hi: int,
                keep_last: bool) -> dict:
        """Loss sum and gradient sum over rows ``lo:hi`` at parameters ``vector``.

        ``keep_last`` is the coordinator's verdict on the previous portion computed here.
        Returns the portion, the loss summed over its rows and the row count.
        """
        began = time.perf_counter()
        self._settle(keep_last)
        if batch != self.batch:
            self._begin(batch, vector)
        self.flat.zero_grad()
        rows = hi - lo
        loss = self.loss_fn(self.flat.model(self.x[lo:hi]), self.y[lo:hi]) * rows
        loss.backward()
        self.flat.sync_grads()
        self.pending_grad.copy_(self.flat.grad)
        self.pending = portion
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
        return {"portion": portion, "loss_sum": float(loss), "rows": rows}

    def push(self, batch: int, tag: str, keep_last: bool) -> list[int]:
        """Stage the sum of this batch's accepted portions on every shard under ``tag``.

        Returns the portions included; the accumulator is empty afterwards.
        """
        self._settle(keep_last)
        if batch != self.batch or not self.held:
            return []
        bounds = self.plan.bounds
        grad = self.accrued.numpy()
        staged = ray.get([s.stage.remote(tag, grad[lo:hi])
                          for s, lo, hi in zip(self.shards, bounds, bounds[1:])])
        if not all(staged):
            raise RuntimeError(f"replica {self.index}: a shard rejected staged gradient {tag} "
                               "(non-finite loss or gradient?)")
        held, self.held = self.held, []
        self.accrued.zero_()
        return held

    def discard(self) -> None:
        """Forget this batch's accepted portions (the coordinator has them recomputed)."""
        self.held, self.pending = [], None
        self.accrued.zero_()

    def _begin(self, batch: int, vector: str) -> None:
        parts = ray.get([s.fetch_vector.remote(vector) for s in self.shards])
        bounds = self.plan.bounds
        for lo, hi, part in zip(bounds, bounds[1:], parts):
            self.flat.flat_np[lo:hi] = part
        self.batch, self.held, self.pending = batch, [], None
        self.accrued.zero_()

    def _settle(self, keep: bool) -> None:
        if self.pending is not None and keep:
            self.accrued += self.pending_grad
            self.held.append(self.pending)
        self.pending = None
