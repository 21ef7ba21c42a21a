"""Downpour in one process, with a seeded clock that reproduces equal-speed staleness.

For studies of asynchrony at more replicas than a machine's cores can run as processes
(bench/staleness.py): ``R`` replicas with ``n_fetch = n_push = 1`` share the real shard logic
(:class:`~distbelief.ps.shard.ShardCore`: the update rule, ``--average``, ``--staleness-lr``,
``--delay-compensation``, the staleness histogram) and read the real replica data order
(:func:`~distbelief.sources.replica_batches`). Each replica fetches, computes its gradient
on what it fetched, and pushes it one step time later; step times are ``1 +- jitter``
(seeded), so with equal speeds the other ``R - 1`` replicas push in between and a push is
about ``R - 1`` updates stale, as on a real cluster. ``max_staleness`` K holds a replica
that finished step s until every replica has done ``s + 1 - K`` steps (SSP), as the driver's
:class:`~distbelief.segments.WorkPool` does. ``backup_workers`` B runs synchronous SGD with
backup workers instead (``--backup-workers``, :class:`~distbelief.ps.sync.SyncAggregator` on
the real shard logic): ``steps`` is then the run's synchronous updates; a replica that pushed
the gradient of version v starts again once every shard is past v (the B slowest of each
version are dropped and start at once on the new version). Time is counted in step times.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from distbelief.ps.average import parse_average
from distbelief.ps.optim import make_rule
from distbelief.ps.shard import ShardCore
from distbelief.ps.staleness import StalenessControl
from distbelief.sources import replica_batches

__all__ = ["SimConfig", "SimResult", "simulate"]


@dataclass(frozen=True)
class SimConfig:
    """One simulated run: ``replicas`` each running ``steps`` mini-batches of ``batch_size``
    over ``shards`` shards updated by ``optimizer`` at ``lr``; the staleness remedies as the
    flags of the same names; ``eval_every``: global updates between test evaluations;
    ``optimizer_args``: ``--optimizer-arg`` strings (``betas=0.5,0.999``)."""

    replicas: int
    steps: int
    lr: float
    optimizer: str = "adagrad"
    shards: int = 2
    batch_size: int = 32
    seed: int = 0
    max_staleness: int | None = None
    staleness_lr: bool = False
    delay_compensation: float = 0.0
    average: str | None = None
    backup_workers: int | None = None
    jitter: float = 0.1
    eval_every: int = 30
    optimizer_args: tuple[str, ...] = ()


@dataclass
class SimResult:
    """Final test accuracy (of the average with ``--average``), the accuracy curve as
    ``(time in step times, accuracy)``, and the shards' merged staleness histogram."""

    accuracy: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)
    updates: int = 0

    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / max(1, n)


def _accuracy(model: nn.Module, flat: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> float:
    torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def simulate(model: nn.Module, loss_fn: nn.Module, x_train: np.ndarray, y_train: np.ndarray,
             x_test: np.ndarray, y_test: np.ndarray, cfg: SimConfig) -> SimResult:
    """Train ``model`` (its initial parameters; left holding the final ones) as ``cfg`` says."""
    torch.set_num_threads(1)
    flat0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    bounds = np.linspace(0, flat0.size, cfg.shards + 1).astype(int)
    control = StalenessControl(cfg.staleness_lr, cfg.delay_compensation)
    average = parse_average(cfg.average) if cfg.average else None
    shards = []
    for s in range(cfg.shards):
        rule = make_rule(cfg.optimizer, cfg.lr, args=cfg.optimizer_args)
        core = ShardCore(s, flat0[bounds[s]:bounds[s + 1]], rule)
        core.keep_extras(None, average, control if control.active else None)
        if cfg.backup_workers is not None:
            core.keep_sync(cfg.replicas - cfg.backup_workers, cfg.steps)
        shards.append(core)
    batches = [replica_batches(x_train, y_train, i, cfg.replicas, cfg.batch_size, cfg.seed)
               for i in range(cfg.replicas)]
    rng = np.random.default_rng(cfg.seed)
    xt, yt = torch.from_numpy(x_test), torch.from_numpy(y_test)
    flat = np.empty_like(flat0)
    done = [0] * cfg.replicas
    held: dict[int, tuple[np.ndarray, list[int]]] = {}  # replica -> gradient, versions
    pushed: dict[int, list[int]] = {}  # sync: the versions each replica last pushed to

    def start(i: int, now: float) -> tuple[float, int, int]:
        """Replica ``i`` fetches and computes step ``done[i]``'s gradient at ``now``."""
        versions = []
        for s, core in enumerate(shards):
            version, part = core.fetch(replica=i)
            flat[bounds[s]:bounds[s + 1]] = part
            versions.append(version)
        torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
        xb, yb = next(batches[i])
        model.zero_grad()
        loss_fn(model(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        held[i] = (grad, versions)
        return now + 1.0 + cfg.jitter * float(rng.uniform(-1, 1)), int(rng.integers(1 << 30)), i

    def current() -> np.ndarray:
        out = np.empty_like(flat0)
        for s, core in enumerate(shards):
            out[bounds[s]:bounds[s + 1]] = core.fetch_average()[1]
        return out

    def may_start(i: int) -> bool:
        if cfg.backup_workers is not None:  # past the version it pushed, before the end
            at = [core.version for core in shards]
            return min(at) < cfg.steps and all(v > p for v, p in zip(at, pushed.get(i, at)))
        k = cfg.max_staleness
        return done[i] < cfg.steps and (k is None or min(done) >= done[i] - k)

    events = [start(i, 0.0) for i in range(cfg.replicas)]
    heapq.heapify(events)
    waiting: list[int] = []
    updates, curve = 0, []
    while events:
        now, _, i = heapq.heappop(events)
        grad, versions = held.pop(i)
        for s, core in enumerate(shards):
            core.push(grad[bounds[s]:bounds[s + 1]], versions[s], i)
        pushed[i] = versions
        done[i] += 1
        updates += 1
        if updates % cfg.eval_every == 0:
            curve.append((now, _accuracy(model, current(), xt, yt)))
        for j in [i, *waiting]:
            if j in waiting:
                waiting.remove(j)
            if may_start(j):
                heapq.heappush(events, start(j, now))
            elif (min(core.version for core in shards) < cfg.steps
                  if cfg.backup_workers is not None else done[j] < cfg.steps):
                waiting.append(j)
    final = _accuracy(model, current(), xt, yt)
    staleness: dict[int, int] = {}
    for core in shards:
        for k, v in core.staleness.items():
            staleness[k] = staleness.get(k, 0) + v
    return SimResult(final, curve, dict(sorted(staleness.items())), updates)
