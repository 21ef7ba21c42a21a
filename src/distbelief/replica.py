"""A Downpour replica: one loop over a parameter host (the paper's Algorithm 7.1).

Each replica owns a split of the training data and loops on its own: every ``n_fetch`` steps
its host fetches fresh parameters, every step it computes a mini-batch gradient, every
``n_push`` steps it pushes the gradient accumulated since its last push, and in between it
applies its own gradients locally with plain SGD. The loop is the same for every kind of
parameters; what differs lives in the host (:mod:`distbelief.host`).
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.allocator import keep_freed_memory
from distbelief.config import TrainConfig
from distbelief.devices import CPU, on_device
from distbelief.host import HostFactory
from distbelief.sources import replica_batches, source_kind

DATA_COUNTERS = ("data_source", "node", "rss_peak_bytes")  # see ReplicaLoop.data_counters


class ReplicaLoop:
    """One model replica: its data split and sampler, the fetch/push schedule, the local
    update between fetches, the straggler slow-down and the step events, over any host
    (plain Python; :data:`DownpourReplica` is the actor).

    ``x`` and ``y`` are the whole training set as arrays (the sampler picks this replica's
    rows); or ``x`` is a data source and ``y`` None: a :class:`~distbelief.sources.Rows`
    (a data folder's ``DiskRows``, a torch ``Dataset``), read through the same sampler, or a
    stream factory (see :func:`~distbelief.sources.replica_batches`). ``start_step`` is
    where a restarted replica resumes its schedule and data order.

    With ``--backup-workers`` (synchronous updates) the run ends after ``cfg.steps``
    updates: once a fetch brings every shard's version to it, the replica computes no more
    and :meth:`run` returns early with ``sync_done`` true.
    """

    def __init__(self, index: int, host: HostFactory, loss_fn: nn.Module, x: Any,
                 y: np.ndarray | None, cfg: TrainConfig, start_step: int = 0) -> None:
        torch.set_num_threads(1)
        keep_freed_memory()  # a step's buffers reuse the last step's pages
        self.index, self.cfg, self.loss_fn = index, cfg, loss_fn
        self.host = host(replica=index)
        self.device = getattr(self.host, "device", CPU)  # batches go where the host computes
        self.source = source_kind(x, y)
        self.data = (x, y)
        self.batches = replica_batches(x, y, index, cfg.replicas, cfg.batch_size, cfg.seed,
                                       cfg.data_split, start_step) if index < cfg.replicas \
            else iter(())  # a replica added to a running job reads where run() says
        self.slot, self.drawn = index, start_step  # (slot, step) of batches' next batch
        self.ahead: deque[tuple[np.ndarray, np.ndarray]] = deque()  # drawn by _upcoming
        self.step = start_step
        self.since_push = 0
        # --slow-replica: each step takes `slow` times as long, but for this actor's first,
        # whose time is start-up (partition actors coming up, the first fetch)
        self.slow = float(cfg.slow_replicas.get(index, 1.0))
        self.first_step = start_step
        self.segment_end: float | None = None  # perf_counter() when the last segment ended
        # a host that can send a fetch early offers prefetch(); others fetch at the step
        self.prefetch = getattr(self.host, "prefetch", None)
        self.sync_target = cfg.sync_end
        self.sync_done = False

    def where(self) -> str:
        return cluster.node_id()

    def pid(self) -> int:
        """This replica's process id (fault tests SIGKILL it)."""
        return os.getpid()

    def partitions(self) -> list:
        """The partition actors of a model-parallel replica (for tools and fault tests)."""
        return self.host.partitions()

    def run(self, n_steps: int, slot: int | None = None, at: int | None = None) -> dict:
        """Run ``n_steps`` steps; returns their events and this replica's counters. With
        ``slot`` and ``at``, their batches are data slot ``slot``'s from its step ``at`` on
        (the rows replica ``slot`` of ``cfg.replicas`` reads; see
        :class:`~distbelief.segments.WorkPool`); by default the batches that follow."""
        cfg, events = self.cfg, []
        if slot is not None and (slot, at) != self._next_batch():
            self.batches = replica_batches(*self.data, slot, cfg.replicas, cfg.batch_size,
                                           cfg.seed, cfg.data_split, at)
            self.slot, self.drawn = slot, at
            self.ahead.clear()
        idle = 0.0 if self.segment_end is None else time.perf_counter() - self.segment_end
        for _ in range(n_steps):
            began = time.perf_counter()
            fetched = self.step % cfg.n_fetch == 0
            fields = self.host.fetch(self._upcoming) if fetched else self.host.event_fields
            fetch_wait = time.perf_counter() - began
            if self.sync_target is not None and min(self.host.versions()) >= self.sync_target:
                self.sync_done = True  # the run's updates are done
                break
            x_np, y_np = self.ahead.popleft() if self.ahead else self._draw()
            x, y = on_device(self.device, torch.from_numpy(x_np), torch.from_numpy(y_np))
            loss = self.host.forward_backward(x, lambda out, y=y: self.loss_fn(out, y))
            computed = time.perf_counter()
            self.since_push += 1
            pushed = self.since_push == cfg.n_push
            if pushed:
                self.since_push = 0
            fetch_next = (self.step + 1) % cfg.n_fetch == 0
            local = cfg.local_update and not fetch_next
            self.host.end_step(pushed, cfg.lr if local else None, fetch_next)
            if pushed and self.prefetch is not None and self._no_push_before_fetch():
                self.prefetch(self._next_window)
            push_wait = time.perf_counter() - computed
            if self.slow > 1.0 and self.step > self.first_step:  # the first is start-up
                time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
            events.append({"t": time.time(), "replica": self.index, "step": self.step,
                           "loss": loss, "versions": self.host.versions(),
                           "fetched": fetched, "pushed": pushed, **fields,
                           **step_times(computed - began - fetch_wait, fetch_wait, push_wait,
                                        idle)})
            idle = 0.0
            self.step += 1
        self.segment_end = time.perf_counter()
        done = {} if self.sync_target is None else {"sync_done": self.sync_done}
        return {"events": events, "step": self.step, **self.host.after_run(events),
                **self.data_counters(), **done}

    def _next_batch(self) -> tuple[int, int]:
        """(slot, step) of the next batch this replica would train on."""
        return self.slot, self.drawn - len(self.ahead)

    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        self.drawn += 1
        return next(self.batches)

    def _no_push_before_fetch(self) -> bool:
        """Whether the push just sent at the end of this step is the last one before the
        next fetch, and that fetch is not at the very next step (which fetches anyway, or
        gets its parameters from a fused push+fetch)."""
        return self.step + 1 < self._next_fetch() <= self.step + self.cfg.n_push

    def _next_fetch(self) -> int:
        """The step of the first fetch after this step."""
        return (self.step // self.cfg.n_fetch + 1) * self.cfg.n_fetch

    def _next_window(self) -> np.ndarray:
        """At the end of a step, the inputs of the batches from the next fetch on until the
        one after it (after the rest of this fetch's batches)."""
        return self._window(self._next_fetch() - self.step - 1)

    def _upcoming(self) -> np.ndarray:
        """The inputs of the batches from this step until the next fetch."""
        return self._window(0)

    def _window(self, skip: int) -> np.ndarray:
        """The inputs of ``n_fetch`` batches, the first ``skip`` batches after this one
        (drawn ahead as needed)."""
        while len(self.ahead) < skip + self.cfg.n_fetch:
            self.ahead.append(self._draw())
        return np.concatenate([x for x, _ in list(self.ahead)[skip: skip + self.cfg.n_fetch]])

    def data_counters(self) -> dict:
        """Where this replica read its rows (``data_source``), on which node, and its
        process's peak resident memory in bytes (``rss_peak_bytes``)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KB
        node = self.where() if ray.is_initialized() else None
        return {"data_source": self.source, "node": node, "rss_peak_bytes": peak}

    def finish(self) -> dict:
        """Push what is still accrued and wait until every shard has applied it."""
        pushed = self.since_push > 0
        self.since_push = 0
        return self.host.finish(pushed, (self.step + 1) % self.cfg.n_fetch == 0)

    def counters(self) -> dict:
        return self.host.counters()


def step_times(compute_s: float, fetch_wait_s: float, push_wait_s: float, idle_s: float
               ) -> dict[str, float]:
    """A step event's time breakdown, seconds: ``compute_s`` (forward and backward),
    ``fetch_wait_s`` (waiting for a fetch's parameters), ``push_wait_s`` (sending a push,
    waiting for its acknowledgement or for a fused push+fetch's parameters, and the local
    update), ``idle_s`` (waiting for the driver's next segment; on a segment's first step)."""
    return {"compute_s": compute_s, "fetch_wait_s": fetch_wait_s, "push_wait_s": push_wait_s,
            "idle_s": idle_s}


DownpourReplica = ray.remote(ReplicaLoop)  # the replica actor; its methods are remote methods
