"""A Downpour replica for models with :class:`SparseEmbedding` tables.

:class:`SparseReplica` is a drop-in for :class:`~distbelief.downpour.DownpourReplica` (same
constructor, ``run``, ``finish``, ``where`` and counters), so the Downpour driver runs it
unchanged. Dense parameters take the ordinary path (``PSClient``, one flat buffer); every
``n_fetch`` steps the replica also fetches, in the same round trip, just the table rows its
next ``n_fetch`` mini-batches use (never the whole table), and every ``n_push`` steps it
pushes the row gradients accrued since its last push, row-sparse. Between fetches it
applies its own gradients locally to both (the paper's Algorithm 7.1).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import ray
import torch
from torch import nn

from distbelief.config import TrainConfig
from distbelief.downpour import DenseLoop
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.sparse.client import SparseClient
from distbelief.sparse.module import sparse_modules
from distbelief.sparse.shard import rss_bytes
from distbelief.sparse.table import TableSpec


@ray.remote
class SparseReplica(DenseLoop):
    """One model replica whose input ``x`` is an id matrix int64 ``(n, fields)``."""

    event_fields = {"rows": 0}  # table rows fetched at this step

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 start_step: int = 0, sparse_shards: list | None = None,
                 specs: list[TableSpec] | None = None) -> None:
        self._setup(index, cfg, loss_fn, len(x), y, start_step)
        self._setup_dense(model, plan, PSClient(shards, plan, replica=index))
        self.modules = sparse_modules(model)
        self.sparse = SparseClient(sparse_shards or [], specs or [], replica=index)
        self.x = np.asarray(x)
        self.accrued_rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)

    def rss(self) -> int:
        """This replica's resident memory in bytes (for the memory benchmark)."""
        return rss_bytes()

    def _fetch(self) -> dict:
        """Dense parameters and the rows of the next ``n_fetch`` batches, one round trip."""
        batches = [self.sampler.batch(k) for k in range(self.step, self.step + self.cfg.n_fetch)]
        rows = np.unique(self.x[np.concatenate(batches)])
        pending = self.sparse.fetch_begin({m.spec.name: rows for m in self.modules})
        self.client.fetch_into(self.flat.flat_np)
        values = self.sparse.fetch_end(pending)
        for m in self.modules:
            m.load(rows, values[m.spec.name])
        return {"rows": int(rows.size)}

    def _step(self, rows: np.ndarray) -> float:
        self.flat.zero_grad()
        for m in self.modules:
            m.zero_row_grads()
        loss = self._backward(self.loss_fn(self.flat.model(torch.from_numpy(self.x[rows])),
                                           self.y[torch.from_numpy(rows)]))
        for m in self.modules:
            self.accrued_rows[m.spec.name].append(m.row_grads())
        return loss

    def _local_update(self) -> None:
        super()._local_update()
        for m in self.modules:
            m.apply_local(self.cfg.lr)

    def finish(self) -> dict:
        """Push what is still accrued and wait until every shard has applied it."""
        if self.since_push:
            self._push()
        self.client.wait()
        self.sparse.wait()
        return self.counters()

    def counters(self) -> dict:
        c, s = self.client, self.sparse
        return {"fetches": c.fetches, "pushes": c.pushes, "rejected": c.rejected + s.rejected,
                **s.counters(), "last_rejection": s.last_rejection, "rss_bytes": rss_bytes()}

    def _push(self) -> None:
        request = {}
        for name, parts in self.accrued_rows.items():
            rows = np.concatenate([r for r, _ in parts])
            if rows.size:
                request[name] = (rows, np.concatenate([g for _, g in parts]))
        super()._push()
        self.sparse.push_many(request)
        self.accrued_rows.clear()
