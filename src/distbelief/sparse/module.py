"""``SparseEmbedding``: an embedding table that lives on row shards, not in the model.

The module holds no ``nn.Parameter``; the dense path (``ShardPlan`` / ``FlatModel``) never
sees the table. Instead it keeps a small local buffer: the rows a mini-batch uses, fetched
from a row source (the parameter-server shards through :class:`~distbelief.sparse.client.
SparseClient`, or :class:`LocalTables` in-process), as a leaf tensor ``(U, dim)`` that
autograd fills with row gradients. After ``backward`` those ``(rows, grads)`` pairs are
pushed row-sparse; the source applies the update rule to those rows only.

Typical loop (what a Downpour replica does for every step)::

    prefetch_rows(model, ids)      # one fetch per shard, all tables together
    loss_fn(model(ids), y).backward()
    push_rows(model)               # row-sparse gradients, then the buffers are dropped
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from distbelief.ps.optim import make_rule
from distbelief.sparse.table import RowTable, TableSpec

POOLING = ("sum", "mean", "concat")


class RowSource(Protocol):
    """Where rows come from and gradients go: shards (over Ray) or in-process tables."""

    def fetch_many(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Values ``(n, dim)`` of each table's unique rows ``(n,)``."""

    def push_many(self, request: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Apply row gradients ``(rows (n,), grads (n, dim))`` per table."""


class LocalTables:
    """An in-process row source: one :class:`RowTable` per spec (no Ray, no shards).

    Rejected pushes raise ``ValueError`` with the table's one-line message.
    """

    def __init__(self, specs: Iterable[TableSpec], optimizer: str = "adagrad",
                 lr: float = 0.05, momentum: float = 0.9, *,
                 args: Mapping[str, object] | None = None, schedule: str | None = None
                 ) -> None:
        rule = make_rule(optimizer, lr, momentum, args, schedule, rows=True)
        self.tables = {s.name: RowTable(s, rule) for s in specs}

    def fetch_many(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: self.tables[name].fetch(rows) for name, rows in request.items()}

    def push_many(self, request: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        for name, (rows, grads) in request.items():
            problem = self.tables[name].push(rows, grads)
            if problem is not None:
                raise ValueError(problem)


class SparseEmbedding(nn.Module):
    """EmbeddingBag-like lookup of a row-sharded table of ``rows`` x ``dim``.

    ``forward(ids)`` takes int64 ids ``(B, F)`` (F fields per example; ``(B,)`` is one field)
    and returns ``(B, dim)`` for ``mode="sum"`` or ``"mean"`` (pooled over fields) or
    ``(B, F * dim)`` for ``"concat"``. Ids must be prefetched (:func:`prefetch_rows`) or
    the module must have a source attached, from which missing rows are fetched on the spot.
    ``name`` identifies the table on the shards and must be unique within a model.
    """

    def __init__(self, rows: int, dim: int, name: str, mode: str = "sum",
                 init_scale: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        if mode not in POOLING:
            raise ValueError(f"mode {mode!r} is unknown: choose one of {', '.join(POOLING)}")
        if rows < 1 or dim < 1:
            raise ValueError(f"a table needs rows >= 1 and dim >= 1 (got {rows} x {dim})")
        self.spec = TableSpec(name, int(rows), int(dim), float(init_scale), int(seed))
        self.mode = mode
        self.source: RowSource | None = None
        self.misses = 0  # forwards that had to fetch rows themselves
        self.clear()

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.name!r}, rows={s.rows}, dim={s.dim}, mode={self.mode!r}"

    def attach(self, source: RowSource | None) -> SparseEmbedding:
        """Fetch missing rows from (and let :func:`push_rows` push to) ``source``."""
        self.source = source
        return self

    def clear(self) -> None:
        """Drop the local buffer (the next forward fetches what it needs)."""
        self.rows = np.zeros(0, dtype=np.int64)
        self.values = torch.zeros((0, self.spec.dim), dtype=torch.float32, requires_grad=True)
        self._touched: list[np.ndarray] = []

    def load(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Make sorted unique ``rows`` (int64 ``(U,)``) with ``values`` ``(U, dim)`` the buffer."""
        self.rows = np.asarray(rows, dtype=np.int64)
        tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        self.values = tensor.requires_grad_(True)
        self._touched = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.detach().cpu().numpy().astype(np.int64, copy=False)
        pos = self._positions(flat)
        if pos is None:
            if self.source is None:
                raise RuntimeError(f"SparseEmbedding {self.spec.name!r}: ids were not "
                                   "prefetched and no source is attached: call prefetch_rows "
                                   "first or attach() a source")
            self.misses += 1
            wanted = np.union1d(self.rows, flat.reshape(-1))
            self.load(wanted, self.source.fetch_many({self.spec.name: wanted})[self.spec.name])
            pos = self._positions(flat)
        if torch.is_grad_enabled():
            self._touched.append(pos.reshape(-1))
        out = F.embedding(torch.from_numpy(pos), self.values)
        if out.ndim == 2:  # one field: (B, dim)
            return out
        if self.mode == "sum":
            return out.sum(dim=1)
        if self.mode == "mean":
            return out.mean(dim=1)
        return out.reshape(out.shape[0], -1)

    def _positions(self, ids: np.ndarray) -> np.ndarray | None:
        """Buffer slot of every id, or None if some id is not in the buffer."""
        if self.rows.size == 0:
            return None if ids.size else np.zeros(ids.shape, dtype=np.int64)
        pos = np.searchsorted(self.rows, ids)
        np.minimum(pos, self.rows.size - 1, out=pos)
        if not np.array_equal(self.rows[pos], ids):
            return None
        return pos

    def row_grads(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows (n,), grads (n, dim))`` of the rows the forwards since the last
        :meth:`zero_row_grads` touched (empty arrays before any backward)."""
        if self.values.grad is None or not self._touched:
            return np.zeros(0, np.int64), np.zeros((0, self.spec.dim), np.float32)
        touched = np.unique(np.concatenate(self._touched))
        return self.rows[touched], self.values.grad.numpy()[touched].copy()

    def zero_row_grads(self) -> None:
        if self.values.grad is not None:
            self.values.grad.zero_()
        self._touched = []

    @torch.no_grad()
    def apply_local(self, lr: float) -> None:
        """Plain SGD on the buffered rows the last backward touched (between fetches)."""
        if self.values.grad is not None:
            self.values.add_(self.values.grad, alpha=-lr)


def sparse_modules(model: nn.Module) -> list[SparseEmbedding]:
    """The model's :class:`SparseEmbedding` modules, checking their table names are unique."""
    found = [m for m in model.modules() if isinstance(m, SparseEmbedding)]
    names = [m.spec.name for m in found]
    if len(set(names)) != len(names):
        raise ValueError(f"SparseEmbedding table names must be unique in a model: {names}")
    return found


def table_specs(model: nn.Module) -> list[TableSpec]:
    return [m.spec for m in sparse_modules(model)]


def needed_rows(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """Sorted unique int64 rows of an id batch (any shape)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.unique(np.asarray(ids, dtype=np.int64))


def prefetch_rows(modules: Sequence[SparseEmbedding] | nn.Module, ids, source: RowSource | None
                  = None) -> int:
    """Load every module's buffer with the rows of ``ids`` (the model's input ``(B, F)``), in
    one ``fetch_many`` to ``source`` (default: the modules' attached source). Returns the
    number of unique rows fetched per table."""
    if isinstance(modules, nn.Module):
        modules = sparse_modules(modules)
    if not modules:
        return 0
    source = source or modules[0].source
    rows = needed_rows(ids)
    values = source.fetch_many({m.spec.name: rows for m in modules})
    for m in modules:
        m.load(rows, values[m.spec.name])
    return int(rows.size)


def push_rows(modules: Sequence[SparseEmbedding] | nn.Module, source: RowSource | None = None
              ) -> None:
    """Push every module's row gradients in one ``push_many`` and drop the buffers (their
    values are stale once the source has applied the update)."""
    if isinstance(modules, nn.Module):
        modules = sparse_modules(modules)
    if not modules:
        return
    source = source or modules[0].source
    request = {m.spec.name: m.row_grads() for m in modules}
    source.push_many({k: v for k, v in request.items() if v[0].size})
    for m in modules:
        m.clear()
