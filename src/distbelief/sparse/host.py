"""The row-sparse parameter host: dense parameters plus embedding rows fetched by id.

A :class:`RowSparseHost` is for models with :class:`~distbelief.sparse.module.SparseEmbedding`
tables, whose inputs are id matrices int64 ``(n, fields)``. Dense parameters take the flat
path (a :class:`~distbelief.ps.host.FlatHost`); every fetch also brings, in the same round
trip, just the table rows the batches until the next fetch use (never the whole table), and
every push sends the row gradients accrued since the last push, row-sparse. Between fetches
it applies its own gradients locally to both (the paper's Algorithm 7.1). It implements
:class:`~distbelief.host.ParamHost` for Downpour; Sandblaster is not offered for tables.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from distbelief.host import LossOf
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan
from distbelief.sparse.client import SparseClient
from distbelief.sparse.module import sparse_modules
from distbelief.sparse.shard import rss_bytes
from distbelief.sparse.table import TableSpec


class RowSparseHost:
    """``model``'s dense parameters on ``shards``, its tables ``specs`` on ``row_shards``."""

    event_fields = {"rows": 0}  # table rows fetched at this step

    def __init__(self, model: nn.Module, plan: ShardPlan, shards: list, row_shards: list,
                 specs: list[TableSpec], replica: int = -1) -> None:
        self.dense = FlatHost(model, plan, shards, replica=replica, fuse=False)
        self.modules = sparse_modules(model)
        self.sparse = SparseClient(row_shards, specs, replica=replica)
        self.accrued_rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        self._prefetched: tuple | None = None  # (rows, pending fetch) sent by prefetch
        self.early_fetches = 0  # fetches that took what prefetch sent

    def partitions(self) -> list:
        return []

    def fetch(self, upcoming: Callable[[], np.ndarray]) -> dict:
        """Dense parameters and the rows of the upcoming batches, one round trip: the one
        :meth:`prefetch` sent if it asked for the same rows, else one sent now."""
        rows = np.unique(upcoming())
        sent, self._prefetched = self._prefetched, None
        if sent is not None and np.array_equal(sent[0], rows):
            pending = sent[1]
            self.early_fetches += 1
        else:  # no early fetch, or its batches changed (a new data slot): its rows go unused
            pending = self._fetch_rows(rows)
        self.dense.fetch()
        values = self.sparse.fetch_end(pending)
        for m in self.modules:
            m.load(rows, values[m.spec.name])
        return {"rows": int(rows.size)}

    def prefetch(self, upcoming: Callable[[], np.ndarray]) -> None:
        """Send the next fetch now, dense parameters and the rows of ``upcoming()`` (the
        batches from that fetch on), after the last push before it (so it sees that push),
        while the steps before it compute; :meth:`fetch` takes it."""
        rows = np.unique(upcoming())
        self.dense.prefetch()
        self._prefetched = rows, self._fetch_rows(rows)

    def _fetch_rows(self, rows: np.ndarray):
        """Send the fetch of ``rows`` of every table; finish it with ``sparse.fetch_end``."""
        return self.sparse.fetch_begin({m.spec.name: rows for m in self.modules})

    def forward_backward(self, x: torch.Tensor, loss_of: LossOf) -> float:
        for m in self.modules:
            m.zero_row_grads()
        loss = self.dense.forward_backward(x, loss_of)
        for m in self.modules:
            self.accrued_rows[m.spec.name].append(m.row_grads())
        return loss

    def end_step(self, push: bool, local_lr: float | None, fetch_next: bool) -> None:
        if push:
            self.push()
        else:
            self.dense.end_step(False, None, fetch_next)
        if local_lr is not None:
            self.dense.apply_local(local_lr)
            for m in self.modules:
                m.apply_local(local_lr)

    def push(self) -> None:
        """Push the dense gradient and the table rows' gradients accrued since the last push."""
        request = {}
        for name, parts in self.accrued_rows.items():
            rows = np.concatenate([r for r, _ in parts])
            if rows.size:
                request[name] = (rows, np.concatenate([g for _, g in parts]))
        self.dense.push()
        self.sparse.push_many(request)
        self.accrued_rows.clear()

    def versions(self) -> list[int]:
        return self.dense.versions()

    def after_run(self, events: list[dict]) -> dict:
        return self.counters()

    def finish(self, push: bool, fetch_next: bool = False) -> dict:
        if push:
            self.push()
        self.dense.client.wait()
        self.sparse.wait()
        return self.counters()

    def counters(self) -> dict:
        c, s = self.dense.client, self.sparse
        return {"fetches": c.fetches, "pushes": c.pushes, "rejected": c.rejected + s.rejected,
                **s.counters(), "early_fetches": self.early_fetches,
                "last_rejection": s.last_rejection, "rss_bytes": rss_bytes()}

    def load_vector(self, name: str) -> None:
        raise NotImplementedError("Sandblaster does not train sparse tables")

    def hold(self, portion: int) -> None:
        raise NotImplementedError("Sandblaster does not train sparse tables")

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        raise NotImplementedError("Sandblaster does not train sparse tables")

    def stage(self, tag: str) -> bool:
        raise NotImplementedError("Sandblaster does not train sparse tables")

    def discard(self) -> None:
        raise NotImplementedError("Sandblaster does not train sparse tables")
