"""Spatial partition plan: blocks of output positions inside every locally connected layer.

:func:`plan_spatial` splits a stack of locally connected layers *within* every layer, as
DistBelief did: partition k owns one block of output positions of each layer (a grid cell
in 2D) and the weights of exactly those positions. To compute its block of layer l it
receives from its neighbours only the halo its windows read from layer l - 1, and in the
backward pass sends the gradient of that halo back to the owner, which sums it into its own.
An optional readout (``nn.Flatten`` + ``nn.Linear``) is split by input blocks: partition k
holds the weight columns of its own last-layer block and sends partition 0 its partial
logits ``(N, classes)``; partition 0 adds them and the bias, and sends the logits' gradient
back. That costs ``(K - 1) * N * classes`` values each way instead of gathering the whole
last layer. The plan is pure data (frozen dataclasses).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distbelief.errors import UserError
from distbelief.modelpar.geometry import DRIVER, Box, Message, ParamSlice, box_index, box_numel
from distbelief.modelpar.layers import LocallyConnectedNd

ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU,
               nn.Softplus, nn.Identity)


@dataclass(frozen=True)
class LCLayer:
    """Geometry of one locally connected layer and the elementwise modules after it."""

    name: str  # the module's key in the Sequential: its parameters are "<name>.weight", ...
    in_channels: int
    out_channels: int
    input_size: tuple[int, ...]
    output_size: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    bias: bool
    activations: tuple[nn.Module, ...] = ()

    def window(self, owned: Box) -> Box:
        """Input span read by output positions ``owned``, in input coordinates (may reach
        into the zero padding, i.e. below 0 or past ``input_size``)."""
        return tuple((a * s - p, (b - 1) * s + k - p) for (a, b), s, k, p in
                     zip(owned, self.stride, self.kernel_size, self.padding))

    def reads(self, owned: Box, region: Box) -> Box | None:
        """Smallest box holding every unit of ``region`` read by outputs ``owned``, or None."""
        box = []
        for (a, b), (lo, hi), s, k, p in zip(owned, region, self.stride, self.kernel_size,
                                             self.padding):
            starts = [o * s - p for o in range(a, b) if o * s - p < hi and o * s - p + k > lo]
            if not starts:
                return None
            box.append((max(lo, starts[0]), min(hi, starts[-1] + k)))
        return tuple(box)


@dataclass(frozen=True)
class Readout:
    """``nn.Linear`` over the flattened last LC layer, split by input blocks."""

    name: str  # the Linear's key in the Sequential
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class Transfer:
    """Halo ``box`` of layer ``layer - 1``'s output: ``src`` sends its activation to ``dst``
    before ``dst`` computes layer ``layer``, and ``dst`` sends its gradient back after."""

    layer: int
    src: int
    dst: int
    box: Box
    channels: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-example shape of the activation (and of its gradient)."""
        return (self.channels, *(hi - lo for lo, hi in self.box))


@dataclass(frozen=True)
class PartitionBlocks:
    """What partition ``index`` owns, reads and exchanges, layer by layer."""

    index: int
    owned: tuple[Box, ...]  # output positions of each LC layer
    reads: tuple[Box, ...]  # input positions of each LC layer its windows read (no padding)
    receive: tuple[Transfer, ...]  # halos from neighbours
    send: tuple[Transfer, ...]  # halos for neighbours
    params: tuple[ParamSlice, ...]


@dataclass(frozen=True)
class SpatialPlan:
    """Within-layer split of an LC stack over a grid of partitions (row-major index)."""

    layers: tuple[LCLayer, ...]
    readout: Readout | None
    grid: tuple[int, ...]
    partitions: tuple[PartitionBlocks, ...]
    unflatten: tuple[int, ...] | None = None  # a leading nn.Unflatten(1, unflatten)

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def rounds(self) -> int:
        return len(self.layers) + (self.readout is not None)

    def params(self, k: int) -> tuple[ParamSlice, ...]:
        return self.partitions[k].params

    def active(self, round: int) -> tuple[int, ...]:
        """The partitions with work in ``round``: all of them, but only partition 0 in the
        readout round."""
        if round == len(self.layers):
            return (0,)
        return tuple(range(len(self.partitions)))

    def input_messages(self, x: torch.Tensor) -> list[Message]:
        """The region of the input ``(N, C, *S)`` that each partition reads from the data
        (flat rows ``(N, C * prod(S))`` first go through the model's leading Unflatten)."""
        if self.unflatten is not None:
            x = x.reshape(x.shape[0], *self.unflatten)
        whole = tuple((0, n) for n in x.shape[2:])
        return [Message("activation", DRIVER, p.index, 0, p.reads[0],
                        x[box_index(p.reads[0], whole)])
                for p in self.partitions]

    def assemble_output(self, messages: Sequence[Message]) -> torch.Tensor:
        if self.readout is not None:
            return messages[0].tensor
        last, first = self.layers[-1], messages[0].tensor
        out = first.new_empty(first.shape[0], last.out_channels, *last.output_size)
        whole = tuple((0, n) for n in last.output_size)
        for m in messages:
            out[box_index(m.box, whole)] = m.tensor
        return out

    def output_grad_messages(self, grad: torch.Tensor) -> list[Message]:
        if self.readout is not None:
            return [Message("gradient", DRIVER, 0, len(self.layers), None, grad)]
        whole = tuple((0, n) for n in self.layers[-1].output_size)
        return [Message("gradient", DRIVER, p.index, len(self.layers) - 1, p.owned[-1],
                        grad[box_index(p.owned[-1], whole)]) for p in self.partitions]

    def planned_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes per step between partitions: halos both ways plus the readout's partial sums
        up and the logits' gradient down."""
        halos = sum(math.prod(t.shape) for p in self.partitions for t in p.send)
        partial = 0
        if self.readout is not None:
            partial = (len(self.partitions) - 1) * self.readout.out_features
        return 2 * batch * itemsize * (halos + partial)

    def naive_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes per step if partitions exchanged whole activations instead: every partition
        gathers all of layer l - 1 before layer l (and returns whole gradients), and the
        readout gathers the whole last layer on partition 0."""
        k = len(self.partitions)
        hidden = sum((k - 1) * layer.in_channels * math.prod(layer.input_size)
                     for layer in self.layers[1:])
        gather = 0
        if self.readout is not None:
            last = self.layers[-1]
            gather = last.out_channels * (math.prod(last.output_size)
                                          - box_numel(self.partitions[0].owned[-1]))
        return 2 * batch * itemsize * (hidden + gather)


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def _parse_stack(model: nn.Sequential
                 ) -> tuple[list[LCLayer], Readout | None, tuple[int, ...] | None]:
    """Read an optional leading ``nn.Unflatten(1, shape)``, LC layers (each with its trailing
    elementwise modules) and an optional readout."""
    keys, modules = zip(*model.named_children()) if len(model) else ((), ())
    layers: list[LCLayer] = []
    readout, i, unflatten = None, 0, None
    if modules and isinstance(modules[0], nn.Unflatten) and modules[0].dim == 1:
        unflatten, i = tuple(modules[0].unflattened_size), 1
    while i < len(modules):
        m = modules[i]
        if isinstance(m, LocallyConnectedNd):
            acts, j = [], i + 1
            while j < len(modules) and isinstance(modules[j], ELEMENTWISE):
                acts.append(modules[j])
                j += 1
            if layers and (m.in_channels, m.input_size) != (layers[-1].out_channels,
                                                            layers[-1].output_size):
                raise UserError(f"layer {i} takes {m.in_channels} x {m.input_size} but the layer "
                                f"below gives {layers[-1].out_channels} x {layers[-1].output_size}")
            if any(p >= k for p, k in zip(m.padding, m.kernel_size)):
                raise UserError(f"layer {i}: padding {m.padding} must be below the kernel size "
                                f"{m.kernel_size} so that every window touches the input")
            layers.append(LCLayer(keys[i], m.in_channels, m.out_channels, m.input_size,
                                  m.output_size, m.kernel_size, m.stride, m.padding,
                                  m.bias is not None, tuple(acts)))
            i = j
        elif (layers and i == len(modules) - 2 and isinstance(m, nn.Flatten)
              and (m.start_dim, m.end_dim) == (1, -1) and isinstance(modules[i + 1], nn.Linear)):
            linear = modules[i + 1]
            last = layers[-1]
            if linear.in_features != last.out_channels * math.prod(last.output_size):
                raise UserError(f"readout takes {linear.in_features} features, the last LC layer "
                                f"gives {last.out_channels * math.prod(last.output_size)}")
            readout = Readout(keys[i + 1], linear.in_features, linear.out_features,
                              linear.bias is not None)
            i += 2
        else:
            raise UserError(f"plan_spatial takes LocallyConnected layers with elementwise "
                            f"activations, then optionally Flatten() + Linear; layer {i} is "
                            f"{type(m).__name__}")
    if not layers:
        raise UserError("plan_spatial needs at least one LocallyConnected layer")
    if unflatten is not None and unflatten != (layers[0].in_channels, *layers[0].input_size):
        raise UserError(f"the leading Unflatten gives {unflatten}, the first LC layer takes "
                        f"{(layers[0].in_channels, *layers[0].input_size)}")
    return layers, readout, unflatten


def _spatial_params(layers: Sequence[LCLayer], readout: Readout | None, owned: Sequence[Box],
                    first: bool) -> tuple[ParamSlice, ...]:
    """The parameter slices of one partition: its output positions' weights and biases in
    every LC layer, its blocks' readout weight columns, and the readout bias if ``first``."""
    params = []
    for layer, box in zip(layers, owned):
        shapes = {"weight": (*layer.output_size, layer.out_channels, layer.in_channels,
                             *layer.kernel_size)}
        if layer.bias:
            shapes["bias"] = (*layer.output_size, layer.out_channels)
        for name, shape in shapes.items():
            whole = box + tuple((0, n) for n in shape[len(box):])
            params.append(ParamSlice(f"{layer.name}.{name}", shape, shape, whole))
    if readout is not None:
        last = layers[-1]
        shape = (readout.out_features, readout.in_features)
        view = (readout.out_features, last.out_channels, *last.output_size)
        box = ((0, view[0]), (0, view[1])) + owned[-1]
        params.append(ParamSlice(f"{readout.name}.weight", shape, view, box))
        if readout.bias and first:
            params.append(ParamSlice.whole(f"{readout.name}.bias",
                                           (readout.out_features,)))
    return tuple(params)


def plan_spatial(model: nn.Sequential, grid: int | Sequence[int]) -> SpatialPlan:
    """Split every LC layer of ``model`` into a ``grid`` of blocks of output positions.

    ``grid`` has one count per spatial axis (an int means that many blocks along the first
    axis: widths in 1D, rows in 2D); partition ``k`` is cell ``k`` of the grid in row-major
    order and owns that cell of every layer, blocks as equal as integer division allows.
    Every axis of every layer must have at least as many positions as the grid has blocks.
    """
    layers, readout, unflatten = _parse_stack(model)
    dims = len(layers[0].input_size)
    grid = (grid,) + (1,) * (dims - 1) if isinstance(grid, int) else tuple(grid)
    if len(grid) != dims or min(grid) < 1:
        raise UserError(f"grid {grid} must give a positive count for each of {dims} axes")
    for layer in layers:
        if any(g > n for g, n in zip(grid, layer.output_size)):
            raise UserError(f"grid {grid} has more blocks than layer {layer.name}'s "
                            f"{layer.output_size} output positions")
    cells = list(itertools.product(*(range(g) for g in grid)))
    owned = [[tuple(_blocks(n, g)[c] for n, g, c in zip(layer.output_size, grid, cell))
              for layer in layers] for cell in cells]
    transfers = [Transfer(i, src, dst, box, layer.in_channels)
                 for i, layer in enumerate(layers) if i > 0
                 for dst, src in itertools.permutations(range(len(cells)), 2)
                 if (box := layer.reads(owned[dst][i], owned[src][i - 1])) is not None]
    parts = []
    for k in range(len(cells)):
        reads = tuple(layer.reads(owned[k][i], tuple((0, n) for n in layer.input_size))
                      for i, layer in enumerate(layers))
        params = _spatial_params(layers, readout, owned[k], first=k == 0)
        parts.append(PartitionBlocks(k, tuple(owned[k]), reads,
                                      tuple(t for t in transfers if t.dst == k),
                                      tuple(t for t in transfers if t.src == k),
                                      tuple(params)))
    return SpatialPlan(tuple(layers), readout, grid, tuple(parts), unflatten)
