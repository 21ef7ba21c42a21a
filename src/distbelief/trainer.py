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
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster, storage
from distbelief.checkpoint import latest_checkpoint, load_shard
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.evaluation import (
    MIN_ROWS_PER_PASS,
    activation_bytes_per_row,
    rows_per_pass,
    score_passes,
)
from distbelief.flat import FlatModel, parameter_shapes
from distbelief.host import HostFactory
from distbelief.job import Job, TrainResult, actor_name
from distbelief.limits import Resources, check_cpus, limited_store
from distbelief.modelpar.host import PartitionedHost
from distbelief.ps.average import parse_average
from distbelief.ps.buffers import BufferAverage, BufferPlan
from distbelief.ps.client import PSClient
from distbelief.ps.failover import FailoverGroup
from distbelief.ps.group import ShardGroup, ShardSet
from distbelief.ps.host import FlatHost
from distbelief.ps.optim import Rule
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard
from distbelief.ps.staleness import StalenessControl
from distbelief.sources import Rows, as_rows

EVAL_BATCH = 1024  # rows of a Dataset/data-folder test set read at a time

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
        self.buffer_plan = BufferPlan.of(model)  # buffers kept on shard 0 (ps/buffers.py)
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

    def fit(self, x_train, y_train=None, x_test=None, y_test=None, progress: bool = False
            ) -> TrainResult:
        """Train on ``(x_train, y_train)``; evaluate on the test set if given.

        Arrays may be NumPy or torch; ``x`` is float32 ``(n, ...)``, ``y`` has ``n`` rows;
        they are put in Ray's object store once. Data larger than that, with ``y_train``
        None: a torch map-style ``Dataset`` or a :class:`~distbelief.sources.Rows` (e.g. a
        data folder's :class:`~distbelief.ondisk.DiskRows`), shipped as it is (a
        ``DiskRows`` as its path) for each replica to read its sampled rows from; or a
        factory ``factory(replica, replicas, seed) -> iterable of (x, y) batches`` that
        each replica calls (see :mod:`distbelief.sources`). The test set, likewise arrays
        or (``y_test`` None) a ``Dataset``/``Rows``, is scored in batches.
        """
        cfg = self.cfg
        x_train, y_train = self._as_data(x_train, y_train, "training")
        test = self._as_data(x_test, y_test, "test") if x_test is not None else None
        if test is not None and test[1] is None:
            test = test[0]  # a Rows: the Evaluator scores it in batches
            if not isinstance(test, Rows):
                raise UserError("the test set is a stream factory: give arrays or a "
                                "map-style Dataset (rows to score)")
        if cfg.partitions > 1:  # plan before any actor starts, so bad splits fail here
            from distbelief.modelpar.plan import plan_partitions

            if y_train is not None or isinstance(x_train, Rows):
                shape = x_train.shape[1:] if y_train is not None else x_train.feature_shape
            else:
                raise UserError("--partitions > 1 needs the rows' shape: give arrays or a "
                                "map-style Dataset, not a stream factory")
            self._partition_plan = plan_partitions(self.model, cfg.partitions,
                                                   cfg.partition_by, tuple(shape))
        if cfg.address is None:  # an embedded run: replica processes against the cores
            warning = check_cpus(cfg.replicas, cfg.partitions, cfg.shards, Resources.local())
            if warning:
                print(warning, file=sys.stderr)
        in_memory = x_train if y_train is not None else np.empty(0, np.float32)
        self.restored = None
        if cfg.run_dir is not None and storage.is_url(cfg.run_dir):
            storage.check_writable(cfg.run_dir)
        if cfg.resume:
            self.restored = latest_checkpoint(cfg.resume, self.plan, self._state_names(),
                                              self._rule().scalar_names)
            self._check_restored()
        with cluster.session(cfg.address, num_cpus=cfg.num_cpus,
                             object_store_memory=store_bytes(in_memory, self.plan, cfg.replicas)):
            if cfg.address is not None:  # a cluster's CPUs, known once connected
                check_cpus(cfg.replicas, cfg.partitions, cfg.shards * (1 + cfg.shard_backups),
                           Resources.from_ray(ray.cluster_resources()))
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

    def _as_data(self, x, y, what: str) -> tuple:
        """``(x, y)`` arrays (:meth:`_as_arrays`) when ``y`` is given, else ``(source,
        None)``: a stream factory as it is, anything else as a :class:`Rows`."""
        if y is not None:
            return self._as_arrays(x, y, what)
        if callable(x) and not hasattr(x, "__getitem__") and not isinstance(x, Rows):
            return x, None
        return as_rows(x), None

    def _check_restored(self) -> None:
        """Raise :class:`UserError` if ``self.restored`` cannot continue this run."""

    def _rule(self) -> Rule:
        """The dense shards' update rule (its state names depend on ``--optimizer-arg``:
        amsgrad adds ``max_exp_avg_sq``)."""
        return self.cfg.update_rule()

    def _state_names(self) -> tuple[str, ...]:
        return self._rule().state_names

    def _resumed_from(self) -> tuple[str, int] | None:
        """The checkpoint this fit resumed from (its run folder and number), if any."""
        if self.restored is None:
            return None
        return self.cfg.resume, int(self.restored[0]["checkpoint"])

    def _start_shards(self, initial: list[np.ndarray]) -> ShardSet:
        """One shard actor per planned slice, from ``initial`` or from the resumed checkpoint."""
        cfg, plan, job = self.cfg, self.plan, self.job
        restored = None
        if self.restored is not None:
            manifest, parts = self.restored
            restored = [{"arrays": a, "version": e["version"], "counters": e.get("counters")}
                        for a, e in zip(parts, manifest["shards"])]

        buffers = None
        if self.buffer_plan:
            buffers = BufferAverage(*self.buffer_plan.read(self.model), cfg.replicas)
        average = parse_average(cfg.average) if cfg.average else None
        control = StalenessControl(cfg.staleness_lr, cfg.delay_compensation)

        def spawn(i: int, restore_point: dict | None, role: str = "shard", index: int = -1):
            return job.actor(ParameterShard, role, i if index < 0 else index, i, initial[i],
                             cfg.optimizer, cfg.lr, cfg.momentum, restore_point,
                             args=cfg.optimizer_args,
                             schedule=cfg.lr_schedule, rows=cfg.ranged_updates,
                             buffers=buffers if i == 0 else None, average=average,
                             control=control if control.active else None,
                             quorum=cfg.quorum, end=cfg.sync_end)

        def read(run_dir: Path, number: int, i: int) -> dict:
            return load_shard(run_dir, number, i, plan, self._state_names(),
                              self._rule().scalar_names)

        group = (ShardGroup if not cfg.shard_backups else partial(
            FailoverGroup, backups=cfg.shard_backups,
            directory=self.actor_name("directory", 0)))(
            job, "shard", plan.shards, spawn, read, self.restores_shards)
        return group.start(restored, self._resumed_from())

    def _host(self, model: nn.Module, shards: ShardSet, incarnation: int = 0) -> HostFactory:
        """The one place a run chooses how its replicas hold parameters (a
        :class:`~distbelief.host.ParamHost`): one flat buffer, or a model-parallel group of
        partition actors; a subclass with other parameters (row-sparse tables) returns its
        own. Built at each replica start (``incarnation``: see :mod:`distbelief.ps.ledger`),
        so a restarted replica sees revived shards."""
        if self.cfg.partitions > 1:
            return partial(PartitionedHost, model, self.plan, shards.handles(),
                           self._partition_plan, self.cfg.precision, self.cfg.clip_grad_norm)
        return partial(FlatHost, model, self.plan, shards.handles(), device=self.cfg.device,
                       grad_dtype=self.cfg.grad_dtype, precision=self.cfg.precision,
                       names=[self.actor_name("shard", i) for i in range(self.plan.shards)],
                       incarnation=incarnation, resend=self.cfg.shard_backups > 0,
                       directory=self.actor_name("directory", 0) if self.cfg.shard_backups
                       else None,
                       sync=self.cfg.sync_end, clip=self.cfg.clip_grad_norm)

    def _evaluator(self, test) -> Evaluator:
        """The driver's copy of the model, scoring ``test`` (None: no test set)."""
        return Evaluator(self.model, self.loss_fn, self.plan, test, average=self.cfg.average)

    def _result(self, evaluator: Evaluator, shards: ShardSet, final: dict, updates: int,
                shard_stats: list[dict], counters: dict) -> TrainResult:
        """The run's result (the model holds the final parameters and buffers, fetched by
        ``final``'s evaluation); the run folder gets params.safetensors (both) and plot.png."""
        params = evaluator.flat.named_arrays(self.plan) | evaluator.named_buffers()
        return self.job.finish(params, final, updates, shard_stats, counters)


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

    ``subset``: the test examples a periodic evaluation scores (None: all); ``average``:
    the shards keep this ``--average`` of the parameters, which evaluations score unless
    told otherwise. The model is scored in ``eval()`` mode under ``no_grad``, with the
    buffers shard 0 holds, so test data changes no state.
    """

    in_actor = True  # a Downpour run may score periodic evaluations in an evaluator actor

    def __init__(self, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan, test,
                 subset: int | None = None, average: str | None = None) -> None:
        self.flat = FlatModel(model, plan)
        self.plan = plan
        self.average = average
        self.buffer_plan = BufferPlan.of(model)
        self.loss_fn = loss_fn
        if test is None or isinstance(test, Rows):
            self.test = test  # a Rows (a Dataset, a data folder) is scored in batches
        else:
            self.test = tuple(torch.from_numpy(a) for a in test)
        self.subset = subset
        self._per_pass: int | None = None  # rows_per_pass(), measured at the first score

    def evaluate(self, job: Job, shards: ShardSet, averaged: bool | None = None) -> dict:
        """Load the shards' current parameters (their average if ``averaged``, by default
        whenever one is kept) and buffers, score them, log an ``eval`` event (its
        ``evaluated`` says which, when an average is kept); the scores."""
        averaged = self.average is not None if averaged is None else averaged
        versions = self.load(shards.handles(), averaged)
        scores = self.score(shards, self.subset)
        fields = {} if self.subset is None else {"subset": self.subset}
        fields.update(self.evaluated_field(averaged))
        job.log("eval", updates=sum(versions), versions=versions, elapsed_s=job.elapsed_s(),
                **fields, **scores)
        job.evaluated(scores)
        return scores

    def load(self, handles: list, averaged: bool = False) -> list[int]:
        """Load the parameters of the shards with actor ``handles`` (their ``--average`` if
        ``averaged``) and shard 0's buffers into the model; the shard versions."""
        client = PSClient(handles, self.plan)
        if averaged:
            versions = client.fetch_average_into(self.flat.flat_np)
        else:
            versions = client.fetch_into(self.flat.flat_np)
        if self.buffer_plan:
            served = ray.get(handles[0].fetch_buffers.remote())
            if served is not None:
                self.buffer_plan.write(self.flat.model, *served)
        return versions

    def named_buffers(self) -> dict[str, np.ndarray]:
        """The model's travelling buffers by name (what params.safetensors holds besides the
        parameters)."""
        return self.buffer_plan.named(self.flat.model)

    def sampled(self, rows: np.ndarray) -> Evaluator:
        """A copy of this evaluator (its own model) scoring only test ``rows``."""
        if self.test is None:
            test = None
        elif isinstance(self.test, Rows):
            test = self.test.rows(rows)
        else:
            test = tuple(a[rows].numpy() for a in self.test)
        return Evaluator(copy.deepcopy(self.flat.model), self.loss_fn, self.plan, test,
                         average=self.average)

    def rows_per_pass(self) -> int:
        """Test rows scored in one forward pass (:func:`~distbelief.evaluation.rows_per_pass`
        of this model, its activations measured once on the first test rows)."""
        if self._per_pass is None:
            if not self.test_rows():
                return MIN_ROWS_PER_PASS
            first = (torch.from_numpy(self.test.rows(np.arange(min(4, len(self.test))))[0])
                     if isinstance(self.test, Rows) else self.test[0][:4])
            self._per_pass = rows_per_pass(
                self.flat.flat.numel() * self.flat.flat.element_size(),
                activation_bytes_per_row(self.flat.model, first))
        return self._per_pass

    def test_rows(self) -> int:
        """How many test examples there are (0 without a test set)."""
        if self.test is None:
            return 0
        return len(self.test) if isinstance(self.test, Rows) else len(self.test[0])

    def evaluated_field(self, averaged: bool) -> dict:
        """The ``evaluated`` field of an ``eval`` event: which parameters were scored."""
        if self.average is None:
            return {}
        return {"evaluated": str(parse_average(self.average)) if averaged else "last"}

    def score(self, shards: ShardSet, limit: int | None = None) -> dict:
        """:func:`~distbelief.evaluation.score_passes` of the loaded parameters on the first
        ``limit`` test examples (None: all), :meth:`rows_per_pass` a pass; a :class:`Rows`
        (a Dataset, a data folder) is read :data:`EVAL_BATCH` rows at a time."""
        if self.test is None:
            return {}
        if isinstance(self.test, Rows):
            end = len(self.test) if limit is None else min(limit, len(self.test))
            parts = (tuple(torch.from_numpy(a) for a in
                           self.test.rows(np.arange(at, min(end, at + EVAL_BATCH))))
                     for at in range(0, end, EVAL_BATCH))
        else:
            parts = iter([tuple(a[:limit] for a in self.test)])
        return score_passes(self.flat.model, self.loss_fn, parts, self.rows_per_pass())


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


def store_bytes(x: np.ndarray, plan: ShardPlan, replicas: int = 1) -> int:
    """Object-store size for an embedded run on this machine (:func:`limits.limited_store`)."""
    return limited_store(x.nbytes, plan.numel, replicas, Resources.local().memory)
