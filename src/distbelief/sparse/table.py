"""Row-sparse embedding tables: rows created on first write, seeded, updated row by row (pure).

A table has ``rows`` rows of ``dim`` float32 columns; its nominal size may far exceed memory
because a row exists only once a push has touched it. Until then its value is a pure
function of ``(seed, table, row, column)`` (a counter-based hash, :func:`initial_rows`), so a
fetch of an untouched row returns the same initial value in any process, in any touch order,
and stores nothing.

Rows are sharded by ``row % shards``: shard ``s`` owns rows ``s, s + S, s + 2S, ...``. That
spreads the hot head of a Zipf-distributed id space (ids ``0, 1, 2, ...``) evenly over the
shards, where contiguous ranges would put it all on shard 0.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from distbelief.ps.optim import Rule

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array: a bijective, well-mixed hash (wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_keys(*keys: np.ndarray | int) -> np.ndarray:
    """One uint64 hash per element of the broadcast ``keys`` (ints or integer arrays)."""
    h = np.full((), _GOLDEN, dtype=np.uint64)
    for k in keys:
        with np.errstate(over="ignore"):
            h = mix64(h ^ np.asarray(k).astype(np.uint64) + _GOLDEN)
    return h


def uniform01(h: np.ndarray) -> np.ndarray:
    """Map uint64 hashes to float64 uniforms in [0, 1) (the top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def table_key(name: str) -> int:
    """A stable integer for a table name (part of every row's initialiser key)."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``rows`` x ``dim`` float32, initialised uniform in
    ``[-init_scale, init_scale)`` from ``seed`` (``init_scale=0`` starts every row at zero)."""

    name: str
    rows: int
    dim: int
    init_scale: float = 0.01
    seed: int = 0

    @property
    def nominal_bytes(self) -> int:
        """Bytes of the whole table as a dense float32 array (what a dense fetch moves)."""
        return self.rows * self.dim * 4


def initial_rows(spec: TableSpec, rows: np.ndarray) -> np.ndarray:
    """The seeded initial values of ``rows`` (int64, ``(n,)``): float32 ``(n, dim)``.

    Depends only on ``(spec.seed, spec.name, row, column)``, never on which rows were asked
    before or together.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if spec.init_scale == 0:
        return np.zeros((rows.size, spec.dim), dtype=np.float32)
    cols = np.arange(spec.dim, dtype=np.int64)
    u = uniform01(hash_keys(spec.seed, table_key(spec.name), rows[:, None], cols[None, :]))
    return ((2.0 * u - 1.0) * spec.init_scale).astype(np.float32)


def shard_of(rows: np.ndarray, shards: int) -> np.ndarray:
    """The shard that owns each row: ``row % shards``."""
    return np.asarray(rows) % shards


class RowTable:
    """The rows of one table that one shard owns (all of them when ``shards == 1``).

    Materialised rows live in growable float32 arrays ``(capacity, dim)`` (values and each
    update-rule state), found through a dict ``row -> slot``; memory is proportional to the
    rows ever pushed, not to ``spec.rows``. Row ids are always global table rows.
    """

    def __init__(self, spec: TableSpec, rule: Rule, shard: int = 0, shards: int = 1) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is outside 0..{shards - 1}")
        self.spec, self.rule, self.shard, self.shards = spec, rule, shard, shards
        self.slots: dict[int, int] = {}
        self.values = np.empty((0, spec.dim), dtype=np.float32)
        self.state = {name: np.empty((0, spec.dim), dtype=np.float32)
                      for name in rule.state_names}
        self.fetches = 0
        self.updates = 0
        self.rejected: Counter[str] = Counter()

    @property
    def materialized(self) -> int:
        """How many rows exist in memory (were pushed at least once)."""
        return len(self.slots)

    @property
    def resident_bytes(self) -> int:
        """Bytes held by row values and rule state (capacity included), dict excluded."""
        return self.values.nbytes + sum(s.nbytes for s in self.state.values())

    def check_rows(self, rows: object) -> tuple[str, str] | None:
        """``(reason, message)`` if ``rows`` are not this shard's row ids, else None."""
        spec = self.spec
        if not isinstance(rows, np.ndarray) or rows.ndim != 1:
            return "rows", f"table {spec.name!r}: row ids must be a 1-D integer array"
        if not np.issubdtype(rows.dtype, np.integer):
            return "rows", f"table {spec.name!r}: row ids have dtype {rows.dtype}, need int64"
        if rows.size and (rows.min() < 0 or rows.max() >= spec.rows):
            bad = int(rows[(rows < 0) | (rows >= spec.rows)][0])
            return "range", (f"table {spec.name!r}: row {bad} is out of range 0..{spec.rows - 1}"
                             " (ids must be < the table's rows)")
        if self.shards > 1 and rows.size and np.any(rows % self.shards != self.shard):
            bad = int(rows[rows % self.shards != self.shard][0])
            return "shard", (f"table {spec.name!r}: row {bad} belongs to shard "
                             f"{bad % self.shards}, not shard {self.shard}")
        return None

    def fetch(self, rows: np.ndarray) -> np.ndarray:
        """Current values of ``rows`` (int64 ``(n,)``, duplicates allowed): float32 ``(n, dim)``.

        Untouched rows come back at their seeded initial value and are not stored. Raises
        ``ValueError`` with a one-line message for ids that are not this shard's.
        """
        problem = self.check_rows(rows)
        if problem is not None:
            raise ValueError(problem[1])
        self.fetches += 1
        slots = self._slots(rows)
        out = np.empty((rows.size, self.spec.dim), dtype=np.float32)
        have = slots >= 0
        out[have] = self.values[slots[have]]
        if not have.all():
            out[~have] = initial_rows(self.spec, rows[~have])
        return out

    def push(self, rows: np.ndarray, grads: np.ndarray, update: int | None = None
             ) -> str | None:
        """Apply the update rule to ``rows`` with ``grads`` (float32 ``(n, dim)``) as update
        number ``update`` (for a learning-rate schedule: the shard's version; default this
        table's update count).

        Duplicate row ids have their gradients summed first, so the rule sees one gradient
        per row, exactly as a dense update of the whole table restricted to those rows would.
        Returns None when applied, else a one-line message; a rejected push changes nothing
        but the rejection counter of its reason (``rows``, ``range``, ``shard``, ``type``,
        ``dtype``, ``shape``, ``nonfinite``).
        """
        problem = self.check_rows(rows) or self.check_grads(rows, grads)
        if problem is not None:
            self.rejected[problem[0]] += 1
            return problem[1]
        rows, grads = dedupe(rows, grads)
        slots = self._materialize(rows)
        param = self.values[slots]
        state = {k: v[slots] for k, v in self.state.items()}
        self.rule.apply(param, grads, state, update=self.updates if update is None else update)
        self.values[slots] = param
        for k, v in state.items():
            self.state[k][slots] = v
        self.updates += 1
        return None

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Materialised rows, sorted (int64 ``(m,)``), and copies of their values ``(m, dim)``."""
        rows = np.fromiter(self.slots.keys(), dtype=np.int64, count=len(self.slots))
        slots = np.fromiter(self.slots.values(), dtype=np.int64, count=len(self.slots))
        order = np.argsort(rows)
        return rows[order], self.values[slots[order]].copy()

    def load(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Materialise unique ``rows`` with ``values`` ``(n, dim)`` (rule state starts at zero)."""
        problem = self.check_rows(rows)
        if problem is not None:
            raise ValueError(problem[1])
        slots = self._materialize(rows)
        self.values[slots] = values

    def snapshot(self) -> dict[str, np.ndarray]:
        """Materialised rows (sorted int64 ``(m,)``), their values and each rule state
        ``(m, dim)``, as copies: what a checkpoint needs to rebuild this table exactly."""
        rows = np.fromiter(self.slots.keys(), dtype=np.int64, count=len(self.slots))
        slots = np.fromiter(self.slots.values(), dtype=np.int64, count=len(self.slots))
        order = np.argsort(rows)
        rows, slots = rows[order], slots[order]
        return {"rows": rows, "values": self.values[slots].copy(),
                **{name: v[slots].copy() for name, v in self.state.items()}}

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace every row with a :meth:`snapshot`'s; raises ``ValueError`` (one line) for
        a snapshot of another table, shard or update rule, leaving the table as it was."""
        name, dim = self.spec.name, self.spec.dim
        missing = {"rows", "values", *self.state} - set(arrays)
        if missing:
            raise ValueError(f"table {name!r}: the snapshot lacks {sorted(missing)}")
        rows = arrays["rows"]
        if rows.dtype != np.int64 or rows.ndim != 1 or np.any(np.diff(rows) <= 0):
            raise ValueError(f"table {name!r}: snapshot rows must be sorted unique int64")
        problem = self.check_rows(rows)
        if problem is not None:
            raise ValueError(problem[1])
        for key in ("values", *self.state):
            a = arrays[key]
            if a.dtype != np.float32 or a.shape != (rows.size, dim):
                raise ValueError(f"table {name!r}: snapshot {key} has {a.dtype} {a.shape}, "
                                 f"need float32 ({rows.size}, {dim})")
            if not np.isfinite(a).all():
                raise ValueError(f"table {name!r}: snapshot {key} holds NaN or inf")
        self.slots = dict(zip(rows.tolist(), range(rows.size)))
        self.values = np.array(arrays["values"], dtype=np.float32)
        self.state = {k: np.array(arrays[k], dtype=np.float32) for k in self.state}

    def check_grads(self, rows: np.ndarray, grads: object) -> tuple[str, str] | None:
        name = self.spec.name
        if not isinstance(grads, np.ndarray):
            return "type", f"table {name!r}: gradients must be a NumPy array"
        if grads.dtype != np.float32:
            return "dtype", f"table {name!r}: gradients have dtype {grads.dtype}, need float32"
        if grads.shape != (rows.size, self.spec.dim):
            return "shape", (f"table {name!r}: gradients have shape {grads.shape}, need "
                             f"({rows.size}, {self.spec.dim}) for {rows.size} rows")
        if not np.isfinite(grads).all():
            return "nonfinite", f"table {name!r}: gradients contain NaN or inf"
        return None

    def _slots(self, rows: np.ndarray) -> np.ndarray:
        get = self.slots.get
        return np.fromiter((get(r, -1) for r in rows.tolist()), dtype=np.int64,
                           count=rows.size)

    def _materialize(self, rows: np.ndarray) -> np.ndarray:
        """Slots of unique ``rows``, creating missing ones at their initial value."""
        slots = self._slots(rows)
        new = np.flatnonzero(slots < 0)
        if new.size:
            start = len(self.slots)
            self._reserve(start + new.size)
            fresh = np.arange(start, start + new.size)
            self.slots.update(zip(rows[new].tolist(), fresh.tolist()))
            self.values[fresh] = initial_rows(self.spec, rows[new])
            for v in self.state.values():
                v[fresh] = 0.0
            slots[new] = fresh
        return slots

    def _reserve(self, n: int) -> None:
        if n <= len(self.values):
            return
        cap = max(n, 2 * len(self.values), 1024)
        self.values = _grow(self.values, cap)
        self.state = {k: _grow(v, cap) for k, v in self.state.items()}

    def stats(self) -> dict:
        """JSON-ready counters of this table on this shard."""
        return {"table": self.spec.name, "materialized": self.materialized,
                "resident_bytes": self.resident_bytes, "fetches": self.fetches,
                "updates": self.updates, "rejected": dict(self.rejected)}


def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.empty((cap, a.shape[1]), dtype=a.dtype)
    out[: len(a)] = a
    return out


def dedupe(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``rows`` and their summed gradients (``(n, dim)`` -> ``(u, dim)``)."""
    unique, inverse = np.unique(rows, return_inverse=True)
    if unique.size == rows.size:
        order = np.argsort(rows, kind="stable")
        return rows[order].astype(np.int64), grads[order]
    summed = np.zeros((unique.size, grads.shape[1]), dtype=np.float32)
    np.add.at(summed, inverse.reshape(-1), grads)
    return unique.astype(np.int64), summed
