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

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler
from distbelief.errors import UserError
from distbelief.flat import FlatModel
from distbelief.job import Cadence, Checkpointer
from distbelief.ps.client import INLINE_BYTES, PSClient
from distbelief.ps.group import ShardSet
from distbelief.ps.plan import ShardPlan
from distbelief.segments import Replicas, SegmentSchedule, Start
from distbelief.trainer import Evaluator, Trainer, TrainResult

SEGMENT_STEPS = 10  # steps a replica runs per driver call; small keeps the driver responsive
MAX_RESTARTS = 3  # per replica, before it is dropped and the others carry on


class ReplicaLoop:
    """What every kind of Downpour replica shares (dense, sparse, model-parallel): its data
    shard and sampler, the fetch/push schedule, the local update between fetches, the
    straggler slow-down and the step events. A kind supplies ``_fetch`` (start or do the
    fetch; return extra event fields), ``_step(rows)`` (forward, backward, accrue; the loss),
    ``_end_step(push, local)`` (push if ``push``; apply the step's gradient locally with plain
    SGD if ``local``), ``_versions``, ``finish`` and ``counters``.
    """

    event_fields: dict = {}  # extra fields of an event whose step did not fetch

    def _setup(self, index: int, cfg: TrainConfig, loss_fn: nn.Module, n_rows: int,
               y: np.ndarray, start_step: int) -> None:
        torch.set_num_threads(1)
        self.index, self.cfg, self.loss_fn = index, cfg, loss_fn
        self.sampler = ReplicaSampler(n_rows, index, cfg.replicas, cfg.batch_size, cfg.seed,
                                      cfg.data_split)
        self.y = torch.from_numpy(np.asarray(y))
        self.step = start_step
        self.since_push = 0
        self.slow = float(cfg.slow_replicas.get(index, 1.0))

    def where(self) -> str:
        return cluster.node_id()

    def run(self, n_steps: int) -> dict:
        """Run ``n_steps`` steps; returns their events and this replica's counters."""
        cfg, events = self.cfg, []
        for _ in range(n_steps):
            began = time.perf_counter()
            fetched = self.step % cfg.n_fetch == 0
            fields = self._fetch() if fetched else self.event_fields
            loss = self._step(self.sampler.batch(self.step))
            self.since_push += 1
            pushed = self.since_push == cfg.n_push
            if pushed:
                self.since_push = 0
            self._end_step(pushed, cfg.local_update and (self.step + 1) % cfg.n_fetch != 0)
            if self.slow > 1.0:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
            events.append({"t": time.time(), "replica": self.index, "step": self.step,
                           "loss": loss, "versions": self._versions(),
                           "fetched": fetched, "pushed": pushed, **fields})
            self.step += 1
        return {"events": events, "step": self.step, **self._after_run(events)}

    def _after_run(self, events: list[dict]) -> dict:
        """This replica's counters after a run (a kind may also annotate the events)."""
        return self.counters()


class DenseLoop(ReplicaLoop):
    """A replica loop whose dense parameters are one flat buffer (:class:`FlatModel`), fetched
    and pushed whole through a :class:`PSClient`."""

    def _setup_dense(self, model: nn.Module, plan: ShardPlan, client: PSClient) -> None:
        self.flat, self.client = FlatModel(model, plan), client
        self.accrued = torch.zeros_like(self.flat.grad) if self.cfg.n_push > 1 else None

    def _backward(self, loss: torch.Tensor) -> float:
        """Back-propagate ``loss`` into the flat gradient and accrue it; the loss."""
        loss.backward()
        self.flat.sync_grads()
        if self.accrued is not None:
            self.accrued += self.flat.grad
        return float(loss)

    def _end_step(self, push: bool, local: bool) -> None:
        if push:
            self._push()
        if local:
            self._local_update()

    def _fetch_due_next(self) -> bool:
        return (self.step + 1) % self.cfg.n_fetch == 0

    def _local_update(self) -> None:
        with torch.no_grad():
            self.flat.flat.add_(self.flat.grad, alpha=-self.cfg.lr)

    def _versions(self) -> list[int]:
        return list(self.client.versions)

    def _push(self) -> None:
        grad = self.accrued if self.accrued is not None else self.flat.grad
        self.client.push(grad.numpy())
        if self.accrued is not None:
            self.accrued.zero_()
        self.since_push = 0


@ray.remote
class DownpourReplica(DenseLoop):
    """One model replica: fetch every ``n_fetch`` steps, push every ``n_push`` steps."""

    def __init__(self, index: int, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan,
                 shards: list, x: np.ndarray, y: np.ndarray, cfg: TrainConfig,
                 start_step: int = 0, shard_names: list[str] | None = None) -> None:
        self._setup(index, cfg, loss_fn, len(x), y, start_step)
        self._setup_dense(model, plan, PSClient(shards, plan, replica=index, names=shard_names,
                                                grad_dtype=cfg.grad_dtype))
        self.x = torch.from_numpy(np.asarray(x))
        self._fetched_early = False

    def _fetch(self) -> dict:
        if self._fetched_early:  # the last push brought this step's parameters back
            self._fetched_early = False
        else:
            self.client.fetch_into(self.flat.flat_np)
        return {}

    def _push(self) -> None:
        """A push whose next step fetches, of a gradient small enough to travel inline, is
        one call per shard that also brings the parameters back (:meth:`PSClient.
        push_fetch_into`); the next step then uses them. Otherwise push and fetch are
        separate calls and the push overlaps the next step."""
        grad = self.accrued if self.accrued is not None else self.flat.grad
        if self._fetch_due_next() and grad.numel() * 4 <= INLINE_BYTES:
            self.client.push_fetch_into(grad.numpy(), self.flat.flat_np)
            self._fetched_early = True
            if self.accrued is not None:
                self.accrued.zero_()
            self.since_push = 0
        else:
            super()._push()

    def _step(self, rows: np.ndarray) -> float:
        rows = torch.from_numpy(rows)
        self.flat.zero_grad()
        return self._backward(self.loss_fn(self.flat.model(self.x[rows]), self.y[rows]))

    def finish(self) -> dict:
        """Push what is still accrued and wait until every shard has applied it."""
        if self.since_push:
            self._push()
        self.client.wait()
        return self.counters()

    def counters(self) -> dict:
        c = self.client
        return {"fetches": c.fetches, "pushes": c.pushes, "rejected": c.rejected,
                "push_dropped": c.dropped, "dropped_by_shard": list(c.dropped_by_shard),
                "retried": c.retried}


class DownpourSGD(Trainer):
    """Train any ``nn.Module`` with Downpour SGD on a sharded parameter server.

    See :class:`~distbelief.trainer.Trainer` for the arguments; the Downpour knobs are
    ``replicas``, ``shards``, ``n_fetch``, ``n_push``, ``optimizer``, ``lr``,
    ``batch_size``, ``steps`` (per replica) and ``warmstart_steps``.
    """

    algorithm = "downpour"
    restores_shards = True

    def __init__(self, model: nn.Module, loss_fn: nn.Module | None = None,
                 config: TrainConfig | None = None, **overrides) -> None:
        super().__init__(model, loss_fn, config, **overrides)
        self.resumed_steps: dict[int, int] = {}  # steps each replica had done at the resume

    def _replica_actor(self):
        """The replica actor class: one process per replica, or a model-parallel group."""
        if self.cfg.partitions > 1:
            from distbelief.modelpar.replica import ModelParallelReplica

            return ModelParallelReplica
        return DownpourReplica

    def _replica_kwargs(self, shards: ShardSet) -> dict:
        """Extra keyword arguments for every replica (subclasses add their own actors)."""
        if self.cfg.partitions > 1:
            return {"partition_plan": self._partition_plan}
        return {"shard_names": [self.actor_name("shard", i) for i in range(self.plan.shards)]}

    def replica_starter(self, shards: ShardSet, blueprint: nn.Module, x_ref: ray.ObjectRef,
                        y_ref: ray.ObjectRef) -> Start:
        """Where a Downpour run builds its replicas: ``start(i, step)`` starts replica i's
        actor at ``step`` with a pristine copy of ``blueprint``, the data and the shards'
        current handles."""
        cfg, plan = self.cfg, self.plan
        replica_actor = self._replica_actor()

        def start(i: int, step: int = 0) -> ray.actor.ActorHandle:
            return self.job.actor(replica_actor, "replica", i, i, blueprint, self.loss_fn,
                                  plan, shards.handles(), x_ref, y_ref, cfg, step,
                                  **self._replica_kwargs(shards))

        return start

    def _check_restored(self) -> None:
        manifest = self.restored[0]
        steps = {int(k): int(v) for k, v in manifest.get("replica_steps", {}).items()}
        if manifest.get("algorithm") != "downpour" or len(steps) != self.cfg.replicas:
            raise UserError(f"the checkpoint in {self.cfg.resume} is of a "
                            f"{manifest.get('algorithm')} run with {len(steps)} replicas: "
                            "resume with the same --algorithm and --replicas")
        self.resumed_steps = steps

    def _train(self, x, y, test) -> TrainResult:
        blueprint = copy.deepcopy(self.model)  # replicas get pristine copies of this
        evaluator = self._evaluator(test)
        shards = self._start_shards(self.plan.split_flat(evaluator.flat.flat_np))
        start = self.replica_starter(shards, blueprint, ray.put(x), ray.put(y))
        steps = {i: self.resumed_steps.get(i, 0) for i in range(self.cfg.replicas)}
        replicas = Replicas(self.job, start, steps, MAX_RESTARTS)
        try:
            return self._drive(shards, replicas, evaluator)
        finally:
            replicas.kill()
            shards.kill()

    def _drive(self, shards: ShardSet, replicas: Replicas, evaluator: Evaluator
               ) -> TrainResult:
        """The driver loop: resubmit each replica's next segment the moment it returns;
        evaluate, check rejections and checkpoint on their cadences."""
        cfg, job = self.cfg, self.job
        first = shards.retry(shards.stats)
        job.log("placement", shards=[s["node"] for s in first], replicas=replicas.where())
        job.progress(cfg.replicas * cfg.steps)
        schedule = SegmentSchedule(cfg.steps, cfg.warmstart_steps, SEGMENT_STEPS,
                                   {i: self.resumed_steps.get(i, 0) for i in replicas.actors})
        counters: dict[int, dict] = {}
        pending: dict[ray.ObjectRef, int] = {}

        def submit(i: int) -> None:
            n = schedule.segment(i)
            if n:
                pending[replicas.actors[i].run.remote(n)] = i

        def evaluate() -> dict:  # also notices a dead shard and restarts it
            return shards.retry(lambda: evaluator.evaluate(job, shards))

        for i in schedule.first(replicas.actors):
            submit(i)
        evaluation = Cadence(cfg.eval_every_s, due_now=True)
        checkpoints = Checkpointer(job, shards, self.plan, self._state_names(),
                                   cfg.checkpoint_every_s or float("inf"))

        def checkpoint() -> None:
            checkpoints.write({"algorithm": "downpour",
                               "replica_steps": schedule.replica_steps()})

        try:
            while pending:
                if checkpoints.due():
                    checkpoint()
                if evaluation.due():
                    evaluate()
                    shards.retry(lambda: shards.check_rejections(cfg.max_rejected))
                    evaluation.restart()
                wake = min(evaluation.at, checkpoints.cadence.at)
                ready, _ = ray.wait(list(pending), num_returns=1,
                                    timeout=max(0.0, wake - time.time()))
                for ref in ready:
                    i = pending.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except ray.exceptions.RayActorError as err:
                        if replicas.failed(i, schedule.done[i], err, shards):
                            submit(i)
                        continue
                    for e in reply["events"]:
                        job.log("step", **e)
                    counters[i] = {k: v for k, v in reply.items() if k not in ("events", "step")}
                    nxt, warm_ended = schedule.returned(i, reply["step"], replicas.actors)
                    job.tick(len(reply["events"]), reply["events"][-1]["loss"])
                    if warm_ended:
                        job.log("warmstart_done", step=schedule.done[0])
                    for j in nxt:
                        submit(j)
        except KeyboardInterrupt:
            replicas.kill()  # stop pushing, so the checkpoint is what the shards hold now
            checkpoint()
            job.log("interrupted", replica_steps=dict(schedule.done))
            raise
        if not replicas.actors:
            raise RuntimeError(f"every replica died more than {MAX_RESTARTS} times; see the "
                               "run's replica_failed events")
        counters.update(replicas.finish())
        checkpoint()
        final = evaluate()
        stats = shards.retry(shards.stats)
        if all("dropped_by_shard" in c for c in counters.values()):
            job.log("push_accounting", exact=not replicas.restarted(),
                    shards=push_accounting(first, stats, list(counters.values())))
        updates = sum(c["pushes"] for c in counters.values())
        return self._result(evaluator, shards, final, updates, stats, counters)


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
