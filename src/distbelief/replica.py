"""A Downpour replica: one loop over a parameter host (the paper's Algorithm 7.1).

Each replica owns a split of the training data and loops on its own: every ``n_fetch`` steps
its host fetches fresh parameters, every step it computes a mini-batch gradient, every
``n_push`` steps it pushes the gradient accumulated since its last push, and in between it
applies its own gradients locally with plain SGD. The loop is the same for every kind of
parameters; what differs lives in the host (:mod:`distbelief.host`).
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
from torch import nn

from distbelief import cluster
from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler
from distbelief.devices import CPU, on_device
from distbelief.host import HostFactory


class ReplicaLoop:
    """One model replica: its data split and sampler, the fetch/push schedule, the local
    update between fetches, the straggler slow-down and the step events, over any host
    (plain Python; :data:`DownpourReplica` is the actor).

    ``x`` and ``y`` are the whole training set (the sampler picks this replica's rows);
    ``start_step`` is where a restarted replica resumes its schedule and data order.
    """

    def __init__(self, index: int, host: HostFactory, loss_fn: nn.Module, x: np.ndarray,
                 y: np.ndarray, cfg: TrainConfig, start_step: int = 0) -> None:
        torch.set_num_threads(1)
        self.index, self.cfg, self.loss_fn = index, cfg, loss_fn
        self.host = host(replica=index)
        self.device = getattr(self.host, "device", CPU)  # batches go where the host computes
        self.sampler = ReplicaSampler(len(x), index, cfg.replicas, cfg.batch_size, cfg.seed,
                                      cfg.data_split)
        self.x_np = np.asarray(x)
        self.x, self.y = torch.from_numpy(self.x_np), torch.from_numpy(np.asarray(y))
        self.step = start_step
        self.since_push = 0
        self.slow = float(cfg.slow_replicas.get(index, 1.0))

    def where(self) -> str:
        return cluster.node_id()

    def partitions(self) -> list:
        """The partition actors of a model-parallel replica (for tools and fault tests)."""
        return self.host.partitions()

    def run(self, n_steps: int) -> dict:
        """Run ``n_steps`` steps; returns their events and this replica's counters."""
        cfg, events = self.cfg, []
        for _ in range(n_steps):
            began = time.perf_counter()
            fetched = self.step % cfg.n_fetch == 0
            fields = self.host.fetch(self._upcoming) if fetched else self.host.event_fields
            rows = torch.from_numpy(self.sampler.batch(self.step))
            x, y = on_device(self.device, self.x[rows], self.y[rows])
            loss = self.host.forward_backward(x, lambda out, y=y: self.loss_fn(out, y))
            self.since_push += 1
            pushed = self.since_push == cfg.n_push
            if pushed:
                self.since_push = 0
            fetch_next = (self.step + 1) % cfg.n_fetch == 0
            local = cfg.local_update and not fetch_next
            self.host.end_step(pushed, cfg.lr if local else None, fetch_next)
            if self.slow > 1.0:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - began))
            events.append({"t": time.time(), "replica": self.index, "step": self.step,
                           "loss": loss, "versions": self.host.versions(),
                           "fetched": fetched, "pushed": pushed, **fields})
            self.step += 1
        return {"events": events, "step": self.step, **self.host.after_run(events)}

    def _upcoming(self) -> np.ndarray:
        """The inputs of the batches from this step until the next fetch."""
        steps = range(self.step, self.step + self.cfg.n_fetch)
        return self.x_np[np.concatenate([self.sampler.batch(k) for k in steps])]

    def finish(self) -> dict:
        """Push what is still accrued and wait until every shard has applied it."""
        pushed = self.since_push > 0
        self.since_push = 0
        return self.host.finish(pushed, (self.step + 1) % self.cfg.n_fetch == 0)

    def counters(self) -> dict:
        return self.host.counters()


DownpourReplica = ray.remote(ReplicaLoop)  # the replica actor; its methods are remote methods
