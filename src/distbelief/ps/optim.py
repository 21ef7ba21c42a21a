"""Server-side update rules, applied by each shard to its own slice (in place).

:func:`make_rule` turns ``--optimizer``, ``--lr``, ``--momentum``, ``--optimizer-arg`` and
``--lr-schedule`` into a rule: one of the chunked NumPy rules here (``sgd``, ``momentum``,
``adagrad``) or a :class:`~distbelief.ps.torchrule.TorchRule` running any element-wise
``torch.optim`` optimizer over the slice. Every rule keeps its state in named float32
arrays that the shard owns and checkpoints (:class:`Rule`).

The NumPy rules' ``apply`` works on any matching views, so they also serve gathered
embedding rows and model-parallel ranges (``rows_ok``); torch rules bind to one fixed
slice and serve dense pushes only.

``apply`` walks contiguous arrays in chunks of :data:`CHUNK` elements with one reused
scratch chunk, so a multi-megabyte update allocates nothing and its temporaries stay in
cache; the arithmetic (and so every bit of the result) is the same as whole-array NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from distbelief.errors import UserError
from distbelief.ps.schedules import CONSTANT, Schedule, parse_schedule, scheduled_lr

State = dict[str, np.ndarray]

class Rule(Protocol):
    """What a shard needs of an update rule.

    ``state_names``: the state arrays, in checkpoint order; ``scalar_names``: those of
    shape ``(1,)`` (the rest have the slice's shape); ``rows_ok``: whether ``apply`` may be
    given gathered rows (copies) rather than the shard's own slice.
    """

    state_names: tuple[str, ...]
    scalar_names: tuple[str, ...]
    rows_ok: bool

    def init_state(self, n: int) -> State:
        """Fresh state for a slice of ``n`` elements."""

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State,
              update: int | None = None, scale: float = 1.0) -> None:
        """Update ``param`` and ``state`` in place; ``update``: the shard's version;
        ``scale``: a factor on this update's learning rate (``--staleness-lr``)."""


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
    """Plain SGD: ``p -= lr * g`` (``lr`` scaled by ``schedule`` at update ``update``)."""

    lr: float
    state_names: tuple[str, ...] = ()
    schedule: Schedule = CONSTANT
    scalar_names: ClassVar[tuple[str, ...]] = ()
    rows_ok: ClassVar[bool] = True

    def init_state(self, n: int) -> State:
        return {name: np.zeros(n, dtype=np.float32) for name in self.state_names}

    def lr_at(self, update: int | None) -> float:
        """The learning rate of update ``update`` (the shard's version before it)."""
        return scheduled_lr(self.lr, self.schedule, update)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State,
              update: int | None = None, scale: float = 1.0) -> None:
        lr = np.float32(self.lr_at(update) * scale)
        for p, g, t in chunks(param, grad):
            np.multiply(g, lr, out=t)
            p -= t


@dataclass(frozen=True)
class Momentum(SGD):
    """Heavy-ball momentum as in ``torch.optim.SGD(momentum=mu)``: ``v = mu v + g; p -= lr v``."""

    momentum: float = 0.9
    state_names: tuple[str, ...] = ("velocity",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State,
              update: int | None = None, scale: float = 1.0) -> None:
        lr, mu = np.float32(self.lr_at(update) * scale), np.float32(self.momentum)
        for p, g, v, t in chunks(param, grad, state["velocity"]):
            v *= mu
            v += g
            np.multiply(v, lr, out=t)
            p -= t


@dataclass(frozen=True)
class Adagrad(SGD):
    """Adagrad as in DistBelief: per-element rate ``lr / sqrt(eps + sum of past g**2)``.

    The accumulator starts at 0 and ``eps`` (1e-8) sits inside the root, so the first
    step is ``lr * sign(g)`` for ``|g| >> 1e-4``. ``torch.optim.Adagrad`` instead divides
    by ``sqrt(sum) + eps`` (eps 1e-10, optional ``initial_accumulator_value`` and
    ``lr_decay``): the two differ where the accumulator is near ``eps`` (up to a factor
    ``sqrt(1 + eps / sum)``), so ``--optimizer adagrad`` stays this rule and torch's is
    ``--optimizer Adagrad``. The same numbers (to 1e-6) through torch:
    ``torch.optim.Adagrad(lr, eps=0, initial_accumulator_value=eps)``, whose ``sum`` state is
    this ``accumulator`` plus ``eps``: :func:`make_rule` runs dense slices that way, through
    torch's fused CPU kernel (2.7-3.1x faster than this rule, bench/optim.py), and keeps this
    rule for gathered rows and ranges.
    """

    eps: float = 1e-8
    state_names: tuple[str, ...] = ("accumulator",)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State,
              update: int | None = None, scale: float = 1.0) -> None:
        lr, eps = np.float32(self.lr_at(update) * scale), np.float32(self.eps)
        for p, g, acc, t in chunks(param, grad, state["accumulator"]):
            np.multiply(g, g, out=t)
            acc += t
            np.add(acc, eps, out=t)
            np.sqrt(t, out=t)
            np.divide(g, t, out=t)
            t *= lr
            p -= t




# Names with a meaning of their own; any other name is a torch.optim class (find_class).
NUMPY_RULES = ("sgd", "momentum", "adagrad")
TORCH_PRESETS = {  # name -> (torch.optim class, arguments the name fixes)
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": None}),  # None: --momentum
    "nesterov": ("SGD", {"momentum": None, "nesterov": True}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "rmsprop": ("RMSprop", {}),
}
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "adam", "adamw", "rmsprop")
# Names served by a NumPy rule on dense slices too: none since the shards run torch's fused
# CPU kernels (bench/optim.py 2026-12-05, 1 torch thread, torch/NumPy time at 4 and 64 MB:
# sgd 0.84 / 0.65, momentum 0.79 / 0.63, DistBelief's adagrad as torch's Adagrad with eps
# inside the root 0.32 / 0.37). Dense momentum's state is torch's "momentum_buffer" (before:
# "velocity"), adagrad's torch's "sum" (= accumulator + eps) and "step".
NUMPY_DENSE: tuple[str, ...] = ()


def make_rule(name: str, lr: float, momentum: float = 0.9,
              args: Mapping[str, object] | Sequence[str] | None = None,
              schedule: Schedule | str | None = None, rows: bool = False) -> Rule:
    """The update rule ``--optimizer name`` names, with ``--lr``, ``--momentum`` (for
    ``momentum`` and ``nesterov``), ``--optimizer-arg`` (``args``: ``KEY=VALUE`` strings or
    a dict) and ``--lr-schedule``.

    ``sgd``, ``momentum``, ``nesterov``, ``adam``, ``adamw``, ``rmsprop`` are the
    ``torch.optim`` optimizers of those names; ``adagrad`` is DistBelief's (:class:`Adagrad`,
    argument ``eps`` only; on dense slices the same numbers through torch's fused Adagrad,
    see :data:`NUMPY_DENSE`); any other name is a ``torch.optim`` class,
    exact or lower-case (``Adagrad``, ``NAdam``, ``radam``). ``rows=True``: a rule for
    gathered rows (row-sparse tables, model-parallel ranges), which only the NumPy rules
    ``sgd``, ``momentum`` and ``adagrad`` can be.

    Raises a one-line :class:`~distbelief.errors.UserError` naming the flag and the fix.
    """
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise UserError(f"--lr must be a finite number > 0 (got {lr!r})")
    raw = _raw_args(args)
    sched = parse_schedule(schedule) if isinstance(schedule, str) else schedule or CONSTANT
    if name in ("momentum", "nesterov") and not 0.0 <= momentum < 1.0:
        raise UserError(f"--momentum must be in [0, 1) for --optimizer {name} (got {momentum})")
    if rows:
        return _row_rule(name, lr, momentum, raw, sched)
    if name in NUMPY_DENSE and not raw:
        return _row_rule(name, lr, momentum, raw, sched)
    from distbelief.ps import torchrule

    if name == "adagrad":  # DistBelief's formula through torch's fused Adagrad (see Adagrad)
        eps = _paper_adagrad(lr, raw, sched).eps
        return torchrule.TorchRule(torchrule.optimizer_classes()["Adagrad"], lr,
                                   {"eps": 0.0, "initial_accumulator_value": eps}, sched, name)

    if name in TORCH_PRESETS:
        cls_name, preset = TORCH_PRESETS[name]
        cls = torchrule.optimizer_classes()[cls_name]
        fixed = {k: momentum if v is None else v for k, v in preset.items()}
    else:
        cls, fixed = torchrule.find_class(name), {}
        if cls is None:
            raise UserError(f"--optimizer {name!r} is unknown: choose one of "
                            f"{', '.join(OPTIMIZERS)} or a torch.optim class name "
                            f"({', '.join(sorted(torchrule.optimizer_classes()))})"
                            + _not_elementwise(name))
    kwargs = fixed | torchrule.coerce_args(cls, raw, fixed, name)
    return torchrule.TorchRule(cls, lr, kwargs, sched, name)


def _raw_args(args: Mapping[str, object] | Sequence[str] | None) -> dict[str, object]:
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    from distbelief.ps.torchrule import parse_optimizer_args

    return dict(parse_optimizer_args([args] if isinstance(args, str) else list(args)))


def _row_rule(name: str, lr: float, momentum: float, raw: dict, sched: Schedule) -> SGD:
    if name not in NUMPY_RULES:
        raise UserError(f"--optimizer {name} cannot update row-sparse tables or "
                        "model-parallel ranges (torch optimizers bind to whole slices): use "
                        f"{', '.join(NUMPY_RULES)}")
    if name == "adagrad":
        return _paper_adagrad(lr, raw, sched)
    if raw:
        raise UserError(f"--optimizer-arg {next(iter(raw))}: --optimizer {name} on row-sparse "
                        "tables or model-parallel ranges takes no arguments: drop it")
    if name == "sgd":
        return SGD(lr, schedule=sched)
    return Momentum(lr, schedule=sched, momentum=momentum)


def _paper_adagrad(lr: float, raw: dict, sched: Schedule) -> Adagrad:
    extra = sorted(set(raw) - {"eps"})
    if extra:
        raise UserError(f"--optimizer-arg {extra[0]}: --optimizer adagrad (DistBelief's) takes "
                        "only eps: use --optimizer Adagrad for torch.optim.Adagrad")
    if "eps" not in raw:
        return Adagrad(lr, schedule=sched)
    eps = raw["eps"]
    try:
        eps = float(eps)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        eps = math.nan
    if not (math.isfinite(eps) and eps > 0):
        raise UserError(f"--optimizer-arg eps={raw['eps']}: pass a finite number > 0")
    return Adagrad(lr, schedule=sched, eps=eps)


def _not_elementwise(name: str) -> str:
    from distbelief.ps.torchrule import NOT_ELEMENTWISE

    match = {k.lower(): (k, v) for k, v in NOT_ELEMENTWISE.items()}.get(name.lower())
    if match is None:
        return ""
    return f"; {match[0]} {match[1]}, so a shard's slice cannot run it alone"
