"""What a replica (or the driver) uses to talk to the shards: fetch and push, all at once.

Every call goes to all S shards concurrently (one Ray call each, submitted back to back)
and is waited for together, never one shard after another. Pushes are not waited for at
all until ``max_in_flight`` of them are outstanding, so sending overlaps the next
mini-batch's compute. Each shard still applies pushes one at a time, in the order sent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import ray

from distbelief.cluster import inline_bytes
from distbelief.ps.codec import WIRE_DTYPES, encode
from distbelief.ps.plan import ShardPlan
from distbelief.ps.sync import WAIT_S

RECONNECT_S = 60.0  # how long a client waits for the driver to restart a dead shard
FETCH_TRIES = 3  # fetches of one shard (first try + retries) before giving up
Call = tuple[int, ray.ObjectRef, tuple]  # shard, reply, (method, args, kwargs) to resend


class ShardUnavailable(RuntimeError):
    """A shard died and no restarted shard answered under its name in time."""


class PSClient:
    """Fetch into and push from one flat float32 vector laid out by ``plan``.

    ``grad_dtype`` is the wire format of pushed gradients (``float32``, or ``float16`` /
    ``bfloat16`` for half the bytes, see :mod:`distbelief.ps.codec`); ``max_in_flight``
    is how many pushes may be outstanding before :meth:`push` blocks.

    With ``names`` (the shards' Ray actor names) the client survives a shard's restart: a
    fetch from a dead shard waits for the actor that the driver restarts under the same name
    and is retried (counted in ``retried``); a push a dead shard never acknowledged is
    dropped and counted (``dropped``, ``dropped_by_shard``). Without names a dead shard's
    error propagates.

    With an ``incarnation`` (> 0, one client per replica incarnation) every push carries an
    id ``(replica, incarnation, seq)`` (:mod:`distbelief.ps.ledger`).
    With ``resend`` (shards with hot standbys) a push a dead shard never acknowledged is
    kept and sent again, with its id, to the standby the driver promoted, found through
    the run's ``directory`` actor (its name); the shard's ledger takes it at most once.
    """

    def __init__(self, shards: Sequence[ray.actor.ActorHandle], plan: ShardPlan,
                 replica: int = -1, grad_dtype: str = "float32", max_in_flight: int = 1,
                 names: Sequence[str] | None = None, incarnation: int = 0,
                 resend: bool = False, directory: str | None = None) -> None:
        if len(shards) != plan.shards:
            raise ValueError(f"plan has {plan.shards} shards, got {len(shards)} handles")
        self.shards = list(shards)
        self.plan = plan
        self.replica = replica
        self.versions = [0] * plan.shards
        self.fetches = self.pushes = self.rejected = 0
        self.grad_dtype = grad_dtype
        self.max_in_flight = max(1, int(max_in_flight))
        self._in_flight: deque[list[Call]] = deque()
        self.incarnation, self.seq = int(incarnation), 0
        self.resend, self.directory, self.resent = resend, directory, 0
        self._one_object: bool | None = None  # at the first push, with ``_inline`` (not at
        self._inline = 0  # import): parts over it go as one object to shards on one node
        self.names = list(names) if names is not None else None
        self.dropped = self.retried = self.reconnects = 0
        self.dropped_by_shard = [0] * plan.shards
        self._dead: set[int] = set()  # shards whose restart this client has yet to reach
        self.buffers: tuple | None = None  # the model buffers shard 0 sent with a fetch

    def fetch_average_into(self, flat: np.ndarray) -> list[int]:
        """Overwrite ``flat`` with every shard's averaged slice (``--average``); versions."""
        replies = ray.get([s.fetch_average.remote() for s in self.shards])
        for lo, hi, (_, part) in zip(self.plan.bounds, self.plan.bounds[1:], replies):
            flat[lo:hi] = part
        return [v for v, _ in replies]

    def fetch_into(self, flat: np.ndarray, buffers: bool = False) -> list[int]:
        """Overwrite ``flat`` (shape ``(numel,)``) with every shard's slice; returns versions.
        ``buffers``: also get the model's buffers from shard 0 (into :attr:`buffers`)."""
        return self.fetch_finish(self.fetch_start(buffers), flat, buffers)

    def fetch_start(self, buffers: bool = False) -> list[ray.ObjectRef]:
        """Send a fetch to every shard, after every push sent before it; don't wait."""
        self._reconnect_dead()
        return [s.fetch.remote(buffers and i == 0, self.replica)
                for i, s in enumerate(self.shards)]

    def fetch_finish(self, refs: list[ray.ObjectRef], flat: np.ndarray,
                     buffers: bool = False) -> list[int]:
        """Wait for :meth:`fetch_start`'s ``refs`` and overwrite ``flat`` with the slices
        (a dead shard's fetch retried after its restart, with ``names``); the versions."""
        try:
            replies = ray.get(refs)
        except ray.exceptions.RayActorError:
            if self.names is None:
                raise
            replies = self._refetch(refs, buffers=buffers)
        bounds = self.plan.bounds
        for lo, hi, reply in zip(bounds, bounds[1:], replies):
            flat[lo:hi] = reply[1]
        self.versions = [reply[0] for reply in replies]
        if buffers:
            self.buffers = replies[0][2]
        self.fetches += 1
        return self.versions

    def push(self, flat_grad: np.ndarray, buffers: tuple | None = None) -> None:
        """Send each shard its slice of ``flat_grad`` (float32, shape ``(numel,)``).

        The gradient is encoded as ``grad_dtype`` and copied into Ray's object store here
        (an explicit ``ray.put`` costs less than a large array argument), so the caller may
        overwrite ``flat_grad`` at once: one object that every shard reads its part of when
        all shards share a node, else one object per shard. Blocks only while
        ``max_in_flight`` earlier pushes are still being applied. ``buffers`` (a buffer
        report, see :mod:`distbelief.ps.buffers`) goes to shard 0 with its part.
        """
        self._drain(self.max_in_flight - 1)
        self._reconnect_dead()
        self._in_flight.append(self._calls("push", flat_grad, buffers))

    def _calls(self, method: str, flat_grad: np.ndarray, buffers: tuple | None) -> list[Call]:
        """A ``method`` call per shard: its part of ``flat_grad`` (encoded), one push id,
        ``buffers`` to shard 0. Parts too large to inline are one object for shards sharing
        a node (``push_part``/``push_part_fetch`` read their own part of it), else one each."""
        bounds, pid = self.plan.bounds, self._next_id()
        more = [{"buffers": buffers} if buffers is not None and s == 0 else {}
                for s in range(len(self.shards))]
        if self._one_object is None:  # the plan, dtype and shards' nodes are the client's own
            self._inline = inline_bytes()
            widest = max(np.diff(bounds)) * WIRE_DTYPES[self.grad_dtype].itemsize
            self._one_object = widest > self._inline and len(self.shards) > 1 and len(set(
                ray.get([s.node.remote() for s in self.shards]))) == 1
        if self._one_object:
            whole = ray.put(encode(flat_grad, self.grad_dtype))
            return [self._call(s, method.replace("push", "push_part"),
                               (whole, lo, version, self.replica), kw | pid)
                    for s, (lo, version, kw) in enumerate(zip(bounds, self.versions, more))]
        calls = []
        for s, (lo, hi, version, kw) in enumerate(zip(bounds, bounds[1:], self.versions, more)):
            part = encode(flat_grad[lo:hi], self.grad_dtype)
            if part.nbytes > self._inline:
                part = ray.put(part)
            calls.append(self._call(s, method, (part, version, self.replica), kw | pid))
        return calls

    def push_fetch_into(self, flat_grad: np.ndarray, flat: np.ndarray,
                        buffers: tuple | None = None) -> list[int]:
        """:meth:`push` of ``flat_grad``, then :meth:`fetch_into` ``flat``, with one call per
        shard instead of two (each shard applies the push, then answers with its slice).
        Waits for it, as a fetch does; returns the versions. A shard that died is handled
        as by the two calls: its push dropped and counted, its fetch retried after its
        restart (with ``names``). With a ``buffers`` report shard 0 also sends its buffers
        back (into :attr:`buffers`)."""
        self._drain(0)
        self._reconnect_dead()
        bounds, calls = self.plan.bounds, self._calls("push_fetch", flat_grad, buffers)
        for s, ((_, ref, call), lo, hi) in enumerate(zip(calls, bounds, bounds[1:])):
            try:
                applied, version, part, *served = (
                    self._resent(s, ref, call) if self.resend else ray.get(ref))
                self.rejected += not applied
            except ray.exceptions.RayActorError:
                if self.names is None:
                    raise
                self.dropped += 1
                self.dropped_by_shard[s] += 1
                self._reconnect(s)
                self.retried += 1
                want = buffers is not None and s == 0
                [(version, part, *served)] = self._refetch(
                    [self.shards[s].fetch.remote(want, self.replica)], [s], buffers=want)
            flat[lo:hi] = part
            if served:
                self.buffers = served[0]
            self.versions[s] = version
        self.fetches += 1
        return self.versions

    def fetch_vector_into(self, vector: str, flat: np.ndarray) -> None:
        """Overwrite ``flat`` with every shard's slice of Sandblaster vector ``vector``."""
        parts = ray.get([s.fetch_vector.remote(vector) for s in self.shards])
        bounds = self.plan.bounds
        for lo, hi, part in zip(bounds, bounds[1:], parts):
            flat[lo:hi] = part

    def stage(self, tag: str, flat_grad: np.ndarray) -> bool:
        """Stage each shard's slice of ``flat_grad`` under ``tag`` (Sandblaster); True if
        every shard accepted its slice."""
        bounds = self.plan.bounds
        return all(ray.get([s.stage.remote(tag, flat_grad[lo:hi])
                            for s, lo, hi in zip(self.shards, bounds, bounds[1:])]))

    def local_ranges(self, ranges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Split global flat ranges (sorted, disjoint) into each shard's local ranges."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.shards]
        bounds = self.plan.bounds
        for lo, hi in ranges:
            for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
                x, y = max(lo, a), min(hi, b)
                if x < y:
                    out[s].append((x - a, y - a))
        return out

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        """The concatenated values of global flat ``ranges``, fetched from their shards only."""
        return self.fetch_ranges_finish(self.fetch_ranges_start(ranges))

    def fetch_ranges_start(self, ranges: list[tuple[int, int]]) -> tuple[list[int], list]:
        """Send :meth:`fetch_ranges`'s calls, after every push sent before them; don't wait."""
        local = self.local_ranges(ranges)
        asked = [s for s, r in enumerate(local) if r]
        return asked, [self.shards[s].fetch_ranges.remote(local[s]) for s in asked]

    def fetch_ranges_finish(self, sent: tuple[list[int], list]) -> np.ndarray:
        """Wait for :meth:`fetch_ranges_start`'s calls; the concatenated values."""
        asked, replies = sent[0], ray.get(sent[1])
        for s, (version, _) in zip(asked, replies):
            self.versions[s] = version
        self.fetches += 1
        return np.concatenate([np.zeros(0, np.float32), *(part for _, part in replies)])

    def push_ranges(self, ranges: list[tuple[int, int]], grad: np.ndarray) -> None:
        """Push the gradient of global flat ``ranges`` (concatenated) to the shards owning them."""
        self.wait()
        local, pid = self.local_ranges(ranges), self._next_id()
        offset, refs = 0, []
        for s, r in enumerate(local):
            size = sum(hi - lo for lo, hi in r)
            if size:
                refs.append(self._call(s, "push_ranges", (r, grad[offset: offset + size],
                                                          self.versions[s], self.replica), pid))
            offset += size
        self._in_flight.append(refs)

    def fetch_vector_ranges(self, vector: str, ranges: list[tuple[int, int]]) -> np.ndarray:
        """The concatenated values of global flat ``ranges`` of a Sandblaster vector."""
        local = self.local_ranges(ranges)
        asked = [s for s, r in enumerate(local) if r]
        parts = ray.get([self.shards[s].fetch_vector_ranges.remote(vector, local[s])
                         for s in asked])
        return np.concatenate([np.zeros(0, np.float32), *parts])

    def stage_ranges(self, tag: str, ranges: list[tuple[int, int]], values: np.ndarray) -> bool:
        """Add the gradient of global flat ``ranges`` into what each owning shard has staged
        under ``tag``; True if every shard accepted its part."""
        local, offset, refs = self.local_ranges(ranges), 0, []
        for s, r in enumerate(local):
            size = sum(hi - lo for lo, hi in r)
            if size:
                refs.append(self.shards[s].stage_ranges.remote(tag, r,
                                                               values[offset: offset + size]))
            offset += size
        return all(ray.get(refs))

    def wait(self) -> None:
        """Block until every push sent is applied (or rejected) by every shard."""
        self._drain(0)

    def wait_newer(self, versions: Sequence[int | None], timeout: float = WAIT_S) -> int:
        """Block until every shard ``s`` whose ``versions[s]`` is not None is past that
        version (``--backup-workers``: a replica's gradient of version v waits for the
        update of v before it fetches); shards are asked together, ``timeout`` seconds per
        call, again until they move. A shard that died is reconnected to (with ``names``)
        and not waited for (a restarted shard is behind); returns the calls that timed out."""
        waiting = {s: int(v) for s, v in enumerate(versions) if v is not None}
        timeouts = 0
        while waiting:
            refs = {s: self.shards[s].wait_version.remote(v, timeout)
                    for s, v in waiting.items()}
            for s, ref in refs.items():
                try:
                    moved = ray.get(ref) > waiting[s]
                except ray.exceptions.RayActorError:
                    if self.names is None:
                        raise
                    self._reconnect(s)
                    moved = True
                if moved:
                    del waiting[s]
                else:
                    timeouts += 1
        return timeouts

    def push_sync(self, flat_grad: np.ndarray, buffers: tuple | None = None
                  ) -> list[int | None]:
        """:meth:`push` and wait for it: the version each shard took it for, None where the
        shard died before it answered (the push was dropped: nothing to wait for there)."""
        before = list(self.dropped_by_shard)
        pushed_at = list(self.versions)
        self.push(flat_grad, buffers)
        self._drain(0)
        return [None if d != b else v
                for v, b, d in zip(pushed_at, before, self.dropped_by_shard)]

    def _drain(self, keep: int) -> None:
        """Wait for the oldest pushes until at most ``keep`` are outstanding."""
        while len(self._in_flight) > keep:
            calls = self._in_flight.popleft()
            try:
                accepted = ray.get([ref for _, ref, _ in calls])
            except ray.exceptions.RayActorError:
                if self.names is None:
                    raise
                accepted = self._settle(calls)
            self.rejected += accepted.count(False)

    def _next_id(self) -> dict:
        """A new push, counted as sent; its id as the shards' keyword (none without an
        incarnation: several such clients, a replica's partitions, may push for one replica)."""
        self.seq += 1
        self.pushes += 1
        return {"pid": (self.replica, self.incarnation, self.seq)} if self.incarnation else {}

    def _call(self, s: int, method: str, args: tuple, kwargs: dict) -> Call:
        """Send ``method(*args, **kwargs)`` to shard ``s``; the call for :meth:`_resent`."""
        call = (method, args, kwargs)
        return s, getattr(self.shards[s], method).remote(*args, **kwargs), call

    # A shard's restart or failover (slow path, only after a RayActorError).

    def _settle(self, calls: list[Call]) -> list[bool | None]:
        """Each shard's answer to one push; None (dropped, counted) where the shard died,
        unless it is resent to the standby that took over (``resend``)."""
        out: list[bool | None] = []
        for s, ref, call in calls:
            try:
                out.append(self._resent(s, ref, call) if self.resend else ray.get(ref))
            except ray.exceptions.RayActorError:
                out.append(None)
                self.dropped += 1
                self.dropped_by_shard[s] += 1
                self._dead.add(s)
        return out

    def _resent(self, s: int, ref: ray.ObjectRef, call: tuple):
        """The answer to ``ref``, a call to shard ``s``; if the shard died, ``call`` sent
        again to the shard that took over (up to ``FETCH_TRIES`` times)."""
        for _ in range(FETCH_TRIES):
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError:
                self._reconnect(s)
                self.resent += 1
                method, args, kwargs = call
                ref = getattr(self.shards[s], method).remote(*args, **kwargs)
        return ray.get(ref)

    def _refetch(self, refs: list[ray.ObjectRef], shards: Sequence[int] | None = None,
                 buffers: bool = False) -> list:
        """Each shard's fetch reply (``refs`` from ``shards``, default all in order),
        reconnecting to and re-asking any shard that died (shard 0 with ``buffers``)."""
        replies = []
        for s, ref in zip(range(len(refs)) if shards is None else shards, refs):
            for _ in range(FETCH_TRIES):
                try:
                    replies.append(ray.get(ref))
                    break
                except ray.exceptions.RayActorError:
                    self._reconnect(s)
                    self.retried += 1
                    ref = self.shards[s].fetch.remote(buffers and s == 0, self.replica)
            else:
                raise ShardUnavailable(f"shard {s} died {FETCH_TRIES} times during one fetch")
        return replies

    def _reconnect_dead(self) -> None:
        """Reach the restart of every shard a push found dead (none: nothing to do)."""
        for s in sorted(self._dead):
            self._reconnect(s)

    def _reconnect(self, s: int) -> None:
        """Wait (up to ``RECONNECT_S``) for shard ``s``'s restart and use that actor."""
        deadline = time.monotonic() + RECONNECT_S
        while time.monotonic() < deadline:
            try:  # the dead actor's name is freed, then taken by its restart, asynchronously
                handle = self._resolve(s)
                ray.get(handle.stats.remote())
            except (ValueError, ray.exceptions.RayActorError):
                time.sleep(0.05)
                continue
            self.shards[s] = handle
            self.reconnects += 1
            self._dead.discard(s)
            return
        raise ShardUnavailable(f"shard {s} ({self.names[s]}) did not come back within "
                               f"{RECONNECT_S:.0f} s")

    def _resolve(self, s: int) -> ray.actor.ActorHandle:
        """Shard ``s``'s actor now: the one the directory names (a promoted standby), else
        the one holding its name (a restart)."""
        if self.directory is not None:
            return ray.get(ray.get_actor(self.directory).get.remote(s))
        return ray.get_actor(self.names[s])
