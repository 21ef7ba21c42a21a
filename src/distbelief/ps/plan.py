"""ShardPlan: which slice of which tensor lives on which parameter-server shard (pure).

All parameters are laid end to end in one flat float32 vector (in the model's
``named_parameters()`` order); shard ``i`` owns the contiguous range
``bounds[i]:bounds[i + 1]`` of it. Cuts fall on tensor boundaries when one is near, so small
tensors stay whole, and inside a tensor otherwise, so a large tensor is cut into contiguous
chunks and no shard holds much more than total / S elements.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from distbelief.errors import UserError

SNAP_TOLERANCE = 0.1  # a cut may move this fraction of the ideal shard size to a tensor edge


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor's place in the flat vector: elements ``offset : offset + numel``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one tensor stored on one shard (all offsets in elements)."""

    name: str
    tensor_start: int
    shard_start: int
    length: int


@dataclass(frozen=True)
class ShardPlan:
    """The split of a model's parameters over ``shards`` server shards."""

    tensors: tuple[TensorSpec, ...]
    bounds: tuple[int, ...]

    @classmethod
    def build(cls, shapes: Sequence[tuple[str, tuple[int, ...]]], shards: int) -> ShardPlan:
        """Plan ``shards`` contiguous slices over tensors given as ``(name, shape)`` pairs."""
        specs, offset = [], 0
        for name, shape in shapes:
            spec = TensorSpec(name, tuple(int(d) for d in shape), offset)
            specs.append(spec)
            offset += spec.numel
        total = offset
        if shards < 1:
            raise UserError(f"--shards must be >= 1 (got {shards})")
        if shards > total:
            raise UserError(f"--shards {shards} exceeds the model's {total} parameter elements: "
                            f"pass --shards {total} or fewer")
        edges = [s.offset for s in specs] + [total]
        ideal = total / shards
        cuts = [0]
        for k in range(1, shards):
            cut = round(k * ideal)
            i = bisect.bisect_left(edges, cut)
            near = min((e for e in edges[max(i - 1, 0): i + 1]), key=lambda e: abs(e - cut))
            if abs(near - cut) <= SNAP_TOLERANCE * ideal:
                cut = near
            cut = min(max(cut, cuts[-1] + 1), total - (shards - k))
            cuts.append(cut)
        cuts.append(total)
        return cls(tuple(specs), tuple(cuts))

    @classmethod
    def for_arrays(cls, arrays: Mapping[str, np.ndarray], shards: int) -> ShardPlan:
        return cls.build([(n, tuple(a.shape)) for n, a in arrays.items()], shards)

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def shard_size(self, shard: int) -> int:
        return self.bounds[shard + 1] - self.bounds[shard]

    def shard_range(self, shard: int) -> tuple[int, int]:
        return self.bounds[shard], self.bounds[shard + 1]

    def pieces(self, shard: int) -> list[Piece]:
        """The runs of tensors that shard ``shard`` holds, in flat order."""
        lo, hi = self.shard_range(shard)
        out = []
        for spec in self.tensors:
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
            if a < b:
                out.append(Piece(spec.name, a - spec.offset, a - lo, b - a))
        return out

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """Lay named arrays end to end as one float32 vector of length ``numel``."""
        flat = np.empty(self.numel, dtype=np.float32)
        for spec in self.tensors:
            value = np.asarray(arrays[spec.name])
            if tuple(value.shape) != spec.shape:
                raise UserError(f"tensor {spec.name!r} has shape {tuple(value.shape)}, the plan "
                                f"expects {spec.shape}: build the plan from the same model")
            flat[spec.offset: spec.offset + spec.numel] = value.reshape(-1)
        return flat

    def split(self, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One contiguous float32 array per shard."""
        return self.split_flat(self.flatten(arrays))

    def split_flat(self, flat: np.ndarray) -> list[np.ndarray]:
        """Copies of each shard's range of a flat vector of length ``numel``."""
        return [flat[lo:hi].copy() for lo, hi in zip(self.bounds[:-1], self.bounds[1:])]

    def assemble(self, parts: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Inverse of :meth:`split`: named arrays in their original shapes."""
        if len(parts) != self.shards:
            raise ValueError(f"expected {self.shards} shard arrays, got {len(parts)}")
        return self.unflatten(np.concatenate([np.asarray(p).reshape(-1) for p in parts]))

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named float32 copies, in their shapes, of a flat vector of length ``numel``."""
        if flat.size != self.numel:
            raise ValueError(f"flat vector holds {flat.size} elements, the plan {self.numel}")
        flat = np.asarray(flat, dtype=np.float32)
        return {s.name: flat[s.offset: s.offset + s.numel].reshape(s.shape).copy()
                for s in self.tensors}
