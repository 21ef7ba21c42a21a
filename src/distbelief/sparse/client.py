"""What a replica (or the driver) uses to reach the embedding shards: row-sparse fetch and push.

Row ids are split by owner (``row % shards``); every shard that owns some of the rows gets
one call carrying all tables' rows, all calls are submitted back to back and waited for
together. Pushes are not waited for until the next push, so they overlap the next
mini-batch; Ray runs one caller's calls to an actor in order, so a fetch submitted after a
push already sees it applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import ray

from distbelief.sparse.table import TableSpec, dedupe

ROW_ID_BYTES = 8  # an int64 row id travels with every fetched or pushed row


class PendingFetch(NamedTuple):
    """A fetch submitted by :meth:`SparseClient.fetch_begin`, finished by ``fetch_end``."""

    asked: list[int]  # the shards asked, in the order of ``refs``
    refs: list[ray.ObjectRef]  # each asked shard's ``(version, {table: values})``
    places: dict[str, list[np.ndarray]]  # per table, per shard: positions of its rows
    sizes: dict[str, int]  # rows asked per table


class SparseClient:
    """Row-sparse access to the tables ``specs`` split over ``shards`` (``row % S``)."""

    def __init__(self, shards: Sequence[ray.actor.ActorHandle], specs: Sequence[TableSpec],
                 replica: int = -1) -> None:
        self.shards = list(shards)
        self.specs = {s.name: s for s in specs}
        self.replica = replica
        self.versions = [0] * len(self.shards)
        self.fetches = self.pushes = self.rejected = 0
        self.rows_fetched = self.bytes_fetched = self.bytes_pushed = 0
        self.last_rejection: str | None = None
        self._in_flight: list[ray.ObjectRef] = []

    def _split(self, rows: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Owner of each row and, per shard, the positions of its rows."""
        owner = rows % len(self.shards)
        order = np.argsort(owner, kind="stable")
        cuts = np.searchsorted(owner[order], np.arange(len(self.shards) + 1))
        return owner, [order[a:b] for a, b in zip(cuts, cuts[1:])]

    def fetch_begin(self, request: dict[str, np.ndarray]) -> PendingFetch:
        """Submit the fetch of each table's unique rows ``(n,)``; finish with :meth:`fetch_end`."""
        per_shard: list[dict[str, np.ndarray]] = [{} for _ in self.shards]
        places: dict[str, list[np.ndarray]] = {}
        for name, rows in request.items():
            rows = np.asarray(rows, dtype=np.int64)
            spec = self.specs[name]
            if rows.size and (rows.min() < 0 or rows.max() >= spec.rows):
                raise ValueError(f"table {name!r}: rows {rows.min()}..{rows.max()} fall outside "
                                 f"0..{spec.rows - 1}")
            _, groups = self._split(rows)
            places[name] = groups
            for s, where in enumerate(groups):
                if where.size:
                    per_shard[s][name] = rows[where]
        asked = [s for s, part in enumerate(per_shard) if part]
        refs = [self.shards[s].fetch.remote(per_shard[s]) for s in asked]
        sizes = {name: len(np.asarray(rows)) for name, rows in request.items()}
        return PendingFetch(asked, refs, places, sizes)

    def fetch_end(self, pending: PendingFetch) -> dict[str, np.ndarray]:
        """The values ``(n, dim)`` of each table's rows, in the order they were asked."""
        asked, refs, places, sizes = pending
        replies = ray.get(refs)
        out = {name: np.empty((n, self.specs[name].dim), dtype=np.float32)
               for name, n in sizes.items()}
        for s, (version, parts) in zip(asked, replies):
            self.versions[s] = version
            for name, values in parts.items():
                out[name][places[name][s]] = values
        self.fetches += 1
        for name, n in sizes.items():
            self.rows_fetched += n
            self.bytes_fetched += n * (self.specs[name].dim * 4 + ROW_ID_BYTES)
        return out

    def fetch_many(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Values ``(n, dim)`` of each table's rows ``(n,)`` (unique ids, any order)."""
        return self.fetch_end(self.fetch_begin(request))

    def push_many(self, request: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Send each table's row gradients ``(rows (n,), grads (n, dim))`` to their owners.

        Duplicate rows are summed here first, so each row travels once. Returns at once;
        the previous push is waited for (and its rejections counted) first.
        """
        self.wait()
        per_shard: list[dict] = [{} for _ in self.shards]
        for name, (rows, grads) in request.items():
            rows, grads = dedupe(np.asarray(rows, dtype=np.int64), grads)
            _, groups = self._split(rows)
            for s, where in enumerate(groups):
                if where.size:
                    per_shard[s][name] = (rows[where], grads[where])
            self.bytes_pushed += rows.size * (grads.shape[1] * 4 + ROW_ID_BYTES)
        self._in_flight = [self.shards[s].push.remote(part, self.versions[s], self.replica)
                           for s, part in enumerate(per_shard) if part]
        self.pushes += 1

    def wait(self) -> None:
        """Block until the last push is applied (or rejected) by every shard it went to."""
        if self._in_flight:
            for problem in ray.get(self._in_flight):
                if problem is not None:
                    self.rejected += 1
                    self.last_rejection = problem
            self._in_flight = []

    def counters(self) -> dict:
        return {"sparse_fetches": self.fetches, "sparse_pushes": self.pushes,
                "sparse_rejected": self.rejected, "rows_fetched": self.rows_fetched,
                "bytes_fetched": self.bytes_fetched, "bytes_pushed": self.bytes_pushed}
