"""SandblasterLBFGS: batch L-BFGS whose vectors live on the shards, portions on replicas."""

from __future__ import annotations

import copy
import time
from functools import partial

import numpy as np
import ray

from distbelief.errors import UserError
from distbelief.metrics import RunLog
from distbelief.modelpar.host import PartitionedHost
from distbelief.ps.client import PSClient
from distbelief.ps.host import FlatHost
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
        self._checkpoints = int(manifest["checkpoint"])

    def _history_vectors(self) -> tuple[str, ...]:
        """The shard vectors an L-BFGS checkpoint needs besides x: g and the (s, y) ring."""
        slots = range(self.cfg.history + 1)
        return (G, *(f"s{i}" for i in slots), *(f"y{i}" for i in slots))

    def _train(self, log: RunLog, x: np.ndarray, y: np.ndarray, test) -> TrainResult:
        cfg, plan = self.cfg, self.plan
        began = time.time()
        blueprint = copy.deepcopy(self.model)
        evaluator = Evaluator(self.model, self.loss_fn, plan, test)
        shards = self._start_shards(plan.split_flat(evaluator.flat.flat_np))
        x_ref, y_ref = ray.put(x), ray.put(y)

        host = partial(FlatHost, blueprint, plan, shards)
        if cfg.partitions > 1:
            host = partial(PartitionedHost, blueprint, plan, shards, self._partition_plan)

        def start(i: int):
            return SandblasterReplica.options(name=self.actor_name("replica", i),
                                              scheduling_strategy="SPREAD").remote(
                i, host, self.loss_fn, x_ref, y_ref, float(cfg.slow_replicas.get(i, 1.0)))

        space = ShardVectorSpace(shards)
        runner = PortionRunner(space, start, cfg.replicas, len(x), min(cfg.portions, len(x)),
                               cfg.portions_per_push, backups=cfg.backups)
        try:
            return self._coordinate(log, began, shards, space, runner, evaluator, len(x))
        finally:
            for actor in [*runner.replicas.values(), *shards]:
                ray.kill(actor)

    def _coordinate(self, log: RunLog, began: float, shards: list, space: ShardVectorSpace,
                    runner: PortionRunner, evaluator: Evaluator, n_rows: int) -> TrainResult:
        cfg = self.cfg
        log.log("placement", shards=[s["node"] for s in ray.get([s.stats.remote()
                                                                  for s in shards])],
                replicas=ray.get([r.where.remote() for r in runner.replicas.values()]))

        def evaluate(vector: str, grad: str) -> float:
            loss = runner.run(vector, grad) / n_rows
            space.scale(1.0 / n_rows, grad)
            if cfg.l2:
                space.axpy(cfg.l2, vector, grad)
                [sq] = space.dots([(vector, vector)])
                loss += 0.5 * cfg.l2 * sq
            b = runner.history[-1]
            log.log("batch", batch=b.batch, vector=vector, loss=loss, wall_s=b.wall_s,
                    portions_by_replica={str(k): v for k, v in b.portions_by_replica.items()},
                    backups=b.backups, duplicates=b.duplicates, rounds=b.rounds,
                    recomputed=b.recomputed, failures=b.failures,
                    compute_s={str(k): v for k, v in b.compute_s.items()},
                    fetch_s={str(k): v for k, v in b.fetch_s.items()})
            return loss

        client = PSClient(shards, self.plan)
        lbfgs = LBFGS(space, evaluate, history=cfg.history)
        if self.restored is not None:
            lbfgs.load_state_dict(self.restored[0]["lbfgs"])
            log.log("resumed", checkpoint=self._checkpoints, iteration=lbfgs.iteration)

        def checkpoint() -> None:
            space.sync()
            self._checkpoint(log, shards, {"algorithm": "sandblaster",
                                           "lbfgs": lbfgs.state_dict()},
                             self._history_vectors())

        self._progress = self._progress_bar(cfg.iterations)
        self._evaluate(log, client, evaluator, began)
        message = f"reached {cfg.iterations} iterations"
        last_checkpoint = time.time()
        for _ in range(cfg.iterations - lbfgs.iteration):
            try:
                info = lbfgs.step()
            except LineSearchError as err:
                message = f"line search failed: {err}"
                break
            log.log("step", replica=-1, step=info.iteration, loss=info.loss,
                    step_size=info.step_size, evaluations=info.evaluations,
                    grad_norm=info.grad_norm)
            self._evaluate(log, client, evaluator, began)
            self._tick(1, info.loss)
            if time.time() - last_checkpoint >= cfg.checkpoint_every_s:
                checkpoint()
                last_checkpoint = time.time()
            if info.grad_norm <= 1e-6:
                message = "gradient norm below 1e-6"
                break
        checkpoint()
        final = self._evaluate(log, client, evaluator, began)
        log.log("lbfgs_done", message=message, iterations=lbfgs.iteration,
                evaluations=lbfgs.evaluations, scalars_received=space.scalars_received,
                commands=space.calls,
                received_types=sorted(t.__name__ for t in space.received_types))
        stats = ray.get([s.stats.remote() for s in shards])
        counters = {r: {"portions": sum(b.portions_by_replica.get(r, 0)
                                        for b in runner.history)} for r in runner.replicas}
        return self._finish(log, evaluator, final, lbfgs.iteration, began, stats, counters)
