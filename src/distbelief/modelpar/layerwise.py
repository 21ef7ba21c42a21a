"""Layer-wise partition plan: an ``nn.Sequential`` cut into K consecutive stages.

:func:`plan_layerwise` balances the stages' cost; each cut carries one activation up and its
gradient down. The plan is pure data (frozen dataclasses).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from distbelief.errors import UserError
from distbelief.modelpar.geometry import DRIVER, Message, ParamSlice


@dataclass(frozen=True)
class Stage:
    """Partition ``index`` runs layers ``start:stop`` of the Sequential; ``cost`` their sum."""

    index: int
    start: int
    stop: int
    cost: float
    params: tuple[ParamSlice, ...]


@dataclass(frozen=True)
class Cut:
    """The boundary before layer ``layer``: per-example shapes that cross it."""

    layer: int
    activation_shape: tuple[int, ...]  # going up
    gradient_shape: tuple[int, ...]  # coming down


@dataclass(frozen=True)
class LayerwisePlan:
    """Stages of a Sequential and the cut tensors between consecutive stages."""

    stages: tuple[Stage, ...]
    cuts: tuple[Cut, ...]

    @property
    def num_partitions(self) -> int:
        return len(self.stages)

    @property
    def rounds(self) -> int:
        return len(self.stages)

    def params(self, k: int) -> tuple[ParamSlice, ...]:
        return self.stages[k].params

    def active(self, round: int) -> tuple[int, ...]:
        """The partitions with work in ``round`` (forward and backward alike)."""
        return (round,)

    def input_messages(self, x: torch.Tensor) -> list[Message]:
        return [Message("activation", DRIVER, 0, 0, None, x)]

    def assemble_output(self, messages: Sequence[Message]) -> torch.Tensor:
        return messages[0].tensor

    def output_grad_messages(self, grad: torch.Tensor) -> list[Message]:
        last = len(self.stages) - 1
        return [Message("gradient", DRIVER, last, last, None, grad)]

    def planned_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes per step over all cuts: each activation up and its gradient down."""
        return sum(batch * itemsize * (math.prod(c.activation_shape)
                                       + math.prod(c.gradient_shape)) for c in self.cuts)

    naive_bytes = planned_bytes  # a layer cut already sends only the tensor that crosses it


def _split(prefix: np.ndarray, parts: int, combine: Callable[[float, float], float],
           score: Callable[[float], float], limit: float) -> tuple[float, list[int]]:
    """Best ``combine``-d ``score`` over splits into ``parts`` non-empty consecutive stages whose
    costs stay within ``limit``; returns it and the stage boundaries ``[0, ..., n]``."""
    n = len(prefix) - 1
    best = np.full((parts + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((parts + 1, n + 1), dtype=int)
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for m in range(j - 1, i):
                stage = prefix[i] - prefix[m]
                value = combine(best[j - 1, m], score(stage)) if stage <= limit else np.inf
                if value < best[j, i]:
                    best[j, i], choice[j, i] = value, m
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(int(choice[j, bounds[-1]]))
    return float(best[parts, n]), bounds[::-1]


def _balance(costs: Sequence[float], parts: int) -> list[int]:
    """Stage boundaries ``[0, ..., len(costs)]``: the smallest largest stage cost, and among
    the splits that reach it the most even one (least sum of squared stage costs)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    bottleneck, _ = _split(prefix, parts, max, lambda c: c, np.inf)
    limit = bottleneck + 1e-9 * max(1.0, bottleneck)
    return _split(prefix, parts, lambda a, b: a + b, lambda c: c * c, limit)[1]


def _meta_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run ``layer`` on meta tensors: shapes only, no memory and no arithmetic."""
    state = {n: torch.empty_like(t, device="meta")
             for n, t in itertools.chain(layer.named_parameters(), layer.named_buffers())}
    return functional_call(layer, state, (x,))


def plan_layerwise(model: nn.Sequential, partitions: int, input_shape: Sequence[int],
                   cost: Sequence[float] | None = None) -> LayerwisePlan:
    """Cut ``model`` into ``partitions`` consecutive stages with the smallest largest cost.

    ``cost`` gives one number per layer (e.g. FLOPs); by default a layer costs its number of
    trainable parameter elements. ``input_shape`` is one example's shape, without the batch
    dim; boundary shapes are found by a shape-only (meta device) forward pass.
    """
    layers = list(model)
    if not 1 <= partitions <= len(layers):
        raise UserError(f"cannot cut {len(layers)} layers into {partitions} stages: pass "
                        f"between 1 and {len(layers)} partitions")
    if cost is None:
        cost = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in layers]
    if len(cost) != len(layers):
        raise UserError(f"cost has {len(cost)} entries for {len(layers)} layers")
    dtype = next(model.parameters(), torch.empty(0)).dtype
    shapes, x = [], torch.empty(1, *input_shape, device="meta", dtype=dtype)
    for layer in layers:
        shapes.append(tuple(x.shape[1:]))
        x = _meta_forward(layer, x)
    bounds = _balance(cost, partitions)
    stages = []
    for k, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        params = tuple(ParamSlice.whole(n, p.shape) for n, p in model[start:stop].named_parameters()
                       if p.requires_grad)
        stages.append(Stage(k, start, stop, float(sum(cost[start:stop])), params))
    cuts = tuple(Cut(b, shapes[b], shapes[b]) for b in bounds[1:-1])
    return LayerwisePlan(tuple(stages), cuts)
