"""Re-sharding a checkpoint onto another shard count (pure: arrays in, arrays out).

Dense shards hold contiguous ranges of one flat vector (:class:`~distbelief.ps.plan.ShardPlan`),
so every per-element array of a shard file (``params``, each update-rule state array such as
Adagrad's ``accumulator`` or Adam's moments, the ``--average`` ``average``, Sandblaster's
``vec:NAME``) is laid end to end over the old shards and cut at the new plan's bounds: the
gathered vectors are unchanged, bit for bit.

Per-shard scalars have no position in the flat vector; they are handled explicitly:

- the rule's scalar state (``scalar_names``: e.g. Adam's ``step``), the ``--average``
  ``average_count`` and the shard's ``version`` (applied pushes, the learning-rate
  schedule's update number): a new shard takes those of the old shard that held the
  largest part of its range (its :func:`owner`; in a Downpour run every shard applies every
  push, so these agree across shards anyway);
- shard 0's model buffers (``buffers``, ``buffer_counts``) stay on shard 0;
- the statistics counters (fetches, rejections, staleness histogram) start afresh.

Row shards own rows by ``row % shards`` (:func:`~distbelief.sparse.table.shard_of`): every
materialised row moves, with its values and rule state, to the shard the new count assigns
it; a new row shard's ``version`` is the largest old one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only a type here: importing distbelief.ps would run its actors' imports
    from distbelief.ps.plan import ShardPlan

__all__ = ["SHARD0_ONLY", "owner", "reshard_dense", "reshard_rows", "same_model"]

SHARD0_ONLY = ("buffers", "buffer_counts")  # model buffers: kept on shard 0
AVERAGE_SCALARS = ("average_count",)  # the --average update count, one per shard


def same_model(old: ShardPlan, new: ShardPlan) -> bool:
    """Both plans cut the same tensors (names, shapes, order): only the bounds may differ."""
    return old.tensors == new.tensors and old.numel == new.numel


def owner(bounds: Sequence[int], lo: int, hi: int) -> int:
    """The shard of ``bounds`` holding the most of the flat range ``lo:hi`` (lowest on ties)."""
    best, best_len = 0, -1
    for i in range(len(bounds) - 1):
        overlap = min(hi, bounds[i + 1]) - max(lo, bounds[i])
        if overlap > best_len:
            best, best_len = i, overlap
    return best


def reshard_dense(old: ShardPlan, parts: Sequence[Mapping[str, np.ndarray]],
                  versions: Sequence[int], new: ShardPlan,
                  scalar_names: Sequence[str] = ()) -> tuple[list[dict[str, np.ndarray]],
                                                            list[int]]:
    """The dense shard files of ``old`` (``parts[i]``: shard i's arrays, ``versions[i]``
    its version) as ``new.shards`` shards of ``new``: their arrays and versions.

    Arrays named in ``scalar_names`` (the rule's scalar state) and ``average_count`` are
    per-shard scalars, ``buffers``/``buffer_counts`` shard 0's; every other array is
    per-element (one value per element of the shard's range). Raises ``ValueError`` when the
    plans are of different models or a part lacks or misshapes an array.
    """
    if not same_model(old, new):
        raise ValueError("the old and new plans are of different models")
    if len(parts) != old.shards or len(versions) != old.shards:
        raise ValueError(f"expected {old.shards} shard parts and versions, got {len(parts)} "
                         f"and {len(versions)}")
    scalars = set(scalar_names) | set(AVERAGE_SCALARS)
    sliced = [k for k in parts[0] if k not in scalars and k not in SHARD0_ONLY]
    for i, part in enumerate(parts):
        n = old.shard_size(i)
        for k in sliced:
            if k not in part or part[k].shape != (n,):
                raise ValueError(f"old shard {i} lacks a per-element {k!r} of {n} elements")
        if set(part) - set(sliced) - set(SHARD0_ONLY) - scalars:
            raise ValueError(f"old shard {i} holds arrays {sorted(part)}, shard 0 "
                             f"{sorted(parts[0])}: the checkpoint is inconsistent")
    flat = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in sliced}
    out, new_versions = [], []
    for j in range(new.shards):
        lo, hi = new.shard_range(j)
        src = owner(old.bounds, lo, hi)
        arrays = {k: flat[k][lo:hi].copy() for k in sliced}
        arrays |= {k: np.array(v, copy=True) for k, v in parts[src].items() if k in scalars}
        if j == 0:
            arrays |= {k: np.array(v, copy=True) for k, v in parts[0].items()
                       if k in SHARD0_ONLY}
        out.append(arrays)
        new_versions.append(int(versions[src]))
    return out, new_versions


def reshard_rows(parts: Sequence[Mapping[str, np.ndarray]], versions: Sequence[int],
                 shards: int) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Row shard files (``parts[i]``: ``TABLE/rows`` sorted int64, ``TABLE/values`` and
    ``TABLE/STATE`` float32 ``(m, dim)``, as :meth:`EmbeddingShardCore.save` writes them)
    regrouped for ``shards`` row shards by ``row % shards``: their arrays (rows sorted) and
    versions (the largest old version each). Raises ``ValueError`` for parts of different
    tables or a row held by two old shards.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1 (got {shards})")
    keys = sorted(parts[0]) if parts else []
    for i, part in enumerate(parts):
        if sorted(part) != keys:
            raise ValueError(f"old row shard {i} holds {sorted(part)}, row shard 0 {keys}")
    tables = sorted({k.rpartition("/")[0] for k in keys})
    out: list[dict[str, np.ndarray]] = [{} for _ in range(shards)]
    for table in tables:
        fields = [k.rpartition("/")[2] for k in keys if k.rpartition("/")[0] == table]
        if "rows" not in fields:
            raise ValueError(f"table {table!r} has no rows array")
        rows = np.concatenate([np.asarray(p[f"{table}/rows"], np.int64) for p in parts])
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        if np.any(np.diff(rows) == 0):
            raise ValueError(f"table {table!r}: a row is held by two old shards")
        data = {f: np.concatenate([np.asarray(p[f"{table}/{f}"]) for p in parts])[order]
                for f in fields if f != "rows"}
        target = rows % shards
        for s in range(shards):
            mask = target == s
            out[s][f"{table}/rows"] = rows[mask]
            for f, a in data.items():
                out[s][f"{table}/{f}"] = a[mask]
    top = max((int(v) for v in versions), default=0)
    return out, [top] * shards
