"""Partition actors: one model split over K Ray actors that exchange only boundary tensors.

A :class:`PartitionWorker` holds one partition of a layer-wise or spatial plan (see
:mod:`distbelief.modelpar.partitions`) and nothing else of the model: it is built from its own
layers or parameter slices only. It fetches and pushes just its own parameters, as flat
ranges, from and to the parameter-server shards.

:class:`PartitionGroup` is the caller's side (a model-parallel Downpour replica, a benchmark,
a test): it submits every partition's calls for a whole forward or backward pass at once and
passes each call's outgoing messages to the next round's calls as Ray object references, so
boundary tensors go from partition to partition through the object store and never through
the caller. Only the model's output (the logits) comes back to the caller, which computes the
loss and sends the output's gradient down.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import ray
import torch
from torch import nn

from distbelief.modelpar.geometry import DRIVER, Message, ParamSlice
from distbelief.modelpar.layerwise import LayerwisePlan
from distbelief.modelpar.partitions import LayerwisePartition, SpatialPartition
from distbelief.modelpar.plan import PartitionPlan, gather_slices
from distbelief.modelpar.schedule import pass_schedule
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan


def partition_piece(plan: PartitionPlan, index: int, model: nn.Module) -> nn.Module | dict:
    """What partition ``index`` is built from: its own layers (layer-wise plans) or its own
    parameter slices (spatial plans), copied out of ``model`` so nothing else travels."""
    if isinstance(plan, LayerwisePlan):
        stage = plan.stages[index]
        return model[stage.start: stage.stop]
    full = dict(model.named_parameters())
    return {s.name: s.take(full[s.name].detach()).clone() for s in plan.params(index)}


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


@ray.remote
class PartitionWorker:
    """One partition: forward/backward rounds, its own parameters, its own PS traffic."""

    def __init__(self, plan: PartitionPlan, index: int, piece: nn.Module | dict,
                 shard_plan: ShardPlan | None = None, shards: list | None = None,
                 replica: int = -1) -> None:
        torch.set_num_threads(1)
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
        self.since_push = 0
        self.held = {}

    def where(self) -> str:
        from distbelief import cluster

        return cluster.node_id()

    def round(self, kind: str, layer: int, *received: list[Message]) -> tuple[list, ...]:
        """Run round ``layer`` of the forward (``kind="activation"``) or backward
        (``"gradient"``) pass. ``received`` are lists of messages sent to this partition
        since its last call (some for later rounds, kept until then). Returns K + 1 lists:
        the messages for each partition, then those for the driver."""
        for batch in received:
            for m in batch:
                self.inbox[m.kind, m.layer].append(m)
        step = self.part.forward if kind == "activation" else self.part.backward
        out: tuple[list, ...] = tuple([] for _ in range(self.k + 1))
        for m in step(layer, self.inbox.pop((kind, layer), [])):
            if m.dst == DRIVER:
                out[self.k].append(m)
            elif m.dst == self.index:
                self.inbox[m.kind, m.layer].append(m)
            else:
                out[m.dst].append(m)
                self.bytes_sent += m.nbytes
                self.messages_sent += 1
        return out

    def fetch(self) -> list[int]:
        """Overwrite this partition's parameters with the shards' values; returns versions."""
        self._load(self.client.fetch_ranges(self.ranges))
        return list(self.client.versions)

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

    def end_step(self, push: bool, local_lr: float | None) -> None:
        """Accrue this step's gradients; push them if ``push``; apply them locally with plain
        SGD at ``local_lr`` if given; clear them for the next step."""
        grads = self.part.gradients()
        if self.client is not None:  # without shards (benchmarks, tests) nothing is pushed
            self._add_grads(self.accrued)
            self.since_push += 1
            if push:
                self._push()
        if local_lr is not None:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.add_(grads[name], alpha=-local_lr)
        self.part.zero_grad()

    def _push(self) -> None:
        self.client.push_ranges(self.ranges, self.accrued)  # Ray copies it at submission
        self.accrued[:] = 0.0
        self.since_push = 0

    # Sandblaster: per batch, fetch the point once; hold each portion's gradient until the
    # coordinator's verdict; stage the sum of the accepted ones under a tag on the shards.

    def fetch_vector(self, vector: str) -> None:
        """Load this partition's part of Sandblaster vector ``vector``; start a new batch."""
        self._load(self.client.fetch_vector_ranges(vector, self.ranges))
        self.held: dict[int, np.ndarray] = {}
        self.accrued[:] = 0.0

    def hold(self, portion: int) -> None:
        """Keep the gradient just computed as ``portion``'s, until its verdict."""
        grad = np.zeros_like(self.accrued)
        self._add_grads(grad)
        self.held[portion] = grad
        self.part.zero_grad()

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        """Add the accepted portions' gradients to the batch sum; forget the others."""
        for portion, keep in verdicts:
            grad = self.held.pop(portion, None)
            if grad is not None and keep:
                self.accrued += grad

    def stage(self, tag: str) -> bool:
        """Add the accepted sum into what the shards stage under ``tag``; empty it."""
        ok = self.client.stage_ranges(tag, self.ranges, self.accrued)
        self.accrued[:] = 0.0
        return ok

    def discard(self) -> None:
        self.held = {}
        self.accrued[:] = 0.0

    def finish(self) -> dict:
        """Push what is still accrued and wait until the shards applied it."""
        if self.since_push:
            self._push()
        if self.client is not None:
            self.client.wait()
        return self.counters()

    def counters(self) -> dict:
        c = self.client
        return {"bytes_sent": self.bytes_sent, "messages_sent": self.messages_sent,
                "rejected": c.rejected if c else 0, "pushes": c.pushes if c else 0}

    def state(self) -> tuple[dict, dict]:
        """This partition's parameter slices and their gradients (for tests and gathering)."""
        return ({n: p.detach().clone() for n, p in self.params.items()},
                {n: g.clone() for n, g in self.part.gradients().items()})


class PartitionGroup:
    """K partition actors running one model together, driven from the caller's process.

    ``shard_plan`` and ``shards`` (optional) connect each partition to the parameter server;
    ``options`` are Ray actor options for every worker (e.g. ``num_cpus``).
    """

    def __init__(self, model: nn.Module, plan: PartitionPlan, shard_plan: ShardPlan | None = None,
                 shards: list | None = None, replica: int = -1,
                 options: dict | None = None) -> None:
        self.plan, self.k = plan, plan.num_partitions
        self.workers = [PartitionWorker.options(**(options or {})).remote(
            plan, k, partition_piece(plan, k, model), shard_plan, shards, replica)
            for k in range(self.k)]

    def _pass(self, kind: str, messages: list[Message], rounds: Sequence[int]) -> list:
        """Submit every call of the pass in :func:`pass_schedule` order, each fed the driver's
        messages for it and references to what earlier calls sent it; return the references
        to what was sent to the driver. Nothing is waited for here."""
        first: dict[int, list] = defaultdict(list)
        for m in messages:
            first[m.dst].append([m])  # one tiny list per message, passed by value
        outputs, to_driver = {}, []
        for r, k, senders in pass_schedule(self.plan, rounds):
            received = first.pop(k, []) + [outputs[s][k] for s in senders]
            refs = self.workers[k].round.options(num_returns=self.k + 1).remote(
                kind, r, *received)
            outputs[r, k] = refs
            to_driver.append(refs[self.k])
        return to_driver

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for a batch ``x`` ``(N, *input)``."""
        refs = self._pass("activation", self.plan.input_messages(x), range(self.plan.rounds))
        return self.plan.assemble_output([m for batch in ray.get(refs) for m in batch])

    def backward(self, grad_output: torch.Tensor) -> None:
        """Send d(loss)/d(output) down; each partition accrues its parameters' gradients."""
        self._pass("gradient", self.plan.output_grad_messages(grad_output),
                   range(self.plan.rounds - 1, -1, -1))

    def step(self, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """Forward, ``loss_fn(output)``, backward (submitted, not waited for); the loss."""
        out = self.forward(x).requires_grad_()
        loss = loss_fn(out)
        loss.backward()
        self.backward(out.grad)
        return float(loss.detach())

    def fetch(self) -> list[ray.ObjectRef]:
        """Every partition fetches its own parameters before its next round (not waited for)."""
        return [w.fetch.remote() for w in self.workers]

    def end_step(self, push: bool, local_lr: float | None) -> None:
        for w in self.workers:
            w.end_step.remote(push, local_lr)

    def counters(self) -> list[dict]:
        return ray.get([w.counters.remote() for w in self.workers])

    def finish(self) -> list[dict]:
        return ray.get([w.finish.remote() for w in self.workers])

    def gather(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Full-shape parameters and gradients by model name, from every partition's slices."""
        states = ray.get([w.state.remote() for w in self.workers])
        return (gather_slices(self.plan, [p for p, _ in states]),
                gather_slices(self.plan, [g for _, g in states]))

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w)
