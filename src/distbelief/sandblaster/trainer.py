"""SandblasterLBFGS: batch L-BFGS whose vectors live on the shards, portions on replicas."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import ray
from torch import nn

from distbelief.checkpointer import Checkpointer
from distbelief.devices import gpu_options
from distbelief.errors import UserError
from distbelief.ps.group import ShardSet
from distbelief.sandblaster.coordinator import PortionRunner, ShardVectorSpace
from distbelief.sandblaster.lbfgs import LBFGS
from distbelief.sandblaster.linesearch import LineSearchError
from distbelief.sandblaster.replica import SandblasterReplica
from distbelief.sandblaster.vectors import G
from distbelief.trainer import Evaluator, Trainer, TrainResult


class SandblasterLBFGS(Trainer):
    """Minimise ``mean loss + l2 / 2 * |x|^2`` over the whole training set with L-BFGS.

    The driver is the coordinator: it runs :class:`~distbelief.sandblaster.lbfgs.LBFGS`
    through :class:`ShardVectorSpace` (only scalars come back) and evaluates each point by
    handing ``portions`` portions of the training set to ``replicas`` replicas, with backup
    copies near the end of each batch. ``iterations`` L-BFGS steps at most.

    After an iteration (every one, or once ``checkpoint_every_s`` seconds have passed) the
    shards checkpoint x, g and the L-BFGS history vectors, and the manifest holds the
    coordinator's :meth:`LBFGS.state_dict`, so ``resume`` continues after the last
    checkpointed iteration even when the coordinator (the driver process) was killed.
    """

    algorithm = "sandblaster"

    def _as_data(self, x, y, what: str) -> tuple:
        """Sandblaster deals portions of indexable rows held in memory: arrays only for
        training (a test ``Dataset`` or data folder is scored in batches)."""
        if y is None and what == "training":
            raise UserError("SandblasterLBFGS needs the training rows as arrays (x, y): "
                            "train a Dataset, data folder or stream with DownpourSGD "
                            "(--algorithm downpour)")
        return super()._as_data(x, y, what)

    def _check_restored(self) -> None:
        manifest = self.restored[0]
        state = manifest.get("lbfgs")
        if manifest.get("algorithm") != "sandblaster" or not isinstance(state, dict):
            raise UserError(f"the checkpoint in {self.cfg.resume} is of a "
                            f"{manifest.get('algorithm')} run: resume it with --algorithm "
                            f"{manifest.get('algorithm')}")
        if state.get("history") != self.cfg.history:
            raise UserError(f"the checkpoint in {self.cfg.resume} has L-BFGS history "
                            f"{state.get('history')}: resume with --history "
                            f"{state.get('history')}")

    def _history_vectors(self) -> tuple[str, ...]:
        """The shard vectors an L-BFGS checkpoint needs besides x: g and the (s, y) ring."""
        slots = range(self.cfg.history + 1)
        return (G, *(f"s{i}" for i in slots), *(f"y{i}" for i in slots))

    def replica_starter(self, shards: ShardSet, blueprint: nn.Module, x_ref: ray.ObjectRef,
                        y_ref: ray.ObjectRef) -> Callable[[int], ray.actor.ActorHandle]:
        """Where a Sandblaster run builds its replicas: ``start(i)`` starts replica i's actor
        over a parameter host (:meth:`Trainer._host`) holding a pristine copy of
        ``blueprint`` and the shards' current handles."""
        cfg = self.cfg

        def start(i: int):
            return self.job.actor(SandblasterReplica, "replica", i, i,
                                  self._host(blueprint, shards), self.loss_fn, x_ref, y_ref,
                                  float(cfg.slow_replicas.get(i, 1.0)),
                                  options=gpu_options(cfg.gpus_per_replica))

        return start

    def _train(self, x: np.ndarray, y: np.ndarray, test) -> TrainResult:
        cfg, plan = self.cfg, self.plan
        blueprint = copy.deepcopy(self.model)
        evaluator = self._evaluator(test)
        shards = self._start_shards(plan.split_flat(evaluator.flat.flat_np))
        start = self.replica_starter(shards, blueprint, ray.put(x), ray.put(y))
        space = ShardVectorSpace(shards.handles())
        runner = PortionRunner(space, start, cfg.replicas, len(x), min(cfg.portions, len(x)),
                               cfg.portions_per_push, backups=cfg.backups)
        try:
            return self._coordinate(shards, space, runner, evaluator, len(x))
        finally:
            for actor in runner.replicas.values():
                ray.kill(actor)
            shards.kill()

    def _coordinate(self, shards: ShardSet, space: ShardVectorSpace, runner: PortionRunner,
                    evaluator: Evaluator, n_rows: int) -> TrainResult:
        cfg, job = self.cfg, self.job
        job.log("placement", shards=[s["node"] for s in shards.stats()],
                replicas=ray.get([r.where.remote() for r in runner.replicas.values()]))

        def evaluate(vector: str, grad: str) -> float:
            loss = runner.run(vector, grad) / n_rows
            space.scale(1.0 / n_rows, grad)
            if cfg.l2:
                space.axpy(cfg.l2, vector, grad)
                [sq] = space.dots([(vector, vector)])
                loss += 0.5 * cfg.l2 * sq
            b = runner.history[-1]
            job.log("batch", batch=b.batch, vector=vector, loss=loss, wall_s=b.wall_s,
                    portions_by_replica={str(k): v for k, v in b.portions_by_replica.items()},
                    backups=b.backups, duplicates=b.duplicates, rounds=b.rounds,
                    recomputed=b.recomputed, failures=b.failures,
                    compute_s={str(k): v for k, v in b.compute_s.items()},
                    fetch_s={str(k): v for k, v in b.fetch_s.items()})
            return loss

        lbfgs = LBFGS(space, evaluate, history=cfg.history)
        if self.restored is not None:
            lbfgs.load_state_dict(self.restored[0]["lbfgs"])
            job.log("resumed", checkpoint=job.checkpoints, iteration=lbfgs.iteration)

        def checkpoint() -> None:
            space.sync()
            checkpoints.write({"algorithm": "sandblaster", "lbfgs": lbfgs.state_dict()},
                              self._history_vectors())

        job.progress(cfg.iterations)
        evaluator.evaluate(job, shards)
        message = f"reached {cfg.iterations} iterations"
        checkpoints = Checkpointer(job, shards, self.plan, self._state_names(),
                                   cfg.checkpoint_every_s)
        for _ in range(cfg.iterations - lbfgs.iteration):
            try:
                info = lbfgs.step()
            except LineSearchError as err:
                message = f"line search failed: {err}"
                break
            job.log("step", replica=-1, step=info.iteration, loss=info.loss,
                    step_size=info.step_size, evaluations=info.evaluations,
                    grad_norm=info.grad_norm)
            evaluator.evaluate(job, shards)
            job.tick(1, info.loss)
            if checkpoints.due():
                checkpoint()
            if info.grad_norm <= 1e-6:
                message = "gradient norm below 1e-6"
                break
        checkpoint()
        final = evaluator.evaluate(job, shards)
        job.log("lbfgs_done", message=message, iterations=lbfgs.iteration,
                evaluations=lbfgs.evaluations, scalars_received=space.scalars_received,
                commands=space.calls,
                received_types=sorted(t.__name__ for t in space.received_types))
        stats = shards.stats()
        counters = {r: {"portions": sum(b.portions_by_replica.get(r, 0)
                                        for b in runner.history)} for r in runner.replicas}
        return self._result(evaluator, shards, final, lbfgs.iteration, stats, counters)
