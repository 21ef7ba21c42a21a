"""The shards of a row-sparse run: the dense shards and the embedding row shards, as one.

:class:`RowShardGroup` holds two :class:`~distbelief.ps.group.ShardGroup` s, the dense
parameter shards and the S embedding row shards (rows ``r % S``), and is what the Downpour
driver talks to: a call that meets a dead shard of either kind revives both kinds' dead
shards (each from the newest checkpoint's files of its own kind), and a checkpoint has
both kinds' files, named by one manifest.
"""

from __future__ import annotations

from pathlib import Path

import ray

from distbelief import storage
from distbelief.checkpoint import shard_file
from distbelief.ps.group import ShardGroup, ShardSet


def row_rejection_error(stats: list[dict], max_rejected: int) -> str | None:
    """Why a run must stop, if the embedding shards (their ``stats``) rejected more than
    ``max_rejected`` pushes in all."""
    rejected = sum(s["rejected_total"] for s in stats)
    if rejected <= max_rejected:
        return None
    last = next(s["last_rejection"] for s in stats if s["last_rejection"])
    return (f"the embedding shards rejected {rejected} pushes, more than --max-rejected "
            f"{max_rejected} (last: {last}): fix the model's ids or lower --lr")


class RowShardGroup(ShardSet):
    """``dense`` parameter shards and ``rows`` embedding shards of the tables ``tables``
    (``[name, rows, dim]`` each, as the manifest records them)."""

    def __init__(self, dense: ShardGroup, rows: ShardGroup, tables: list[list]) -> None:
        super().__init__(dense.revives)
        self.dense = dense
        self.rows = rows
        self.tables = tables

    def handles(self) -> list[ray.actor.ActorHandle]:
        return self.dense.handles()

    def row_handles(self) -> list[ray.actor.ActorHandle]:
        """The embedding shards' current actor handles, in shard order (a new list)."""
        return self.rows.handles()

    def revive(self) -> list[int]:
        """The dense shards' revival, then the row shards'; the restarted shards (dense
        indices, then row shards numbered after them)."""
        dead = self.dense.revive()
        return dead + [self.dense.count + i for i in self.rows.revive()]

    def stats(self) -> list[dict]:
        return self.dense.stats()

    def row_stats(self) -> list[dict]:
        return self.rows.stats()

    def check_rejections(self, max_rejected: int) -> None:
        self.dense.check_rejections(max_rejected)
        self.rows.check_rejections(max_rejected)

    def save(self, run_dir: Path, number: int, vectors: tuple[str, ...] = ()
             ) -> tuple[list[int], dict]:
        """The row shards write their rows, then the dense shards their slices; the
        manifest's extra fields name the tables and the row files."""
        versions = self.retry(lambda: self.rows.write(run_dir, number))
        rows = [{"file": storage.basename(shard_file(run_dir, number, i, self.rows.role)),
                 "version": int(v)}
                for i, v in enumerate(versions)]
        dense = self.retry(lambda: self.dense.write(run_dir, number, vectors))
        return dense, {"tables": self.tables, "row_shards": rows}

    def saved(self, run_dir: Path, number: int) -> None:
        self.dense.saved(run_dir, number)
        self.rows.saved(run_dir, number)

    def kill(self) -> None:
        self.dense.kill()
        self.rows.kill()
