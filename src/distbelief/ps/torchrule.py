"""Any element-wise ``torch.optim`` optimizer as a shard's update rule, with zero copies.

:class:`TorchRule` is a drop-in for the NumPy rules of :mod:`distbelief.ps.optim`: the
shard keeps owning its float32 slice and a dict of named float32 state arrays (and
checkpoints them as today). On the first :meth:`TorchRule.apply` the rule binds a torch
optimizer to that very slice (``torch.from_numpy``, no copy) and makes the optimizer's
state tensors views of the state arrays, so every step updates the shard's arrays in place
and a restore that copies saved arrays into them continues bit for bit. Each push's
gradient is wrapped the same way. Per-element state (``exp_avg``, ``exp_avg_sq`` ...) has
the slice's shape ``(n,)``; scalar state (``step``, NAdam's ``mu_product``) is a 1-element
array, named in :attr:`TorchRule.scalar_names`.

Only element-wise optimizers qualify (applying them to two slices equals applying them to
the whole tensor): LBFGS, SparseAdam, Adafactor and Muon are refused.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch

from distbelief.errors import UserError
from distbelief.ps.schedules import CONSTANT, Schedule, finite_number, scheduled_lr

State = dict[str, np.ndarray]

NOT_ELEMENTWISE = {
    "LBFGS": "needs a closure re-evaluating the whole model",
    "SparseAdam": "takes only sparse gradients",
    "Adafactor": "scales each step by the whole tensor's RMS",
    "Muon": "orthogonalises whole weight matrices",
}
# Arguments distbelief sets itself: why the user may not.
RESERVED = {
    "params": "the shard passes its own slice",
    "lr": "use --lr and --lr-schedule",
    "foreach": "shards pick the CPU path (fused where torch has one)",
    "fused": "shards pick the CPU path (fused where torch has one)",
    "capturable": "shards run on CPU",
    "differentiable": "shards do not differentiate through updates",
}
PINNED = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}


def one_torch_thread() -> None:
    """Run this process's torch on one thread (a shard actor holds one logical CPU), unless
    Ray (``OMP_NUM_THREADS``) or someone else already did."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def without_compiler() -> None:
    """Let torch.optim run in this process without importing ``torch._dynamo``, torch's
    compiler, which costs a shard about 1.1 s of CPU at start (half its start-up, every
    start and restart) and is never used by one. Two things import it: the
    ``torch._disable_dynamo`` wrappers on ``Optimizer``'s methods (``add_param_group``,
    ``state_dict`` ...), which here call the method itself (what they do when nothing
    compiles), and every ``step``, which imports it for ``graph_break()`` (an empty function
    outside compilation). For that one, ``torch._dynamo`` is :class:`_CompilerOnDemand`
    until anything else is asked of it, which imports the real module then.

    Only for processes of ours: shard actors, and the ``distbelief`` program, whose driver
    steps torch.optim only to probe a rule (a user's model that compiles still gets the real
    module, on demand); not a Python API caller's process. A no-op where ``torch._dynamo``
    is already loaded."""
    if "torch._dynamo" in sys.modules:
        return
    marker = torch._disable_dynamo(lambda: None).__code__  # torch's lazy wrapper's code
    for klass in {torch.optim.Optimizer, *optimizer_classes().values()}:
        for attr in vars(klass).values():
            original = getattr(attr, "__wrapped__", None)
            if getattr(attr, "__code__", None) is marker and original is not None:
                setattr(original, "__dynamo_disable", original)  # the wrapper's cache slot
    sys.modules["torch._dynamo"] = torch._dynamo = _CompilerOnDemand("torch._dynamo")


class _CompilerOnDemand(types.ModuleType):
    """Stands in for ``torch._dynamo`` (see :func:`without_compiler`): ``graph_break`` is a
    no-op, as the real one is outside compilation; any other name imports the real module
    in its place and comes from it."""

    @staticmethod
    def graph_break(msg: str = "") -> None:
        return None

    def __getattr__(self, name: str):
        if sys.modules.get("torch._dynamo") is self:
            del sys.modules["torch._dynamo"]
            del torch._dynamo
            importlib.import_module("torch._dynamo")
        return getattr(sys.modules["torch._dynamo"], name)


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every element-wise ``torch.optim`` optimizer, by class name (``Adam``, ``NAdam`` ...)."""
    found = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                and cls is not torch.optim.Optimizer and name not in NOT_ELEMENTWISE):
            found[name] = cls
    return found


def find_class(name: str) -> type[torch.optim.Optimizer] | None:
    """The optimizer class called ``name`` (exact or lower-case: ``NAdam``, ``nadam``)."""
    classes = optimizer_classes()
    if name in classes:
        return classes[name]
    folded = {k.lower(): v for k, v in classes.items()}
    return folded.get(name)


def parse_optimizer_args(items: Sequence[str]) -> dict[str, str]:
    """``--optimizer-arg KEY=VALUE`` strings as ``{KEY: VALUE}`` text (typed later, against
    the optimizer's signature, by :func:`coerce_args`)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise UserError(f"--optimizer-arg {item!r}: write KEY=VALUE, e.g. "
                            "weight_decay=0.01 or betas=0.9,0.99")
        if key in out:
            raise UserError(f"--optimizer-arg {key} is given twice: give it once")
        out[key] = value
    return out


def coerce_args(cls: type[torch.optim.Optimizer], raw: Mapping[str, object],
                fixed: Mapping[str, object] | None = None, label: str = "") -> dict:
    """``raw`` (text or values) typed after the defaults of ``cls``'s signature.

    ``fixed`` names arguments the chosen ``--optimizer`` sets itself (``nesterov``'s
    ``momentum``). One-line :class:`UserError` for an argument ``cls`` does not take, one
    distbelief sets, or a value of the wrong kind.
    """
    params = inspect.signature(cls.__init__).parameters
    label = label or cls.__name__
    takes = [k for k in params if k not in RESERVED and k != "self" and k not in (fixed or {})]
    out = {}
    for key, value in raw.items():
        where = f"--optimizer-arg {key}"
        if key in RESERVED:
            raise UserError(f"{where}: distbelief sets it ({RESERVED[key]}): drop it")
        if fixed and key in fixed:
            fix = "use --momentum" if key == "momentum" else f"use --optimizer {cls.__name__}"
            raise UserError(f"{where}: --optimizer {label} sets {key}={fixed[key]}: {fix}")
        if key not in params:
            raise UserError(f"{where}: torch.optim.{cls.__name__} (--optimizer {label}) takes "
                            f"no {key!r}: use one of {', '.join(takes)}")
        out[key] = _typed(where, value, params[key].default)
    return out


def _typed(where: str, value: object, default: object) -> object:
    """``value`` as the type of ``default`` (bool, tuple of floats, or number)."""
    if not isinstance(value, str):  # from a config file: already typed
        return tuple(value) if isinstance(default, tuple) and isinstance(value, list) else value
    text = value.strip().lower()
    if isinstance(default, bool):
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise UserError(f"{where}={value}: pass true or false")
    if isinstance(default, tuple):
        numbers = [finite_number(f"{where}={value}", part) for part in text.split(",")]
        if len(numbers) != len(default):
            raise UserError(f"{where}={value}: pass {len(default)} comma-separated numbers, "
                            f"e.g. {','.join(f'{d:g}' for d in default)}")
        return tuple(numbers)
    if default is None or isinstance(default, (int, float)):
        number = finite_number(f"{where}={value}", text)
        if isinstance(default, int) and number.is_integer() and "." not in text \
                and "e" not in text:
            return int(number)
        return number
    raise UserError(f"{where}: this argument cannot be set from the command line: drop it")


def probe_state(cls: type[torch.optim.Optimizer], lr: float, kwargs: Mapping,
                label: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the state ``cls(**kwargs)`` keeps per parameter, and which are scalars,
    found by one step on a 2-element tensor. One-line :class:`UserError` if torch rejects
    the settings or the state is not float32 per-element/scalar tensors."""
    param = torch.zeros(2)
    try:
        opt = cls([param], lr=lr, **_pinned(cls), **kwargs)
        param.grad = torch.tensor([0.5, -1.0])
        opt.step()
    except (ValueError, TypeError, RuntimeError) as err:
        reason = " ".join(str(err).split())
        given = " ".join(f"{k}={v}" for k, v in kwargs.items()) or "its defaults"
        raise UserError(f"--optimizer {label} --optimizer-arg: torch.optim.{cls.__name__} "
                        f"rejects {given} ({reason}): pass values it accepts") from None
    names, scalars = [], []
    for name, value in opt.state[param].items():
        ok = isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
            and value.shape in ((), param.shape)
        if not ok:
            raise UserError(f"--optimizer {label}: its state {name!r} is not a float32 tensor "
                            "per element or a scalar, which shards cannot hold: pick another")
        names.append(name)
        if value.shape == ():
            scalars.append(name)
    return tuple(names), tuple(scalars)


@functools.cache
def _pinned(cls: type[torch.optim.Optimizer]) -> dict:
    """The path arguments a shard passes ``cls``: torch's fused CPU kernel where ``cls`` has
    one (Adam, AdamW, SGD, Adagrad: one pass over the slice, 2-12x faster than the
    single-tensor loop at 4-32 MB on one thread, BENCHMARKS.md), else the single-tensor
    path."""
    params = inspect.signature(cls.__init__).parameters
    pinned = {k: v for k, v in PINNED.items() if k in params}
    if "fused" in params:
        try:
            param = torch.zeros(2)
            opt = cls([param], lr=0.1, **(pinned | {"fused": True}))
            param.grad = torch.ones(2)
            opt.step()
        except (RuntimeError, ValueError, TypeError):
            return pinned
        pinned["fused"] = True
    return pinned


class _Binding:
    """A torch optimizer bound to one param array and its state arrays (all aliased)."""

    def __init__(self, rule: TorchRule, param: np.ndarray, state: State) -> None:
        if param.dtype != np.float32 or not param.flags.writeable:
            raise ValueError("a TorchRule updates writeable float32 arrays only")
        self.param = param
        self.arrays = {name: state[name] for name in rule.state_names}
        self.tensor = torch.from_numpy(param)
        self.opt = rule.cls([self.tensor], lr=rule.lr, **_pinned(rule.cls), **rule.kwargs)
        self.aliases = {name: torch.from_numpy(a).view(() if name in rule.scalar_names
                                                        else param.shape)
                        for name, a in self.arrays.items()}
        # Fresh state (all zero, as init_state made it): torch initialises it on the first
        # step (Adagrad's initial_accumulator_value, ASGD's eta, NAdam's mu_product = 1)
        # and realias() copies it in once. Otherwise the saved arrays are the state.
        if any(a.any() for a in self.arrays.values()):
            self.opt.state[self.tensor] = dict(self.aliases)

    def matches(self, param: np.ndarray, state: State) -> bool:
        return param is self.param and all(state.get(k) is a for k, a in self.arrays.items())

    def step(self, grad: np.ndarray, lr: float) -> None:
        self.opt.param_groups[0]["lr"] = lr
        if grad.flags.writeable:
            self.tensor.grad = torch.from_numpy(grad)
        else:  # a pushed gradient straight from the object store; torch only reads it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.tensor.grad = torch.from_numpy(grad)
        try:
            self.opt.step()
        finally:
            self.tensor.grad = None  # do not pin the pushed buffer
        self.realias()

    def realias(self) -> None:
        """Point the optimizer's state back at the shard's arrays where torch made its own
        tensors (first step from fresh state), copying their values in once."""
        live = self.opt.state[self.tensor]
        for name, alias in self.aliases.items():
            current = live.get(name)
            if current is not alias:
                if current is not None:
                    alias.copy_(current)
                live[name] = alias


class TorchRule:
    """``torch.optim.<cls>(lr=lr, **kwargs)`` applied to a shard's slice in place.

    Same protocol as the NumPy rules: ``state_names``, ``init_state(n)``, ``apply(param,
    grad, state, update)``; plus ``scalar_names`` (the 1-element state arrays). The
    binding to the shard's arrays is made on first use and kept while the same arrays come
    back; other arrays (a test's second slice) get a new binding over their own state.
    """

    rows_ok: ClassVar[bool] = False  # binds to fixed tensors: no gathered-row updates

    def __init__(self, cls: type[torch.optim.Optimizer], lr: float, kwargs: Mapping | None = None,
                 schedule: Schedule = CONSTANT, label: str = "") -> None:
        self.cls, self.lr, self.schedule = cls, float(lr), schedule
        self.kwargs = dict(kwargs or {})
        self.name = label or cls.__name__
        self.state_names, self.scalar_names = probe_state(cls, self.lr, self.kwargs, self.name)
        self._binding: _Binding | None = None

    def __repr__(self) -> str:
        return (f"TorchRule({self.cls.__name__}, lr={self.lr}, kwargs={self.kwargs}, "
                f"schedule={self.schedule})")

    def init_state(self, n: int) -> State:
        """Zeroed state: ``(n,)`` per element, ``(1,)`` per scalar (torch fills in its
        initial values on the first step)."""
        return {name: np.zeros(1 if name in self.scalar_names else n, dtype=np.float32)
                for name in self.state_names}

    def lr_at(self, update: int | None) -> float:
        """The learning rate of update ``update`` (the shard's version before it)."""
        return scheduled_lr(self.lr, self.schedule, update)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State,
              update: int | None = None, scale: float = 1.0) -> None:
        """One optimizer step of ``param`` (float32, in place) with ``grad`` (same shape),
        updating ``state`` in place; ``update`` is the shard's version (for schedules);
        ``scale`` a factor on this step's learning rate (``--staleness-lr``)."""
        lr = self.lr_at(update) * scale
        binding = self._binding
        if binding is None or not binding.matches(param, state):
            binding = self._binding = _Binding(self, param, state)
        binding.step(grad, lr)

