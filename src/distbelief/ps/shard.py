"""A parameter-server shard: owns one contiguous slice, applies pushes, serves fetches.

:class:`ShardCore` is the whole logic, plain Python, composed of one class per protocol
(:mod:`~distbelief.ps.pushfetch` for Downpour, :mod:`~distbelief.ps.vectors` for Sandblaster,
over the state in :mod:`~distbelief.ps.slice`); :class:`ParameterShard` is the Ray actor
around it. Shards never talk to each other and take no global lock: each applies
its own update rule to its own slice, in the order pushes reach it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import ray

from distbelief.ps.average import AverageSpec
from distbelief.ps.buffers import BufferAverage
from distbelief.ps.optim import make_rule
from distbelief.ps.pushfetch import PushFetch
from distbelief.ps.staleness import StalenessControl
from distbelief.ps.torchrule import TorchRule, one_torch_thread
from distbelief.ps.vectors import VectorStore


class ShardCore(PushFetch, VectorStore):
    """Everything a shard offers over its one slice: Downpour's fetches and pushes
    (:class:`PushFetch`) and Sandblaster's named vectors and staging (:class:`VectorStore`),
    each whole or by flat ranges, on the state of :class:`~distbelief.ps.slice.ShardSlice`."""


@ray.remote
class ParameterShard(ShardCore):
    """Ray actor holding one shard: every :class:`ShardCore` method is a remote method."""

    def __init__(self, shard_id: int, init: np.ndarray, optimizer: str, lr: float,
                 momentum: float = 0.9, restored: dict | None = None, *,
                 args: Mapping[str, object] | None = None, schedule: str | None = None,
                 rows: bool = False, buffers: BufferAverage | None = None,
                 average: AverageSpec | None = None,
                 control: StalenessControl | None = None) -> None:
        """Shard ``shard_id`` of ``init`` (float32), updated by ``make_rule(optimizer, lr,
        momentum, args, schedule, rows)`` (``rows``: pushes come as ranges); ``restored``: a
        checkpoint's ``{"arrays", "version", "counters"}`` to start from; ``buffers`` (shard 0
        of a model with buffers), ``average`` (``--average``) and ``control`` (``--staleness-lr``,
        ``--delay-compensation``) as in :class:`ShardCore`."""
        rule = make_rule(optimizer, lr, momentum, args, schedule, rows=rows)
        if isinstance(rule, TorchRule):
            one_torch_thread()
        super().__init__(shard_id, init, rule)
        self.keep_extras(buffers, average, control)
        if restored is not None:
            self.restore(restored["arrays"], restored["version"], restored.get("counters"))

    def stats(self) -> dict:
        return super().stats() | {"node": self.node()}

    def node(self) -> str:
        """The Ray node this shard runs on (clients send shards on one node one object)."""
        return ray.get_runtime_context().get_node_id()
