"""An embedding shard: the rows ``r % shards == shard`` of every sparse table, as an actor.

:class:`EmbeddingShardCore` is the logic (plain Python over :class:`RowTable` s);
:class:`EmbeddingShard` is the Ray actor around it. One call serves every table, so a
replica's fetch or push costs one round trip per shard however many tables the model has.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping

import numpy as np
import ray

from distbelief.ps.optim import make_rule
from distbelief.sparse.table import RowTable, TableSpec


class EmbeddingShardCore:
    """Shard ``shard`` of ``shards`` of each table in ``specs``.

    ``version`` counts applied pushes; staleness of a push is the version when it is applied
    minus the version the replica saw at its last fetch.
    """

    def __init__(self, shard: int, shards: int, specs: list[TableSpec], optimizer: str,
                 lr: float, momentum: float = 0.9, restored: dict | None = None, *,
                 args: Mapping[str, object] | None = None, schedule: str | None = None
                 ) -> None:
        rule = make_rule(optimizer, lr, momentum, args, schedule, rows=True)
        self.shard_id, self.shards = shard, shards
        self.tables = {s.name: RowTable(s, rule, shard, shards) for s in specs}
        self.version = 0
        self.fetches = 0
        self.rejected: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.pushes_by_replica: Counter[int] = Counter()
        self.last_rejection: str | None = None
        if restored is not None:
            self.restore(restored["arrays"], restored["version"])

    def save(self, path: str) -> int:
        """Write every table's materialised rows, values and rule state, and the version, to
        ``path`` atomically (safetensors: ``TABLE/rows``, ``TABLE/values``, ``TABLE/STATE``);
        the version."""
        from distbelief.checkpoint import save_arrays

        arrays = {f"{name}/{key}": a for name, table in self.tables.items()
                  for key, a in table.snapshot().items()}
        save_arrays(path, arrays, {"version": str(self.version), "shard": str(self.shard_id),
                                   "tables": json.dumps(sorted(self.tables))})
        return self.version

    def restore(self, arrays: dict[str, np.ndarray], version: int) -> None:
        """Load what :meth:`save` wrote; raises ``ValueError`` (one line) for arrays of other
        tables, rows of another shard or another update rule, changing nothing then."""
        parts: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.tables}
        for key, a in arrays.items():
            name, _, field = key.rpartition("/")
            if name not in parts:
                raise ValueError(f"the row checkpoint holds {key!r}, not a table of this model "
                                 f"({sorted(self.tables)})")
            parts[name][field] = a
        fresh = {}
        for name, table in self.tables.items():
            copy = RowTable(table.spec, table.rule, table.shard, table.shards)
            copy.restore(parts[name])
            fresh[name] = copy
        self.tables, self.version = fresh, int(version)

    def fetch(self, request: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """Current version and the values ``(n, dim)`` of each named table's rows ``(n,)``.

        Raises ``ValueError`` (one line) for an unknown table or rows not on this shard.
        """
        unknown = set(request) - set(self.tables)
        if unknown:
            raise ValueError(f"no table(s) {sorted(unknown)} on this shard: tables are "
                             f"{sorted(self.tables)}")
        self.fetches += 1
        return self.version, {name: self.tables[name].fetch(rows)
                              for name, rows in request.items()}

    def push(self, request: dict[str, tuple[np.ndarray, np.ndarray]], fetched_version: int,
             replica: int = -1) -> str | None:
        """Apply every table's ``(rows, grads)`` or, if any part is malformed, none of them.

        Returns None when applied, else the one-line reason (also counted by kind:
        ``table``, ``rows``, ``range``, ``shard``, ``type``, ``dtype``, ``shape``,
        ``nonfinite``).
        """
        problem = self.check(request)
        if problem is not None:
            self.rejected[problem[0]] += 1
            self.last_rejection = problem[1]
            return problem[1]
        for name, (rows, grads) in request.items():
            self.tables[name].push(rows, grads, update=self.version)
        self.staleness[self.version - int(fetched_version)] += 1
        self.version += 1
        self.pushes_by_replica[int(replica)] += 1
        return None

    def export(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """This shard's materialised rows of table ``name`` and their values (copies)."""
        return self.tables[name].export()

    def check(self, request: object) -> tuple[str, str] | None:
        """``(reason, message)`` if ``request`` may not be applied, else None."""
        if not isinstance(request, dict):
            return "type", "a sparse push is a dict {table: (rows, grads)}"
        for name, part in request.items():
            table = self.tables.get(name)
            if table is None:
                return "table", f"no table {name!r} on this shard: tables are {sorted(self.tables)}"
            if not (isinstance(part, tuple) and len(part) == 2):
                return "type", f"table {name!r}: push (rows, grads) pairs"
            problem = table.check_rows(part[0]) or table.check_grads(part[0], part[1])
            if problem is not None:
                return problem
        return None

    def stats(self) -> dict:
        """JSON-ready counters: updates, fetches, rejections, staleness, rows per table."""
        return {
            "shard": self.shard_id,
            "version": self.version,
            "updates": self.version,
            "fetches": self.fetches,
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
            "last_rejection": self.last_rejection,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "pushes_by_replica": {str(k): v for k, v in sorted(self.pushes_by_replica.items())},
            "tables": {name: t.stats() for name, t in self.tables.items()},
        }


@ray.remote
class EmbeddingShard(EmbeddingShardCore):
    """Ray actor holding one embedding shard: every core method is a remote method."""

    def stats(self) -> dict:
        return super().stats() | {"node": ray.get_runtime_context().get_node_id(),
                                  "rss_bytes": rss_bytes()}


def rss_bytes() -> int:
    """Resident memory of this process, in bytes."""
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)
