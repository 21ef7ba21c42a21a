"""Server-side update rules, applied by each shard to its own slice (pure NumPy, in place).

Each rule keeps its per-element state (momentum buffer, Adagrad accumulator) in named
float32 arrays that the shard owns and checkpoints. ``apply`` works on any matching
views, so the same rule serves dense slices and gathered embedding rows.

``apply`` walks contiguous arrays in chunks of :data:`CHUNK` elements with one reused
scratch chunk, so a multi-megabyte update allocates nothing and its temporaries stay in
cache; the arithmetic (and so every bit of the result) is the same as whole-array NumPy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

State = dict[str, np.ndarray]

CHUNK = 1 << 17  # elements per chunk (512 KiB of float32): temporaries stay in L2


def chunks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """Matching 1-D chunks of same-shape arrays, each tuple followed by a scratch chunk.

    Contiguous arrays are walked as views of :data:`CHUNK` elements with one scratch
    buffer reused throughout; anything else comes back whole with a whole-size scratch.
    """
    if not all(a.flags.c_contiguous and a.shape == arrays[0].shape for a in arrays):
        yield (*arrays, np.empty(arrays[0].shape, dtype=np.float32))
        return
    flat = [a.reshape(-1) for a in arrays]
    n = flat[0].size
    scratch = np.empty(min(n, CHUNK), dtype=np.float32)
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        yield (*(a[lo:hi] for a in flat), scratch[: hi - lo])


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``p -= lr * g``."""

    lr: float
    state_names: tuple[str, ...] = ()

    def init_state(self, n: int) -> State:
        return {name: np.zeros(n, dtype=np.float32) for name in self.state_names}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        lr = np.float32(self.lr)
        for p, g, t in chunks(param, grad):
            np.multiply(g, lr, out=t)
            p -= t


@dataclass(frozen=True)
class Momentum(SGD):
    """Heavy-ball momentum as in ``torch.optim.SGD(momentum=mu)``: ``v = mu v + g; p -= lr v``."""

    momentum: float = 0.9
    state_names: tuple[str, ...] = ("velocity",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        lr, mu = np.float32(self.lr), np.float32(self.momentum)
        for p, g, v, t in chunks(param, grad, state["velocity"]):
            v *= mu
            v += g
            np.multiply(v, lr, out=t)
            p -= t


@dataclass(frozen=True)
class Adagrad(SGD):
    """Adagrad as in DistBelief: per-element rate ``lr / sqrt(eps + sum of past g**2)``."""

    eps: float = 1e-8
    state_names: tuple[str, ...] = ("accumulator",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        lr, eps = np.float32(self.lr), np.float32(self.eps)
        for p, g, acc, t in chunks(param, grad, state["accumulator"]):
            np.multiply(g, g, out=t)
            acc += t
            np.add(acc, eps, out=t)
            np.sqrt(t, out=t)
            np.divide(g, t, out=t)
            t *= lr
            p -= t


def make_rule(name: str, lr: float, momentum: float = 0.9) -> SGD:
    """The update rule called ``name`` (``sgd``, ``momentum`` or ``adagrad``)."""
    if name == "sgd":
        return SGD(lr)
    if name == "momentum":
        return Momentum(lr, momentum=momentum)
    if name == "adagrad":
        return Adagrad(lr)
    raise ValueError(f"unknown optimizer {name!r}")
