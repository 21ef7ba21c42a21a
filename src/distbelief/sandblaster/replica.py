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
        self.pending: dict[int, torch.Tensor] = {}  # computed portions awaiting a verdict

    def where(self) -> str:
        return cluster.node_id()

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
            self._begin(batch, vector)
            fetch_s = time.perf_counter() - began
        began = time.perf_counter()
        self.flat.zero_grad()
        rows = hi - lo
        loss = self.loss_fn(self.flat.model(self.x[lo:hi]), self.y[lo:hi]) * rows
        loss.backward()
        self.flat.sync_grads()
        self.pending[portion] = self.flat.grad.clone()
        compute_s = time.perf_counter() - began
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * compute_s)
        return {"portion": portion, "loss_sum": float(loss), "rows": rows,
                "compute_s": compute_s, "fetch_s": fetch_s,
                "busy_s": time.perf_counter() - entered - fetch_s}

    def push(self, batch: int, tag: str, verdicts: list[tuple[int, bool]]) -> list[int]:
        """Stage the sum of this batch's accepted portions on every shard under ``tag``.

        Returns the portions included; the accumulator is empty afterwards.
        """
        self._settle(verdicts)
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
        self.held, self.pending = [], {}
        self.accrued.zero_()

    def _begin(self, batch: int, vector: str) -> None:
        parts = ray.get([s.fetch_vector.remote(vector) for s in self.shards])
        bounds = self.plan.bounds
        for lo, hi, part in zip(bounds, bounds[1:], parts):
            self.flat.flat_np[lo:hi] = part
        self.batch, self.held, self.pending = batch, [], {}
        self.accrued.zero_()

    def _settle(self, verdicts: list[tuple[int, bool]]) -> None:
        for portion, keep in verdicts:
            grad = self.pending.pop(portion, None)
            if grad is not None and keep:
                self.accrued += grad
                self.held.append(portion)
