"""Downpour SGD for models with row-sparse embedding tables, and the CLI's ``ctr`` run.

:class:`SparseDownpourSGD` is :class:`~distbelief.downpour.DownpourSGD` with three
additions: it starts S embedding shards next to the S dense shards (rows ``r % S``), its
replicas are :class:`~distbelief.sparse.replica.SparseReplica` s, and it scores held-out
click data by AUC (during training on the first ``EVAL_SUBSET`` test examples, at the end on
all of them). The driver loop, restarts and the dense path are Downpour's own.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from torch import nn

from distbelief.config import TrainConfig
from distbelief.downpour import DownpourSGD
from distbelief.errors import UserError
from distbelief.metrics import RunLog
from distbelief.ps.client import PSClient
from distbelief.sparse.client import SparseClient
from distbelief.sparse.ctr import CTRData, auc, ctr_from_npz, synthetic_ctr
from distbelief.sparse.module import LocalTables, prefetch_rows, sparse_modules, table_specs
from distbelief.sparse.replica import SparseReplica
from distbelief.sparse.shard import EmbeddingShard
from distbelief.trainer import Evaluator, TrainResult

EVAL_SUBSET = 10_000  # test examples scored by the periodic evaluations (all at the end)


@dataclass
class SparseTrainResult(TrainResult):
    """:class:`TrainResult` plus the test AUC and the embedding shards' statistics."""

    test_auc: float | None = None
    sparse_stats: list[dict] = field(default_factory=list, repr=False)


class SparseDownpourSGD(DownpourSGD):
    """Downpour SGD for a model with :class:`~distbelief.sparse.module.SparseEmbedding` s.

    ``x`` is an id matrix int64 ``(n, fields)`` of table rows, ``y`` click labels (0/1,
    float32 ``(n,)``); ``loss_fn`` defaults to ``BCEWithLogitsLoss`` on the model's logits
    ``(B,)``. After :meth:`fit` the model holds the trained dense parameters and its
    sparse modules are attached to an in-process copy of the trained rows.
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module | None = None,
                 config: TrainConfig | None = None, **overrides) -> None:
        super().__init__(model, loss_fn if loss_fn is not None else nn.BCEWithLogitsLoss(),
                         config, **overrides)
        self.specs = table_specs(model)
        if not self.specs:
            raise UserError("the model has no SparseEmbedding tables: train it with "
                            "DownpourSGD instead")
        if self.cfg.partitions > 1:
            raise UserError("--partitions > 1 does not work with sparse embedding tables yet: "
                            "pass --partitions 1")
        if self.cfg.resume:
            raise UserError("--resume does not restore sparse embedding tables yet (their "
                            "rows are not checkpointed): start the run afresh")
        self._sparse_shards: list = []

    def _as_arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        return id_arrays(x, y, what, self.specs)

    def _replica_actor(self):
        return SparseReplica

    def _replica_kwargs(self, shards: list) -> dict:
        return {"sparse_shards": self._sparse_shards, "specs": self.specs}

    def _start_shards(self, initial: list[np.ndarray]) -> list[ray.actor.ActorHandle]:
        dense = super()._start_shards(initial)
        cfg = self.cfg
        self._sparse_shards = [
            EmbeddingShard.options(name=self.actor_name("rowshard", i),
                                   scheduling_strategy="SPREAD")
            .remote(i, cfg.shards, self.specs, cfg.optimizer, cfg.lr, cfg.momentum)
            for i in range(cfg.shards)]
        self._driver_rows = SparseClient(self._sparse_shards, self.specs)
        return dense

    def _train(self, log: RunLog, x, y, test) -> TrainResult:
        try:
            return super()._train(log, x, y, test)
        finally:
            for actor in self._sparse_shards:
                ray.kill(actor)
            self._sparse_shards = []

    def _score(self, evaluator: Evaluator, limit: int | None) -> dict:
        """Held-out log loss and AUC with the shards' current rows (dense already fetched)."""
        if evaluator.test is None:
            return {}
        ids, y = (a[:limit] for a in evaluator.test)
        modules = sparse_modules(evaluator.flat.model)
        prefetch_rows(modules, ids, self._driver_rows)
        with torch.no_grad():
            logits = evaluator.flat.model(ids)
            loss = float(self.loss_fn(logits, y))
        for m in modules:
            m.clear()
        return {"test_loss": loss, "test_auc": auc(y.numpy(), logits.numpy())}

    def _evaluate(self, log: RunLog, client: PSClient, evaluator: Evaluator,
                  began: float) -> dict:
        versions = client.fetch_into(evaluator.flat.flat_np)
        scores = self._score(evaluator, EVAL_SUBSET)
        log.log("eval", updates=sum(versions), versions=versions, elapsed_s=time.time() - began,
                subset=EVAL_SUBSET, **scores)
        return scores

    def _check_rejections(self, shards: list) -> None:
        super()._check_rejections(shards)
        stats = ray.get([s.stats.remote() for s in self._sparse_shards])
        rejected = sum(s["rejected_total"] for s in stats)
        if rejected > self.cfg.max_rejected:
            last = next(s["last_rejection"] for s in stats if s["last_rejection"])
            raise UserError(f"the embedding shards rejected {rejected} pushes, more than "
                            f"--max-rejected {self.cfg.max_rejected} (last: {last}): fix the "
                            "model's ids or lower --lr")

    def _finish(self, log: RunLog, evaluator: Evaluator, final: dict, updates: int,
                began: float, shard_stats: list[dict], counters: dict) -> TrainResult:
        final = {**final, **self._score(evaluator, None)}
        sparse_stats = ray.get([s.stats.remote() for s in self._sparse_shards])
        log.log("sparse_shards", stats=sparse_stats)
        self._keep_rows()
        base = super()._finish(log, evaluator, final, updates, began, shard_stats, counters)
        return SparseTrainResult(**vars(base), test_auc=final.get("test_auc"),
                                 sparse_stats=sparse_stats)

    def _keep_rows(self) -> None:
        """Copy the trained rows into an in-process source attached to the user's model."""
        cfg = self.cfg
        local = LocalTables(self.specs, cfg.optimizer, cfg.lr, cfg.momentum)
        for spec in self.specs:
            parts = ray.get([s.export.remote(spec.name) for s in self._sparse_shards])
            for rows, values in parts:
                local.tables[spec.name].load(rows, values)
        for m in sparse_modules(self.model):
            m.clear()
            m.attach(local)


def id_arrays(x, y, what: str, specs) -> tuple[np.ndarray, np.ndarray]:
    """Validated id matrix int64 ``(n, fields)`` and labels float32 ``(n,)``."""
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if x.ndim != 2 or len(x) == 0:
        raise UserError(f"the {what} ids must be a non-empty 2-D array (examples, fields), got "
                        f"shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        raise UserError(f"the {what} ids have dtype {x.dtype}: pass integer table rows")
    if len(x) != len(y):
        raise UserError(f"the {what} set has {len(x)} id rows but {len(y)} labels: pass one "
                        "label per row")
    rows = min(s.rows for s in specs)
    if x.min() < 0 or x.max() >= rows:
        raise UserError(f"the {what} ids span {x.min()}..{x.max()} but the tables have {rows} "
                        "rows: make the tables larger (--rows) or remap the ids")
    return np.ascontiguousarray(x, dtype=np.int64), np.ascontiguousarray(y, dtype=np.float32)


def load_ctr(cfg: TrainConfig) -> CTRData:
    """``--dataset ctr`` (synthetic, sized by ``--samples`` and ``--rows``) or a CTR .npz."""
    if cfg.dataset == "ctr":
        return synthetic_ctr(cfg.samples, cfg.rows, cfg.seed)
    return ctr_from_npz(cfg.dataset, cfg.rows)


def train_ctr(cfg: TrainConfig, progress: bool = True) -> int:
    """The CLI's click-through run: wide-and-deep on ``cfg``'s data; prints the final line."""
    from distbelief.sparse.models import WideAndDeep

    ds = load_ctr(cfg)
    truth = ds.truth_auc()
    model = WideAndDeep(cfg.rows, ds.fields, hidden=cfg.hidden, seed=cfg.seed)
    trainer = SparseDownpourSGD(model, config=cfg)
    result = trainer.fit(ds.ids_train, ds.y_train, ds.ids_test, ds.y_test, progress=progress)
    rows = sum(t["materialized"] for s in result.sparse_stats for t in s["tables"].values())
    print(f"run folder: {result.run_dir} (metrics.jsonl, params.safetensors, plot.png); "
          f"{rows} table rows materialised of {cfg.rows} x {len(trainer.specs)} tables",
          file=sys.stderr)
    truth_text = "" if truth is None else f" truth_auc={truth:.4f}"
    print(f"final test_auc={result.test_auc:.4f}{truth_text} updates={result.updates} "
          f"wall_s={result.wall_s:.1f}")
    return 0
