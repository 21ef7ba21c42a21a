"""A shard's Downpour protocol: serve fetches and apply pushes, whole or by flat ranges."""

from __future__ import annotations

import time

import numpy as np

from distbelief.ps.codec import WIRE_DTYPES, all_finite, decode_into
from distbelief.ps.ledger import PushId
from distbelief.ps.optim import Rule
from distbelief.ps.slice import ShardSlice
from distbelief.ps.staleness import compensate

PUSH_DTYPES = tuple(WIRE_DTYPES.values())  # float32, float16, bfloat16 bits (uint16)


class PushFetch(ShardSlice):
    """Fetches of the slice (or ranges of it) and pushes applied by the shard's update rule,
    in the order they arrive."""

    def __init__(self, shard_id: int, init: np.ndarray, rule: Rule) -> None:
        super().__init__(shard_id, init, rule)
        self._wide: np.ndarray | None = None  # float32 scratch for 16-bit pushes
        self._compensated: np.ndarray | None = None  # float32 scratch for DC-ASGD

    def fetch(self, buffers: bool = False, replica: int = -1) -> tuple:
        """Current version and a read-only view of the slice (callers must copy to keep it);
        with ``buffers`` also the model's buffers this shard holds (None if it holds none).
        ``replica``: who fetches (with ``--delay-compensation`` the shard keeps a copy)."""
        self.fetches += 1
        if self.fetched is not None and int(replica) >= 0:  # not the driver's evaluations
            self.fetched.remember(int(replica), self.params)
        view = self.params.view()
        view.flags.writeable = False
        if buffers:
            return self.version, view, None if self.buffers is None else self.buffers.served()
        return self.version, view

    def fetch_buffers(self) -> tuple | None:
        """The model's buffers this shard holds (statistics, counts), or None."""
        return None if self.buffers is None else self.buffers.served()

    def fetch_average(self) -> tuple[int, np.ndarray]:
        """Current version and a copy of the averaged slice (``--average``; the slice itself
        when no average is kept)."""
        values = self.params if self.average is None else self.average.values
        return self.version, values.copy()

    def push(self, grad: np.ndarray, fetched_version: int, replica: int = -1,
             buffers: tuple | None = None, pid: PushId | None = None) -> bool:
        """:meth:`_push`, its time added to :meth:`~distbelief.ps.slice.ShardSlice.timings`."""
        began = time.perf_counter()
        try:
            return self._push(grad, fetched_version, replica, buffers, pid)
        finally:
            self.push_s += time.perf_counter() - began
            self.pushes_timed += 1

    def _push(self, grad: np.ndarray, fetched_version: int, replica: int = -1,
              buffers: tuple | None = None, pid: PushId | None = None) -> bool:
        """Apply ``grad`` unless it is malformed; returns whether it was applied.
        ``buffers``: the replica's buffer report (statistics, count deltas), folded into the
        buffers this shard holds along with an applied push.

        ``grad`` is float32 or a 16-bit wire format of :mod:`distbelief.ps.codec`, widened
        to float32 here (parameters and rule state stay float32). A rejected push changes
        nothing but the rejection counter for its reason (``type``, ``dtype``, ``shape``,
        ``nonfinite``). A push with an id ``pid`` (:mod:`distbelief.ps.ledger`) that this
        shard has taken already is answered as before and not applied again.

        With ``--backup-workers`` (:attr:`sync`) a push is a vote towards the version's
        synchronous update (:meth:`_sync_push`): True if it is counted in, False if it is
        dropped (late, or the replica's second gradient of the version).
        """
        prior = self.ledger.taken(pid) if pid is not None else None
        if prior is not None:
            return prior
        reason = self.check_shape(grad, self.params.shape, PUSH_DTYPES)
        if reason is None and grad.dtype != np.float32:
            if self._wide is None:
                self._wide = np.empty_like(self.params)
            grad = decode_into(grad, self._wide)
            reason = None if all_finite(grad) else "nonfinite"
        if reason is not None:
            self.rejected[reason] += 1
            self.noted(pid, False)
            return False
        stale = self.version - int(fetched_version)
        self.staleness[stale] += 1
        if self.sync is not None:
            return self._sync_push(grad, stale, int(replica), buffers, pid)
        grad = self._compensate(grad, int(replica))
        self.rule.apply(self.params, grad, self.state, update=self.version,
                        scale=self.control.scale(stale))
        self.version += 1
        self.pushes_by_replica[int(replica)] += 1
        self.applied(buffers)
        self.noted(pid, True)
        return True

    def _sync_push(self, grad: np.ndarray, stale: int, replica: int, buffers: tuple | None,
                   pid: PushId | None) -> bool:
        """Count ``grad`` into the current version's sum (its buffer report folded in) or
        drop it; once the quorum is in, apply the sum's mean once and move to the next
        version."""
        taken = self.sync.offer(grad, stale, replica, self.version)
        if taken:
            self.pushes_by_replica[replica] += 1
            self.fold(buffers)
            if self.sync.full():
                self.rule.apply(self.params, self.sync.mean(), self.state, update=self.version)
                self.sync.clear()
                self.version += 1
                self.applied()
        self.noted(pid, taken)
        return taken

    def push_fetch(self, grad: np.ndarray, fetched_version: int, replica: int = -1,
                   buffers: tuple | None = None, pid: PushId | None = None) -> tuple:
        """:meth:`push`, then :meth:`fetch`, in one call: whether ``grad`` was applied, and
        the version and slice after it (one round trip where a replica pushes at the end of
        a step and fetches at the start of the next); with ``buffers`` (a report) also the
        buffers after it."""
        applied = self.push(grad, fetched_version, replica, buffers, pid)
        return (applied, *self.fetch(buffers is not None, replica))

    def _compensate(self, grad: np.ndarray, replica: int) -> np.ndarray:
        """``grad`` with DC-ASGD's correction towards the current slice when the shard keeps
        ``replica``'s last fetch (``--delay-compensation``); else ``grad`` itself."""
        fetched = None if self.fetched is None else self.fetched.get(replica)
        if fetched is None:
            return grad
        if self._compensated is None:
            self._compensated = np.empty_like(self.params)
        return compensate(grad, self.params, fetched, self.control.dc_lambda,
                          self._compensated)

    def push_part(self, grad: np.ndarray, lo: int, fetched_version: int,
                  replica: int = -1, buffers: tuple | None = None,
                  pid: PushId | None = None) -> bool:
        """:meth:`push` of ``grad[lo : lo + size]`` (a 1-D array covering several shards).

        A client puts one gradient in the object store for all shards on a node and each
        shard reads its own part of it, zero-copy; the part is checked as in :meth:`push`.
        """
        if isinstance(grad, np.ndarray) and grad.ndim == 1:
            grad = grad[lo: lo + self.params.size]
        return self.push(grad, fetched_version, replica, buffers, pid)

    def push_part_fetch(self, grad: np.ndarray, lo: int, fetched_version: int,
                        replica: int = -1, buffers: tuple | None = None,
                        pid: PushId | None = None) -> tuple:
        """:meth:`push_part`, then :meth:`fetch`, in one call (:meth:`push_fetch` of one
        object holding every shard's part, as a client on the shards' node sends it)."""
        applied = self.push_part(grad, lo, fetched_version, replica, buffers, pid)
        return (applied, *self.fetch(buffers is not None, replica))

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> tuple[int, np.ndarray]:
        """Current version and the concatenated values of ``ranges`` (a copy)."""
        self.fetches += 1
        index = self._index(ranges)
        return self.version, self.params[index]

    def push_ranges(self, ranges: list[tuple[int, int]], grad: np.ndarray,
                    fetched_version: int, replica: int = -1,
                    pid: PushId | None = None) -> bool:
        """Apply ``grad`` (the concatenated gradient of ``ranges``) to those elements only.

        The update rule and its state see just the touched elements, so Adagrad or
        momentum on a subset equals the dense rule restricted to it; only rules that can
        update gathered elements (``rule.rows_ok``: the NumPy rules) serve ranges, others
        reject the push as ``rule``. Malformed input is
        rejected and counted, as for :meth:`push`; ranges outside the slice count as
        ``range``.
        """
        prior = self.ledger.taken(pid) if pid is not None else None
        if prior is not None:
            return prior
        if not self.rule.rows_ok:
            self.rejected["rule"] += 1
            self.noted(pid, False)
            return False
        index = self._checked_index(ranges, grad)
        if index is None:
            self.noted(pid, False)
            return False
        self.staleness[self.version - int(fetched_version)] += 1
        param = self.params[index]
        state = {k: v[index] for k, v in self.state.items()}
        self.rule.apply(param, grad, state, update=self.version)
        self.params[index] = param
        for k, v in state.items():
            self.state[k][index] = v
        self.version += 1
        self.pushes_by_replica[int(replica)] += 1
        self.applied()
        self.noted(pid, True)
        return True
