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

import time
from collections import defaultdict

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler, replica_indices
from distbelief.flat import FlatModel
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.sparse.client import SparseClient
from distbelief.sparse.module import sparse_modules
from distbelief.sparse.shard import rss_bytes
from distbelief.sparse.table import TableSpec


@ray.remote
class SparseReplica:
    """One model replica whose input ``x`` is an id matrix int64 ``(n, fields)``."""

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 start_step: int = 0, sparse_shards: list | None = None,
                 specs: list[TableSpec] | None = None) -> None:
        torch.set_num_threads(1)
        self.index, self.cfg, self.loss_fn = index, cfg, loss_fn
        self.flat = FlatModel(model, plan)
        self.modules = sparse_modules(model)
        self.client = PSClient(shards, plan, replica=index)
        self.sparse = SparseClient(sparse_shards or [], specs or [], replica=index)
        rows = replica_indices(len(x), index, cfg.replicas)
        self.sampler = ReplicaSampler(rows, cfg.batch_size, cfg.seed, index)
        self.x, self.y = np.asarray(x), torch.from_numpy(np.asarray(y))
        self.step = start_step
        self.accrued = torch.zeros_like(self.flat.grad) if cfg.n_push > 1 else None
        self.accrued_rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        self.since_push = 0
        self.slow = float(cfg.slow_replicas.get(index, 1.0))

    def where(self) -> str:
        return cluster.node_id()

    def rss(self) -> int:
        """This replica's resident memory in bytes (for the memory benchmark)."""
        return rss_bytes()

    def _fetch(self) -> int:
        """Dense parameters and the rows of the next ``n_fetch`` batches, one round trip."""
        batches = [self.sampler.batch(k) for k in range(self.step, self.step + self.cfg.n_fetch)]
        rows = np.unique(self.x[np.concatenate(batches)])
        pending = self.sparse.fetch_begin({m.spec.name: rows for m in self.modules})
        self.client.fetch_into(self.flat.flat_np)
        values = self.sparse.fetch_end(pending)
        for m in self.modules:
            m.load(rows, values[m.spec.name])
        return int(rows.size)

    def run(self, n_steps: int) -> dict:
        """Run ``n_steps`` steps; returns their events and this replica's counters."""
        cfg, flat, events = self.cfg, self.flat, []
        for _ in range(n_steps):
            began = time.perf_counter()
            fetched = self.step % cfg.n_fetch == 0
            rows = self._fetch() if fetched else 0
            batch = torch.from_numpy(self.sampler.batch(self.step))
            flat.zero_grad()
            for m in self.modules:
                m.zero_row_grads()
            loss = self.loss_fn(flat.model(torch.from_numpy(self.x[batch.numpy()])),
                                self.y[batch])
            loss.backward()
            flat.sync_grads()
            if self.accrued is not None:
                self.accrued += flat.grad
            for m in self.modules:
                self.accrued_rows[m.spec.name].append(m.row_grads())
            self.since_push += 1
            pushed = self.since_push == cfg.n_push
            if pushed:
                self._push()
            if cfg.local_update and (self.step + 1) % cfg.n_fetch != 0:
                with torch.no_grad():
                    flat.flat.add_(flat.grad, alpha=-cfg.lr)
                for m in self.modules:
                    m.apply_local(cfg.lr)
            if self.slow > 1.0:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
            events.append({"t": time.time(), "replica": self.index, "step": self.step,
                           "loss": float(loss), "versions": list(self.client.versions),
                           "fetched": fetched, "pushed": pushed, "rows": rows})
            self.step += 1
        return {"events": events, "step": self.step, **self.counters()}

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
        grad = self.accrued if self.accrued is not None else self.flat.grad
        self.client.push(grad.numpy())
        request = {}
        for name, parts in self.accrued_rows.items():
            rows = np.concatenate([r for r, _ in parts])
            if rows.size:
                request[name] = (rows, np.concatenate([g for _, g in parts]))
        self.sparse.push_many(request)
        self.accrued_rows.clear()
        if self.accrued is not None:
            self.accrued.zero_()
        self.since_push = 0
