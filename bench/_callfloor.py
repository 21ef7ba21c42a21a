"""Ray's own CPU cost of a Downpour step's push+fetch, and the bound it sets on Downpour.

A Downpour replica with ``n_fetch = n_push = 1`` (the defaults) sends one fused push+fetch
call per shard each step (``PSClient.push_fetch_into``). :func:`measure` times such calls
from one client actor (a replica's ``PSClient``, its process's malloc set as a replica's)
to S shards of two kinds, in turn, all created with distbelief's actor options
(``distbelief.cluster.actor_options``: Ray's task events off unless
``DISTBELIEF_TASK_EVENTS=1``): ``null`` shards that answer each call with their slice
without reading the gradient (Ray's cost alone: the call, the arguments and the reply), and
the real ``ParameterShard`` with the workload's update rule. Per call it reports the wall
time, the client process's CPU time and the shards' CPU time (all shards together, read from
``/proc`` through psutil), the median over ``rounds`` rounds of ``calls`` calls each, on an
otherwise quiet machine with one client, so nothing competes for the cores.

Each step of a replica needs at least its compute plus that CPU: where one process of one
thread takes ``t1`` seconds a step (its optimizer's update and its evaluations included),
R replicas on R cores reach at most ``t1 / (t1 + client CPU + null shards' CPU)`` of the
cores' limit (R x the one-thread rate), whatever the replicas, shards and driver do besides
(:func:`bound`). The null shards' CPU is the right one there: the update a real shard
applies is the one ``t1`` already counts (real shards' CPU minus the null shards' is that
update and the checks).

Used by ``bench/workloads.py --methods ... floor``; the actor classes are sent to Ray by
value (this folder is not on the workers' path).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import ray
from _common import cpu_seconds
from ray import cloudpickle

from distbelief.allocator import keep_freed_memory
from distbelief.cluster import actor_options
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NullPushFetch:
    """A shard that answers a push+fetch with its (unchanged) slice, never reading the
    gradient: what Ray's call costs with a free apply."""

    def __init__(self, size: int) -> None:
        keep_freed_memory()
        self.params, self.version = np.zeros(size, np.float32), 0

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def push_fetch(self, grad, fetched_version, replica=-1, buffers=None, pid=None) -> tuple:
        self.version += 1
        view = self.params.view()
        view.flags.writeable = False
        return True, self.version, view

    def push_part_fetch(self, grad, lo, fetched_version, replica=-1, buffers=None,
                        pid=None) -> tuple:
        return self.push_fetch(grad, fetched_version)


class Client:
    """One replica's side of the calls: a ``PSClient`` pushing a fixed gradient and fetching
    into a flat buffer, in a process set up as a replica's."""

    def __init__(self, shards: list, plan: ShardPlan) -> None:
        import torch

        torch.set_num_threads(1)
        keep_freed_memory()
        n = plan.bounds[-1]
        self.client = PSClient(shards, plan, replica=0)
        self.grad = np.random.default_rng(0).standard_normal(n).astype(np.float32) * 1e-4
        self.flat = np.zeros(n, np.float32)

    def run(self, calls: int) -> tuple[float, float]:
        """Wall and CPU seconds per push+fetch over ``calls`` calls."""
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            self.client.push_fetch_into(self.grad, self.flat)
        return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def measure(n: int, shards: int, optimizer: str, lr: float, calls: int = 200,
            rounds: int = 3) -> dict[str, dict[str, float]]:
    """Per push+fetch of an ``n``-parameter float32 model over ``shards`` shards, for
    ``null`` and ``real`` shards: ``wall_s``, ``client_cpu_s``, ``shards_cpu_s`` (medians
    over ``rounds``; the kinds take turns within each round). Needs a Ray session."""
    plan = ShardPlan.build([("w", (n,))], shards)
    opts = actor_options()  # as distbelief creates its actors
    null_cls = ray.remote(num_cpus=0)(NullPushFetch).options(**opts)
    client_cls = ray.remote(num_cpus=0)(Client).options(**opts)
    kinds = {
        "null": [null_cls.remote(plan.shard_size(i)) for i in range(shards)],
        "real": [ParameterShard.options(num_cpus=0, **opts).remote(
            i, np.zeros(plan.shard_size(i), np.float32), optimizer, lr) for i in range(shards)],
    }
    pids = {k: ray.get([h.pid.remote() for h in hs]) for k, hs in kinds.items()}
    clients = {k: client_cls.remote(hs, plan) for k, hs in kinds.items()}
    ray.get([c.run.remote(max(10, calls // 4)) for c in clients.values()])  # warm up
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for k, c in clients.items():
            before = cpu_seconds(pids[k])
            wall, cpu = ray.get(c.run.remote(calls))
            rows[k].append((wall, cpu, (cpu_seconds(pids[k]) - before) / calls))
    for handle in [*clients.values(), *(h for hs in kinds.values() for h in hs)]:
        ray.kill(handle)
    return {k: {name: statistics.median(r[i] for r in rs)
                for i, name in enumerate(("wall_s", "client_cpu_s", "shards_cpu_s"))}
            for k, rs in rows.items()}


def bound(step_s: float, kind: dict[str, float]) -> float:
    """The most of the cores' limit replicas can reach when each step of ``step_s`` compute
    (one process of one thread's time per mini-batch) also needs ``kind``'s CPU."""
    return step_s / (step_s + kind["client_cpu_s"] + kind["shards_cpu_s"])
