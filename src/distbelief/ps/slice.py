"""The state of one parameter-server shard: its slice, rule state, version and counters.

:class:`ShardSlice` owns what every protocol a shard speaks shares: the float32 slice, the
update rule's state, the version (applied pushes), the counters :meth:`~ShardSlice.stats`
shows, input checks, and saving and restoring all of it. The protocols are subclasses:
:class:`~distbelief.ps.pushfetch.PushFetch` (Downpour) and
:class:`~distbelief.ps.vectors.VectorStore` (Sandblaster); :class:`~distbelief.ps.shard.
ShardCore` composes them.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import numpy as np

from distbelief.checkpoint import save_arrays
from distbelief.ps.average import AverageSpec, ParamAverage
from distbelief.ps.buffers import BufferAverage
from distbelief.ps.codec import all_finite
from distbelief.ps.ledger import PushId, PushLedger
from distbelief.ps.optim import Rule
from distbelief.ps.staleness import FetchedCopies, StalenessControl
from distbelief.ps.sync import SyncAggregator

ACCEPTED_DTYPES = (np.float32,)


class ShardSlice:
    """State of one shard: parameters (float32, shape ``(n,)``), rule state, version, stats.

    ``version`` counts applied pushes (with ``--backup-workers``, synchronous updates).
    Staleness of a push is the shard's version when it is applied minus the version the
    pushing replica last fetched. Every change of ``version`` wakes :meth:`wait_version`.
    """

    def __init__(self, shard_id: int, init: np.ndarray, rule: Rule) -> None:
        self._moved = threading.Condition()  # notified whenever the version changes
        self.shard_id = shard_id
        self.params = np.array(init, dtype=np.float32, copy=True).reshape(-1)
        self.rule = rule
        self.state = rule.init_state(self.params.size)
        self.version = 0
        self.fetches = 0
        self.rejected: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.pushes_by_replica: Counter[int] = Counter()
        self.buffers: BufferAverage | None = None  # the model's buffers (shard 0 only)
        self.average: ParamAverage | None = None  # --average
        self.buffer_reports = 0
        self.control = StalenessControl()  # --staleness-lr, --delay-compensation: off
        self.fetched: FetchedCopies | None = None  # each replica's last fetch (DC-ASGD)
        self.ledger = PushLedger()  # pushes taken, by replica incarnation (ps/ledger.py)
        self.sync: SyncAggregator | None = None  # --backup-workers: synchronous updates
        self.push_s, self.pushes_timed = 0.0, 0  # see timings()

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        with self._moved:
            self._version = value
            self._moved.notify_all()

    def wait_version(self, version: int, timeout: float) -> int:
        """Block until this shard's version is past ``version``, or ``timeout`` seconds;
        the version then (a replica of a synchronous run waits here between its push and its
        next fetch; on the actor this runs beside the pushes, see ``ParameterShard``)."""
        with self._moved:
            self._moved.wait_for(lambda: self._version > version, timeout)
            return self._version

    def keep_sync(self, quorum: int | None, end: int | None = None) -> None:
        """``--backup-workers``: apply the mean of each ``quorum`` gradients of the current
        version once, until version ``end`` (:class:`~distbelief.ps.sync.SyncAggregator`);
        None: asynchronous."""
        self.sync = None if quorum is None else SyncAggregator(quorum, self.params.size, end)

    def keep_extras(self, buffers: BufferAverage | None, average: AverageSpec | None,
                    control: StalenessControl | None = None) -> None:
        """Hold the model's buffers (``buffers``: shard 0 of a model that has some), keep
        an average of the slice over updates (``average``: ``--average``), and apply the
        staleness remedies of ``control`` (with delay compensation, keep each replica's last
        fetched slice)."""
        self.buffers = buffers
        self.average = None if average is None else ParamAverage(average, self.params)
        self.control = control or StalenessControl()
        self.fetched = FetchedCopies(self.params.size) if self.control.dc_lambda > 0 else None

    def applied(self, report: object = None) -> None:
        """After an update: fold it into the average, and a replica's buffer ``report``
        (statistics, count deltas) into the buffers if it is well formed."""
        if self.average is not None:
            self.average.update(self.params)
        self.fold(report)

    def fold(self, report: object) -> None:
        """Fold a replica's buffer ``report`` into the buffers if it is well formed."""
        if report is not None and self.buffers is not None and self.buffers.check(report):
            self.buffers.report(*report)
            self.buffer_reports += 1

    def noted(self, pid: PushId | None, applied: bool) -> None:
        """Record push ``pid`` (if it has an id) in the ledger as applied or rejected."""
        if pid is not None:
            self.ledger.record(pid, applied)

    def check(self, grad: object) -> str | None:
        """Why ``grad`` may not be applied to the whole slice, or None if it may."""
        return self.check_shape(grad, self.params.shape)

    def check_shape(self, grad: object, shape: tuple[int, ...],
                    dtypes: tuple = ACCEPTED_DTYPES) -> str | None:
        """Why ``grad`` is not a finite array of ``shape`` and one of ``dtypes``, or None.

        Finiteness is checked here for float dtypes; bfloat16 bits after widening.
        """
        if not isinstance(grad, np.ndarray):
            return "type"
        if grad.dtype not in dtypes:
            return "dtype"
        if grad.shape != tuple(shape):
            return "shape"
        if grad.dtype.kind == "f" and not all_finite(grad):
            return "nonfinite"
        return None

    # Ranged access: a model partition or an embedding lookup touches only some elements.
    # ``ranges`` are half-open (start, stop) pairs in this shard's coordinates.

    def _checked_index(self, ranges: list[tuple[int, int]], values: object) -> np.ndarray | None:
        """The element index of ``ranges`` if they lie in the slice and ``values`` is a finite
        float array of matching length; else None, with the reason counted as a rejection."""
        try:
            index = self._index(ranges)
        except ValueError:
            self.rejected["range"] += 1
            return None
        reason = self.check_shape(values, (index.size,))
        if reason is not None:
            self.rejected[reason] += 1
            return None
        return index

    def _index(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        n = self.params.size
        if any(not (0 <= lo <= hi <= n) for lo, hi in ranges):
            raise ValueError(f"a range falls outside 0..{n}")
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(lo, hi) for lo, hi in ranges])

    def save(self, path: str, vectors: tuple[str, ...] = ()) -> int:
        """Write parameters, rule state, counters and version to ``path`` atomically; the
        version. ``vectors`` names Sandblaster vectors to include too (as ``vec:NAME``)."""
        save_arrays(path, self._saved_arrays(vectors),
                    {"version": str(self.version), "shard": str(self.shard_id),
                     "counters": json.dumps(self.counters())})
        return self.version

    def counters(self) -> dict:
        """The counters a checkpoint keeps (JSON-ready), the push ledger among them."""
        return {"fetches": self.fetches, "rejected": dict(self.rejected),
                "pushes_by_replica": {str(k): v for k, v in self.pushes_by_replica.items()},
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "ledger": self.ledger.to_json(), "buffer_reports": self.buffer_reports,
                **({} if self.sync is None else {"sync": self.sync.counters()})}

    def snapshot(self) -> dict:
        """A copy of everything :meth:`save` writes, as :meth:`restore` takes it (``arrays``,
        ``version``, ``counters``): a standby started from it is bit-equal to this shard."""
        return {"arrays": {k: v.copy() for k, v in self._saved_arrays(()).items()},
                "version": self.version, "counters": self.counters()}

    def _saved_arrays(self, vectors: tuple[str, ...]) -> dict[str, np.ndarray]:
        """What :meth:`save` writes: the slice and rule state (a protocol may add arrays)."""
        extras = {} if self.buffers is None else self.buffers.arrays()
        if self.average is not None:
            extras |= self.average.arrays()
        return {"params": self.params, **self.state, **extras}

    def restore(self, arrays: dict[str, np.ndarray], version: int,
                counters: dict | None = None) -> None:
        """Load what :meth:`save` wrote (already validated by the caller): the slice, rule
        state, version and, if given, the counters :meth:`stats` shows."""
        np.copyto(self.params, arrays["params"])
        for name in self.state:
            np.copyto(self.state[name], arrays[name])
        self.version = int(version)
        if self.buffers is not None:
            self.buffers.restore(arrays)
        if self.average is not None:
            self.average.restore(arrays, self.params)
        if counters:
            self.fetches = int(counters.get("fetches", 0))
            self.rejected = Counter(counters.get("rejected", {}))
            self.pushes_by_replica = Counter({int(k): v for k, v in
                                              counters.get("pushes_by_replica", {}).items()})
            self.staleness = Counter({int(k): v for k, v in
                                      counters.get("staleness", {}).items()})
            self.ledger = PushLedger(counters.get("ledger"))
            self.buffer_reports = int(counters.get("buffer_reports", 0))
            if self.sync is not None:
                self.sync.restore(counters.get("sync"))

    def timings(self) -> dict:
        """Seconds spent inside whole-slice pushes (checks, decoding, the update rule:
        what the shard itself adds to Ray's cost of a call) and how many pushes that covers,
        applied or not. Not part of :meth:`stats`: it differs between copies of one state."""
        return {"push_s": self.push_s, "pushes": self.pushes_timed}

    def stats(self) -> dict:
        """JSON-ready counters: updates, fetches, rejections by reason, staleness histogram."""
        return {
            "shard": self.shard_id,
            "size": int(self.params.size),
            "version": self.version,
            "updates": self.version,
            "fetches": self.fetches,
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "pushes_by_replica": {str(k): v for k, v in sorted(self.pushes_by_replica.items())},
            "buffer_reports": self.buffer_reports,
            "fetched_copies_bytes": 0 if self.fetched is None else self.fetched.nbytes(),
            "ledger": self.ledger.to_json(),
            **({} if self.sync is None else {"sync": self.sync.counters()}),
        }
