"""Server-side update rules, applied by each shard to its own slice (pure NumPy, in place).

Each rule keeps its per-element state (momentum buffer, Adagrad accumulator) in named
float32 arrays that the shard owns and checkpoints. ``apply`` works on any matching
views, so the same rule serves dense slices and gathered embedding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``p -= lr * g``."""

    lr: float
    state_names: tuple[str, ...] = ()

    def init_state(self, n: int) -> State:
        return {name: np.zeros(n, dtype=np.float32) for name in self.state_names}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        param -= np.float32(self.lr) * grad


@dataclass(frozen=True)
class Momentum(SGD):
    """Heavy-ball momentum as in ``torch.optim.SGD(momentum=mu)``: ``v = mu v + g; p -= lr v``."""

    momentum: float = 0.9
    state_names: tuple[str, ...] = ("velocity",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        v = state["velocity"]
        v *= np.float32(self.momentum)
        v += grad
        param -= np.float32(self.lr) * v


@dataclass(frozen=True)
class Adagrad(SGD):
    """Adagrad as in DistBelief: per-element rate ``lr / sqrt(eps + sum of past g**2)``."""

    eps: float = 1e-8
    state_names: tuple[str, ...] = ("accumulator",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        acc = state["accumulator"]
        acc += grad * grad
        step = acc + np.float32(self.eps)
        np.sqrt(step, out=step)
        np.divide(grad, step, out=step)
        step *= np.float32(self.lr)
        param -= step


def make_rule(name: str, lr: float, momentum: float = 0.9) -> SGD:
    """The update rule called ``name`` (``sgd``, ``momentum`` or ``adagrad``)."""
    if name == "sgd":
        return SGD(lr)
    if name == "momentum":
        return Momentum(lr, momentum=momentum)
    if name == "adagrad":
        return Adagrad(lr)
    raise ValueError(f"unknown optimizer {name!r}")
