"""Training configuration: one dataclass, validated before any actor starts."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from distbelief.errors import UserError

ALGORITHMS = ("downpour", "sandblaster")
OPTIMIZERS = ("sgd", "momentum", "adagrad")
DATASETS = ("digits", "synthetic", "ctr")
MODELS = ("mlp", "lc")
PARTITION_BY = ("auto", "space", "layers")
GRAD_DTYPES = ("float32", "float16", "bfloat16")  # wire formats, see distbelief.ps.codec
SPLITS = ("epoch", "fixed")  # how training rows are dealt to replicas, see data.ReplicaSampler


def flag(name: str) -> str:
    """The command-line flag of a config field: ``n_fetch`` -> ``--n-fetch``."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything a training run needs; field names match the CLI flags (``--n-fetch`` ...).

    ``steps`` counts mini-batches per replica (warm-start steps included, on replica 0);
    ``lr`` is the server-side learning rate; ``eval_every_s`` is the wall-clock period of
    the driver's held-out evaluation, in seconds; ``hidden=0`` makes the CLI's model a
    softmax regression. Sandblaster uses ``iterations`` (L-BFGS steps), ``portions`` per
    batch, ``portions_per_push``, ``history`` (m pairs), ``l2`` (the objective's
    ``l2 / 2 * |x|^2`` term) and ``backups``.
    """

    algorithm: str = "downpour"
    dataset: str = "digits"
    samples: int = 10000
    features: int = 32
    classes: int = 10
    rows: int = 1_000_000  # --dataset ctr: rows of each sparse embedding table
    hidden: int = 64
    model: str = "mlp"
    channels: int = 8  # --model lc: channels of each locally connected layer
    partitions: int = 1  # model-parallel partitions per replica
    partition_by: str = "auto"  # space (within layers), layers (stages), auto
    replicas: int = 2
    shards: int = 2
    n_fetch: int = 1
    n_push: int = 1
    optimizer: str = "adagrad"
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    steps: int = 300
    warmstart_steps: int = 0
    local_update: bool = True
    data_split: str = "epoch"  # rows dealt to replicas afresh each epoch, or "fixed" shards
    seed: int = 0
    eval_every_s: float = 0.5
    address: str | None = None
    num_cpus: int | None = None
    run_dir: str | None = None
    slow_replicas: dict[int, float] = field(default_factory=dict)
    grad_dtype: str = "float32"  # gradients on the wire; shards keep float32 either way
    max_rejected: int = 1000  # abort once the shards have rejected more pushes than this
    checkpoint_every_s: float = 0.0  # 0: only at the end of the run (and on Ctrl-C)
    resume: str | None = None
    # Sandblaster L-BFGS
    iterations: int = 40
    portions: int = 0  # 0: PORTIONS_PER_REPLICA per replica
    portions_per_push: int = 4
    history: int = 10
    l2: float = 1e-4
    backups: bool = True

    def validate(self) -> TrainConfig:
        """Raise :class:`UserError` naming the first bad field's flag and the fix.

        Path fields may be given as :class:`os.PathLike` (``pathlib.Path``); they become
        ``str`` here, so the config stays JSON-ready.
        """
        for name in ("dataset", "run_dir", "resume"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        _choice("algorithm", self.algorithm, ALGORITHMS)
        if self.dataset not in DATASETS and not self.dataset.endswith(".npz"):
            raise UserError(f"{flag('dataset')} {self.dataset!r} is unknown: choose one of "
                            f"{', '.join(DATASETS)} or the path of a .npz file")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("grad_dtype", self.grad_dtype, GRAD_DTYPES)
        _choice("data_split", self.data_split, SPLITS)
        _choice("model", self.model, MODELS)
        _at_least("partitions", self.partitions, 1)
        _choice("partition_by", self.partition_by, PARTITION_BY)
        _at_least("channels", self.channels, 1)
        if self.dataset == "ctr" and self.algorithm != "downpour":
            raise UserError(f"--dataset ctr (sparse embedding tables) trains with --algorithm "
                            f"downpour only, not {self.algorithm}: drop --algorithm")
        for name in ("replicas", "shards", "n_fetch", "n_push", "batch_size", "steps",
                     "samples", "features", "rows"):
            _at_least(name, getattr(self, name), 1)
        _at_least("hidden", self.hidden, 0)
        _at_least("classes", self.classes, 2)
        for name in ("iterations", "portions_per_push", "history"):
            _at_least(name, getattr(self, name), 1)
        _at_least("portions", self.portions, 0)
        if not (isinstance(self.l2, (int, float)) and math.isfinite(self.l2) and self.l2 >= 0):
            raise UserError(f"{flag('l2')} must be a finite number >= 0 (got {self.l2!r})")
        _at_least("warmstart_steps", self.warmstart_steps, 0)
        _at_least("max_rejected", self.max_rejected, 0)
        if self.warmstart_steps > self.steps:
            raise UserError(f"{flag('warmstart_steps')} ({self.warmstart_steps}) exceeds "
                            f"{flag('steps')} ({self.steps}): warm-start steps are part of "
                            "replica 0's steps, so pass a smaller value")
        _positive("lr", self.lr)
        _positive("eval_every_s", self.eval_every_s)
        if not (math.isfinite(self.checkpoint_every_s) and self.checkpoint_every_s >= 0):
            raise UserError(f"{flag('checkpoint_every_s').replace('-s', '')} must be >= 0 "
                            f"seconds (got {self.checkpoint_every_s})")
        if not (0.0 <= self.momentum < 1.0):
            raise UserError(f"{flag('momentum')} must be in [0, 1) (got {self.momentum})")
        if self.num_cpus is not None:
            _at_least("num_cpus", self.num_cpus, 1)
        for index, factor in self.slow_replicas.items():
            if not 0 <= index < self.replicas:
                raise UserError(f"--slow-replica {index}:{factor} names replica {index}, but "
                                f"replicas are 0..{self.replicas - 1}")
            if not (math.isfinite(factor) and factor >= 1.0):
                raise UserError(f"--slow-replica {index}:{factor}: the factor must be >= 1")
        return self

    def to_dict(self) -> dict:
        """A JSON-ready copy (slow-replica keys become strings)."""
        out = dataclasses.asdict(self)
        out["slow_replicas"] = {str(k): v for k, v in self.slow_replicas.items()}
        return out


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{flag(name)} {value!r} is unknown: choose one of {', '.join(allowed)}")


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{flag(name)} must be an integer >= {low} (got {value!r})")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{flag(name)} must be a finite number > 0 (got {value!r})")
