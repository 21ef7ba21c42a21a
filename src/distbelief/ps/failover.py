"""Hot standbys for the dense shards (``--shard-backups N``): failover that loses nothing.

Each shard's primary copies every push to N standby actors (:class:`~distbelief.ps.shard.
Replicated`), spread over the cluster's nodes where it has several (Ray's ``SPREAD``
strategy; on one machine, other processes). A :class:`ShardDirectory` actor names each
shard's current primary. When a primary dies, :meth:`FailoverGroup.revive` promotes a live
standby, copies its state to the other standbys and to new ones (up to N), and points the
directory at it; replicas re-resolve the shard there and resend the pushes it never
acknowledged, which the promoted shard's ledger takes at most once. A dead standby is
replaced from its primary at the driver's next probe. Only when every copy of a shard died
does it restart from the newest checkpoint, as without standbys.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distbelief.cluster import actor_options
from distbelief.ps.group import ShardGroup, dead_shards

__all__ = ["FailoverGroup", "ShardDirectory"]


@ray.remote(num_cpus=0)
class ShardDirectory:
    """Each shard's current primary actor, by index (clients ask it after a failover)."""

    def __init__(self, handles: list) -> None:
        self.handles = list(handles)

    def get(self, i: int):
        return self.handles[i]

    def set(self, i: int, handle) -> None:
        self.handles[i] = handle


class FailoverGroup(ShardGroup):
    """A :class:`ShardGroup` whose shards each keep ``backups`` hot standbys, started by
    ``spawn(i, None, role="standby", index=...)`` and named ``standby`` + a run-wide
    counter; ``directory`` is the name of the run's :class:`ShardDirectory`."""

    def __init__(self, *args, backups: int, directory: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backups = backups
        self.directory_name = directory
        self.directory: ray.actor.ActorHandle | None = None
        self.standbys: list[list[ray.actor.ActorHandle]] = [[] for _ in range(self.count)]
        self._started = 0  # standbys started so far (their actor name's index)

    def start(self, restored: Sequence[dict | None] | None = None,
              source=None) -> FailoverGroup:
        super().start(restored, source)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)  # the driver's node: it stays
        self.directory = ShardDirectory.options(name=self.directory_name, scheduling_strategy=here,
                                                **actor_options()).remote(self._handles)
        for i in range(self.count):
            self._replenish(i)
        return self

    def _new_standby(self, i: int) -> ray.actor.ActorHandle:
        self._started += 1
        return self._spawn(i, None, role="standby", index=self._started)

    def _replenish(self, i: int) -> list[int]:
        """Start standbys for shard ``i`` until it has ``backups`` live ones, each a copy of
        its primary; the indices of those started."""
        live = [s for s in self.standbys[i] if not dead_shards([s])]
        for s in self.standbys[i]:
            if s not in live:
                ray.kill(s)
        started = []
        while len(live) < self.backups:
            standby = self._new_standby(i)
            ray.get(self._handles[i].attach.remote(standby))
            live.append(standby)
            started.append(self._started)
        self.standbys[i] = live
        return started

    def revive(self) -> list[int]:
        dead = self.probe()
        for i in dead:
            self.job.log("shard_failed", shard=i, restarts=self.restarts[i] + 1)
            live = [s for s in self.standbys[i] if not dead_shards([s])]
            if not live:  # every copy died: restart from the checkpoint
                self.standbys[i] = []
                self.revive_one(i)
            else:
                self.restarts[i] += 1
                ray.kill(self._handles[i])
                promoted, *others = live
                ray.get(promoted.promote.remote())
                self._handles[i] = promoted
                for s in others:  # bit-equal to the new primary again
                    ray.get(promoted.attach.remote(s))
                self.standbys[i] = others
                version = ray.get(promoted.stats.remote())["version"]
                self.job.log("shard_promoted", shard=i, version=version)
            self._replenish(i)
            ray.get(self.directory.set.remote(i, self._handles[i]))
        return dead

    def check_rejections(self, max_rejected: int) -> None:
        """Also the driver's probe of the standbys: a dead one is replaced (and logged)."""
        for i in range(self.count):
            if any(dead_shards([s]) for s in self.standbys[i]):
                self.job.log("standby_failed", shard=i)
                self.job.log("standby_started", shard=i, standbys=self._replenish(i))
        super().check_rejections(max_rejected)

    def standby_handles(self) -> list[list[ray.actor.ActorHandle]]:
        """Each shard's standbys (for tools and fault tests)."""
        return [list(s) for s in self.standbys]

    def kill(self) -> None:
        super().kill()
        for standbys in self.standbys:
            for s in standbys:
                ray.kill(s)
        if self.directory is not None:
            ray.kill(self.directory)
