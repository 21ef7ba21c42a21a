"""Partitions: each holds only its own parameters and speaks only in messages.

A partition object talks only through :class:`~distbelief.modelpar.geometry.Message` lists:
``forward(layer, received) -> sent`` and ``backward(layer, received) -> sent``, one call per
round, so each can run inside a Ray actor unchanged
(:class:`~distbelief.modelpar.worker.PartitionWorker`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from distbelief.errors import UserError
from distbelief.modelpar.geometry import DRIVER, Message, ParamSlice, box_index, intersect
from distbelief.modelpar.layers import locally_connected
from distbelief.modelpar.layerwise import LayerwisePlan
from distbelief.modelpar.spatial import LCLayer, SpatialPlan


class _Partition:
    """What every partition offers a parameter server: its slices, by full-model name."""

    index: int
    slices: tuple[ParamSlice, ...]
    _params: dict[str, nn.Parameter]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(full-model name, owned slice)`` pairs; see :meth:`param_slices` for where."""
        yield from self._params.items()

    def param_slices(self) -> tuple[ParamSlice, ...]:
        """Where each owned slice sits in the full model's parameters, in the same order."""
        return self.slices

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy fresh slice values (keyed by full name, shaped like the slices) in place."""
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(values[name])

    def gradients(self) -> dict[str, torch.Tensor]:
        """Gradients of the owned slices (zeros where none flowed), keyed by full name."""
        return {n: torch.zeros_like(p) if p.grad is None else p.grad
                for n, p in self._params.items()}

    def zero_grad(self) -> None:
        for p in self._params.values():
            p.grad = None


class LayerwisePartition(_Partition):
    """One stage of a layer-wise plan: a copy of its layers, acting in round ``index``."""

    def __init__(self, plan: LayerwisePlan, index: int, layers: nn.Sequential) -> None:
        self.index, self.stage = index, plan.stages[index]
        self.last = index == plan.num_partitions - 1
        self.slices = self.stage.params
        self.layers = layers
        params = dict(layers.named_parameters())
        self._params = {s.name: params[s.name] for s in self.slices}
        self._saved: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_model(cls, plan: LayerwisePlan, index: int, model: nn.Sequential
                   ) -> LayerwisePartition:
        stage = plan.stages[index]
        return cls(plan, index, copy.deepcopy(model[stage.start:stage.stop]))

    def forward(self, layer: int, received: Sequence[Message]) -> list[Message]:
        """Round ``layer``: run this stage on the one activation received, send it up."""
        if layer != self.index:
            return []
        x = received[0].tensor.detach().requires_grad_(self.index > 0)
        out = self.layers(x)
        self._saved = (x, out)
        dst = DRIVER if self.last else self.index + 1
        return [Message("activation", self.index, dst, self.index + 1, None, out.detach())]

    def backward(self, layer: int, received: Sequence[Message]) -> list[Message]:
        """Round ``layer``: back-propagate the gradient received, send the input's down."""
        if layer != self.index:
            return []
        x, out = self._saved
        self._saved = None
        out.backward(received[0].tensor)
        if self.index == 0:
            return []
        return [Message("gradient", self.index, self.index - 1, self.index - 1, None, x.grad)]


class SpatialPartition(_Partition):
    """Partition ``index`` of a spatial plan: its blocks of every LC layer (and of the readout).

    Round ``l < len(layers)`` computes its block of layer ``l`` from its own block of layer
    ``l - 1`` (or the data) plus the halos received; round ``len(layers)`` (readout plans only)
    runs on partition 0 and adds the partial logits.
    """

    def __init__(self, plan: SpatialPlan, index: int, params: Mapping[str, torch.Tensor]) -> None:
        self.plan, self.index = plan, index
        self.part = plan.partitions[index]
        self.slices = self.part.params
        self._params = {s.name: nn.Parameter(params[s.name].detach().clone())
                        for s in self.slices}
        for s, p in zip(self.slices, self._params.values()):
            if tuple(p.shape) != s.part_shape:
                raise UserError(f"{s.name} slice has shape {tuple(p.shape)}, expected "
                                f"{s.part_shape}")
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}  # local share of each owned block's gradient
        self._partial: torch.Tensor | None = None
        self._logits_grad: torch.Tensor | None = None

    @classmethod
    def from_model(cls, plan: SpatialPlan, index: int, model: nn.Module) -> SpatialPartition:
        full = dict(model.named_parameters())
        return cls(plan, index, {s.name: s.take(full[s.name].detach())
                                 for s in plan.partitions[index].params})

    def _layer_params(self, layer: LCLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._params[f"{layer.name}.weight"], self._params.get(f"{layer.name}.bias")

    def forward(self, layer: int, received: Sequence[Message]) -> list[Message]:
        """Round ``layer``: compute this partition's block; send halos, partials or output."""
        layers = self.plan.layers
        if layer == len(layers):
            return self._readout_forward(received)
        spec, owned = layers[layer], self.part.owned[layer]
        span = spec.window(owned)
        pieces = [(m.box, m.tensor) for m in received]
        if layer > 0:
            pieces.append((self.part.owned[layer - 1], self._saved[layer - 1][1].detach()))
        first = pieces[0][1]
        x = first.new_zeros(first.shape[0], spec.in_channels, *(hi - lo for lo, hi in span))
        for box, tensor in pieces:  # owned block and halos are disjoint; the rest is zeros
            region = intersect(box, span)
            if region is not None:
                x[box_index(region, span)] = tensor[box_index(region, box)]
        x.requires_grad_(layer > 0)
        out = locally_connected(x, *self._layer_params(spec), spec.stride)
        for act in spec.activations:
            out = act(out)
        self._saved[layer] = (x, out)
        sent = [Message("activation", self.index, t.dst, layer + 1, t.box,
                        out.detach()[box_index(t.box, owned)].contiguous())
                for t in self.part.send if t.layer == layer + 1]
        if layer < len(layers) - 1:
            return sent
        if self.plan.readout is None:
            return [Message("activation", self.index, DRIVER, layer, owned, out.detach())]
        weight = self._params[f"{self.plan.readout.name}.weight"]
        self._partial = out.reshape(out.shape[0], -1) @ weight.reshape(weight.shape[0], -1).T
        if self.index == 0:
            return []
        return [Message("activation", self.index, 0, layer + 1, None, self._partial.detach())]

    def _readout_forward(self, received: Sequence[Message]) -> list[Message]:
        if self.index != 0:
            return []
        logits = self._partial.detach() + sum(m.tensor for m in received)
        bias = self._params.get(f"{self.plan.readout.name}.bias")
        if bias is not None:
            logits = logits + bias.detach()
        return [Message("activation", 0, DRIVER, len(self.plan.layers), None, logits)]

    def backward(self, layer: int, received: Sequence[Message]) -> list[Message]:
        """Round ``layer``: back-propagate this block's gradient (own share plus neighbours'
        halo gradients); send the gradient of each halo it read back to its owner."""
        layers = self.plan.layers
        if layer == len(layers):
            return self._readout_backward(received)
        x, out = self._saved.pop(layer)
        owned = self.part.owned[layer]
        if layer == len(layers) - 1 and self.plan.readout is not None:
            grad = self._logits_grad if self.index == 0 else received[0].tensor
            self._partial.backward(grad)
            self._partial = self._logits_grad = None
        else:
            grad = self._grads.pop(layer, None)
            grad = torch.zeros_like(out) if grad is None else grad
            for m in received:
                grad[box_index(m.box, owned)] += m.tensor
            out.backward(grad)
        if layer == 0:
            return []
        span, below = layers[layer].window(owned), self.part.owned[layer - 1]
        mine = torch.zeros_like(self._saved[layer - 1][1])
        region = intersect(below, span)
        if region is not None:
            mine[box_index(region, below)] = x.grad[box_index(region, span)]
        self._grads[layer - 1] = mine
        return [Message("gradient", self.index, t.src, layer - 1, t.box,
                        x.grad[box_index(t.box, span)])
                for t in self.part.receive if t.layer == layer]

    def _readout_backward(self, received: Sequence[Message]) -> list[Message]:
        if self.index != 0:
            return []
        grad = received[0].tensor
        bias = self._params.get(f"{self.plan.readout.name}.bias")
        if bias is not None:
            bias.grad = grad.sum(0) if bias.grad is None else bias.grad + grad.sum(0)
        self._logits_grad = grad
        return [Message("gradient", 0, k, len(self.plan.layers) - 1, None, grad)
                for k in range(1, self.plan.num_partitions)]
