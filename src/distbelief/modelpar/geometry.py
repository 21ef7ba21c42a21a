"""Boxes, parameter slices and messages: the vocabulary every partition plan speaks.

A :data:`Box` is one half-open ``(start, stop)`` range per spatial axis. A :class:`ParamSlice`
is the part of one full-model parameter a partition owns; a :class:`Message` is one tensor
sent between partitions (or to and from the driver, :data:`DRIVER`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

Box = tuple[tuple[int, int], ...]  # one half-open (start, stop) range per axis
DRIVER = -1  # source of the input and of the output's gradient, sink of the output


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of ``a`` and ``b``, or None when they do not overlap."""
    box = tuple((max(lo, c), min(hi, d)) for (lo, hi), (c, d) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def box_numel(box: Box) -> int:
    """Number of positions in ``box``."""
    return math.prod(hi - lo for lo, hi in box)


def box_index(box: Box, origin: Box) -> tuple[slice, ...]:
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

