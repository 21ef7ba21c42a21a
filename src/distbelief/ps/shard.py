"""A parameter-server shard: owns one contiguous slice, applies pushes, serves fetches.

:class:`ShardCore` is the whole logic, plain Python, composed of one class per protocol
(:mod:`~distbelief.ps.pushfetch` for Downpour, :mod:`~distbelief.ps.vectors` for Sandblaster,
over the state in :mod:`~distbelief.ps.slice`); :class:`ParameterShard` is the Ray actor
around it. Shards never talk to each other and take no global lock: each applies
its own update rule to its own slice, in the order pushes reach it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import ray

from distbelief.allocator import keep_freed_memory
from distbelief.ps.average import AverageSpec
from distbelief.ps.buffers import BufferAverage
from distbelief.ps.ledger import PushId
from distbelief.ps.optim import make_rule
from distbelief.ps.pushfetch import PushFetch
from distbelief.ps.staleness import StalenessControl
from distbelief.ps.torchrule import TorchRule, one_torch_thread, without_compiler
from distbelief.ps.vectors import VectorStore


class ShardCore(PushFetch, VectorStore):
    """Everything a shard offers over its one slice: Downpour's fetches and pushes
    (:class:`PushFetch`) and Sandblaster's named vectors and staging (:class:`VectorStore`),
    each whole or by flat ranges, on the state of :class:`~distbelief.ps.slice.ShardSlice`."""


class Replicated(ShardCore):
    """A primary shard that copies every push to its hot standbys (``--shard-backups``).

    A push (with its id) is applied here and forwarded to every live standby at once; it
    is acknowledged once every live copy holds it. Standbys are shards like this one with
    no standbys of their own; they apply the same pushes in the same order by the same
    deterministic rule, so their state stays bit-equal to the primary's. A standby that
    dies is dropped from the list (the driver starts a new one and attaches it with
    :meth:`attach`).
    """

    standbys: list = []

    def push(self, grad: np.ndarray, fetched_version: int, replica: int = -1,
             buffers: tuple | None = None, pid: PushId | None = None) -> bool:
        refs = [s.push.remote(grad, fetched_version, replica, buffers, pid)
                for s in self.standbys]
        applied = super().push(grad, fetched_version, replica, buffers, pid)
        self._settle(refs)
        return applied

    def push_ranges(self, ranges: list[tuple[int, int]], grad: np.ndarray,
                    fetched_version: int, replica: int = -1,
                    pid: PushId | None = None) -> bool:
        refs = [s.push_ranges.remote(ranges, grad, fetched_version, replica, pid)
                for s in self.standbys]
        applied = super().push_ranges(ranges, grad, fetched_version, replica, pid)
        self._settle(refs)
        return applied

    def _settle(self, refs: list) -> None:
        """Wait for the standbys' copies; drop those that died."""
        dead = set()
        for standby, ref in zip(self.standbys, refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.add(id(standby))
        if dead:
            self.standbys = [s for s in self.standbys if id(s) not in dead]

    def attach(self, standby: ray.actor.ActorHandle) -> int:
        """Make ``standby`` a copy of this shard and forward it every push from now on (no
        push runs in between: an actor runs one call at a time); the live standbys."""
        ray.get(standby.load.remote(self.snapshot()))
        self.standbys = [*self.live_standbys(), standby]
        return len(self.standbys)

    def live_standbys(self) -> list:
        alive = []
        for s in self.standbys:
            try:
                ray.get(s.pid.remote(), timeout=30)
                alive.append(s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        return alive

    def promote(self) -> None:
        """This standby becomes its shard's primary (it has no standbys until attached)."""
        self.standbys = []

    def load(self, snapshot: dict) -> None:
        """Take a primary's :meth:`snapshot` (slice, rule state, version, counters, ledger)."""
        self.restore(snapshot["arrays"], snapshot["version"], snapshot["counters"])


WAITERS = 64  # threads of a shard actor's ``wait`` group: replicas waiting for a version


@ray.remote(concurrency_groups={"wait": WAITERS})
class ParameterShard(Replicated):
    """Ray actor holding one shard: every :class:`ShardCore` method is a remote method, and
    a primary copies pushes to its standbys (:class:`Replicated`).

    Calls run one at a time (the default concurrency group), so the shard's state needs no
    lock, except :meth:`wait_version`, which runs in the ``wait`` group (threads made on
    demand) beside them and only reads the version under its condition."""

    def __init__(self, shard_id: int, init: np.ndarray, optimizer: str, lr: float,
                 momentum: float = 0.9, restored: dict | None = None, *,
                 args: Mapping[str, object] | None = None, schedule: str | None = None,
                 rows: bool = False, buffers: BufferAverage | None = None,
                 average: AverageSpec | None = None,
                 control: StalenessControl | None = None, quorum: int | None = None,
                 end: int | None = None) -> None:
        """Shard ``shard_id`` of ``init`` (float32), updated by ``make_rule(optimizer, lr,
        momentum, args, schedule, rows)`` (``rows``: pushes come as ranges); ``restored``: a
        checkpoint's ``{"arrays", "version", "counters"}`` to start from; ``buffers`` (shard 0
        of a model with buffers), ``average`` (``--average``) and ``control`` (``--staleness-lr``,
        ``--delay-compensation``) as in :class:`ShardCore`; ``quorum``: with
        ``--backup-workers``, the gradients each synchronous update waits for, until version
        ``end`` (the run's ``--steps``)."""
        without_compiler()  # before the rule's first torch.optim call
        keep_freed_memory()  # the rule's temporaries reuse the last push's pages
        rule = make_rule(optimizer, lr, momentum, args, schedule, rows=rows)
        if isinstance(rule, TorchRule):
            one_torch_thread()
        super().__init__(shard_id, init, rule)
        self.standbys = []
        self.keep_extras(buffers, average, control)
        self.keep_sync(quorum, end)
        if restored is not None:
            self.restore(restored["arrays"], restored["version"], restored.get("counters"))

    @ray.method(concurrency_group="wait")
    def wait_version(self, version: int, timeout: float) -> int:
        return super().wait_version(version, timeout)

    def stats(self) -> dict:
        return super().stats() | {"node": self.node(), "standbys": len(self.standbys)}

    def node(self) -> str:
        """The Ray node this shard runs on (clients send shards on one node one object)."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This shard's process id (fault tests SIGKILL it)."""
        return os.getpid()
