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
import time
from collections import Counter
from functools import partial

import ray
from torch import nn

from distbelief.errors import UserError
from distbelief.host import HostFactory
from distbelief.metrics import RunLog
from distbelief.modelpar.host import PartitionedHost
from distbelief.ps.client import PSClient
from distbelief.ps.host import FlatHost
from distbelief.replica import DownpourReplica
from distbelief.trainer import Evaluator, Trainer, TrainResult

SEGMENT_STEPS = 10  # steps a replica runs per driver call; small keeps the driver responsive
MAX_RESTARTS = 3  # per replica, before it is dropped and the others carry on


class DownpourSGD(Trainer):
    """Train any ``nn.Module`` with Downpour SGD on a sharded parameter server.

    See :class:`~distbelief.trainer.Trainer` for the arguments; the Downpour knobs are
    ``replicas``, ``shards``, ``n_fetch``, ``n_push``, ``optimizer``, ``lr``,
    ``batch_size``, ``steps`` (per replica) and ``warmstart_steps``.
    """

    algorithm = "downpour"
    restores_shards = True

    def _host(self, model: nn.Module, shards: list) -> HostFactory:
        """How every replica holds its parameters: one flat buffer, or a model-parallel group
        (subclasses return their own kind of :class:`~distbelief.host.ParamHost`)."""
        if self.cfg.partitions > 1:
            return partial(PartitionedHost, model, self.plan, shards, self._partition_plan)
        return partial(FlatHost, model, self.plan, shards, grad_dtype=self.cfg.grad_dtype,
                       names=[self.actor_name("shard", i) for i in range(self.plan.shards)])

    def _train(self, log: RunLog, x, y, test) -> TrainResult:
        cfg, plan = self.cfg, self.plan
        began = time.time()
        blueprint = copy.deepcopy(self.model)  # replicas get pristine copies of this
        evaluator = Evaluator(self.model, self.loss_fn, plan, test)
        initial = plan.split_flat(evaluator.flat.flat_np)
        shards = self._start_shards(initial)
        x_ref, y_ref = ray.put(x), ray.put(y)

        host = self._host(blueprint, shards)

        def start(i: int, step: int = 0) -> ray.actor.ActorHandle:
            return self._named_actor(DownpourReplica, "replica", i, i, host, self.loss_fn,
                                     x_ref, y_ref, cfg, step)

        resumed = self._resumed
        replicas = {i: start(i, resumed.get(i, 0)) for i in range(cfg.replicas)}
        try:
            return self._drive(log, began, shards, replicas, start, evaluator, resumed)
        finally:
            for actor in [*replicas.values(), *shards]:
                ray.kill(actor)

    _resumed: dict[int, int] = {}  # steps each replica had done at the resumed checkpoint

    def _check_restored(self) -> None:
        manifest = self.restored[0]
        steps = {int(k): int(v) for k, v in manifest.get("replica_steps", {}).items()}
        if manifest.get("algorithm") != "downpour" or len(steps) != self.cfg.replicas:
            raise UserError(f"the checkpoint in {self.cfg.resume} is of a "
                            f"{manifest.get('algorithm')} run with {len(steps)} replicas: "
                            "resume with the same --algorithm and --replicas")
        self._checkpoints = int(manifest["checkpoint"])
        self._resumed = steps

    def _check_rejections(self, shards: list) -> None:
        """Abort (leaving the last checkpoint as it is) once too many pushes were rejected."""
        stats = ray.get([s.stats.remote() for s in shards])
        rejected = sum(s["rejected_total"] for s in stats)
        if rejected > self.cfg.max_rejected:
            reasons = sum((Counter(s["rejected"]) for s in stats), Counter())
            raise UserError(f"the shards rejected {rejected} pushes ({dict(reasons)}), more than "
                            f"--max-rejected {self.cfg.max_rejected}: the model produces NaN/inf "
                            "or misshaped gradients; lower --lr or fix the model (the last "
                            "checkpoint is untouched)")

    def _drive(self, log: RunLog, began: float, shards: list, replicas: dict, start,
               evaluator: Evaluator, resumed: dict[int, int]) -> TrainResult:
        """The driver loop: resubmit each replica's next segment the moment it returns."""
        cfg, plan = self.cfg, self.plan
        client = PSClient(shards, plan)

        def shard_stats() -> list[dict]:
            return self._on_shards(log, shards, lambda: ray.get([s.stats.remote()
                                                                 for s in shards]))

        first = shard_stats()
        log.log("placement", shards=[s["node"] for s in first],
                replicas=ray.get([r.where.remote() for r in replicas.values()]))
        self._progress = self._progress_bar(cfg.replicas * cfg.steps)
        done = {i: resumed.get(i, 0) for i in replicas}
        restarts = {i: 0 for i in replicas}
        counters: dict[int, dict] = {}
        warm = done[0] < cfg.warmstart_steps
        pending: dict[ray.ObjectRef, int] = {}

        def submit(i: int) -> None:
            limit = cfg.warmstart_steps if warm else cfg.steps
            if done[i] < limit:
                pending[replicas[i].run.remote(min(SEGMENT_STEPS, limit - done[i]))] = i

        def checkpoint() -> None:
            self._checkpoint(log, shards, {"algorithm": "downpour",
                                           "replica_steps": {str(k): v for k, v in done.items()}})

        for i in [0] if warm else list(replicas):
            submit(i)
        next_eval = time.time()
        next_checkpoint = time.time() + (cfg.checkpoint_every_s or float("inf"))
        try:
            while pending:
                if time.time() >= next_checkpoint:
                    checkpoint()
                    next_checkpoint = time.time() + cfg.checkpoint_every_s
                if time.time() >= next_eval:  # also notices a dead shard and restarts it
                    self._on_shards(log, shards, lambda: self._evaluate(log, client, evaluator,
                                                                        began), (client,))
                    self._on_shards(log, shards, lambda: self._check_rejections(shards))
                    next_eval = time.time() + cfg.eval_every_s
                wake = min(next_eval, next_checkpoint)
                ready, _ = ray.wait(list(pending), num_returns=1,
                                    timeout=max(0.0, wake - time.time()))
                for ref in ready:
                    i = pending.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except ray.exceptions.RayActorError as err:
                        restarts[i] += 1
                        log.log("replica_failed", replica=i, step=done[i], restarts=restarts[i],
                                error=type(err).__name__)
                        ray.kill(replicas[i])  # a task error (a dead partition) leaves it up
                        if self.restores_shards:  # it may have died of a dead shard
                            self._revive_shards(log, shards)
                        if restarts[i] > MAX_RESTARTS:
                            replicas.pop(i)
                        else:
                            replicas[i] = start(i, done[i])
                            submit(i)
                        continue
                    for e in reply["events"]:
                        log.log("step", **e)
                    counters[i] = {k: v for k, v in reply.items() if k not in ("events", "step")}
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
        except KeyboardInterrupt:
            for r in replicas.values():
                ray.kill(r)  # stop pushing, so the checkpoint is what the shards hold now
            checkpoint()
            log.log("interrupted", replica_steps=dict(done))
            raise
        if not replicas:
            raise RuntimeError(f"every replica died more than {MAX_RESTARTS} times; see the "
                               "run's replica_failed events")
        for i, c in zip(replicas, ray.get([r.finish.remote() for r in replicas.values()])):
            counters[i] = c
        checkpoint()
        final = self._on_shards(log, shards, lambda: self._evaluate(log, client, evaluator,
                                                                    began), (client,))
        stats = shard_stats()
        if all("dropped_by_shard" in c for c in counters.values()):
            log.log("push_accounting", exact=not any(restarts.values()),
                    shards=push_accounting(first, stats, list(counters.values())))
        updates = sum(c["pushes"] for c in counters.values())
        return self._finish(log, evaluator, final, updates, began, stats, counters)


def push_accounting(first: list[dict], last: list[dict], counters: list[dict]) -> list[dict]:
    """Where every push to each shard went, from shard stats at the start and end of a run
    and the replicas' counters: ``sent == applied + rejected + dropped + lost_with_shard``.

    ``dropped`` pushes were never acknowledged (the shard had died); ``lost_with_shard``
    ones were acknowledged, then rolled back when the shard restarted from a checkpoint.
    Exact while no replica restarted (a dead replica's last counters are unknown).
    """
    sent = sum(c["pushes"] for c in counters)
    out = []
    for s, (a, b) in enumerate(zip(first, last)):
        applied = b["version"] - a["version"]
        rejected = b["rejected_total"] - a["rejected_total"]
        dropped = sum(c["dropped_by_shard"][s] for c in counters)
        out.append({"shard": s, "sent": sent, "applied": applied, "rejected": rejected,
                    "dropped": dropped, "lost_with_shard": sent - applied - rejected - dropped})
    return out
