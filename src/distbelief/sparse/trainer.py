"""Downpour SGD for models with row-sparse embedding tables, and the CLI's ``ctr`` run.

:class:`SparseDownpourSGD` is :class:`~distbelief.downpour.DownpourSGD` with three
additions: it starts S embedding shards next to the S dense shards (rows ``r % S``), its
replicas are :class:`~distbelief.replica.DownpourReplica` s over a
:class:`~distbelief.sparse.host.RowSparseHost`, and it scores held-out
click data by AUC (during training on the first ``EVAL_SUBSET`` test examples, at the end on
all of them). The driver loop, restarts and the dense path are Downpour's own; the two
kinds of shards are one :class:`~distbelief.sparse.group.RowShardGroup` to the driver.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import ray
import torch
from torch import nn

from distbelief.checkpoint import load_row_shard, load_row_shards
from distbelief.config import TrainConfig
from distbelief.downpour import DownpourSGD
from distbelief.errors import UserError
from distbelief.host import HostFactory
from distbelief.ps.group import ShardGroup
from distbelief.ps.plan import ShardPlan
from distbelief.sparse.client import SparseClient
from distbelief.sparse.ctr import CTRData, auc, ctr_from_npz, synthetic_ctr
from distbelief.sparse.group import RowShardGroup, row_rejection_error
from distbelief.sparse.host import RowSparseHost
from distbelief.sparse.module import LocalTables, prefetch_rows, sparse_modules, table_specs
from distbelief.sparse.shard import EmbeddingShard, EmbeddingShardCore
from distbelief.sparse.table import TableSpec
from distbelief.trainer import Evaluator, TrainResult

EVAL_SUBSET = 10_000  # test examples scored by the periodic evaluations (all at the end)


@dataclass
class SparseTrainResult(TrainResult):
    """:class:`TrainResult` plus the test AUC and the embedding shards' statistics."""

    test_auc: float | None = None
    sparse_stats: list[dict] = field(default_factory=list, repr=False)


class SparseEvaluator(Evaluator):
    """The driver's copy of the model: dense parameters from the dense shards, the rows a
    test batch needs from the row shards; scores log loss and AUC (periodic evaluations on
    the first ``EVAL_SUBSET`` test examples)."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module, plan: ShardPlan, test,
                 specs: list[TableSpec]) -> None:
        super().__init__(model, loss_fn, plan, test, subset=EVAL_SUBSET)
        self.in_actor = False  # scores with the row shards: stays in the driver
        self.specs = specs

    def score(self, shards: RowShardGroup, limit: int | None = None) -> dict:
        """Held-out log loss and AUC with the shards' current rows (dense already fetched)."""
        if self.test is None:
            return {}
        ids, y = (a[:limit] for a in self.test)
        modules = sparse_modules(self.flat.model)
        prefetch_rows(modules, ids, SparseClient(shards.row_handles(), self.specs))
        with torch.no_grad():
            logits = self.flat.model(ids)
            loss = float(self.loss_fn(logits, y))
        for m in modules:
            m.clear()
        return {"test_loss": loss, "test_auc": auc(y.numpy(), logits.numpy())}


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
        if self.cfg.gpus_per_replica > 0:
            raise UserError("sparse embedding tables train on CPU: drop --device and "
                            "--gpus-per-replica")
        self.cfg.update_rule(rows=True)  # row shards update gathered rows: NumPy rules only
        # the resumed checkpoint's rows, read and validated before any actor starts; held
        # only until the row shards start (a later restart reads the file again)
        self._resumed_rows: list[dict] | None = None

    def _as_arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        return id_arrays(x, y, what, self.specs)

    def _host(self, model: nn.Module, shards: RowShardGroup, incarnation: int = 0
              ) -> HostFactory:
        return partial(RowSparseHost, model, self.plan, shards.handles(), shards.row_handles(),
                       self.specs)

    def _check_restored(self) -> None:
        """Downpour's checks, then the embedding rows: the checkpoint must hold this model's
        tables, intact row files (read, regrouped for ``--shards`` row shards if it had
        another count, and validated here, before any actor)."""
        super()._check_restored()
        manifest = self.restored[0]
        if manifest.get("tables") != self._table_list() or not manifest.get("row_shards"):
            raise UserError(f"the checkpoint in {self.cfg.resume} holds tables "
                            f"{manifest.get('tables')}, not this model's {self._table_list()}: "
                            "resume with the --rows and model of the run that wrote it")
        parts = load_row_shards(self.cfg.resume, int(manifest["checkpoint"]), self.cfg.shards)
        self._resumed_rows = [self._check_rows(i, part) for i, part in enumerate(parts)]

    def _table_list(self) -> list[list]:
        return [[s.name, s.rows, s.dim] for s in self.specs]

    def _check_rows(self, i: int, part: dict) -> dict:
        """Row shard ``i``'s part of a checkpoint, validated by loading it into a throwaway
        shard core (so a damaged file fails here, in one line, not inside an actor)."""
        cfg = self.cfg
        try:
            EmbeddingShardCore(i, cfg.shards, self.specs, cfg.optimizer, cfg.lr, cfg.momentum,
                               part, args=cfg.optimizer_args, schedule=cfg.lr_schedule)
        except ValueError as err:
            raise UserError(f"row shard {i}'s rows of the checkpoint in {cfg.resume} do not "
                            f"fit this model ({err}): use another checkpoint") from None
        return part

    def _start_shards(self, initial: list[np.ndarray]) -> RowShardGroup:
        """Downpour's dense shards, then S embedding shards (from the resumed rows or the
        initial ones), as one group."""
        dense = super()._start_shards(initial)
        cfg, job, specs = self.cfg, self.job, self.specs

        def spawn(i: int, restore_point: dict | None):
            return job.actor(EmbeddingShard, "rowshard", i, i, cfg.shards, specs,
                             cfg.optimizer, cfg.lr, cfg.momentum, restore_point,
                             args=cfg.optimizer_args, schedule=cfg.lr_schedule)

        def read(run_dir: str, number: int, i: int) -> dict:
            return load_row_shard(run_dir, number, i, cfg.shards)

        rows = ShardGroup(job, "rowshard", cfg.shards, spawn, read,
                          self.restores_shards, label="row shard",
                          rejections=row_rejection_error)
        rows.start(self._resumed_rows, self._resumed_from())
        self._resumed_rows = None
        return RowShardGroup(dense, rows, self._table_list())

    def _evaluator(self, test) -> SparseEvaluator:
        return SparseEvaluator(self.model, self.loss_fn, self.plan, test, self.specs)

    def _result(self, evaluator: SparseEvaluator, shards: RowShardGroup, final: dict,
                updates: int, shard_stats: list[dict], counters: dict) -> TrainResult:
        """Downpour's result plus the AUC on the whole test set and the row shards' stats;
        the user's model gets the trained rows."""
        final = {**final, **evaluator.score(shards, None)}
        sparse_stats = shards.row_stats()
        self.job.log("sparse_shards", stats=sparse_stats)
        self._keep_rows(shards.row_handles())
        base = super()._result(evaluator, shards, final, updates, shard_stats, counters)
        return SparseTrainResult(**vars(base), test_auc=final.get("test_auc"),
                                 sparse_stats=sparse_stats)

    def _keep_rows(self, row_shards: list) -> None:
        """Copy the trained rows into an in-process source attached to the user's model."""
        cfg = self.cfg
        local = LocalTables(self.specs, cfg.optimizer, cfg.lr, cfg.momentum,
                            args=cfg.optimizer_args, schedule=cfg.lr_schedule)
        for spec in self.specs:
            parts = ray.get([s.export.remote(spec.name) for s in row_shards])
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
