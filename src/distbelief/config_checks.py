"""The checks behind :meth:`TrainConfig.validate <distbelief.config.TrainConfig.validate>`:
each bad value is a one-line :class:`UserError` naming its flag and the fix.

Kept apart from the dataclass so that config.py holds the fields; the allowed values come
from each field's ``choices`` metadata, the flags from ``config.flag`` (passed in).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

from distbelief.devices import check_gpus
from distbelief.errors import UserError, one_of


def at_least(flag: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{flag} must be an integer >= {low} (got {value!r})")


def positive(flag: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0 (got {value!r})")


def check_fields(cfg, flag: Callable[[str], str]) -> None:
    """Check every field of ``cfg`` (a TrainConfig), filling its automatic defaults on the
    way (the later checks see the values a run will use); path fields given as
    :class:`os.PathLike` become ``str``. ``flag(name)`` is a field's command-line flag."""
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(cfg)
               if "choices" in f.metadata}

    def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
        one_of(flag(name), value, allowed)

    def _at_least(name: str, value: int, low: int) -> None:
        at_least(flag(name), value, low)

    def _positive(name: str, value: float) -> None:
        positive(flag(name), value)

    for name in ("dataset", "run_dir", "resume"):
        if isinstance(getattr(cfg, name), os.PathLike):
            setattr(cfg, name, os.fspath(getattr(cfg, name)))
    _choice("algorithm", cfg.algorithm, choices["algorithm"])
    if cfg.dataset not in choices["dataset"] and not cfg.dataset.endswith(".npz") \
            and not (Path(cfg.dataset) / "meta.json").is_file():  # ondisk's data folder
        raise UserError(f"{flag('dataset')} {cfg.dataset!r} is unknown: choose one of "
                        f"{', '.join(choices['dataset'])}, the path of a .npz file, or a data "
                        "folder holding a meta.json (python -m distbelief.ondisk writes one)")
    cfg._fill_automatic()  # the checks below see the values a run will use
    _choice("grad_dtype", cfg.grad_dtype, choices["grad_dtype"])
    _choice("precision", cfg.precision, choices["precision"])
    _choice("data_split", cfg.data_split, choices["data_split"])
    from distbelief.usermodel import check_model_spec

    check_model_spec(cfg.model, cfg.model_args, choices["model"])
    _at_least("partitions", cfg.partitions, 1)
    _choice("partition_by", cfg.partition_by, choices["partition_by"])
    check_gpus(cfg.device, cfg.gpus_per_replica, cfg.partitions, cfg.click_data)
    _at_least("channels", cfg.channels, 1)
    if cfg.dataset == "ctr" and cfg.algorithm != "downpour":
        raise UserError(f"--dataset ctr (sparse embedding tables) trains with --algorithm "
                        f"downpour only, not {cfg.algorithm}: drop --algorithm")
    for name in ("replicas", "shards", "n_fetch", "n_push", "batch_size", "steps",
                 "samples", "features", "rows"):
        if getattr(cfg, name) is not None:
            _at_least(name, getattr(cfg, name), 1)
    _at_least("hidden", cfg.hidden, 0)
    _at_least("shard_backups", cfg.shard_backups, 0)
    if not (isinstance(cfg.clip_grad_norm, (int, float)) and math.isfinite(cfg.clip_grad_norm)
            and cfg.clip_grad_norm >= 0):
        raise UserError(f"{flag('clip_grad_norm')} must be a finite number >= 0 (0: off; got "
                        f"{cfg.clip_grad_norm!r})")
    dense_downpour_only = {"precision": cfg.precision != "float32",
                           "clip_grad_norm": cfg.clip_grad_norm > 0}
    for name in (n for n, on in dense_downpour_only.items() if on):
        if cfg.algorithm != "downpour" or cfg.click_data:
            raise UserError(f"{flag(name)} {getattr(cfg, name)} runs in dense Downpour replicas "
                            "(whole or --partitions) only: drop it for this run (--algorithm "
                            "sandblaster, click data)")
    if cfg.shard_backups and (cfg.algorithm != "downpour" or cfg.click_data):
        raise UserError(f"{flag('shard_backups')} keeps standbys of dense Downpour shards "
                        "only: drop it for this run (--algorithm sandblaster, click data)")
    _at_least("classes", cfg.classes, 2)
    for name in ("iterations", "portions_per_push", "history"):
        _at_least(name, getattr(cfg, name), 1)
    _at_least("portions", cfg.portions, 0)
    if not (isinstance(cfg.l2, (int, float)) and math.isfinite(cfg.l2) and cfg.l2 >= 0):
        raise UserError(f"{flag('l2')} must be a finite number >= 0 (got {cfg.l2!r})")
    _at_least("warmstart_steps", cfg.warmstart_steps, 0)
    _at_least("max_rejected", cfg.max_rejected, 0)
    if cfg.average is not None:
        from distbelief.ps.average import check_average

        check_average(cfg.average, "click data" if cfg.click_data else cfg.algorithm)
    from distbelief.ps.staleness import check_staleness_flags

    check_staleness_flags(cfg.max_staleness, cfg.staleness_lr, cfg.delay_compensation,
                          cfg.algorithm, cfg.ranged_updates)
    from distbelief.ps.sync import check_sync_flags

    check_sync_flags(cfg.backup_workers, cfg.replicas, cfg.algorithm, cfg.ranged_updates,
                     max_staleness=cfg.max_staleness, staleness_lr=cfg.staleness_lr,
                     delay_compensation=cfg.delay_compensation,
                     shard_backups=cfg.shard_backups, n_fetch=cfg.n_fetch, n_push=cfg.n_push,
                     warmstart_steps=cfg.warmstart_steps)
    if cfg.shard_backups and cfg.delay_compensation:
        raise UserError(f"{flag('shard_backups')} with {flag('delay_compensation')}: standbys "
                        "apply pushes without the replicas' fetched copies that delay "
                        "compensation needs, so they would drift from the primary: drop one")
    _positive("lr", cfg.lr)
    _positive("eval_every_s", cfg.eval_every_s)
    if not (isinstance(cfg.eval_budget, (int, float)) and 0 < cfg.eval_budget <= 1):
        raise UserError(f"{flag('eval_budget')} must be in (0, 1] (got {cfg.eval_budget!r})")
    _at_least("eval_rows", cfg.eval_rows, 1)
    if not (math.isfinite(cfg.checkpoint_every_s) and cfg.checkpoint_every_s >= 0):
        raise UserError(f"{flag('checkpoint_every_s')} must be >= 0 seconds "
                        f"(got {cfg.checkpoint_every_s})")
    if not (0.0 <= cfg.momentum < 1.0):
        raise UserError(f"{flag('momentum')} must be in [0, 1) (got {cfg.momentum})")
    cfg.update_rule()
    if cfg.num_cpus is not None:
        _at_least("num_cpus", cfg.num_cpus, 1)
    for index, factor in cfg.slow_replicas.items():
        if not 0 <= index < cfg.replicas:
            raise UserError(f"--slow-replica {index}:{factor} names replica {index}, but "
                            f"replicas are 0..{cfg.replicas - 1}")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise UserError(f"--slow-replica {index}:{factor}: the factor must be >= 1")
