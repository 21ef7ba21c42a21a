"""The server shards of one run: start, probe, revive from the newest checkpoint, save, stats.

A :class:`ShardGroup` owns one kind of shard actor by index (the dense parameter shards, or
the embedding row shards of :mod:`distbelief.sparse.group`). Clients never share its list:
they ask :meth:`ShardGroup.handles` for the current handles, and a replica restarted after
a shard died gets the restarted shard's handle. A restarted shard resumes from the newest
checkpoint the run wrote (or the one it resumed from), otherwise from its initial state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import ray

from distbelief.checkpoint import shard_file
from distbelief.errors import UserError

if TYPE_CHECKING:
    from distbelief.job import Job

MAX_SHARD_RESTARTS = 3  # per shard, before the run fails
PROBE_TIMEOUT_S = 30  # a shard that answers nothing for this long is busy, not dead

T = TypeVar("T")
Spawn = Callable[[int, dict | None], ray.actor.ActorHandle]  # shard i from a restore point
Read = Callable[[Path, int, int], dict]  # (run folder, checkpoint number, i) -> restore point
RejectionError = Callable[[list[dict], int], str | None]  # (stats, max_rejected) -> message


def dead_shards(shards: Sequence[ray.actor.ActorHandle]) -> list[int]:
    """Indices of the shard actors in ``shards`` that died (a busy one counts as alive)."""
    dead = []
    for i, shard in enumerate(shards):
        try:
            ray.get(shard.stats.remote(), timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            dead.append(i)
        except ray.exceptions.GetTimeoutError:
            pass  # alive, only busy
    return dead


def rejection_error(stats: list[dict], max_rejected: int) -> str | None:
    """Why a run must stop, if the dense shards (their ``stats``) rejected more than
    ``max_rejected`` pushes in all."""
    rejected = sum(s["rejected_total"] for s in stats)
    if rejected <= max_rejected:
        return None
    reasons = sum((Counter(s["rejected"]) for s in stats), Counter())
    return (f"the shards rejected {rejected} pushes ({dict(reasons)}), more than "
            f"--max-rejected {max_rejected}: the model produces NaN/inf or misshaped "
            "gradients; lower --lr or fix the model (the last checkpoint is untouched)")


class ShardSet:
    """What a driver asks of its run's shards. ``revives``: a call that meets a dead shard
    revives it and is made again (Downpour); otherwise the error propagates (Sandblaster).
    """

    def __init__(self, revives: bool) -> None:
        self.revives = revives

    def handles(self) -> list[ray.actor.ActorHandle]:
        """The dense shards' current actor handles, in shard order (a new list)."""
        raise NotImplementedError

    def revive(self) -> list[int]:
        """Restart every dead shard from its restore point; the restarted indices."""
        raise NotImplementedError

    def retry(self, call: Callable[[], T]) -> T:
        """``call()``, which talks to the shards; if a shard died, revive it and call again."""
        while True:
            try:
                return call()
            except ray.exceptions.RayActorError:
                if not (self.revives and self.revive()):
                    raise

    def stats(self) -> list[dict]:
        """The dense shards' statistics (each has ``node``, ``version``, ``rejected_total``)."""
        raise NotImplementedError

    def check_rejections(self, max_rejected: int) -> None:
        """Raise :class:`UserError` once the shards rejected more than ``max_rejected``
        pushes (the run stops, its last checkpoint untouched)."""
        raise NotImplementedError

    def save(self, run_dir: Path, number: int, vectors: tuple[str, ...] = ()
             ) -> tuple[list[int], dict]:
        """Every shard writes its files of checkpoint ``number`` (with the named Sandblaster
        ``vectors``); the dense shards' versions and extra manifest fields."""
        raise NotImplementedError

    def saved(self, run_dir: Path, number: int) -> None:
        """Checkpoint ``number`` is complete: shards that die from now on restart from it."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


class ShardGroup(ShardSet):
    """``count`` shard actors of one ``role`` ("shard", "rowshard": their actor and file
    names), each started by ``spawn(i, restore_point)``; ``read(run_dir, number, i)`` reads
    shard i's restore point from a checkpoint. ``label`` names the shards in messages and
    events (``"row shard"``: ``row_shard_failed``); ``rejections`` turns their statistics
    into the error that stops a run.
    """

    def __init__(self, job: Job, role: str, count: int, spawn: Spawn, read: Read,
                 revives: bool, label: str = "shard",
                 rejections: RejectionError = rejection_error) -> None:
        super().__init__(revives)
        self.job = job
        self.role = role
        self.count = count
        self.label = label
        self._spawn = spawn
        self._read = read
        self._rejections = rejections
        self._handles: list[ray.actor.ActorHandle] = []
        self.restarts = [0] * count
        self._source: tuple[Path, int] | None = None  # the checkpoint restarts read

    def start(self, restored: Sequence[dict | None] | None = None,
              source: tuple[Path, int] | None = None) -> ShardGroup:
        """Start every shard from ``restored[i]`` (None: initial); ``source`` is the
        checkpoint (run folder, number) these came from, None for the initial state."""
        restored = restored if restored is not None else [None] * self.count
        self._handles = [self._spawn(i, restored[i]) for i in range(self.count)]
        self._source = source
        return self

    def handles(self) -> list[ray.actor.ActorHandle]:
        return list(self._handles)

    def probe(self) -> list[int]:
        """The shards that died."""
        return dead_shards(self._handles)

    def restore_point(self, i: int) -> tuple[dict | None, int | None]:
        """What shard ``i`` restarts from (None: its initial state) and that checkpoint's
        number."""
        if self._source is None:
            return None, None
        run_dir, number = self._source
        return self._read(run_dir, number, i), number

    def revive(self) -> list[int]:
        dead = self.probe()
        for i in dead:
            self.job.log(f"{self.event}_failed", shard=i, restarts=self.restarts[i] + 1)
            self.revive_one(i)
        return dead

    @property
    def event(self) -> str:
        return self.label.replace(" ", "_")

    def revive_one(self, i: int) -> None:
        """Restart dead shard ``i`` from its restore point (counted, up to the limit)."""
        self.restarts[i] += 1
        if self.restarts[i] > MAX_SHARD_RESTARTS:
            raise RuntimeError(f"{self.label} {i} died more than {MAX_SHARD_RESTARTS} "
                               f"times; see the run's {self.event}_failed events")
        restored, number = self.restore_point(i)
        ray.kill(self._handles[i])
        self._handles[i] = self._spawn(i, restored)
        version = ray.get(self._handles[i].stats.remote())["version"]
        self.job.log(f"{self.event}_restored", shard=i, checkpoint=number, version=version)

    def stats(self) -> list[dict]:
        return ray.get([s.stats.remote() for s in self._handles])

    def check_rejections(self, max_rejected: int) -> None:
        error = self._rejections(self.stats(), max_rejected)
        if error is not None:
            raise UserError(error)

    def write(self, run_dir: Path, number: int, vectors: tuple[str, ...] = ()) -> list[int]:
        """Every shard writes its file of checkpoint ``number``; their versions (no retry)."""
        more = (vectors,) if vectors else ()
        return ray.get([s.save.remote(str(shard_file(run_dir, number, i, self.role)), *more)
                        for i, s in enumerate(self._handles)])

    def save(self, run_dir: Path, number: int, vectors: tuple[str, ...] = ()
             ) -> tuple[list[int], dict]:
        return self.retry(lambda: self.write(run_dir, number, vectors)), {}

    def saved(self, run_dir: Path, number: int) -> None:
        self._source = (run_dir, number)

    def kill(self) -> None:
        for shard in self._handles:
            ray.kill(shard)
