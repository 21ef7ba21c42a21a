"""One partition's state: its own layers or parameter slices, its boundary messages, and
where its parameters lie in the flat vector the shards hold.

:class:`PartitionCore` runs forward and backward rounds and reads and writes its owned
parameters as one concatenated array (flat-vector order). What it does with the parameter
server is added by :class:`~distbelief.modelpar.pushfetch.PartitionPushFetch` (Downpour) and
:class:`~distbelief.modelpar.staging.PartitionStaging` (Sandblaster); the actor
:class:`~distbelief.modelpar.worker.PartitionWorker` composes them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from distbelief import cluster
from distbelief.allocator import keep_freed_memory
from distbelief.devices import CPU, autocast
from distbelief.modelpar.geometry import DRIVER, Message, ParamSlice
from distbelief.modelpar.layerwise import LayerwisePlan
from distbelief.modelpar.partitions import LayerwisePartition, SpatialPartition
from distbelief.modelpar.plan import PartitionPlan
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan


def narrowed(m: Message) -> Message:
    """``m`` with a float32 tensor sent as bfloat16 (half the bytes); others as they are."""
    if m.tensor.dtype != torch.float32:
        return m
    return dataclasses.replace(m, tensor=m.tensor.to(torch.bfloat16))


def widened(m: Message) -> Message:
    """``m`` with a bfloat16 tensor back in float32, to compute on; others as they are."""
    if m.tensor.dtype != torch.bfloat16:
        return m
    return dataclasses.replace(m, tensor=m.tensor.float())


def flat_runs(index: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[(lo, hi), ...]`` of consecutive values in a strictly increasing
    integer array (the element offsets a partition owns in the flat parameter vector)."""
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [index.size]])
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops)]


def owned_ranges(slices: Sequence[ParamSlice], shard_plan: ShardPlan
                 ) -> tuple[list[ParamSlice], list[tuple[int, int]]]:
    """The slices in flat-vector order and the flat ranges they cover, in the same order.

    Values fetched for the ranges, concatenated, are the slices' values one after another,
    each in row-major order of its box.
    """
    offsets = {t.name: t.offset for t in shard_plan.tensors}
    ordered = sorted(slices, key=lambda s: offsets[s.name])
    index = np.concatenate([np.zeros(0, np.int64)]
                           + [offsets[s.name] + s.flat_index() for s in ordered])
    if np.any(np.diff(index) <= 0):
        raise ValueError("a partition's parameter slices overlap")
    return ordered, flat_runs(index)


class PartitionCore:
    """One partition: forward/backward rounds and its own parameters (no PS protocol)."""

    def __init__(self, plan: PartitionPlan, index: int, piece: nn.Module | dict,
                 shard_plan: ShardPlan | None = None, shards: list | None = None,
                 replica: int = -1, precision: str = "float32") -> None:
        torch.set_num_threads(1)
        self.precision, self.half = precision, precision == "bfloat16"
        keep_freed_memory()
        if isinstance(plan, LayerwisePlan):
            self.part = LayerwisePartition(plan, index, piece)
        else:
            self.part = SpatialPartition(plan, index, piece)
        self.index, self.k = index, plan.num_partitions
        self.params = dict(self.part.named_parameters())
        self.inbox: dict[tuple[str, int], list[Message]] = defaultdict(list)
        self.bytes_sent = self.messages_sent = 0
        self.client = None
        self.slices = list(self.part.param_slices())
        if shards is not None:
            self.slices, self.ranges = owned_ranges(self.slices, shard_plan)
            self.client = PSClient(shards, shard_plan, replica=replica)
        owned = sum(p.numel() for p in self.params.values()) if shards is not None else 0
        self.accrued = np.zeros(owned, np.float32)  # gradient summed since the last push

    def where(self) -> str:
        return cluster.node_id()

    def round(self, kind: str, layer: int, *received: list[Message]) -> tuple[list, ...]:
        """Run round ``layer`` of the forward (``kind="activation"``) or backward
        (``"gradient"``) pass. ``received`` are lists of messages sent to this partition
        since its last call (some for later rounds, kept until then). Returns K + 1 lists:
        the messages for each partition, then those for the driver.

        With ``precision`` bfloat16 the forward rounds run under
        :func:`~distbelief.devices.autocast`, and tensors cross partition boundaries in
        bfloat16 (half the bytes); each partition computes on what it receives in float32,
        and what goes to the driver (the output) is float32."""
        for batch in received:
            for m in batch:
                self.inbox[m.kind, m.layer].append(widened(m) if self.half else m)
        step = self.part.forward if kind == "activation" else self.part.backward
        out: tuple[list, ...] = tuple([] for _ in range(self.k + 1))
        with autocast(CPU, self.precision if kind == "activation" else "float32"):
            sent = step(layer, self.inbox.pop((kind, layer), []))
        for m in sent:
            if m.dst == DRIVER:
                out[self.k].append(widened(m) if self.half else m)
            elif m.dst == self.index:
                self.inbox[m.kind, m.layer].append(m)
            else:
                m = narrowed(m) if self.half else m
                out[m.dst].append(m)
                self.bytes_sent += m.nbytes
                self.messages_sent += 1
        return out

    def _load(self, values: np.ndarray) -> None:
        """Set the owned slices from their concatenated values (flat-vector order)."""
        fresh, offset = {}, 0
        for s in self.slices:
            n = int(np.prod(s.part_shape))
            fresh[s.name] = torch.from_numpy(values[offset: offset + n].reshape(s.part_shape))
            offset += n
        self.part.load(fresh)

    def _add_grads(self, into: np.ndarray) -> None:
        """Add the owned slices' gradients, concatenated in flat-vector order, to ``into``."""
        grads, offset = self.part.gradients(), 0
        for s in self.slices:
            g = grads[s.name].detach().reshape(-1).numpy()
            into[offset: offset + g.size] += g
            offset += g.size

    def state(self) -> tuple[dict, dict]:
        """This partition's parameter slices and their gradients (for tests and gathering)."""
        return ({n: p.detach().clone() for n, p in self.params.items()},
                {n: g.clone() for n, g in self.part.gradients().items()})
