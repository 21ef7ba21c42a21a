"""The in-process executor of a partitioned model: the tests' reference for model parallelism.

:class:`Executor` drives a :data:`~distbelief.modelpar.plan.PartitionPlan`'s rounds in one
process, routes messages in :func:`~distbelief.modelpar.schedule.pass_schedule` order and
counts the bytes that cross partition boundaries in :class:`Traffic`.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from distbelief.modelpar.core import PartitionCore
from distbelief.modelpar.geometry import DRIVER, Message
from distbelief.modelpar.layerwise import LayerwisePlan
from distbelief.modelpar.partitions import LayerwisePartition, SpatialPartition
from distbelief.modelpar.plan import PartitionPlan, gather_slices
from distbelief.modelpar.schedule import pass_schedule
from distbelief.modelpar.worker import partition_piece


@dataclass
class Traffic:
    """Bytes that crossed partition boundaries in one step (driver traffic not counted)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    messages: int = 0
    naive_bytes: int = 0  # the plan's figure for exchanging whole activations instead

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


AnyPartition = LayerwisePartition | SpatialPartition


@dataclass
class Executor:
    """Run a partitioned model's rounds in one process, passing only the plan's messages."""

    plan: PartitionPlan
    partitions: list[AnyPartition]
    traffic: Traffic = field(default_factory=Traffic)

    @classmethod
    def from_model(cls, model: nn.Sequential, plan: PartitionPlan) -> Executor:
        """One partition per plan entry, each copying just its slice of ``model``."""
        kind = LayerwisePartition if isinstance(plan, LayerwisePlan) else SpatialPartition
        return cls(plan, [kind.from_model(plan, k, model) for k in range(plan.num_partitions)])

    def _run(self, messages: list[Message], rounds: Sequence[int], backward: bool
             ) -> list[Message]:
        """Deliver ``messages`` and make the calls of :func:`pass_schedule` (the order a
        :class:`~distbelief.modelpar.worker.PartitionGroup` submits them in, each call fed
        only what its senders sent it); return the driver's messages."""
        inbox: dict[tuple[int, int], list[Message]] = defaultdict(list)
        to_driver: list[Message] = []

        def post(sent: list[Message], now: int) -> dict[int, list[Message]]:
            """Check and count what one call sent; keep its own; the rest by destination."""
            out: dict[int, list[Message]] = defaultdict(list)
            for m in sent:
                if m.dst == DRIVER:
                    to_driver.append(m)
                    continue
                if (m.layer - now) * direction <= 0:  # so that one round's calls could run at once
                    raise RuntimeError(f"partition {m.src} sent a message for round {m.layer} "
                                       f"in round {now}")
                if m.src == m.dst:
                    inbox[m.layer, m.dst].append(m)
                    continue
                out[m.dst].append(m)
                if m.src != DRIVER:
                    self.traffic.messages += 1
                    if backward:
                        self.traffic.backward_bytes += m.nbytes
                    else:
                        self.traffic.forward_bytes += m.nbytes
            return out

        direction = -1 if backward else 1
        first = post(messages, rounds[0] - direction)
        sent: dict[tuple[int, int], dict[int, list[Message]]] = {}
        for r, k, senders in pass_schedule(self.plan, rounds):
            for m in first.pop(k, []) + [m for s in senders for m in sent[s].pop(k, [])]:
                inbox[m.layer, k].append(m)
            part = self.partitions[k]
            step = part.backward if backward else part.forward
            sent[r, k] = post(step(r, inbox.pop((r, k), [])), r)
        undelivered = [m for out in sent.values() for ms in out.values() for m in ms]
        if undelivered or any(inbox.values()):
            raise RuntimeError("a partition message was never delivered to its round")
        return to_driver

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``x`` (``(N, *input)``), detached; resets :attr:`traffic`."""
        self.traffic = Traffic(naive_bytes=self.plan.naive_bytes(x.shape[0], x.element_size()))
        out = self._run(self.plan.input_messages(x), range(self.plan.rounds), False)
        return self.plan.assemble_output(out)

    def backward(self, grad_output: torch.Tensor) -> None:
        """Accumulate every partition's parameter gradients given d(loss)/d(output)."""
        self._run(self.plan.output_grad_messages(grad_output),
                  range(self.plan.rounds - 1, -1, -1), True)

    def step(self, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
        """Forward, ``loss_fn(output)``, backward; returns the (detached) scalar loss."""
        out = self.forward(x).requires_grad_()
        loss = loss_fn(out)
        loss.backward()
        self.backward(out.grad)
        return loss.detach()

    def zero_grad(self) -> None:
        for part in self.partitions:
            part.zero_grad()

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients by model parameter name, gathered from the slices."""
        return self._gather(lambda part: part.gradients())

    def parameters(self) -> dict[str, torch.Tensor]:
        """Full-shape parameters by model parameter name, gathered from the slices."""
        return self._gather(lambda part: {n: p.detach() for n, p in part.named_parameters()})

    def _gather(self, values: Callable[[AnyPartition], dict[str, torch.Tensor]]
                ) -> dict[str, torch.Tensor]:
        return gather_slices(self.plan, [values(part) for part in self.partitions])



class CoreGroup:
    """:class:`~distbelief.modelpar.core.PartitionCore` objects driven in one process the way
    a :class:`~distbelief.modelpar.worker.PartitionGroup` drives its actors: each call fed
    the driver's messages for it and what its senders' calls returned for it (as values, not
    object references), in :func:`pass_schedule` order."""

    def __init__(self, model: nn.Module, plan: PartitionPlan, precision: str = "float32"
                 ) -> None:
        threads = torch.get_num_threads()  # a core runs torch on one thread, as an actor does
        self.plan, self.k = plan, plan.num_partitions
        self.cores = [PartitionCore(plan, k, copy.deepcopy(partition_piece(plan, k, model)),
                                    precision=precision) for k in range(self.k)]
        torch.set_num_threads(threads)

    def _pass(self, kind: str, messages: list[Message], rounds: Sequence[int]) -> list[Message]:
        first: dict[int, list] = defaultdict(list)
        for m in messages:
            first[m.dst].append([m])
        outputs, to_driver = {}, []
        for r, k, senders in pass_schedule(self.plan, rounds):
            received = first.pop(k, []) + [outputs[s][k] for s in senders]
            outputs[r, k] = self.cores[k].round(kind, r, *received)
            to_driver += outputs[r, k][self.k]
        return to_driver

    def step(self, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]
             ) -> tuple[torch.Tensor, float]:
        """Forward, ``loss_fn(output)``, backward; the output (detached) and the loss."""
        sent = self._pass("activation", self.plan.input_messages(x), range(self.plan.rounds))
        out = self.plan.assemble_output(sent).requires_grad_()
        loss = loss_fn(out)
        loss.backward()
        self._pass("gradient", self.plan.output_grad_messages(out.grad),
                   range(self.plan.rounds - 1, -1, -1))
        return out.detach(), float(loss.detach())

    def gradients(self) -> dict[str, torch.Tensor]:
        return gather_slices(self.plan, [core.state()[1] for core in self.cores])

    def bytes_sent(self) -> int:
        """Bytes of the tensors that crossed partition boundaries (driver traffic not counted)."""
        return sum(core.bytes_sent for core in self.cores)
