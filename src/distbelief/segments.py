"""Downpour's replicas as the driver sees them: segments of steps, and restarts.

:class:`SegmentSchedule` (pure) says which replica runs its next segment and for how many
steps: during warm-start replica 0 runs alone up to ``warmstart_steps``, then every replica
runs up to ``steps``; with ``max_staleness`` K (SSP, Ho et al. 2013) a segment ends before
any step s its replica may not start yet: step s starts once every live replica has done at
least s - K steps (K = 0: lockstep). :class:`Replicas` holds the replica actors by index and
restarts one that dies at the step it had reached, up to ``max_restarts`` times, then drops
it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import ray

from distbelief.job import Job
from distbelief.ps.group import ShardSet

Start = Callable[[int, int, int], ray.actor.ActorHandle]  # replica i at a step, incarnation


class SegmentSchedule:
    """Segments of at most ``segment_steps`` steps; ``done`` is each replica's step count so
    far (a resumed run's counts, or zeros)."""

    def __init__(self, steps: int, warmstart_steps: int, segment_steps: int,
                 done: dict[int, int], max_staleness: int | None = None) -> None:
        self.steps = steps
        self.warmstart_steps = warmstart_steps
        self.segment_steps = segment_steps
        self.done = dict(done)
        self.warm = self.done[0] < warmstart_steps
        self.max_staleness = max_staleness
        self.live = set(self.done)  # replicas the bound waits for (dropped ones leave)

    def first(self, replicas: Iterable[int]) -> list[int]:
        """The replicas that get a segment at the start: replica 0 alone while warm."""
        return [0] if self.warm else list(replicas)

    def segment(self, i: int) -> int:
        """Steps of replica ``i``'s next segment; 0 when it has none (for now)."""
        limit = self.warmstart_steps if self.warm else self.steps
        n = min(self.segment_steps, limit - self.done[i])
        if self.max_staleness is not None and not self.warm:
            slowest = min(self.done[j] for j in self.live)
            n = min(n, slowest + self.max_staleness + 1 - self.done[i])
        return max(n, 0)

    def returned(self, i: int, step: int, replicas: Iterable[int]) -> tuple[list[int], bool]:
        """Replica ``i`` has now done ``step`` steps: the replicas among ``replicas`` to hand
        a segment next, and whether warm-start ended here."""
        self.done[i] = step
        if self.warm and self.done[0] >= self.warmstart_steps:
            self.warm = False
            return [j for j in replicas if self.done[j] < self.steps], True
        if self.max_staleness is not None and not self.warm:  # it may unblock others
            return [j for j in replicas if self.done[j] < self.steps], False
        return [i], False

    def drop(self, i: int) -> None:
        """Replica ``i`` was dropped: the staleness bound no longer waits for it."""
        self.live.discard(i)

    def replica_steps(self) -> dict[str, int]:
        """Each replica's step count, as a checkpoint's manifest records it."""
        return {str(k): v for k, v in self.done.items()}


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
