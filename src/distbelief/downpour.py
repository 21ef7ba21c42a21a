"""Downpour SGD: many asynchronous model replicas around a sharded parameter server.

Each replica owns a slice of the training data and loops on its own: every ``n_fetch``
steps it fetches fresh parameters from all shards, every step it computes a mini-batch
gradient, and every ``n_push`` steps it pushes the gradient accumulated since its last push.
Between fetches it applies its own gradients locally with plain SGD (the paper's
Algorithm 7.1). Replicas never wait for each other; shards never wait for each other.
The driver hands each replica its next segment of steps as soon as the last one returns,
evaluates held-out accuracy from the shards, and restarts a replica that dies.

With ``--backup-workers B`` the same replicas and shards run synchronous SGD instead
(:mod:`distbelief.ps.sync`): each shard update is the mean of the first replicas - B
gradients of its version, and the run ends after ``steps`` updates.
"""

from __future__ import annotations

import copy
import time

import ray
from torch import nn

from distbelief.checkpointer import Checkpointer
from distbelief.config import TrainConfig
from distbelief.devices import gpu_options
from distbelief.elastic import ScaleRequests
from distbelief.errors import UserError
from distbelief.evaluation import Evaluations
from distbelief.job import Cadence
from distbelief.limits import Resources
from distbelief.ps.group import MAX_SHARD_RESTARTS, ShardSet
from distbelief.ps.ledger import account, key_of, next_incarnation
from distbelief.replica import DATA_COUNTERS, DownpourReplica
from distbelief.segments import Replicas, Start, WorkPool
from distbelief.trainer import Evaluator, Trainer, TrainResult

SEGMENT_STEPS = 10  # steps a replica runs per driver call; small keeps the driver responsive
MAX_RESTARTS = 3  # per replica, before it is dropped and the others carry on


def slot_steps(cfg: TrainConfig) -> int:
    """Steps each data slot may run: ``steps``; with ``--backup-workers`` an upper bound,
    since the run ends after ``steps`` updates (a replica computes one gradient per version
    it fetches, more only after its restart or a shard's restart from a checkpoint)."""
    if cfg.backup_workers is None:
        return cfg.steps
    return cfg.steps * (1 + MAX_SHARD_RESTARTS) + MAX_RESTARTS + 1


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
        self.resumed_work: tuple[dict, int] | None = None  # unrun ranges, steps a slot
        self._requests: ScaleRequests | None = None  # while fit runs

    def scale(self, replicas: int) -> None:
        """Ask the running :meth:`fit` (in another thread) for ``replicas`` replicas; it
        starts or stops replicas at its next probe (``eval_every_s``), keeping the run's
        total steps. :class:`UserError` when no fit runs, or ``replicas`` is below 1 or
        beyond what the machine or cluster can run."""
        requests = self._requests
        if self.cfg.backup_workers is not None:
            raise UserError("a synchronous run (--backup-workers) keeps its replicas: its "
                            "quorum is fixed at the start; run without --backup-workers")
        if requests is None:
            raise UserError("no run in progress: call scale(replicas=N) while fit() runs "
                            "(in another thread)")
        requests.ask(replicas)

    def replica_starter(self, shards: ShardSet, blueprint: nn.Module, x_ref: ray.ObjectRef,
                        y_ref: ray.ObjectRef | None) -> Start:
        """Where a Downpour run builds its replicas: ``start(i, step)`` starts replica i's
        actor at ``step`` over a parameter host (:meth:`Trainer._host`) holding a pristine
        copy of ``blueprint`` and the shards' current handles. ``x_ref``/``y_ref``: the
        training arrays in the object store, or a data source and None (each replica reads
        its own rows, see :class:`~distbelief.replica.ReplicaLoop`)."""
        cfg = self.cfg

        def start(i: int, step: int = 0, incarnation: int = 0) -> ray.actor.ActorHandle:
            return self.job.actor(DownpourReplica, "replica", i, i,
                                  self._host(blueprint, shards, incarnation),
                                  self.loss_fn, x_ref, y_ref, cfg, step,
                                  options=gpu_options(cfg.gpus_per_replica))

        return start

    def _check_restored(self) -> None:
        manifest = self.restored[0]
        steps = {int(k): int(v) for k, v in manifest.get("replica_steps", {}).items()}
        if manifest.get("algorithm") != "downpour" or len(steps) != self.cfg.replicas:
            raise UserError(f"the checkpoint in {self.cfg.resume} is of a "
                            f"{manifest.get('algorithm')} run with {len(steps)} replicas: "
                            "resume with the same --algorithm and --replicas")
        self.resumed_steps = steps
        self.resumed_work = ((manifest["work"], int(manifest["steps"]))
                             if "work" in manifest and "steps" in manifest else None)

    def _train(self, x, y, test) -> TrainResult:
        blueprint = copy.deepcopy(self.model)  # replicas get pristine copies of this
        evaluator = self._evaluator(test)
        shards = self._start_shards(self.plan.split_flat(evaluator.flat.flat_np))
        shipped = (ray.put(x), ray.put(y)) if y is not None else (x, None)
        start = self.replica_starter(shards, blueprint, *shipped)
        steps = {i: self.resumed_steps.get(i, 0) for i in range(self.cfg.replicas)}
        # past every incarnation the restored shards' ledgers saw; a new run's ledgers are
        # empty, so its replicas start at once, their processes beside the shards'
        incarnation = (next_incarnation(shards.retry(shards.stats)) if self.restored else 1)
        replicas = Replicas(self.job, start, steps, MAX_RESTARTS, incarnation)
        res = (Resources.from_ray(ray.cluster_resources()) if self.cfg.address is not None
               else Resources.local())
        self._requests = ScaleRequests(self.job.run_dir, self.cfg.partitions,
                                       self.cfg.shards * (1 + self.cfg.shard_backups), res)
        try:
            return self._drive(shards, replicas, evaluator)
        finally:
            self._requests.close()
            self._requests = None
            replicas.kill()
            shards.kill()

    def _drive(self, shards: ShardSet, replicas: Replicas, evaluator: Evaluator
               ) -> TrainResult:
        """The driver loop: hand each idle replica its next segment of the run's work the
        moment it returns; evaluate, check rejections, apply scale requests and checkpoint
        on their cadences."""
        cfg, job = self.cfg, self.job
        budget = slot_steps(cfg)
        evals = Evaluations(job, shards, evaluator, cfg)
        evals.ready()  # the evaluator is up and has scored the initial parameters
        first = shards.retry(shards.stats)
        job.log("placement", shards=[s["node"] for s in first], replicas=replicas.where(),
                versions=[s["version"] for s in first], evaluator=evals.where())
        job.progress(cfg.replicas * cfg.steps)
        pool = (WorkPool.resumed(cfg.replicas, budget, self.resumed_work[0],
                                 self.resumed_work[1], SEGMENT_STEPS, cfg.warmstart_steps,
                                 cfg.max_staleness)
                if self.resumed_work else
                WorkPool.from_done(cfg.replicas, budget, self.resumed_steps, SEGMENT_STEPS,
                                   cfg.warmstart_steps, cfg.max_staleness))
        pool.assign(replicas.actors)
        steps = {i: self.resumed_steps.get(i, 0) for i in replicas.actors}  # each one's own
        counters: dict[int, dict] = {}
        retired: dict[int, dict] = {}  # final counters of replicas stopped by a scale-down
        stopping: set[int] = set()  # replicas to stop when their segment returns
        pending: dict[ray.ObjectRef, int] = {}
        data_read: dict[int, dict] = {}  # each replica's DATA_COUNTERS, from its last reply
        warm = pool.warm
        synced = False  # --backup-workers: the run's updates are done

        def feed() -> None:  # a segment for every idle replica that has work
            if synced:
                return
            for i in sorted(set(replicas.actors) - set(pending.values()) - stopping):
                seg = pool.next(i)
                if seg is not None:
                    slot, at, end = seg
                    pending[replicas.actors[i].run.remote(end - at, slot, at)] = i

        def retire(i: int) -> None:
            stopping.discard(i)
            pool.remove(i)
            retired[i] = counters[i] = replicas.retire(i)
            job.log("replica_stopped", replica=i, step=steps[i], pushes=retired[i]["pushes"])

        def rescale(target: int, reason: str) -> None:
            live = sorted(set(replicas.actors) - stopping)
            pool.balance = True
            for _ in range(len(live), target):
                i = max(set(replicas.actors) | set(steps) | set(retired)) + 1
                replicas.add(i)
                steps[i] = 0
            for i in live[target:]:
                if i in pending.values():
                    stopping.add(i)
                else:
                    retire(i)
            job.log("scale", reason=reason, replicas=sorted(set(replicas.actors) - stopping),
                    **{"from": len(live), "to": target})
            feed()

        def evaluate(averaged: bool | None = None) -> dict:  # also revives a dead shard
            return shards.retry(lambda: evaluator.evaluate(job, shards, averaged))

        feed()
        probe = Cadence(cfg.eval_every_s, due_now=True)  # rejections, dead shards, scaling
        checkpoints = Checkpointer(job, shards, self.plan, self._state_names(),
                                   cfg.checkpoint_every_s or float("inf"))

        def checkpoint() -> None:
            checkpoints.write({"algorithm": "downpour", "replica_steps": pool.replica_steps(),
                               "work": pool.remaining(), "steps": budget})

        try:
            while pending:
                if checkpoints.due():
                    checkpoint()
                evals.submit_if_due()
                if probe.due():
                    shards.retry(lambda: shards.check_rejections(cfg.max_rejected))
                    asked = self._requests.take()
                    if asked is not None and cfg.quorum is not None:
                        job.log("scale_refused", reason=asked[1], replicas=asked[0],
                                why="a synchronous run (--backup-workers) keeps its replicas")
                    elif asked is not None:
                        rescale(*asked)
                    probe.restart()
                wake = min(probe.at, checkpoints.cadence.at, evals.wake())
                ready, _ = ray.wait(list(pending) + evals.refs(), num_returns=1,
                                    timeout=max(0.0, wake - time.time()))
                for ref in ready:
                    if evals.collect(ref):
                        continue
                    i = pending.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except ray.exceptions.RayActorError as err:
                        pool.failed(i)
                        if i in stopping:  # it was leaving anyway
                            stopping.discard(i)
                            pool.remove(i)
                            replicas.actors.pop(i)
                        elif not replicas.failed(i, steps[i], err, shards):
                            pool.remove(i)  # dropped: the others run its steps
                            if cfg.quorum is not None and len(replicas.actors) < cfg.quorum:
                                raise RuntimeError(
                                    f"{len(replicas.actors)} replicas are left, fewer than "
                                    f"the {cfg.quorum} each synchronous update waits for; see "
                                    "the run's replica_failed events") from err
                        feed()
                        continue
                    pool.done(i)
                    for e in reply["events"]:
                        job.log("step", **e)
                    data_read[i] = {k: reply.pop(k) for k in DATA_COUNTERS if k in reply}
                    counters[i] = {k: v for k, v in reply.items()
                                   if k not in ("events", "step", "sync_done")}
                    steps[i] = reply["step"]
                    synced |= bool(reply.get("sync_done"))
                    if reply["events"]:
                        job.tick(len(reply["events"]), reply["events"][-1]["loss"])
                    if warm and not pool.warm:
                        warm = False
                        job.log("warmstart_done", step=steps[i])
                    if i in stopping:
                        retire(i)
                    feed()
        except KeyboardInterrupt:
            evals.stop()
            replicas.kill()  # stop pushing, so the checkpoint is what the shards hold now
            checkpoint()
            job.log("interrupted", replica_steps=pool.replica_steps())
            raise
        if pool.left() and not synced:
            raise RuntimeError(f"every replica died more than {MAX_RESTARTS} times; see the "
                               "run's replica_failed events")
        evals.stop(collect=True)
        shards.retry(lambda: shards.check_rejections(cfg.max_rejected))  # a last probe
        finished = retired | replicas.finish()  # every incarnation's final counters
        counters.update(finished)
        for i, read in sorted(data_read.items()):  # where each replica read its rows
            job.log("replica_data", replica=i, **read)
        checkpoint()
        final = evaluate(cfg.average is not None and cfg.average_final)
        stats = shards.retry(shards.stats)
        if cfg.quorum is not None:
            job.log("sync", quorum=cfg.quorum, backup_workers=cfg.backup_workers,
                    shards=[{"shard": s["shard"], **s["sync"]} for s in stats])
        if all("incarnation" in c for c in finished.values()):
            shards_out = push_accounting(first, stats, finished)
            job.log("push_accounting", exact=all(s.pop("exact") for s in shards_out),
                    shards=shards_out)
        updates = sum(c["pushes"] for c in counters.values())
        if cfg.quorum is not None:  # synchronous: the updates are the shards' versions
            updates = min(s["version"] for s in stats)
        return self._result(evaluator, shards, final, updates, stats, counters)


def push_accounting(first: list[dict], last: list[dict], finished: dict[int, dict]
                    ) -> list[dict]:
    """Where every push to each shard went, from the shards' push ledgers at the start and
    end of a run (their stats' ``ledger``) and the counters of each replica incarnation that
    finished: ``sent == applied + rejected + dropped + lost_with_shard``, per shard, with
    ``duplicates`` (resends taken once) and ``exact`` (see :func:`distbelief.ps.ledger.
    account`: a replica that died counts as sent the pushes the shard took from it).

    ``dropped`` pushes were never acknowledged (the shard had died, no standby);
    ``lost_with_shard`` ones were acknowledged, then rolled back when the shard restarted
    from a checkpoint (0 with ``--shard-backups``).
    """
    clients = {key_of(i, c["incarnation"]): c for i, c in finished.items()}
    return [account(a.get("ledger", {}), b.get("ledger", {}), clients, s)
            for s, (a, b) in enumerate(zip(first, last))]
