"""Downpour's replicas as the driver sees them: the run's work, segments of it, and restarts.

:class:`WorkPool` (pure) holds the run's fixed work in mini-batches: for each data *slot* (a
replica index at the run's start: slot s reads the rows ``ReplicaSampler(slot=s,
replicas=slots)`` picks), the steps still to run, as ranges. Each replica (a *worker*) runs
segments of at most ``segment_steps`` steps from its own queue of ranges; at the start
replica i holds slot i's steps. A worker removed gives its queue back for the others to
take; a worker added while the run goes on (and, once the run has been scaled, any idle
worker) takes the back half of the longest queue. An unscaled run thus runs as before. So the run
ends having run every slot's steps once, whatever the replicas did: the samples of an
unchanged run. During warm-start only slot 0's steps below ``warmstart_steps`` are handed
out, one segment at a time. With ``max_staleness`` K (SSP, Ho et al. 2013) a segment ends
before any step its worker may not start yet: a worker's step s (counting the steps it has
run) starts once every live worker has run at least s - K steps (K = 0: lockstep); a worker
added later starts level with the slowest. :class:`Replicas` holds the replica actors by
index, starts new ones, retires them, and restarts one that dies, up to ``max_restarts``
times, then drops it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import ray

from distbelief.job import Job
from distbelief.ps.group import ShardSet

__all__ = ["Range", "Replicas", "Start", "WorkPool"]

Start = Callable[[int, int, int], ray.actor.ActorHandle]  # replica i at a step, incarnation
Range = tuple[int, int, int]  # (slot, start, end): steps start..end-1 of data slot ``slot``


def _steps(ranges: Iterable[Range]) -> int:
    return sum(end - start for _, start, end in ranges)


class WorkPool:
    """The run's unrun steps (see the module docstring). ``remaining``: each slot's unrun
    ``(start, end)`` ranges (a new run: ``{s: [(0, steps)]}``); ``slots`` and ``steps``: the
    run's replicas and steps per replica at its start."""

    def __init__(self, slots: int, steps: int, remaining: Mapping[int, Sequence[Sequence[int]]],
                 segment_steps: int, warmstart_steps: int = 0,
                 max_staleness: int | None = None) -> None:
        self.slots, self.steps, self.segment_steps = slots, steps, segment_steps
        self.max_staleness = max_staleness
        self.ran: dict[int, int] = {}  # steps each worker has run (the SSP bound's clock)
        self.live: set[int] = set()  # workers the bound waits for (removed ones leave)
        self.warmstart_steps = warmstart_steps
        self.free: list[Range] = sorted((int(s), int(a), int(b)) for s, rs in remaining.items()
                                        for a, b in rs if b > a)
        self.queues: dict[int, list[Range]] = {}
        self.running: dict[int, Range] = {}
        self.balance = False  # idle workers take from others' queues (set once scaled)

    @classmethod
    def from_done(cls, slots: int, steps: int, done: Mapping[int, int], segment_steps: int,
                  warmstart_steps: int = 0, max_staleness: int | None = None) -> WorkPool:
        """The pool of a run whose slot s has done its first ``done[s]`` steps (0 if absent)."""
        return cls(slots, steps, {s: [(done.get(s, 0), steps)] for s in range(slots)},
                   segment_steps, warmstart_steps, max_staleness)

    @classmethod
    def resumed(cls, slots: int, steps: int, work: Mapping[str, Sequence[Sequence[int]]],
                saved_steps: int, segment_steps: int, warmstart_steps: int = 0,
                max_staleness: int | None = None) -> WorkPool:
        """The pool of a run resumed from a checkpoint whose ``work`` (:meth:`remaining`) was
        of ``saved_steps`` steps a slot, now run to ``steps``: ranges past the old end are
        added, ranges past the new end cut."""
        more = [(saved_steps, steps)] if steps > saved_steps else []
        return cls(slots, steps, {int(k): [(a, min(b, steps)) for a, b in v if a < steps]
                                  + more for k, v in work.items()},
                   segment_steps, warmstart_steps, max_staleness)

    def assign(self, workers: Iterable[int]) -> None:
        """Workers at the run's start: worker w takes the free ranges of slot w."""
        for w in workers:
            mine = [r for r in self.free if r[0] == w]
            self.queues.setdefault(w, []).extend(mine)
            self.free = [r for r in self.free if r[0] != w]
            self.ran.setdefault(w, self.steps - _steps(mine))
            self.live.add(w)

    def _unrun(self) -> list[Range]:
        return ([r for q in self.queues.values() for r in q] + self.free
                + list(self.running.values()))

    def _warm(self, r: Range) -> bool:
        """Whether range ``r`` holds warm-start steps (slot 0, below ``warmstart_steps``)."""
        return r[0] == 0 and r[1] < self.warmstart_steps

    @property
    def warm(self) -> bool:
        """Whether slot 0 still has steps below ``warmstart_steps`` to run."""
        return any(map(self._warm, self._unrun()))

    def left(self) -> int:
        """Steps not run yet (running ones included)."""
        return _steps(self._unrun())

    def idle(self, w: int) -> bool:
        return w not in self.running

    def next(self, w: int) -> Range | None:
        """Worker ``w``'s next segment (now running), or None when there is none for it."""
        if w in self.running:
            raise ValueError(f"worker {w} is already running {self.running[w]}")
        queue = self.queues.setdefault(w, [])
        if w not in self.ran:  # a worker added while the run goes on: level with the slowest
            self.ran[w] = min((self.ran[v] for v in self.live), default=0)
            self.live.add(w)
        if self.warm:
            return self._warm_segment(w, queue)
        cap = self.segment_steps
        if self.max_staleness is not None:  # SSP: at most K steps ahead of the slowest
            cap = min(self.ran[v] for v in self.live) + self.max_staleness + 1 - self.ran[w]
            if cap <= 0:
                return None
        if not queue and self.free:
            queue.append(self.free.pop(0))
        if not queue and (self.balance or w >= self.slots):
            self._steal(w, queue)
        if not queue:
            return None
        return self._cut(w, queue, min(queue[0][2], queue[0][1] + cap))

    def _warm_segment(self, w: int, queue: list[Range]) -> Range | None:
        if any(map(self._warm, self.running.values())):
            return None  # one warm-start segment at a time
        if not any(map(self._warm, queue)):  # take the earliest free one (free is sorted)
            first = next((i for i, r in enumerate(self.free) if self._warm(r)), None)
            if first is not None:
                queue.append(self.free.pop(first))
        ours = [i for i, r in enumerate(queue) if self._warm(r)]
        if not ours:
            return None
        queue.insert(0, queue.pop(min(ours, key=lambda i: queue[i][1])))  # earliest first
        return self._cut(w, queue, min(queue[0][2], self.warmstart_steps))

    def _cut(self, w: int, queue: list[Range], bound: int) -> Range:
        slot, a, b = queue[0]
        end = min(bound, a + self.segment_steps)
        if end == b:
            queue.pop(0)
        else:
            queue[0] = (slot, end, b)
        self.running[w] = (slot, a, end)
        return self.running[w]

    def _steal(self, w: int, queue: list[Range]) -> None:
        """Take the back half of the longest other queue (of at least 2 steps)."""
        victims = [(_steps(q), v) for v, q in self.queues.items() if v != w]
        total, victim = max(victims, key=lambda v: (v[0], -v[1]), default=(0, None))
        if total < 2:
            return
        theirs, want, taken = self.queues[victim], total // 2, []
        while want:
            slot, a, b = theirs.pop()
            k = min(want, b - a)
            taken.insert(0, (slot, b - k, b))
            if k < b - a:
                theirs.append((slot, a, b - k))
            want -= k
        queue.extend(taken)

    def done(self, w: int) -> Range:
        """Worker ``w`` ran its segment; the segment."""
        segment = self.running.pop(w)
        self.ran[w] = self.ran.get(w, 0) + segment[2] - segment[1]
        return segment

    def failed(self, w: int) -> None:
        """Worker ``w`` died in its segment (if any): the segment goes back to the front of
        its queue, to run again."""
        if w in self.running:
            self.queues.setdefault(w, []).insert(0, self.running.pop(w))

    def remove(self, w: int) -> None:
        """Worker ``w`` is gone: its queue (and a segment it died in) is free for others."""
        self.failed(w)
        self.free = sorted(self.free + self.queues.pop(w, []))
        self.live.discard(w)  # the staleness bound no longer waits for it

    def remaining(self) -> dict[str, list[list[int]]]:
        """Each slot's unrun ranges, merged and sorted (a checkpoint manifest's ``work``)."""
        out: dict[str, list[list[int]]] = {str(s): [] for s in range(self.slots)}
        for s, a, b in sorted(self._unrun()):
            ranges = out.setdefault(str(s), [])
            if ranges and ranges[-1][1] == a:
                ranges[-1][1] = b
            else:
                ranges.append([a, b])
        return out

    def replica_steps(self) -> dict[str, int]:
        """Steps run in each slot (a checkpoint manifest's ``replica_steps``)."""
        return {s: self.steps - sum(b - a for a, b in rs)
                for s, rs in self.remaining().items()}


class Replicas:
    """The run's replica actors, started by ``start(i, step, incarnation)`` at the steps
    ``steps``; each start gets a new incarnation (push ids, :mod:`distbelief.ps.ledger`),
    from ``first_incarnation`` on."""

    def __init__(self, job: Job, start: Start, steps: dict[int, int],
                 max_restarts: int, first_incarnation: int = 1) -> None:
        self.job = job
        self._start = start
        self.max_restarts = max_restarts
        self._next = first_incarnation
        self.actors = {i: self._started(i, step) for i, step in steps.items()}
        self.restarts = dict.fromkeys(self.actors, 0)

    def _started(self, i: int, step: int) -> ray.actor.ActorHandle:
        self._next += 1
        return self._start(i, step, self._next - 1)

    def where(self) -> list[str]:
        """The node each replica runs on."""
        return ray.get([r.where.remote() for r in self.actors.values()])

    def failed(self, i: int, step: int, err: Exception, shards: ShardSet) -> bool:
        """Replica ``i`` died (``err``) at ``step``: log it, revive any dead shard it may
        have died of, restart it at ``step``; False when it is dropped instead."""
        self.restarts[i] += 1
        self.job.log("replica_failed", replica=i, step=step, restarts=self.restarts[i],
                     error=type(err).__name__)
        ray.kill(self.actors[i])  # a task error (a dead partition) leaves it up
        if shards.revives:  # it may have died of a dead shard
            shards.revive()
        if self.restarts[i] > self.max_restarts:
            self.actors.pop(i)
            return False
        self.actors[i] = self._started(i, step)
        return True

    def add(self, i: int) -> None:
        """Start a new replica ``i`` (an index never used in this run) at step 0."""
        self.actors[i] = self._started(i, 0)
        self.restarts[i] = 0

    def retire(self, i: int) -> dict:
        """Replica ``i`` pushes what it still holds and stops; its final counters."""
        actor = self.actors.pop(i)
        try:
            return ray.get(actor.finish.remote())
        finally:
            ray.kill(actor)

    def restarted(self) -> bool:
        """Whether any replica was restarted (its counters before dying are lost)."""
        return any(self.restarts.values())

    def finish(self) -> dict[int, dict]:
        """Each live replica pushes what it still holds; their final counters."""
        return dict(zip(self.actors, ray.get([r.finish.remote()
                                              for r in self.actors.values()])))

    def kill(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
