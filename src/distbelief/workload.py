"""What the command line trains: resource checks, the data, the model (``distbelief train``).

:func:`check_resources` runs before anything heavy (limits as one-line input errors);
:func:`load_data` gives the training and test sets (arrays, or a data folder's
:class:`~distbelief.ondisk.DiskRows` that each replica reads for itself); :func:`build` the
built-in model or the user's ``--model MODULE:CALLABLE``, its size checked on the meta device
before it exists.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from distbelief import limits
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.ondisk import DiskRows, is_data_dir
from distbelief.usermodel import (
    build_model,
    count_parameters,
    is_factory_spec,
    load_factory,
    parse_model_args,
    ship_by_value,
)


@dataclass
class Workload:
    """Training and test data as ``fit`` takes them (``y`` None for a data folder), the
    rows' shape and the class count."""

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    feature_shape: tuple[int, ...]
    classes: int


def resources(cfg: TrainConfig) -> limits.Resources:
    return limits.Resources.local()


def check_resources(cfg: TrainConfig, res: limits.Resources) -> None:
    """The run folder and an in-memory data set's size (the CPUs are checked by
    ``Trainer.fit``, once the model's partition plan is known)."""
    if cfg.run_dir is not None:
        limits.check_run_dir(cfg.run_dir)
    if cfg.dataset == "synthetic":
        limits.check_synthetic(cfg.samples, cfg.features, res)
    elif cfg.dataset.endswith(".npz") and os.path.isfile(cfg.dataset):
        limits.check_data(cfg.dataset, os.path.getsize(cfg.dataset), res)


def load_data(cfg: TrainConfig) -> Workload:
    """``--dataset``'s training and test sets; a data folder stays on disk."""
    from distbelief import data

    if cfg.dataset not in ("digits", "mnist", "synthetic") and is_data_dir(cfg.dataset):
        train, test = DiskRows(cfg.dataset, "train"), DiskRows(cfg.dataset, "test")
        return Workload(train, None, test, None, train.feature_shape, train.classes)
    ds = data.load(cfg.dataset, cfg.samples, cfg.features, cfg.classes, cfg.seed)
    return Workload(ds.x_train, ds.y_train, ds.x_test, ds.y_test, tuple(ds.x_train.shape[1:]),
                    ds.classes)


def build(cfg: TrainConfig, shape: tuple[int, ...], classes: int,
          res: limits.Resources) -> nn.Module:
    """``--model``: counted on the meta device and checked against memory
    (:func:`limits.check_model`), then built; a user factory's module ships by value."""
    if is_factory_spec(cfg.model):
        kwargs = parse_model_args(cfg.model_args)
        factory = load_factory(cfg.model)
        try:
            parameters = count_parameters(lambda: factory(**kwargs))
        except Exception:  # build_model below says what is wrong, in one line
            parameters = 0
        limits.check_model(parameters, cfg.replicas, cfg.optimizer, res)
        model = build_model(cfg.model, kwargs, shape, classes, cfg.seed)
        ship_by_value(factory)
        return model
    make = builtin(cfg, math.prod(shape), classes)
    limits.check_model(count_parameters(make), cfg.replicas, cfg.optimizer, res)
    return make()


def builtin(cfg: TrainConfig, features: int, classes: int) -> Callable[[], nn.Module]:
    """A maker of the built-in ``--model`` for flat rows of ``features`` values."""
    from distbelief import models

    if cfg.model == "lc":
        return lambda: models.lc(features, cfg.channels, classes, cfg.seed)
    if cfg.model == "cnn":
        return lambda: models.cnn(features, classes, cfg.seed)
    if cfg.model != "mlp":
        raise UserError(f"--model {cfg.model!r} is unknown")
    return lambda: models.mlp(features, cfg.hidden, classes, cfg.seed)
