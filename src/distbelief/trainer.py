"""What every trainer shares: config, shard start-up, the run folder, evaluation, results.

:class:`Trainer` validates its config and builds the shard plan in ``__init__`` (before any
actor starts), then :meth:`Trainer.fit` connects to Ray, opens the run folder and calls the
subclass's ``_train``.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_arrays,
    shard_file,
    write_manifest,
)
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.flat import FlatModel, parameter_shapes
from distbelief.metrics import RunLog, plot_run
from distbelief.ps.client import PSClient
from distbelief.ps.optim import make_rule
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

MAX_SHARD_RESTARTS = 3  # per shard, before the run fails

@dataclass
class TrainResult:
    """What a run produced: final parameters by name and the run's figures."""

    params: dict[str, np.ndarray]
    test_accuracy: float | None
    test_loss: float | None
    updates: int
    wall_s: float
    shard_stats: list[dict]
    replica_counters: dict[int, dict]
    events: list[dict] = field(repr=False)
    run_dir: str | None = None


def dead_shards(shards: list) -> list[int]:
    """Indices of the shard actors in ``shards`` that died (a busy one counts as alive)."""
    dead = []
    for i, shard in enumerate(shards):
        try:
            ray.get(shard.stats.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            dead.append(i)
        except ray.exceptions.GetTimeoutError:
            pass  # alive, only busy
    return dead


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
        self._progress = None
        self._show_progress = False
        self._accuracy: float | None = None
        self.restored = None
        self._checkpoints = 0

    def actor_name(self, role: str, index: int) -> str:
        """The Ray actor name of a shard or replica of this run (for tools and fault tests)."""
        return f"distbelief-{self.run_id}-{role}-{index}"

    def fit(self, x_train, y_train, x_test=None, y_test=None, progress: bool = False
            ) -> TrainResult:
        """Train on ``(x_train, y_train)``; evaluate on the test set if given.

        Arrays may be NumPy or torch; ``x`` is float32 ``(n, ...)``, ``y`` has ``n`` rows.
        """
        cfg = self.cfg
        x_train, y_train = self._as_arrays(x_train, y_train, "training")
        test = self._as_arrays(x_test, y_test, "test") if x_test is not None else None
        self._show_progress = progress
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
            log = RunLog(cfg.run_dir)
            log.write_json("config.json", cfg.to_dict())
            try:
                with _sigterm_as_interrupt():
                    return self._train(log, x_train, y_train, test)
            finally:
                log.close()
                if self._progress is not None:
                    self._progress.close()
                    self._progress = None

    def _train(self, log: RunLog, x: np.ndarray, y: np.ndarray, test) -> TrainResult:
        raise NotImplementedError

    def _as_arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Validated contiguous NumPy inputs (float32 features); subclasses take other kinds."""
        return as_arrays(x, y, what)

    def _check_restored(self) -> None:
        """Raise :class:`UserError` if ``self.restored`` cannot continue this run."""

    def _state_names(self) -> tuple[str, ...]:
        return make_rule(self.cfg.optimizer, self.cfg.lr, self.cfg.momentum).state_names

    def _start_shards(self, initial: list[np.ndarray]) -> list[ray.actor.ActorHandle]:
        """One shard actor per planned slice, from ``initial`` or from the resumed checkpoint."""
        restored = [None] * self.plan.shards
        if self.restored is not None:
            manifest, parts = self.restored
            restored = [{"arrays": a, "version": e["version"], "counters": e.get("counters")}
                        for a, e in zip(parts, manifest["shards"])]
        self._initial = initial
        self._shard_restarts = [0] * self.plan.shards
        self._restart_from = restored, self._checkpoints or None  # until a checkpoint is written
        return [self._new_shard(i, restored[i]) for i in range(self.plan.shards)]

    def _named_actor(self, actor_class, role: str, i: int, *args, **kwargs):
        """``actor_class(*args, **kwargs)`` as the actor named ``actor_name(role, i)``, spread
        over the nodes; retried while a dead predecessor's name is still being freed (Ray
        frees it asynchronously)."""
        for _ in range(200):
            try:
                return actor_class.options(name=self.actor_name(role, i),
                                           scheduling_strategy="SPREAD").remote(*args, **kwargs)
            except ray.exceptions.ActorAlreadyExistsError:
                time.sleep(0.05)
        raise RuntimeError(f"{role} {i}'s actor name is still taken after it died")

    def _new_shard(self, i: int, restored: dict | None) -> ray.actor.ActorHandle:
        cfg = self.cfg
        return self._named_actor(ParameterShard, "shard", i, i, self._initial[i],
                                 cfg.optimizer, cfg.lr, cfg.momentum, restored)

    def _on_shards(self, log: RunLog, shards: list, call, clients: tuple = ()):
        """``call()``, which talks to ``shards``; if a shard died, restart it and call again.

        Only where :attr:`restores_shards` is set; ``clients`` are the driver's
        :class:`PSClient` s, pointed at the restarted shards.
        """
        while True:
            for client in clients:  # a shard may have been restarted by an earlier call
                client.shards[:] = shards
            try:
                return call()
            except ray.exceptions.RayActorError:
                if not (self.restores_shards and self._revive_shards(log, shards)):
                    raise

    def _revive_shards(self, log: RunLog, shards: list) -> list[int]:
        """Restart every dead shard in place in ``shards``; the restarted indices.

        A restarted shard resumes from the newest checkpoint this run has written (or the
        one it resumed from), so it loses the updates applied to its slice since then; with
        no checkpoint yet it starts again from the initial parameters.
        """
        dead = dead_shards(shards)
        for i in dead:
            self._shard_restarts[i] += 1
            log.log("shard_failed", shard=i, restarts=self._shard_restarts[i])
            if self._shard_restarts[i] > MAX_SHARD_RESTARTS:
                raise RuntimeError(f"shard {i} died more than {MAX_SHARD_RESTARTS} times; see "
                                   "the run's shard_failed events")
            restored, number = self._shard_checkpoint(log, i)
            ray.kill(shards[i])
            shards[i] = self._new_shard(i, restored)
            version = ray.get(shards[i].stats.remote())["version"]
            log.log("shard_restored", shard=i, checkpoint=number, version=version)
        return dead

    def _shard_checkpoint(self, log: RunLog, i: int) -> tuple[dict | None, int | None]:
        """Shard ``i``'s part of the newest checkpoint (None: initial) and that number."""
        if self._restart_from is not None:  # no checkpoint written by this run yet
            restored, number = self._restart_from
            return restored[i], number
        manifest, parts = load_checkpoint(log.run_dir, self._checkpoints, self.plan,
                                          self._state_names(), shards=[i])
        entry = manifest["shards"][i]
        return ({"arrays": parts[i], "version": entry["version"],
                 "counters": entry["counters"]}, self._checkpoints)

    def _checkpoint(self, log: RunLog, shards: list, extra: dict,
                    vectors: tuple[str, ...] = ()) -> int | None:
        """Every shard writes its slice, rule state, version and the named Sandblaster
        ``vectors``; then the manifest. The checkpoint's number."""
        if log.run_dir is None:
            return None
        number = self._checkpoints + 1
        (log.run_dir / "checkpoints").mkdir(exist_ok=True)
        versions = self._on_shards(log, shards, lambda: ray.get(
            [s.save.remote(str(shard_file(log.run_dir, number, i)), vectors)
             for i, s in enumerate(shards)]))
        write_manifest(log.run_dir, number, versions, self.plan, self._state_names(), extra)
        self._checkpoints, self._restart_from = number, None
        log.log("checkpoint", number=number, versions=versions, **extra)
        return number

    def _progress_bar(self, total: int):
        if not self._show_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="step", dynamic_ncols=True)

    def _evaluate(self, log: RunLog, client: PSClient, evaluator: Evaluator,
                  began: float) -> dict:
        versions = client.fetch_into(evaluator.flat.flat_np)
        scores = evaluator.score()
        log.log("eval", updates=sum(versions), versions=versions, elapsed_s=time.time() - began,
                **scores)
        self._accuracy = scores.get("test_accuracy", self._accuracy)
        return scores

    def _tick(self, steps: int, loss: float) -> None:
        if self._progress is None:
            return
        self._progress.update(steps)
        rate = self._progress.format_dict.get("rate") or 0.0
        acc = "" if self._accuracy is None else f" acc={self._accuracy:.3f}"
        self._progress.set_postfix_str(f"loss={loss:.3f}{acc} updates/s={rate:.0f}")

    def _finish(self, log: RunLog, evaluator: Evaluator, final: dict, updates: int,
                began: float, shard_stats: list[dict], counters: dict) -> TrainResult:
        """Log the final event, write params.safetensors and plot.png, build the result."""
        wall = time.time() - began
        log.log("final", updates=updates, wall_s=wall, shard_stats=shard_stats, **final)
        params = evaluator.flat.named_arrays(self.plan)
        if log.run_dir is not None:
            save_arrays(log.run_dir / "params.safetensors", params,
                        {"updates": str(updates), "algorithm": self.algorithm})
            log.close()
            plot_run(log.run_dir)
        return TrainResult(params, final.get("test_accuracy"), final.get("test_loss"),
                           updates, wall, shard_stats, counters, log.events,
                           str(log.run_dir) if log.run_dir else None)


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
    """The driver's copy of the model, loaded from the shards to score the test set."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan, test) -> None:
        self.flat = FlatModel(model, plan)
        self.loss_fn = loss_fn
        self.test = None if test is None else tuple(torch.from_numpy(a) for a in test)

    @torch.no_grad()
    def score(self) -> dict:
        if self.test is None:
            return {}
        x, y = self.test
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
