"""A parameter-server shard: owns one contiguous slice, applies pushes, serves fetches.

:class:`ShardCore` is the whole logic, plain Python; :class:`ParameterShard` is the Ray
actor around it. Shards never talk to each other and take no global lock: each applies
its own update rule to its own slice, in the order pushes reach it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import ray

from distbelief.ps.codec import WIRE_DTYPES, all_finite, decode_into
from distbelief.ps.optim import SGD, make_rule

ACCEPTED_DTYPES = (np.float32,)
PUSH_DTYPES = tuple(WIRE_DTYPES.values())  # float32, float16, bfloat16 bits (uint16)


class ShardCore:
    """State of one shard: parameters (float32, shape ``(n,)``), rule state, version, stats.

    ``version`` counts applied pushes. Staleness of a push is the shard's version when it
    is applied minus the version the pushing replica last fetched.
    """

    def __init__(self, shard_id: int, init: np.ndarray, rule: SGD) -> None:
        self.shard_id = shard_id
        self.params = np.array(init, dtype=np.float32, copy=True).reshape(-1)
        self.rule = rule
        self.state = rule.init_state(self.params.size)
        self.version = 0
        self.fetches = 0
        self.rejected: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.pushes_by_replica: Counter[int] = Counter()
        self.vectors: dict[str, np.ndarray] = {}
        self.staged: dict[str, np.ndarray] = {}
        self._wide: np.ndarray | None = None  # float32 scratch for 16-bit pushes

    def fetch(self) -> tuple[int, np.ndarray]:
        """Current version and a read-only view of the slice (callers must copy to keep it)."""
        self.fetches += 1
        view = self.params.view()
        view.flags.writeable = False
        return self.version, view

    def check(self, grad: object) -> str | None:
        """Why ``grad`` may not be applied to the whole slice, or None if it may."""
        return self.check_shape(grad, self.params.shape)

    def check_shape(self, grad: object, shape: tuple[int, ...],
                    dtypes: tuple = ACCEPTED_DTYPES) -> str | None:
        """Why ``grad`` is not a finite array of ``shape`` and one of ``dtypes``, or None.

        Finiteness is checked here for float dtypes; bfloat16 bits after widening.
        """
        if not isinstance(grad, np.ndarray):
            return "type"
        if grad.dtype not in dtypes:
            return "dtype"
        if grad.shape != tuple(shape):
            return "shape"
        if grad.dtype.kind == "f" and not all_finite(grad):
            return "nonfinite"
        return None

    def push(self, grad: np.ndarray, fetched_version: int, replica: int = -1) -> bool:
        """Apply ``grad`` unless it is malformed; returns whether it was applied.

        ``grad`` is float32 or a 16-bit wire format of :mod:`distbelief.ps.codec`, widened
        to float32 here (parameters and rule state stay float32). A rejected push changes
        nothing but the rejection counter for its reason (``type``, ``dtype``, ``shape``,
        ``nonfinite``).
        """
        reason = self.check_shape(grad, self.params.shape, PUSH_DTYPES)
        if reason is None and grad.dtype != np.float32:
            if self._wide is None:
                self._wide = np.empty_like(self.params)
            grad = decode_into(grad, self._wide)
            reason = None if all_finite(grad) else "nonfinite"
        if reason is not None:
            self.rejected[reason] += 1
            return False
        self.staleness[self.version - int(fetched_version)] += 1
        self.rule.apply(self.params, grad, self.state)
        self.version += 1
        self.pushes_by_replica[int(replica)] += 1
        return True

    def push_fetch(self, grad: np.ndarray, fetched_version: int, replica: int = -1
                   ) -> tuple[bool, int, np.ndarray]:
        """:meth:`push`, then :meth:`fetch`, in one call: whether ``grad`` was applied, and
        the version and slice after it (one round trip where a replica pushes at the end of
        a step and fetches at the start of the next)."""
        applied = self.push(grad, fetched_version, replica)
        return (applied, *self.fetch())

    def push_part(self, grad: np.ndarray, lo: int, fetched_version: int,
                  replica: int = -1) -> bool:
        """:meth:`push` of ``grad[lo : lo + size]`` (a 1-D array covering several shards).

        A client puts one gradient in the object store for all shards on a node and each
        shard reads its own part of it, zero-copy; the part is checked as in :meth:`push`.
        """
        if isinstance(grad, np.ndarray) and grad.ndim == 1:
            grad = grad[lo: lo + self.params.size]
        return self.push(grad, fetched_version, replica)

    def save(self, path: str, vectors: tuple[str, ...] = ()) -> int:
        """Write parameters, rule state, counters and version to ``path`` atomically; the
        version. ``vectors`` names Sandblaster vectors to include too (as ``vec:NAME``)."""
        import json

        from distbelief.checkpoint import save_arrays

        arrays = {"params": self.params, **self.state}
        arrays |= {f"vec:{n}": self.vectors[n] for n in vectors if n in self.vectors}
        counters = {"fetches": self.fetches, "rejected": dict(self.rejected),
                    "pushes_by_replica": {str(k): v for k, v in self.pushes_by_replica.items()},
                    "staleness": {str(k): v for k, v in self.staleness.items()}}
        save_arrays(path, arrays, {"version": str(self.version), "shard": str(self.shard_id),
                                   "counters": json.dumps(counters)})
        return self.version

    def restore(self, arrays: dict[str, np.ndarray], version: int,
                counters: dict | None = None) -> None:
        """Load what :meth:`save` wrote (already validated by the caller): the slice, rule
        state, version, Sandblaster vectors and, if given, the counters :meth:`stats` shows."""
        np.copyto(self.params, arrays["params"])
        for name in self.state:
            np.copyto(self.state[name], arrays[name])
        for key, values in arrays.items():
            if key.startswith("vec:"):
                self.vectors[key[4:]] = np.array(values, dtype=np.float32)
        self.version = int(version)
        if counters:
            self.fetches = int(counters.get("fetches", 0))
            self.rejected = Counter(counters.get("rejected", {}))
            self.pushes_by_replica = Counter({int(k): v for k, v in
                                              counters.get("pushes_by_replica", {}).items()})
            self.staleness = Counter({int(k): v for k, v in
                                      counters.get("staleness", {}).items()})

    # Sandblaster: named vectors over this shard's slice ("x" is the parameters themselves).
    # The coordinator sends these small commands and gets back only scalars.

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

    def stage(self, tag: str, grad: np.ndarray) -> bool:
        """Hold a replica's gradient under ``tag`` until the coordinator commits or aborts it."""
        reason = self.check(grad)
        if reason is not None:
            self.rejected[reason] += 1
            return False
        self.staged[tag] = grad  # read-only is fine: commit only reads it
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

    # Ranged (sparse) access: a model partition or an embedding lookup touches only some
    # elements. ``ranges`` are half-open (start, stop) pairs in this shard's coordinates.

    def fetch_vector_ranges(self, name: str, ranges: list[tuple[int, int]]) -> np.ndarray:
        """The concatenated values of ``ranges`` of vector ``name`` (a copy)."""
        return self.vector(name)[self._index(ranges)]

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

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> tuple[int, np.ndarray]:
        """Current version and the concatenated values of ``ranges`` (a copy)."""
        self.fetches += 1
        index = self._index(ranges)
        return self.version, self.params[index]

    def push_ranges(self, ranges: list[tuple[int, int]], grad: np.ndarray,
                    fetched_version: int, replica: int = -1) -> bool:
        """Apply ``grad`` (the concatenated gradient of ``ranges``) to those elements only.

        The update rule and its state see just the touched elements, so Adagrad or
        momentum on a subset equals the dense rule restricted to it. Malformed input is
        rejected and counted, as for :meth:`push`; ranges outside the slice count as
        ``range``.
        """
        index = self._checked_index(ranges, grad)
        if index is None:
            return False
        self.staleness[self.version - int(fetched_version)] += 1
        param = self.params[index]
        state = {k: v[index] for k, v in self.state.items()}
        self.rule.apply(param, grad, state)
        self.params[index] = param
        for k, v in state.items():
            self.state[k][index] = v
        self.version += 1
        self.pushes_by_replica[int(replica)] += 1
        return True

    def _checked_index(self, ranges: list[tuple[int, int]], values: object) -> np.ndarray | None:
        """The element index of ``ranges`` if they lie in the slice and ``values`` is a finite
        float array of matching length; else None, with the reason counted as a rejection."""
        try:
            index = self._index(ranges)
        except ValueError:
            self.rejected["range"] += 1
            return None
        reason = self.check_shape(values, (index.size,))
        if reason is not None:
            self.rejected[reason] += 1
            return None
        return index

    def _index(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        n = self.params.size
        if any(not (0 <= lo <= hi <= n) for lo, hi in ranges):
            raise ValueError(f"a range falls outside 0..{n}")
        if not ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(lo, hi) for lo, hi in ranges])

    def stats(self) -> dict:
        """JSON-ready counters: updates, fetches, rejections by reason, staleness histogram."""
        return {
            "shard": self.shard_id,
            "size": int(self.params.size),
            "version": self.version,
            "updates": self.version,
            "fetches": self.fetches,
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "pushes_by_replica": {str(k): v for k, v in sorted(self.pushes_by_replica.items())},
        }


@ray.remote
class ParameterShard(ShardCore):
    """Ray actor holding one shard: every :class:`ShardCore` method is a remote method."""

    def __init__(self, shard_id: int, init: np.ndarray, optimizer: str, lr: float,
                 momentum: float = 0.9, restored: dict | None = None) -> None:
        super().__init__(shard_id, init, make_rule(optimizer, lr, momentum))
        if restored is not None:
            self.restore(restored["arrays"], restored["version"], restored.get("counters"))

    def stats(self) -> dict:
        return super().stats() | {"node": self.node()}

    def node(self) -> str:
        """The Ray node this shard runs on (clients send shards on one node one object)."""
        return ray.get_runtime_context().get_node_id()
