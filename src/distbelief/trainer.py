"""What every trainer shares: config, shard start-up, the run, evaluation, results.

:class:`Trainer` validates its config and builds the shard plan in ``__init__`` (before any
actor starts), then :meth:`Trainer.fit` connects to Ray, opens the run (a
:class:`~distbelief.job.Job`) and calls the subclass's ``_train``, which starts the shards
(a :class:`~distbelief.ps.group.ShardGroup`) and drives the replicas.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distbelief import cluster
from distbelief.checkpoint import latest_checkpoint, load_shard
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.flat import FlatModel, parameter_shapes
from distbelief.host import HostFactory
from distbelief.job import Job, TrainResult, actor_name
from distbelief.modelpar.host import PartitionedHost
from distbelief.ps.client import PSClient
from distbelief.ps.group import ShardGroup, ShardSet
from distbelief.ps.host import FlatHost
from distbelief.ps.optim import make_rule
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

__all__ = ["Evaluator", "Trainer", "TrainResult", "as_arrays", "store_bytes"]


class Trainer:
    """Base of the trainers: ``model`` gives the architecture and initial float32 parameters;
    ``loss_fn`` maps ``(model(x), y)`` to a scalar mean loss (cross-entropy by default).
    Keyword arguments are :class:`TrainConfig` fields and override ``config``. After
    :meth:`fit` the model holds the final parameters.
    """

    algorithm = ""
    restores_shards = False  # restart a dead shard from the newest checkpoint (Downpour)

    def __init__(self, model: nn.Module, loss_fn: nn.Module | None = None,
                 config: TrainConfig | None = None, **overrides) -> None:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
        if unknown:
            raise UserError(f"unknown option(s) {', '.join(sorted(unknown))}: see TrainConfig")
        overrides.setdefault("algorithm", self.algorithm)
        self.cfg = dataclasses.replace(config or TrainConfig(), **overrides).validate()
        if self.cfg.algorithm != self.algorithm:
            raise UserError(f"{type(self).__name__} runs --algorithm {self.algorithm}, "
                            f"not {self.cfg.algorithm}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.plan = ShardPlan.build(parameter_shapes(model), self.cfg.shards)
        self.run_id = uuid.uuid4().hex[:8]
        self.restored: tuple[dict, list] | None = None  # the resumed checkpoint
        self._partition_plan = None  # the model-parallel plan (partitions > 1)
        self.job: Job | None = None  # the run of the current (or last) fit

    def actor_name(self, role: str, index: int) -> str:
        """The Ray actor name of a shard or replica of this run (for tools and fault tests)."""
        return actor_name(self.run_id, role, index)

    @property
    def checkpoints(self) -> int:
        """The number of the newest checkpoint of the current (or last) fit: the one it
        resumed from or the last it wrote; 0 for none (for tools and fault tests)."""
        return 0 if self.job is None else self.job.checkpoints

    def fit(self, x_train, y_train, x_test=None, y_test=None, progress: bool = False
            ) -> TrainResult:
        """Train on ``(x_train, y_train)``; evaluate on the test set if given.

        Arrays may be NumPy or torch; ``x`` is float32 ``(n, ...)``, ``y`` has ``n`` rows.
        """
        cfg = self.cfg
        x_train, y_train = self._as_arrays(x_train, y_train, "training")
        test = self._as_arrays(x_test, y_test, "test") if x_test is not None else None
        if cfg.partitions > 1:  # plan before any actor starts, so bad splits fail here
            from distbelief.modelpar.plan import plan_partitions

            self._partition_plan = plan_partitions(self.model, cfg.partitions,
                                                   cfg.partition_by, x_train.shape[1:])
        self.restored = None
        if cfg.resume:
            self.restored = latest_checkpoint(cfg.resume, self.plan, self._state_names())
            self._check_restored()
        with cluster.session(cfg.address, num_cpus=cfg.num_cpus,
                             object_store_memory=store_bytes(x_train, self.plan)):
            resumed = int(self.restored[0]["checkpoint"]) if self.restored else 0
            self.job = Job(self.run_id, self.algorithm, cfg.run_dir, progress, resumed)
            self.job.write_json("config.json", cfg.to_dict())
            try:
                with _sigterm_as_interrupt():
                    return self._train(x_train, y_train, test)
            finally:
                self.job.close()

    def _train(self, x: np.ndarray, y: np.ndarray, test) -> TrainResult:
        raise NotImplementedError

    def _as_arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Validated contiguous NumPy inputs (float32 features); subclasses take other kinds."""
        return as_arrays(x, y, what)

    def _check_restored(self) -> None:
        """Raise :class:`UserError` if ``self.restored`` cannot continue this run."""

    def _state_names(self) -> tuple[str, ...]:
        return make_rule(self.cfg.optimizer, self.cfg.lr, self.cfg.momentum).state_names

    def _resumed_from(self) -> tuple[Path, int] | None:
        """The checkpoint this fit resumed from (its run folder and number), if any."""
        if self.restored is None:
            return None
        return Path(self.cfg.resume), int(self.restored[0]["checkpoint"])

    def _start_shards(self, initial: list[np.ndarray]) -> ShardSet:
        """One shard actor per planned slice, from ``initial`` or from the resumed checkpoint."""
        cfg, plan, job = self.cfg, self.plan, self.job
        restored = None
        if self.restored is not None:
            manifest, parts = self.restored
            restored = [{"arrays": a, "version": e["version"], "counters": e.get("counters")}
                        for a, e in zip(parts, manifest["shards"])]

        def spawn(i: int, restore_point: dict | None):
            return job.actor(ParameterShard, "shard", i, i, initial[i], cfg.optimizer,
                             cfg.lr, cfg.momentum, restore_point)

        def read(run_dir: Path, number: int, i: int) -> dict:
            return load_shard(run_dir, number, i, plan, self._state_names())

        group = ShardGroup(job, "shard", plan.shards, spawn, read, self.restores_shards)
        return group.start(restored, self._resumed_from())

    def _host(self, model: nn.Module, shards: ShardSet) -> HostFactory:
        """The one place a run chooses how its replicas hold parameters (a
        :class:`~distbelief.host.ParamHost`): one flat buffer, or a model-parallel group of
        partition actors; a subclass with other parameters (row-sparse tables) returns its
        own. Built at each replica start, so a restarted replica sees revived shards."""
        if self.cfg.partitions > 1:
            return partial(PartitionedHost, model, self.plan, shards.handles(),
                           self._partition_plan)
        return partial(FlatHost, model, self.plan, shards.handles(),
                       grad_dtype=self.cfg.grad_dtype,
                       names=[self.actor_name("shard", i) for i in range(self.plan.shards)])

    def _evaluator(self, test) -> Evaluator:
        """The driver's copy of the model, scoring ``test`` (None: no test set)."""
        return Evaluator(self.model, self.loss_fn, self.plan, test)

    def _result(self, evaluator: Evaluator, shards: ShardSet, final: dict, updates: int,
                shard_stats: list[dict], counters: dict) -> TrainResult:
        """The run's result (the model holds the final parameters, fetched by ``final``'s
        evaluation); the run folder gets params.safetensors and plot.png."""
        return self.job.finish(evaluator.flat.named_arrays(self.plan), final, updates,
                               shard_stats, counters)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C (checkpoint, stop actors) while training, in the main thread.

    Installed after Ray starts, since ``ray.init`` sets a SIGTERM handler of its own.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Evaluator:
    """The driver's copy of the model, loaded from the shards to score the test set.

    ``subset``: the test examples a periodic evaluation scores (None: all).
    """

    in_actor = True  # a Downpour run may score periodic evaluations in an evaluator actor

    def __init__(self, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan, test,
                 subset: int | None = None) -> None:
        self.flat = FlatModel(model, plan)
        self.plan = plan
        self.loss_fn = loss_fn
        self.test = None if test is None else tuple(torch.from_numpy(a) for a in test)
        self.subset = subset

    def evaluate(self, job: Job, shards: ShardSet) -> dict:
        """Load the shards' current parameters, score them, log an ``eval`` event; the
        scores."""
        versions = PSClient(shards.handles(), self.plan).fetch_into(self.flat.flat_np)
        scores = self.score(shards, self.subset)
        fields = {} if self.subset is None else {"subset": self.subset}
        job.log("eval", updates=sum(versions), versions=versions, elapsed_s=job.elapsed_s(),
                **fields, **scores)
        job.evaluated(scores)
        return scores

    def sampled(self, rows: np.ndarray) -> Evaluator:
        """A copy of this evaluator (its own model) scoring only test ``rows``."""
        test = None if self.test is None else tuple(a[rows].numpy() for a in self.test)
        return Evaluator(copy.deepcopy(self.flat.model), self.loss_fn, self.plan, test)

    @torch.no_grad()
    def score(self, shards: ShardSet, limit: int | None = None) -> dict:
        """Test loss (and accuracy, for a classifier) of the loaded parameters on the first
        ``limit`` test examples (None: all)."""
        if self.test is None:
            return {}
        x, y = (a[:limit] for a in self.test)
        out = self.flat.model(x)
        scores = {"test_loss": float(self.loss_fn(out, y))}
        if out.ndim == 2 and not y.is_floating_point():
            scores["test_accuracy"] = float((out.argmax(1) == y).float().mean())
        return scores


def as_arrays(x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if x.ndim < 1 or len(x) == 0:
        raise UserError(f"the {what} inputs are empty: pass at least one row")
    if len(x) != len(y):
        raise UserError(f"the {what} set has {len(x)} inputs but {len(y)} targets: "
                        "pass one target per input row")
    if x.dtype != np.float32:
        if not np.issubdtype(x.dtype, np.number):
            raise UserError(f"the {what} inputs have dtype {x.dtype}: pass numbers")
        x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise UserError(f"the {what} inputs contain NaN or inf: clean the data first")
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def store_bytes(x: np.ndarray, plan: ShardPlan) -> int:
    """Object-store size for an embedded run: room for the data and many parameter copies."""
    return int(max(128 * 2**20, 4 * x.nbytes + 64 * plan.numel * 4))
