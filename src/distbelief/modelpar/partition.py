"""Split one model across K partitions and run it in one process with explicit messages.

Two plans, both pure data (frozen dataclasses):

- :func:`plan_layerwise` cuts an ``nn.Sequential`` into K consecutive stages of balanced cost;
  each cut carries one activation up and its gradient down.
- :func:`plan_spatial` splits a stack of locally connected layers *within* every layer, as
  DistBelief did: partition k owns one block of output positions of each layer (a grid cell
  in 2D) and the weights of exactly those positions. To compute its block of layer l it
  receives from its neighbours only the halo its windows read from layer l - 1, and in the
  backward pass sends the gradient of that halo back to the owner, which sums it into its own.
  An optional readout (``nn.Flatten`` + ``nn.Linear``) is split by input blocks: partition k
  holds the weight columns of its own last-layer block and sends partition 0 its partial
  logits ``(N, classes)``; partition 0 adds them and the bias, and sends the logits' gradient
  back. That costs ``(K - 1) * N * classes`` values each way instead of gathering the whole
  last layer.

A partition object holds only its own parameters and talks only through :class:`Message`
lists: ``forward(layer, received) -> sent`` and ``backward(layer, received) -> sent``, one
call per round, so each can become a Ray actor unchanged. :class:`Executor` drives the rounds
in process, routes messages and counts the bytes that cross partition boundaries.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from distbelief.errors import UserError
from distbelief.modelpar.layers import LocallyConnectedNd, locally_connected

Box = tuple[tuple[int, int], ...]  # one half-open (start, stop) range per axis
DRIVER = -1  # source of the input and of the output's gradient, sink of the output

ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU,
               nn.Softplus, nn.Identity)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(lo, c), min(hi, d)) for (lo, hi), (c, d) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _at(box: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a ``(N, C, *S)`` tensor whose spatial dims start at ``origin``."""
    return (slice(None), slice(None)) + tuple(slice(lo - o, hi - o)
                                              for (lo, hi), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class ParamSlice:
    """The part of one full-model parameter that a partition owns.

    The full tensor, of shape ``shape`` and named ``name`` in the model's
    ``named_parameters()``, is viewed as ``view`` (the same shape, except for a readout weight
    seen as ``(classes, channels, *positions)``) and ``box`` picks one range per view axis.
    """

    name: str
    shape: tuple[int, ...]
    view: tuple[int, ...]
    box: Box

    @classmethod
    def whole(cls, name: str, shape: Sequence[int]) -> ParamSlice:
        shape = tuple(shape)
        return cls(name, shape, shape, tuple((0, n) for n in shape))

    @property
    def part_shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    def _index(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in self.box)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This slice of a full-shape tensor (a view when the box allows)."""
        return full.reshape(self.view)[self._index()]

    def put(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """Write ``part`` (shape ``part_shape``) into this slice of ``full``, in place."""
        full.view(self.view)[self._index()] = part

    def flat_index(self) -> np.ndarray:
        """Row-major element offsets of this slice inside the full tensor, in slice order."""
        return np.arange(math.prod(self.shape)).reshape(self.view)[self._index()].ravel()


@dataclass
class Message:
    """One tensor sent between partitions (or to/from the driver, ``DRIVER``).

    ``layer`` is the round in which ``dst`` consumes it. ``box`` is the spatial region of the
    layer output that ``tensor`` ``(N, C, *box)`` covers, or None for whole tensors.
    """

    kind: str  # "activation" (forward) or "gradient" (backward)
    src: int
    dst: int
    layer: int
    box: Box | None
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


# ------------------------------------------------------------------------------------------
# Layer-wise plan: K consecutive stages


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


# ------------------------------------------------------------------------------------------
# Spatial plan: blocks of output positions inside every locally connected layer


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
class PartitionPlan:
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
    partitions: tuple[PartitionPlan, ...]
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
        return [Message("activation", DRIVER, p.index, 0, p.reads[0], x[_at(p.reads[0], whole)])
                for p in self.partitions]

    def assemble_output(self, messages: Sequence[Message]) -> torch.Tensor:
        if self.readout is not None:
            return messages[0].tensor
        last, first = self.layers[-1], messages[0].tensor
        out = first.new_empty(first.shape[0], last.out_channels, *last.output_size)
        whole = tuple((0, n) for n in last.output_size)
        for m in messages:
            out[_at(m.box, whole)] = m.tensor
        return out

    def output_grad_messages(self, grad: torch.Tensor) -> list[Message]:
        if self.readout is not None:
            return [Message("gradient", DRIVER, 0, len(self.layers), None, grad)]
        whole = tuple((0, n) for n in self.layers[-1].output_size)
        return [Message("gradient", DRIVER, p.index, len(self.layers) - 1, p.owned[-1],
                        grad[_at(p.owned[-1], whole)]) for p in self.partitions]

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
                                          - _numel(self.partitions[0].owned[-1]))
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
        parts.append(PartitionPlan(k, tuple(owned[k]), reads,
                                   tuple(t for t in transfers if t.dst == k),
                                   tuple(t for t in transfers if t.src == k), tuple(params)))
    return SpatialPlan(tuple(layers), readout, grid, tuple(parts), unflatten)


def plan_partitions(model: nn.Module, partitions: int, how: str = "auto",
                    input_shape: Sequence[int] | None = None) -> LayerwisePlan | SpatialPlan:
    """The plan behind ``--partitions K --partition-by HOW``.

    ``how`` is ``"space"`` (within every locally connected layer, :func:`plan_spatial`),
    ``"layers"`` (consecutive stages, :func:`plan_layerwise`, which needs one example's
    ``input_shape``) or ``"auto"``: space for a stack of locally connected layers, layers
    otherwise.
    """
    if how not in ("auto", "space", "layers"):
        raise UserError(f"--partition-by {how!r} is unknown: choose auto, space or layers")
    if not isinstance(model, nn.Sequential):
        raise UserError(f"--partitions {partitions} splits an nn.Sequential; the model is a "
                        f"{type(model).__name__}: wrap its layers in nn.Sequential")
    if how == "auto":
        lc = any(isinstance(m, LocallyConnectedNd) for m in model)
        how = "space" if lc else "layers"
    if how == "space":
        return plan_spatial(model, partitions)
    if input_shape is None:
        raise UserError("layer-wise partitioning needs the shape of one example")
    return plan_layerwise(model, partitions, input_shape)


# ------------------------------------------------------------------------------------------
# Partitions: each holds only its own parameters and speaks only in messages


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
            region = _intersect(box, span)
            if region is not None:
                x[_at(region, span)] = tensor[_at(region, box)]
        x.requires_grad_(layer > 0)
        out = locally_connected(x, *self._layer_params(spec), spec.stride)
        for act in spec.activations:
            out = act(out)
        self._saved[layer] = (x, out)
        sent = [Message("activation", self.index, t.dst, layer + 1, t.box,
                        out.detach()[_at(t.box, owned)].contiguous())
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
                grad[_at(m.box, owned)] += m.tensor
            out.backward(grad)
        if layer == 0:
            return []
        span, below = layers[layer].window(owned), self.part.owned[layer - 1]
        mine = torch.zeros_like(self._saved[layer - 1][1])
        region = _intersect(below, span)
        if region is not None:
            mine[_at(region, below)] = x.grad[_at(region, span)]
        self._grads[layer - 1] = mine
        return [Message("gradient", self.index, t.src, layer - 1, t.box, x.grad[_at(t.box, span)])
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


def pass_schedule(plan: Plan, rounds: Sequence[int]
                  ) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """The calls of one pass, in submission order: ``(round, partition, senders)``, where
    ``senders`` are the earlier calls ``(round, partition)`` whose messages to this partition
    are handed to this call (it keeps those meant for later rounds).

    Each call gets what other partitions' calls sent since its own previous call, and only
    from earlier rounds: what a round sends is always for a later round, and handing it to
    another partition's call in the same round would make the two wait for each other.
    """
    schedule, pending = [], defaultdict(list)
    for r in rounds:
        active = plan.active(r)
        for k in active:
            schedule.append((r, k, tuple(pending.pop(k, []))))
        for k in active:
            for dst in range(plan.num_partitions):
                if dst != k:
                    pending[dst].append((r, k))
    return schedule


# ------------------------------------------------------------------------------------------
# In-process executor


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


Plan = LayerwisePlan | SpatialPlan
AnyPartition = LayerwisePartition | SpatialPartition


@dataclass
class Executor:
    """Run a partitioned model's rounds in one process, passing only the plan's messages."""

    plan: Plan
    partitions: list[AnyPartition]
    traffic: Traffic = field(default_factory=Traffic)

    @classmethod
    def from_model(cls, model: nn.Sequential, plan: Plan) -> Executor:
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


def gather_slices(plan: Plan, parts: Sequence[Mapping[str, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """Full-shape tensors by model parameter name from each partition's slice values
    (``parts[k]`` keyed by full name, shaped like partition ``k``'s slices)."""
    full: dict[str, torch.Tensor] = {}
    for k, got in enumerate(parts):
        for s in plan.params(k):
            value = got[s.name]
            if s.name not in full:
                full[s.name] = value.new_zeros(s.shape)
            s.put(full[s.name], value)
    return full
