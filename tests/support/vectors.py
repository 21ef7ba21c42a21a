"""An in-process L-BFGS vector space: the tests' stand-in for the parameter-server shards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike, DTypeLike


class LocalVectorSpace:
    """A `VectorSpace` over in-process 1-D numpy arrays that counts what crosses the boundary.

    Indexing (``space["x"] = x0``, ``space["g"]``) is the shard side, used by the evaluate
    callback and by tests; a coordinator only calls the five operations. ``calls`` counts calls
    per operation and ``scalars_returned`` the floats handed back (only ``dots`` returns any).
    Vectors are stored as ``dtype`` (float64 or float32); dot products accumulate in float64.
    """

    def __init__(
        self, vectors: Mapping[str, ArrayLike] | None = None, dtype: DTypeLike = np.float64
    ) -> None:
        self.dtype = np.dtype(dtype)
        self._vectors: dict[str, np.ndarray] = {}
        for name, values in (vectors or {}).items():
            self[name] = values
        self.calls: Counter[str] = Counter()
        self.scalars_returned = 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self._vectors[name]

    def __setitem__(self, name: str, values: ArrayLike) -> None:
        self._vectors[name] = np.array(values, dtype=self.dtype).ravel()

    def __contains__(self, name: str) -> bool:
        return name in self._vectors

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        self.calls["dots"] += 1
        self.scalars_returned += len(pairs)
        return [float(self._f64(u) @ self._f64(v)) for u, v in pairs]

    def axpy(self, alpha: float, x: str, y: str) -> None:
        self.calls["axpy"] += 1
        self._vectors[y] += float(alpha) * self._vectors[x]

    def scale(self, alpha: float, x: str) -> None:
        self.calls["scale"] += 1
        self._vectors[x] *= float(alpha)

    def copy(self, src: str, dst: str) -> None:
        self.calls["copy"] += 1
        self._vectors[dst] = self._vectors[src].copy()

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        self.calls["lincomb"] += 1
        out = np.zeros_like(self._vectors[terms[0][1] if terms else dst])
        for c, name in terms:
            out += float(c) * self._vectors[name]
        self._vectors[dst] = out

    def _f64(self, name: str) -> np.ndarray:
        return self._vectors[name].astype(np.float64, copy=False)
