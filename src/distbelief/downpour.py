"""Downpour SGD: many asynchronous model replicas around a sharded parameter server.

Each replica owns a slice of the training data and loops on its own: every ``n_fetch``
steps it fetches fresh parameters from all shards, every step it computes a mini-batch
gradient, and every ``n_push`` steps it pushes the gradient accumulated since its last push.
Between fetches it applies its own gradients locally with plain SGD (the paper's
Algorithm 7.1). Replicas never wait for each other; shards never wait for each other.
The driver hands each replica its next segment of steps as soon as the last one returns,
evaluates held-out accuracy from the shards, and restarts a replica that dies.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.checkpoint import save_arrays
from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler, replica_indices
from distbelief.errors import UserError
from distbelief.flat import FlatModel, parameter_shapes
from distbelief.metrics import RunLog, plot_run
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

SEGMENT_STEPS = 10  # steps a replica runs per driver call; small keeps the driver responsive
MAX_RESTARTS = 3  # per replica, before it is dropped and the others carry on


@ray.remote
class DownpourReplica:
    """One model replica: fetch every ``n_fetch`` steps, push every ``n_push`` steps."""

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 start_step: int = 0) -> None:
        torch.set_num_threads(1)
        self.index, self.cfg, self.loss_fn = index, cfg, loss_fn
        self.flat = FlatModel(model, plan)
        self.client = PSClient(shards, plan, replica=index)
        rows = replica_indices(len(x), index, cfg.replicas)
        self.sampler = ReplicaSampler(rows, cfg.batch_size, cfg.seed, index)
        self.x, self.y = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
        self.step = start_step
        self.accrued = torch.zeros_like(self.flat.grad) if cfg.n_push > 1 else None
        self.since_push = 0
        self.slow = float(cfg.slow_replicas.get(index, 1.0))

    def where(self) -> str:
        return cluster.node_id()

    def run(self, n_steps: int) -> dict:
        """Run ``n_steps`` steps; returns their events and this replica's counters."""
        cfg, flat, events = self.cfg, self.flat, []
        for _ in range(n_steps):
            began = time.perf_counter()
            fetched = self.step % cfg.n_fetch == 0
            if fetched:
                self.client.fetch_into(flat.flat_np)
            rows = torch.from_numpy(self.sampler.batch(self.step))
            flat.zero_grad()
            loss = self.loss_fn(flat.model(self.x[rows]), self.y[rows])
            loss.backward()
            flat.sync_grads()
            if self.accrued is not None:
                self.accrued += flat.grad
            self.since_push += 1
            pushed = self.since_push == cfg.n_push
            if pushed:
                self._push()
            if cfg.local_update and (self.step + 1) % cfg.n_fetch != 0:
                with torch.no_grad():
                    flat.flat.add_(flat.grad, alpha=-cfg.lr)
            if self.slow > 1.0:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
            events.append({"t": time.time(), "replica": self.index, "step": self.step,
                           "loss": float(loss), "versions": list(self.client.versions),
                           "fetched": fetched, "pushed": pushed})
            self.step += 1
        return {"events": events, "step": self.step, **self.counters()}

    def finish(self) -> dict:
        """Push what is still accrued and wait until every shard has applied it."""
        if self.since_push:
            self._push()
        self.client.wait()
        return self.counters()

    def counters(self) -> dict:
        c = self.client
        return {"fetches": c.fetches, "pushes": c.pushes, "rejected": c.rejected}

    def _push(self) -> None:
        grad = self.accrued if self.accrued is not None else self.flat.grad
        self.client.push(grad.numpy())
        if self.accrued is not None:
            self.accrued.zero_()
        self.since_push = 0


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


class DownpourSGD:
    """Train any ``nn.Module`` with Downpour SGD on a sharded parameter server.

    ``model`` gives the architecture and the initial parameters (float32); ``loss_fn``
    maps ``(model(x), y)`` to a scalar mean loss (cross-entropy by default). Keyword
    arguments are :class:`TrainConfig` fields and override ``config``. After :meth:`fit`
    the model holds the final parameters.
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module | None = None,
                 config: TrainConfig | None = None, **overrides) -> None:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
        if unknown:
            raise UserError(f"unknown option(s) {', '.join(sorted(unknown))}: see TrainConfig")
        self.cfg = dataclasses.replace(config or TrainConfig(), **overrides).validate()
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.plan = ShardPlan.build(parameter_shapes(model), self.cfg.shards)
        self.run_id = uuid.uuid4().hex[:8]
        self._progress = None
        self._show_progress = False
        self._accuracy: float | None = None

    def actor_name(self, role: str, index: int) -> str:
        """The Ray actor name of a shard or replica of this run (for tools and fault tests)."""
        return f"distbelief-{self.run_id}-{role}-{index}"

    def fit(self, x_train, y_train, x_test=None, y_test=None, progress: bool = False
            ) -> TrainResult:
        """Train on ``(x_train, y_train)``; evaluate on the test set if given.

        Arrays may be NumPy or torch; ``x`` is float32 ``(n, ...)``, ``y`` has ``n`` rows.
        """
        cfg = self.cfg
        x_train, y_train = _as_arrays(x_train, y_train, "training")
        test = _as_arrays(x_test, y_test, "test") if x_test is not None else None
        self._show_progress = progress
        num_cpus = cfg.num_cpus or max(2, cfg.replicas + cfg.shards)
        with cluster.session(cfg.address, num_cpus=num_cpus,
                             object_store_memory=_store_bytes(x_train, self.plan)):
            log = RunLog(cfg.run_dir)
            log.write_json("config.json", cfg.to_dict())
            try:
                return self._train(log, x_train, y_train, test)
            finally:
                log.close()
                if self._progress is not None:
                    self._progress.close()
                    self._progress = None

    def _train(self, log: RunLog, x, y, test) -> TrainResult:
        cfg, plan = self.cfg, self.plan
        began = time.time()
        blueprint = copy.deepcopy(self.model)  # replicas get pristine copies of this
        evaluator = _Evaluator(self.model, self.loss_fn, plan, test)
        initial = plan.split_flat(evaluator.flat.flat_np)
        shards = [ParameterShard.options(name=self.actor_name("shard", i),
                                         scheduling_strategy="SPREAD")
                  .remote(i, initial[i], cfg.optimizer, cfg.lr, cfg.momentum)
                  for i in range(plan.shards)]
        x_ref, y_ref = ray.put(x), ray.put(y)

        def start(i: int, step: int = 0) -> ray.actor.ActorHandle:
            return DownpourReplica.options(name=self.actor_name("replica", i),
                                           scheduling_strategy="SPREAD").remote(
                i, blueprint, self.loss_fn, plan, shards, x_ref, y_ref, cfg, step)

        replicas = {i: start(i) for i in range(cfg.replicas)}
        try:
            return self._drive(log, began, shards, replicas, start, evaluator)
        finally:
            for actor in [*replicas.values(), *shards]:
                ray.kill(actor)

    def _drive(self, log: RunLog, began: float, shards: list, replicas: dict, start,
               evaluator: _Evaluator) -> TrainResult:
        """The driver loop: resubmit each replica's next segment the moment it returns."""
        cfg, plan = self.cfg, self.plan
        client = PSClient(shards, plan)
        log.log("placement", shards=[s["node"] for s in ray.get([s.stats.remote()
                                                                  for s in shards])],
                replicas=ray.get([r.where.remote() for r in replicas.values()]))
        self._progress = self._progress_bar()
        done = {i: 0 for i in replicas}
        restarts = {i: 0 for i in replicas}
        counters: dict[int, dict] = {}
        warm = cfg.warmstart_steps > 0
        pending: dict[ray.ObjectRef, int] = {}

        def submit(i: int) -> None:
            limit = cfg.warmstart_steps if warm else cfg.steps
            pending[replicas[i].run.remote(min(SEGMENT_STEPS, limit - done[i]))] = i

        for i in [0] if warm else list(replicas):
            submit(i)
        next_eval = time.time()
        while pending:
            if time.time() >= next_eval:
                self._evaluate(log, client, evaluator, began)
                next_eval = time.time() + cfg.eval_every_s
            ready, _ = ray.wait(list(pending), num_returns=1,
                                timeout=max(0.0, next_eval - time.time()))
            for ref in ready:
                i = pending.pop(ref)
                try:
                    reply = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    restarts[i] += 1
                    log.log("replica_failed", replica=i, step=done[i], restarts=restarts[i],
                            error=type(err).__name__)
                    if restarts[i] > MAX_RESTARTS:
                        ray.kill(replicas.pop(i))
                    else:
                        replicas[i] = start(i, done[i])
                        submit(i)
                    continue
                for e in reply["events"]:
                    log.log("step", **e)
                counters[i] = {k: reply[k] for k in ("fetches", "pushes", "rejected")}
                done[i] = reply["step"]
                self._tick(len(reply["events"]), reply["events"][-1]["loss"])
                if warm and done[0] >= cfg.warmstart_steps:
                    warm = False
                    log.log("warmstart_done", step=done[0])
                    for j in replicas:
                        if done[j] < cfg.steps:
                            submit(j)
                elif done[i] < (cfg.warmstart_steps if warm else cfg.steps):
                    submit(i)
        if not replicas:
            raise RuntimeError(f"every replica died more than {MAX_RESTARTS} times; see the "
                               "run's replica_failed events")
        for i, c in zip(replicas, ray.get([r.finish.remote() for r in replicas.values()])):
            counters[i] = c
        final = self._evaluate(log, client, evaluator, began)
        stats = ray.get([s.stats.remote() for s in shards])
        updates = sum(c["pushes"] for c in counters.values())
        wall = time.time() - began
        log.log("final", updates=updates, wall_s=wall, shard_stats=stats, **final)
        params = evaluator.flat.named_arrays(plan)
        if log.run_dir is not None:
            save_arrays(log.run_dir / "params.safetensors", params,
                        {"updates": str(updates), "algorithm": "downpour"})
            log.close()
            plot_run(log.run_dir)
        return TrainResult(params, final.get("test_accuracy"), final.get("test_loss"),
                           updates, wall, stats, counters, log.events,
                           str(log.run_dir) if log.run_dir else None)

    def _progress_bar(self):
        if not self._show_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.replicas * self.cfg.steps, unit="step", dynamic_ncols=True)

    def _evaluate(self, log: RunLog, client: PSClient, evaluator: _Evaluator,
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


class _Evaluator:
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


def _as_arrays(x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
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


def _store_bytes(x: np.ndarray, plan: ShardPlan) -> int:
    """Object-store size for an embedded run: room for the data and many parameter copies."""
    return int(max(128 * 2**20, 4 * x.nbytes + 64 * plan.numel * 4))
