"""Partition actors: one model split over K Ray actors that exchange only boundary tensors.

A :class:`PartitionWorker` holds one partition of a layer-wise or spatial plan (see
:mod:`distbelief.modelpar.partitions`) and nothing else of the model: it is built from its own
layers or parameter slices only (:mod:`~distbelief.modelpar.core`). It fetches and pushes
just its own parameters, as flat ranges, from and to the parameter-server shards
(:mod:`~distbelief.modelpar.pushfetch`, :mod:`~distbelief.modelpar.staging`).

:class:`PartitionGroup` is the caller's side (a
:class:`~distbelief.modelpar.host.PartitionedHost`, a benchmark, a test): it submits every
partition's calls for a whole forward or backward pass at once and passes each call's
outgoing messages to the next round's calls as Ray object references, so boundary tensors go
from partition to partition through the object store and never through the caller. Only the
model's output (the logits) comes back to the caller, which computes the loss and sends the
output's gradient down.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import ray
import torch
from torch import nn

from distbelief.cluster import actor_options
from distbelief.modelpar.geometry import Message
from distbelief.modelpar.layerwise import LayerwisePlan
from distbelief.modelpar.plan import PartitionPlan, gather_slices
from distbelief.modelpar.pushfetch import PartitionPushFetch
from distbelief.modelpar.schedule import pass_schedule
from distbelief.modelpar.staging import PartitionStaging
from distbelief.ps.plan import ShardPlan


def partition_piece(plan: PartitionPlan, index: int, model: nn.Module) -> nn.Module | dict:
    """What partition ``index`` is built from: its own layers (layer-wise plans) or its own
    parameter slices (spatial plans), copied out of ``model`` so nothing else travels."""
    if isinstance(plan, LayerwisePlan):
        stage = plan.stages[index]
        return model[stage.start: stage.stop]
    full = dict(model.named_parameters())
    return {s.name: s.take(full[s.name].detach()).clone() for s in plan.params(index)}


@ray.remote
class PartitionWorker(PartitionPushFetch, PartitionStaging):
    """One partition actor: forward/backward rounds plus the parameter server protocols a
    run needs, Downpour's (:class:`PartitionPushFetch`) and Sandblaster's
    (:class:`PartitionStaging`), over its own parameters only."""


class PartitionGroup:
    """K partition actors running one model together, driven from the caller's process.

    ``shard_plan`` and ``shards`` (optional) connect each partition to the parameter server;
    ``options`` are Ray actor options for every worker (e.g. ``num_cpus``); ``precision``
    what the partitions' forward computes in and boundary tensors travel in (see
    :meth:`~distbelief.modelpar.core.PartitionCore.round`).
    """

    def __init__(self, model: nn.Module, plan: PartitionPlan, shard_plan: ShardPlan | None = None,
                 shards: list | None = None, replica: int = -1,
                 options: dict | None = None, precision: str = "float32") -> None:
        self.plan, self.k = plan, plan.num_partitions
        self.workers = [PartitionWorker.options(**actor_options() | (options or {})).remote(
            plan, k, partition_piece(plan, k, model), shard_plan, shards, replica, precision)
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

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient of the step just computed (waits for
        every partition's backward)."""
        return math.sqrt(sum(ray.get([w.grad_sqnorm.remote() for w in self.workers])))

    def end_step(self, push: bool, local_lr: float | None, scale: float = 1.0) -> None:
        for w in self.workers:
            w.end_step.remote(push, local_lr, scale)

    def prefetch(self) -> None:
        """Every partition sends its next fetch after its last push (not waited for)."""
        for w in self.workers:
            w.prefetch.remote()

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
