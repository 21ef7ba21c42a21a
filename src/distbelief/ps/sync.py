"""Synchronous SGD with backup workers on the same shards (``--backup-workers B``), pure NumPy.

Chen et al. 2016, "Revisiting Distributed Synchronous SGD": with R replicas and B backup
workers, each update of a shard waits for the first Q = R - B gradients computed on its
current version and drops the rest, so a straggler (a slow or dead replica) delays no
update; B = 0 is plain synchronous SGD (every update waits for all R). It is the
synchronous counterpart of Sandblaster's backup tasks.

On a shard (:class:`SyncAggregator`): a push whose fetched version is the shard's current
version is added to a float32 sum and counted, one replica at most once per version (a
restarted replica's second gradient of a version is a ``repeat``, dropped); a push of any
other version is dropped and counted as ``dropped_late`` (the shard's staleness histogram
shows its staleness). Once Q gradients of the version are in, the shard applies their mean
through its update rule once and its version goes up by one. Each shard forms its quorums
on its own, as each variable's accumulator does in TensorFlow's SyncReplicasOptimizer: a
late gradient may make one shard's quorum and miss another's.

On a replica (:class:`~distbelief.ps.host.FlatHost` with ``sync``): after pushing the
gradient of version v it waits until every shard is past v (``wait_version``, served by
the shard actor's ``wait`` concurrency group while pushes keep arriving), then fetches; it
never computes two gradients on one version. The run's length is ``--steps`` synchronous
updates: a replica stops once every shard's version reaches it, and a shard at that version
(the ``end``) takes no more gradients (``after_end``): shards may reach it at slightly
different times, and a replica that fetched one shard at the end and another before it
still pushes to both.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from distbelief.errors import UserError

__all__ = ["SyncAggregator", "check_sync_flags"]

WAIT_S = 1.0  # one wait_version call's timeout; a replica calls again until the shard moves


class SyncAggregator:
    """The gradients of a shard's current version, until ``quorum`` of them are in.

    :meth:`offer` takes a push (its staleness: shard version minus fetched version); when
    :meth:`full`, :meth:`mean` is the update to apply and :meth:`clear` starts the next
    version. Counters: ``accepted`` gradients, ``dropped_late`` by replica, ``repeats``
    (a replica's second gradient of one version), ``after_end`` (gradients offered once the
    shard's version reached ``end``, the run's last), ``updates`` formed.
    """

    def __init__(self, quorum: int, size: int, end: int | None = None) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1 (got {quorum})")
        self.quorum = int(quorum)
        self.end = end
        self.after_end = 0
        self.sum = np.zeros(size, dtype=np.float32)
        self.count = 0
        self.contributors: set[int] = set()  # replicas in the current version's sum
        self.accepted = 0
        self.dropped_late: Counter[int] = Counter()
        self.repeats = 0
        self.updates = 0

    def offer(self, grad: np.ndarray, staleness: int, replica: int = -1,
              version: int = 0) -> bool:
        """Add ``grad`` (float32, the slice's shape) if it is of the current version
        (``staleness`` 0), ``replica`` has none in the sum yet (replicas < 0 are not told
        apart) and the shard's ``version`` is before the ``end``; whether it was added."""
        if self.end is not None and version >= self.end:
            self.after_end += 1
            return False
        if staleness != 0:
            self.dropped_late[int(replica)] += 1
            return False
        if replica >= 0 and replica in self.contributors:
            self.repeats += 1
            return False
        self.sum += grad
        self.count += 1
        self.accepted += 1
        if replica >= 0:
            self.contributors.add(int(replica))
        return True

    def full(self) -> bool:
        return self.count >= self.quorum

    def mean(self) -> np.ndarray:
        """The mean of the gradients in the sum (in place: the sum is spent)."""
        np.divide(self.sum, np.float32(self.count), out=self.sum)
        return self.sum

    def clear(self) -> None:
        """The update is applied: start the next version with an empty sum."""
        self.sum.fill(0.0)
        self.count = 0
        self.contributors.clear()
        self.updates += 1

    def counters(self) -> dict:
        """JSON-ready counters (a shard's stats and checkpoint ``sync``)."""
        return {"quorum": self.quorum, "accepted": self.accepted,
                "dropped_late": sum(self.dropped_late.values()),
                "dropped_late_by_replica": {str(k): v for k, v in
                                            sorted(self.dropped_late.items())},
                "repeats": self.repeats, "after_end": self.after_end, "updates": self.updates,
                "pending": self.count}

    def restore(self, counters: dict | None) -> None:
        """Take :meth:`counters` back (the sum of an unfinished version is not kept: a
        restored shard starts its version afresh)."""
        if not counters:
            return
        self.accepted = int(counters.get("accepted", 0))
        self.dropped_late = Counter({int(k): int(v) for k, v in
                                     counters.get("dropped_late_by_replica", {}).items()})
        self.repeats = int(counters.get("repeats", 0))
        self.after_end = int(counters.get("after_end", 0))
        self.updates = int(counters.get("updates", 0))


def check_sync_flags(backup_workers: int | None, replicas: int, algorithm: str, ranged: bool,
                     *, max_staleness: int | None = None, staleness_lr: bool = False,
                     delay_compensation: float = 0.0, shard_backups: int = 0,
                     n_fetch: int = 1, n_push: int = 1, warmstart_steps: int = 0) -> None:
    """One-line :class:`UserError` for a bad ``--backup-workers`` or a flag it cannot run
    with (each names the fix); nothing when it is off (None)."""
    if backup_workers is None:
        return
    b = backup_workers
    if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b >= replicas:
        raise UserError(f"--backup-workers must be an integer from 0 to --replicas - 1 = "
                        f"{replicas - 1} (got {b!r}): each update waits for replicas - B "
                        "gradients, 0 waits for all")
    if algorithm != "downpour":
        raise UserError(f"--backup-workers applies to --algorithm downpour only, not "
                        f"{algorithm} (its backup copies are --backups): drop it")
    if ranged:
        raise UserError("--backup-workers works on dense pushes only, not on click data or "
                        "model-parallel partitions: drop it")
    why = {"--max-staleness": "replicas already run in lockstep",
           "--staleness-lr": "every gradient applied is of the current version",
           "--delay-compensation": "every gradient applied is of the current version",
           "--shard-backups": "standbys would not hold the primary's unfinished sum",
           "--warmstart-steps": "replica 0 alone forms no quorum"}
    clash = [f for f, on in (("--max-staleness", max_staleness is not None),
                             ("--staleness-lr", staleness_lr),
                             ("--delay-compensation", delay_compensation > 0),
                             ("--shard-backups", shard_backups > 0),
                             ("--warmstart-steps", warmstart_steps > 0)) if on]
    if clash:
        raise UserError(f"--backup-workers with {clash[0]}: {why[clash[0]]}: drop one")
    if n_fetch != 1 or n_push != 1:
        raise UserError(f"--backup-workers needs --n-fetch 1 and --n-push 1 (got {n_fetch} "
                        f"and {n_push}): every step fetches the new version and pushes its "
                        "gradient")
