"""Downpour SGD for models with row-sparse embedding tables, and the CLI's ``ctr`` run.

:class:`SparseDownpourSGD` is :class:`~distbelief.downpour.DownpourSGD` with three
additions: it starts S embedding shards next to the S dense shards (rows ``r % S``), its
replicas are :class:`~distbelief.replica.DownpourReplica` s over a
:class:`~distbelief.sparse.host.RowSparseHost`, and it scores held-out
click data by AUC (during training on the first ``EVAL_SUBSET`` test examples, at the end on
all of them). The driver loop, restarts and the dense path are Downpour's own.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from distbelief.checkpoint import load_arrays, shard_file
from distbelief.config import TrainConfig
from distbelief.downpour import DownpourSGD
from distbelief.errors import UserError
from distbelief.host import HostFactory
from distbelief.metrics import RunLog
from distbelief.ps.client import PSClient
from distbelief.sparse.client import SparseClient
from distbelief.sparse.ctr import CTRData, auc, ctr_from_npz, synthetic_ctr
from distbelief.sparse.host import RowSparseHost
from distbelief.sparse.module import LocalTables, prefetch_rows, sparse_modules, table_specs
from distbelief.sparse.shard import EmbeddingShard, EmbeddingShardCore
from distbelief.trainer import MAX_SHARD_RESTARTS, Evaluator, TrainResult, dead_shards

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
        self._sparse_shards: list = []
        # where row shard i (re)starts from: None (the initial rows) or a checkpoint's row
        # file {"file", "version", "arrays"}; arrays are held only until the shards start
        self._row_restart_from: list[dict | None] = []
        self._row_restarts: list[int] = []

    def _as_arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        return id_arrays(x, y, what, self.specs)

    def _host(self, model: nn.Module, shards: list) -> HostFactory:
        return partial(RowSparseHost, model, self.plan, shards, self._sparse_shards, self.specs)

    def _check_restored(self) -> None:
        """Downpour's checks, then the embedding rows: the checkpoint must hold this model's
        tables, one intact row file per shard (read and validated here, before any actor)."""
        super()._check_restored()
        manifest = self.restored[0]
        folder = Path(self.cfg.resume) / "checkpoints"
        if manifest.get("tables") != self._table_list() \
                or len(manifest.get("row_shards", [])) != self.cfg.shards:
            raise UserError(f"the checkpoint in {self.cfg.resume} holds tables "
                            f"{manifest.get('tables')}, not this model's {self._table_list()}: "
                            "resume with the --rows and model of the run that wrote it")
        self._row_restart_from = [self._read_rows(folder, i, entry)
                                  for i, entry in enumerate(manifest["row_shards"])]

    def _table_list(self) -> list[list]:
        return [[s.name, s.rows, s.dim] for s in self.specs]

    def _read_rows(self, folder: Path, i: int, entry: dict) -> dict:
        """Row shard ``i``'s part of a checkpoint, validated by loading it into a throwaway
        shard core (so a damaged file fails here, in one line, not inside an actor)."""
        arrays = load_arrays(folder / entry["file"])
        cfg = self.cfg
        try:
            EmbeddingShardCore(i, cfg.shards, self.specs, cfg.optimizer, cfg.lr, cfg.momentum,
                               {"arrays": arrays, "version": entry["version"]})
        except ValueError as err:
            raise UserError(f"row checkpoint {entry['file']} does not fit this model ({err}): "
                            "use another checkpoint") from None
        return {"arrays": arrays, "file": folder / entry["file"], "version": int(entry["version"])}

    def _start_shards(self, initial: list[np.ndarray]) -> list[ray.actor.ActorHandle]:
        dense = super()._start_shards(initial)
        if not self._row_restart_from:
            self._row_restart_from = [None] * self.cfg.shards
        self._row_restarts = [0] * self.cfg.shards
        self._sparse_shards = [self._new_row_shard(i, self._row_restart_from[i])
                               for i in range(self.cfg.shards)]
        for part in self._row_restart_from:  # a later restart reads the file again
            if part is not None:
                part["arrays"] = None
        self._driver_rows = SparseClient(self._sparse_shards, self.specs)
        return dense

    def _new_row_shard(self, i: int, restored: dict | None) -> ray.actor.ActorHandle:
        cfg = self.cfg
        return self._named_actor(EmbeddingShard, "rowshard", i, i, cfg.shards, self.specs,
                                 cfg.optimizer, cfg.lr, cfg.momentum, restored)

    def _checkpoint(self, log: RunLog, shards: list, extra: dict,
                    vectors: tuple[str, ...] = ()) -> int | None:
        """Every embedding shard writes its rows, rule state and version; then Downpour's
        dense checkpoint, whose manifest (written last) names the row files too."""
        if log.run_dir is None:
            return None
        number = self._checkpoints + 1
        (log.run_dir / "checkpoints").mkdir(exist_ok=True)
        files = [shard_file(log.run_dir, number, i, "rowshard") for i in range(self.cfg.shards)]
        versions = self._on_shards(log, shards, lambda: ray.get(
            [s.save.remote(str(f)) for s, f in zip(self._sparse_shards, files)]))
        rows = [{"file": f.name, "version": int(v)} for f, v in zip(files, versions)]
        number = super()._checkpoint(log, shards, {**extra, "tables": self._table_list(),
                                                   "row_shards": rows}, vectors)
        self._row_restart_from = [{"arrays": None, "file": f, "version": r["version"]}
                                  for f, r in zip(files, rows)]
        return number

    def _revive_shards(self, log: RunLog, shards: list) -> list[int]:
        """Downpour's dense shards, then every dead embedding shard: restarted under its name
        from the newest checkpoint's rows (or the initial rows), in place in the list the
        replicas and the driver use. The restarted shards (dense indices, then row shards
        numbered after them)."""
        dead = super()._revive_shards(log, shards)
        rows_dead = dead_shards(self._sparse_shards)
        for i in rows_dead:
            self._row_restarts[i] += 1
            log.log("row_shard_failed", shard=i, restarts=self._row_restarts[i])
            if self._row_restarts[i] > MAX_SHARD_RESTARTS:
                raise RuntimeError(f"row shard {i} died more than {MAX_SHARD_RESTARTS} times; "
                                   "see the run's row_shard_failed events")
            part = self._row_restart_from[i]
            if part is not None and part["arrays"] is None:  # written by this run: read it
                part = {"arrays": load_arrays(part["file"]), "version": part["version"]}
            ray.kill(self._sparse_shards[i])
            self._sparse_shards[i] = self._driver_rows.shards[i] = self._new_row_shard(i, part)
            version = ray.get(self._sparse_shards[i].stats.remote())["version"]
            log.log("row_shard_restored", shard=i, checkpoint=self._checkpoints or None,
                    version=version)
        return dead + [len(shards) + i for i in rows_dead]

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
