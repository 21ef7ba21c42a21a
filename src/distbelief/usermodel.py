"""A user's model from the command line: ``--model MODULE:CALLABLE`` and ``--model-arg K=V``.

``MODULE`` is an importable module name (found on ``PYTHONPATH``) or the path of a ``.py``
file; ``CALLABLE`` (dotted names allowed, e.g. ``Net.build``) is called with the
``--model-arg`` values as keyword arguments and must return an ``nn.Module`` that maps a
batch of the data's rows ``(N, *input_shape)`` to logits ``(N, classes)``. Every way this can
go wrong is a one-line :class:`UserError` naming the flag and the fix; nothing is trained
before the model has passed one dummy forward.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from distbelief.errors import UserError

BUILTIN_MODELS = ("mlp", "lc", "cnn")
ARG_TYPES = (bool, int, float, str, type(None))


def is_factory_spec(spec: str) -> bool:
    """Whether ``--model`` names a user factory (``MODULE:CALLABLE``), not a built-in name."""
    return spec not in BUILTIN_MODELS and ":" in spec


def one_line(err: BaseException, limit: int = 200) -> str:
    """``TypeError: message`` squeezed onto one line of at most ``limit`` characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_model_args(items: Iterable[str]) -> dict[str, Any]:
    """``["depth=3", "rate=0.5", "bias=false", "act=relu"]`` as keyword arguments.

    Values are Python literals where they parse as one (int, float, bool, None or a quoted
    string), ``true``/``false`` in any case are booleans, and anything else is a plain string.
    """
    kwargs: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise UserError(f"--model-arg {item!r} is not KEY=VALUE: write e.g. "
                            "--model-arg hidden=128")
        if key in kwargs:
            raise UserError(f"--model-arg {key} is given twice: pass each key once")
        kwargs[key] = parse_value(raw.strip())
    return kwargs


def parse_value(raw: str) -> Any:
    """One ``--model-arg`` value: a literal (int, float, bool, None, quoted str) or the text."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw
    return value if isinstance(value, ARG_TYPES) else raw


def _import_module(spec: str, module: str) -> Any:
    """The module ``module`` of ``--model spec``: a ``.py`` path or an importable name."""
    if module.endswith(".py") or os.sep in module:
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"--model {spec}: no such file {str(path)!r}: check the path of "
                            "your model's .py file")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        name = f"distbelief_user_{path.stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise UserError(f"--model {spec}: cannot load {str(path)!r} as Python: give a .py "
                            "file")
        mod = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = mod  # dataclasses and pickling look a class's module up here
        try:
            loader_spec.loader.exec_module(mod)
        except BaseException as err:
            del sys.modules[name]
            if isinstance(err, KeyboardInterrupt):
                raise
            raise UserError(f"--model {spec}: importing {path.name} raised {one_line(err)}: "
                            "fix the file") from None
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.split(".")[0] == err.name.split(".")[0]:
            raise UserError(f"--model {spec}: no module named {module!r}: put its folder on "
                            "PYTHONPATH or give the path of a .py file") from None
        raise UserError(f"--model {spec}: importing {module} raised {one_line(err)}: install "
                        "what it needs") from None
    except Exception as err:
        raise UserError(f"--model {spec}: importing {module} raised {one_line(err)}: fix the "
                        "module") from None


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable that ``--model MODULE:CALLABLE`` names (a function, class or any callable)."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise UserError(f"--model {spec!r} is neither {', '.join(BUILTIN_MODELS)} nor "
                        "MODULE:CALLABLE: write e.g. --model mynets:build or "
                        "--model ./net.py:build")
    mod = _import_module(spec, module)
    try:
        factory = functools.reduce(getattr, attr.split("."), mod)
    except AttributeError:
        raise UserError(f"--model {spec}: {module} has no attribute {attr!r}: name the function "
                        "that returns your nn.Module") from None
    if not callable(factory):
        raise UserError(f"--model {spec}: {attr} is not callable ({type(factory).__name__}): "
                        "name a function that returns your nn.Module")
    return factory


def count_parameters(build: Callable[[], nn.Module]) -> int:
    """Parameters of the model ``build()`` returns, built on torch's ``meta`` device (shapes
    only, no memory), so ``limits.check_model`` can refuse a huge model before it exists.
    Raises what ``build`` raises."""
    import torch

    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


def ship_by_value(factory: Callable[..., Any]) -> None:
    """Make Ray pickle the module of a user's ``factory`` by value, so that a model built from
    it (its classes and functions) reaches replicas that cannot import that module: a ``.py``
    file given by path, or a module on the driver's ``PYTHONPATH`` only. Imports Ray."""
    module = sys.modules.get(getattr(factory, "__module__", "") or "")
    if module is None or module.__name__.split(".")[0] in ("distbelief", "torch", "builtins"):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def build_model(spec: str, args: Mapping[str, Any], input_shape: tuple[int, ...],
                classes: int, seed: int | None = None) -> nn.Module:
    """Call ``--model spec``'s factory with ``args``, seeded by ``seed`` (``torch.manual_seed``
    first, so a factory's random initial weights follow ``--seed``), and check the result: an
    ``nn.Module`` mapping rows ``(N, *input_shape)`` to ``(N, classes)`` logits."""
    import torch

    factory = load_factory(spec)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = factory(**args)
    except TypeError as err:
        raise UserError(f"--model {spec}: calling it with --model-arg {dict(args)} raised "
                        f"{one_line(err)}: match --model-arg to its parameters") from None
    except Exception as err:
        raise UserError(f"--model {spec} raised {one_line(err)}: fix the factory or its "
                        "--model-arg values") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {spec} returned a {type(model).__name__}, not a "
                        "torch.nn.Module: return the network itself")
    check_fits(spec, model, input_shape, classes)
    return model


def check_fits(spec: str, model: nn.Module, input_shape: tuple[int, ...], classes: int,
               batch: int = 2) -> None:
    """One dummy forward of ``batch`` zero rows ``(batch, *input_shape)`` in eval mode (no
    BatchNorm statistics change, no dropout); the output must be ``(batch, classes)``."""
    import torch

    shape = (batch, *input_shape)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(shape))
    except Exception as err:
        raise UserError(f"--model {spec} does not fit the data: a batch of shape "
                        f"{tuple(shape)} raised {one_line(err)}: make its first layer take rows "
                        f"of shape {tuple(input_shape)} (e.g. start with nn.Unflatten)") from None
    finally:
        model.train(was_training)
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if got != (batch, classes):
        raise UserError(f"--model {spec} maps a batch of shape {tuple(shape)} to {got}, not "
                        f"{(batch, classes)}: end the network with {classes} outputs "
                        "(one logit per class)")


def check_model_spec(model: str, model_args: Iterable[str], builtins: tuple[str, ...]) -> None:
    """``--model`` is a built-in name or ``MODULE:CALLABLE``; ``--model-arg`` is ``KEY=VALUE``
    and only for a factory (imported later, by the CLI). One-line :class:`UserError` if not."""
    if model not in builtins and not is_factory_spec(model):
        raise UserError(f"--model {model!r} is neither {', '.join(builtins)} nor "
                        "MODULE:CALLABLE: write e.g. --model mynets:build or "
                        "--model ./net.py:build")
    if model_args and model in builtins:
        raise UserError(f"--model-arg is for --model MODULE:CALLABLE, not the built-in "
                        f"{model}: set it with --hidden or --channels instead")
    parse_model_args(model_args)
