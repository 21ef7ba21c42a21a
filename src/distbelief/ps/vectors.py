"""A shard's Sandblaster protocol: named vectors over its slice, and staged gradients.

``"x"`` is the parameters themselves; every other name is a float32 vector of the slice's
size, created as zeros on first use. The coordinator sends small commands (dots, axpy, ...)
and gets back only scalars; replicas fetch a vector once per batch and stage gradient sums
under a tag, which the coordinator commits into a vector or aborts.
"""

from __future__ import annotations

import numpy as np

from distbelief.ps.optim import Rule
from distbelief.ps.slice import ShardSlice


class VectorStore(ShardSlice):
    """Named vectors (saved with the shard when asked) and gradients staged under tags."""

    def __init__(self, shard_id: int, init: np.ndarray, rule: Rule) -> None:
        super().__init__(shard_id, init, rule)
        self.vectors: dict[str, np.ndarray] = {}
        self.staged: dict[str, np.ndarray] = {}

    def vector(self, name: str) -> np.ndarray:
        if name == "x":
            return self.params
        if name not in self.vectors:
            self.vectors[name] = np.zeros_like(self.params)
        return self.vectors[name]

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Partial dot products of this slice, accumulated in float64."""
        return [float(np.dot(self.vector(a).astype(np.float64), self.vector(b)))
                for a, b in pairs]

    def axpy(self, alpha: float, x: str, y: str) -> None:
        self.vector(y)[:] += np.float32(alpha) * self.vector(x)

    def scale(self, alpha: float, x: str) -> None:
        self.vector(x)[:] *= np.float32(alpha)

    def copy(self, src: str, dst: str) -> None:
        np.copyto(self.vector(dst), self.vector(src))

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        out = np.zeros(self.params.size, dtype=np.float64)
        for c, name in terms:
            out += c * self.vector(name)
        np.copyto(self.vector(dst), out, casting="same_kind")

    def drop(self, names: list[str]) -> None:
        for name in names:
            self.vectors.pop(name, None)

    def fetch_vector(self, name: str) -> np.ndarray:
        view = self.vector(name).view()
        view.flags.writeable = False
        return view

    def fetch_vector_ranges(self, name: str, ranges: list[tuple[int, int]]) -> np.ndarray:
        """The concatenated values of ``ranges`` of vector ``name`` (a copy)."""
        return self.vector(name)[self._index(ranges)]

    def stage(self, tag: str, grad: np.ndarray) -> bool:
        """Hold a replica's gradient under ``tag`` until the coordinator commits or aborts it."""
        reason = self.check(grad)
        if reason is not None:
            self.rejected[reason] += 1
            return False
        self.staged[tag] = grad  # read-only is fine: commit only reads it
        return True

    def stage_ranges(self, tag: str, ranges: list[tuple[int, int]], values: np.ndarray) -> bool:
        """Add ``values`` (the concatenated gradient of ``ranges``) into what is staged under
        ``tag``, zeros elsewhere: the partitions of a model-parallel replica stage their own
        parameters' gradients one by one under one tag. False (and counted) if malformed."""
        index = self._checked_index(ranges, values)
        if index is None:
            return False
        staged = self.staged.get(tag)
        if staged is None or not staged.flags.writeable:
            staged = np.zeros_like(self.params) if staged is None else staged.copy()
            self.staged[tag] = staged
        staged[index] += values
        return True

    def commit(self, tag: str, into: str) -> bool:
        """Add the gradient staged under ``tag`` to vector ``into``; False if none is staged."""
        grad = self.staged.pop(tag, None)
        if grad is None:
            return False
        self.vector(into)[:] += grad
        return True

    def abort(self, tags: list[str]) -> None:
        for tag in tags:
            self.staged.pop(tag, None)

    def _saved_arrays(self, vectors: tuple[str, ...]) -> dict[str, np.ndarray]:
        arrays = super()._saved_arrays(vectors)
        return arrays | {f"vec:{n}": self.vectors[n] for n in vectors if n in self.vectors}

    def restore(self, arrays: dict[str, np.ndarray], version: int,
                counters: dict | None = None) -> None:
        """:meth:`ShardSlice.restore`, and the Sandblaster vectors saved with it."""
        super().restore(arrays, version, counters)
        for key, values in arrays.items():
            if key.startswith("vec:"):
                self.vectors[key[4:]] = np.array(values, dtype=np.float32)
