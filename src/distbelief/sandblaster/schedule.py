"""Sandblaster's portion scheduler: dynamic assignment and backup tasks (pure, event-driven).

A batch is cut into many more portions than there are replicas (`PORTIONS_PER_REPLICA` each
by default). Whenever a replica becomes free the coordinator calls `PortionScheduler.assign`:
it hands out the next unassigned portion, so fast replicas do more. Once none is left, an idle
replica gets a backup copy of an unfinished portion (fewest copies first, then the one running
longest) and whichever copy reports first is used: `PortionScheduler.complete` returns True
exactly once per portion. A failed replica's portions go back to the queue. The scheduler has
no threads and reads no clock; the order of calls is its only time, so "running longest" means
"assigned earliest".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from distbelief.config import PORTIONS_PER_REPLICA


def portion_bounds(n_samples: int, n_portions: int) -> list[tuple[int, int]]:
    """Cut samples ``0 .. n_samples - 1`` into ``n_portions`` contiguous half-open ranges
    ``(start, stop)``, in order, whose sizes differ by at most one (larger ones first)."""
    if not 1 <= n_portions <= n_samples:
        raise ValueError(f"need 1 <= n_portions <= n_samples, got {n_portions}, {n_samples}")
    size, extra = divmod(n_samples, n_portions)
    bounds, start = [], 0
    for portion in range(n_portions):
        stop = start + size + (portion < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def static_plan(n_portions: int, replicas: int) -> list[list[int]]:
    """The equal split Sandblaster improves on: replica ``r`` computes the portions in
    ``plan[r]``, one contiguous block each, block sizes differing by at most one."""
    return [list(range(start, stop)) for start, stop in portion_bounds(n_portions, replicas)]


class PortionScheduler:
    """Which replica computes which portion of one batch; build a new one per batch.

    ``replicas`` is a count (ids ``0 .. replicas - 1``) or the ids themselves;
    ``n_portions`` defaults to `PORTIONS_PER_REPLICA` per replica. ``max_copies`` caps the
    copies of a portion running at once (1 turns backup tasks off). Counters:
    ``portions_done[r]`` (results of replica r that were used), ``backups_issued`` and
    ``duplicates_discarded``.
    """

    def __init__(
        self, replicas: int | Iterable[int], n_portions: int | None = None, max_copies: int = 2
    ) -> None:
        self.replicas = tuple(range(replicas)) if isinstance(replicas, int) else tuple(replicas)
        if not self.replicas:
            raise ValueError("need at least one replica")
        self.n_portions = (
            PORTIONS_PER_REPLICA * len(self.replicas) if n_portions is None else n_portions
        )
        if self.n_portions < 1:
            raise ValueError(f"need at least one portion, got {self.n_portions}")
        if max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {max_copies}")
        self.max_copies = max_copies
        self._queue = deque(range(self.n_portions))  # unassigned; may hold done ones, skipped
        self._copies: dict[int, dict[int, int]] = {}  # unfinished portion -> {replica: order}
        self._running: dict[int, set[int]] = {r: set() for r in self.replicas}
        self._done = [False] * self.n_portions
        self._alive = set(self.replicas)
        self._order = 0  # assignments so far: the scheduler's clock
        self.completed = 0
        self.portions_done = dict.fromkeys(self.replicas, 0)
        self.backups_issued = 0
        self.duplicates_discarded = 0

    @property
    def done(self) -> bool:
        """Whether every portion has a result."""
        return self.completed == self.n_portions

    @property
    def has_fresh(self) -> bool:
        """Whether unassigned portions remain (never started, or requeued after a failure)."""
        return any(not self._done[p] for p in self._queue)

    def assign(self, replica: int) -> int | None:
        """A portion for ``replica`` to compute, or None when there is nothing for it.

        Fresh portions come first. When none is left and ``replica`` is idle (computing
        nothing, so it can never get a second copy of its own portion), it gets a backup copy
        of an unfinished portion with fewer than ``max_copies`` copies: fewest copies first,
        then the one assigned earliest.
        """
        self._check_alive(replica)
        while self._queue:
            portion = self._queue.popleft()
            if not self._done[portion]:
                return self._start(replica, portion)
        if self._running[replica]:
            return None
        candidates = [p for p, copies in self._copies.items() if len(copies) < self.max_copies]
        if not candidates:
            return None
        portion = min(
            candidates, key=lambda p: (len(self._copies[p]), min(self._copies[p].values()))
        )
        self.backups_issued += 1
        return self._start(replica, portion)

    def complete(self, replica: int, portion: int) -> bool:
        """Record that ``replica`` finished ``portion``; True if this is the first result (use
        it), False for a duplicate (discard it). A late result from a replica already declared
        failed still counts if it is the first."""
        if replica not in self._running:
            raise ValueError(f"unknown replica {replica}")
        if not 0 <= portion < self.n_portions:
            raise ValueError(f"portion {portion} out of range 0..{self.n_portions - 1}")
        self._running[replica].discard(portion)
        if self._done[portion]:
            self.duplicates_discarded += 1
            return False
        self._done[portion] = True
        self._copies.pop(portion, None)
        self.completed += 1
        self.portions_done[replica] += 1
        return True

    def fail(self, replica: int) -> list[int]:
        """Mark ``replica`` dead; its unfinished portions that no other replica is running go
        back to the front of the queue, and are returned. Failing a dead replica does nothing."""
        if replica not in self._alive:
            return []
        self._alive.discard(replica)
        requeued = []
        for portion in sorted(self._running[replica]):
            copies = self._copies.get(portion)
            if copies is None:
                continue
            del copies[replica]
            if not copies:
                del self._copies[portion]
                requeued.append(portion)
        self._running[replica].clear()
        self._queue.extendleft(reversed(requeued))
        return requeued

    def revive(self, replica: int) -> None:
        """Let a restarted ``replica`` take portions again."""
        if replica not in self._running:
            raise ValueError(f"unknown replica {replica}")
        self._alive.add(replica)

    def _start(self, replica: int, portion: int) -> int:
        self._copies.setdefault(portion, {})[replica] = self._order
        self._order += 1
        self._running[replica].add(portion)
        return portion

    def _check_alive(self, replica: int) -> None:
        if replica not in self._alive:
            state = "failed" if replica in self._running else "unknown"
            raise ValueError(f"replica {replica} is {state}")
