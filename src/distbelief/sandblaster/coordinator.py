"""Sandblaster's coordinator: L-BFGS over vectors on the shards, portions over replicas.

The coordinator holds no parameter or gradient vector. :class:`ShardVectorSpace` turns each
L-BFGS vector command into one call per shard and sums the partial dot products it gets
back (scalars only). Each loss-and-gradient evaluation is a *batch*: the training set is cut
into many portions, handed out by :class:`~distbelief.sandblaster.schedule.PortionScheduler`
as replicas become free, with backup copies near the end. A replica keeps the gradient sums
of its accepted portions and stages them on the shards every ``portions_per_push``
portions; the coordinator commits a staged tag into the batch's gradient, so every portion
counts exactly once. Portions whose gradient is lost (a replica died, or is still busy
when the rest is done) are recomputed in a follow-up round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from distbelief.sandblaster.schedule import PortionScheduler, portion_bounds

PIPELINE = 2  # portions queued on a replica at once, so it never waits for the coordinator


class ShardVectorSpace:
    """The L-BFGS ``VectorSpace`` over shard actors; counts what comes back to the caller."""

    def __init__(self, shards: list) -> None:
        self.shards = list(shards)
        self._pending: list[ray.ObjectRef] = []
        self.calls = 0
        self.scalars_received = 0
        self.received_types: set[type] = set()

    def _all(self, method: str, *args) -> None:
        self.calls += 1
        self._pending += [getattr(s, method).remote(*args) for s in self.shards]

    def sync(self) -> None:
        """Wait until every command sent so far has been applied on every shard."""
        if self._pending:
            ray.get(self._pending)
            self._pending = []

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        self.calls += 1
        parts = ray.get([s.dots.remote(pairs) for s in self.shards])
        for part in parts:
            self.received_types.update(type(v) for v in part)
            self.scalars_received += len(part)
        return [float(sum(column)) for column in zip(*parts)]

    def axpy(self, alpha: float, x: str, y: str) -> None:
        self._all("axpy", alpha, x, y)

    def scale(self, alpha: float, x: str) -> None:
        self._all("scale", alpha, x)

    def copy(self, src: str, dst: str) -> None:
        self._all("copy", src, dst)

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        self._all("lincomb", dst, terms)

    def commit(self, tag: str, into: str) -> None:
        self._all("commit", tag, into)

    def abort(self, tags: list[str]) -> None:
        self._all("abort", tags)


@dataclass
class BatchStats:
    """What one batch (one evaluation) took: portions per replica, backups, rounds, seconds."""

    batch: int
    portions_by_replica: dict[int, int] = field(default_factory=dict)
    backups: int = 0
    duplicates: int = 0
    rounds: int = 0
    recomputed: int = 0
    failures: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    compute_s: dict[int, float] = field(default_factory=dict)  # replica time in compute
    fetch_s: dict[int, float] = field(default_factory=dict)  # replica time fetching vectors


class PortionRunner:
    """Runs batches of portions over replica actors (restarting those that die).

    ``start_replica(i)`` creates replica ``i``'s actor. ``portions`` is the number of
    portions per batch; ``backups`` turns backup copies on; ``portions_per_push`` is how
    many accepted portions a replica accumulates before staging them on the shards.
    """

    def __init__(self, space: ShardVectorSpace, start_replica: Callable[[int], object],
                 replicas: int, n_rows: int, portions: int, portions_per_push: int,
                 backups: bool = True, max_restarts: int = 3) -> None:
        self.space = space
        self.start_replica = start_replica
        self.replicas = {i: start_replica(i) for i in range(replicas)}
        self.bounds = portion_bounds(n_rows, portions)
        self.k = portions_per_push
        self.backups = backups
        self.max_restarts = max_restarts
        self.restarts = dict.fromkeys(range(replicas), 0)
        self.batch = 0
        self.inflight: dict[ray.ObjectRef, tuple] = {}  # ref -> (kind, replica, batch, data)
        self.history: list[BatchStats] = []
        self.portion_s: dict[int, float] = {}  # replica busy seconds per portion (moving avg)

    def run(self, vector: str, grad: str) -> float:
        """Loss summed over all rows at ``vector``; the gradient sum is committed to ``grad``."""
        began = time.perf_counter()
        self.batch += 1
        stats = BatchStats(self.batch)
        self.space.lincomb(grad, [])  # zero the batch's gradient vector on every shard
        self.space.sync()
        losses: dict[int, float] = {}
        todo = list(range(len(self.bounds)))
        while todo:
            stats.rounds += 1
            lost = self._round(todo, vector, grad, losses, stats)
            stats.recomputed += len(lost)
            todo = lost
        stats.wall_s = time.perf_counter() - began
        self.history.append(stats)
        return sum(losses.values())

    def _round(self, todo: list[int], vector: str, grad: str, losses: dict[int, float],
               stats: BatchStats) -> list[int]:
        alive = sorted(self.replicas)
        sched = PortionScheduler(alive, n_portions=len(todo),
                                 max_copies=2 if self.backups else 1)
        verdicts: dict[int, list] = {r: [] for r in alive}  # decisions not yet delivered
        held: dict[int, list[int]] = {r: [] for r in alive}  # accepted, not yet committed
        lost: list[int] = []
        here = (self.batch, stats.rounds)
        seq = [0]

        def push(r: int) -> None:
            seq[0] += 1
            tag = f"{self.batch}.{stats.rounds}.{r}.{seq[0]}"
            ref = self.replicas[r].push.remote(self.batch, tag, verdicts[r])
            self.inflight[ref] = ("push", r, here, (tag, list(held[r]), time.perf_counter()))
            verdicts[r] = []

        def dispatch(r: int) -> None:
            """Keep replica r busy: up to PIPELINE portions queued, pushes when due."""
            if r not in self.replicas or self._pushing(r):
                return
            if held[r] and (len(held[r]) >= self.k or not sched.has_fresh):
                push(r)
                return
            while self._computing(r) < self._depth(r):
                local = sched.assign(r)
                if local is None:
                    return
                start(r, local)

        def start(r: int, local: int) -> None:
            portion = todo[local]
            lo, hi = self.bounds[portion]
            ref = self.replicas[r].compute.remote(self.batch, vector, portion, lo, hi,
                                                  verdicts[r])
            self.inflight[ref] = ("compute", r, here, (local, portion))
            verdicts[r] = []

        for r in alive:  # one portion each first: a static split gives one block per replica
            if r in self.replicas and not self._computing(r) and not self._pushing(r):
                local = sched.assign(r)
                if local is not None:
                    start(r, local)
        while not (sched.done and not any(held.values()) and not self._pushing()):
            if sched.done:
                self._give_up_stragglers(held, lost, push)
            for r in list(self.replicas):
                dispatch(r)
            if not self.inflight:
                raise RuntimeError("no Sandblaster replica is left to compute portions")
            [ref], _ = ray.wait(list(self.inflight), num_returns=1)
            kind, r, when, data = self.inflight.pop(ref)
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayActorError:
                stats.failures.append(r)
                if when == here and r in sched.replicas:
                    sched.fail(r)
                lost += held.get(r, [])
                held[r], verdicts[r] = [], []
                for other, info in list(self.inflight.items()):
                    if info[1] == r:  # the dead actor's other calls fail too: forget them
                        del self.inflight[other]
                        if info[0] == "push":
                            self.space.abort([info[3][0]])
                if kind == "push":
                    self.space.abort([data[0]])
                self._restart(r, sched)
                continue
            if when != here:
                continue  # a straggler's answer from an earlier round or batch
            if kind == "compute":
                local, portion = data
                self._observe(r, reply["busy_s"])
                stats.compute_s[r] = stats.compute_s.get(r, 0.0) + reply["compute_s"]
                stats.fetch_s[r] = stats.fetch_s.get(r, 0.0) + reply["fetch_s"]
                first = sched.complete(r, local)
                verdicts[r].append((portion, first))
                if first:
                    losses[portion] = reply["loss_sum"]
                    held[r].append(portion)
            else:
                tag, expected, _ = data
                if sorted(reply) != sorted(expected):
                    raise RuntimeError(f"replica {r} staged {reply}, expected {expected}")
                self.space.commit(tag, grad)
                held[r] = [p for p in held[r] if p not in reply]
        self.space.sync()
        for r, n in sched.portions_done.items():
            stats.portions_by_replica[r] = stats.portions_by_replica.get(r, 0) + n
        stats.backups += sched.backups_issued
        stats.duplicates += sched.duplicates_discarded
        return lost

    def _give_up_stragglers(self, held: dict[int, list[int]], lost: list[int], push) -> None:
        """Every portion has a result; replicas still computing (duplicates now) hold others.

        For each such replica, either queue its push behind its current work (if that work
        should end sooner than recomputing its portions on the fastest replica), or give its
        portions up to the next round and tell it to forget them.
        """
        fastest = min(self.portion_s.values(), default=0.0)
        for r in held:
            if not held[r] or not self._computing(r) or self._pushing(r):
                continue
            wait = self._computing(r) * self.portion_s.get(r, fastest)
            if wait <= fastest * len(held[r]):
                push(r)
            else:
                lost += held[r]
                held[r] = []
                self.replicas[r].discard.remote()

    def _depth(self, r: int) -> int:
        """Portions to queue on replica r: PIPELINE once it has shown it is not a straggler."""
        mine, fastest = self.portion_s.get(r), min(self.portion_s.values(), default=None)
        return PIPELINE if mine is not None and mine <= 2 * fastest else 1

    def _observe(self, r: int, seconds: float) -> None:
        """Track each replica's time per portion (exponential moving average)."""
        old = self.portion_s.get(r)
        self.portion_s[r] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def _computing(self, r: int) -> int:
        return sum(info[0] == "compute" and info[1] == r for info in self.inflight.values())

    def _pushing(self, r: int | None = None) -> bool:
        return any(info[0] == "push" and r in (None, info[1]) for info in self.inflight.values())

    def _restart(self, r: int, sched: PortionScheduler) -> None:
        self.restarts[r] += 1
        if self.restarts[r] > self.max_restarts:
            self.replicas.pop(r, None)
            if not self.replicas:
                raise RuntimeError("every Sandblaster replica died")
            return
        self.replicas[r] = self.start_replica(r)
        if r in sched.replicas:
            sched.revive(r)
