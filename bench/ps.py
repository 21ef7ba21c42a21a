"""Push+apply and fetch throughput of the shards vs the same Adagrad update in-process.

Run: .venv/bin/python bench/ps.py [--sizes-mb 4 64] [--shards 1 2] [--repeat 20]
Prints, per gradient size and shard count, MB/s of push+apply (one client pushing a whole
gradient to all shards at once and waiting for all applies) and of fetch, and the ratio
to the in-process update measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray

from distbelief import cluster
from distbelief.ps.client import PSClient
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard


def in_process_rate(n: int, repeat: int) -> float:
    rule, p, g = Adagrad(0.01), np.zeros(n, np.float32), np.ones(n, np.float32)
    state = rule.init_state(n)
    rule.apply(p, g, state)
    began = time.perf_counter()
    for _ in range(repeat):
        rule.apply(p, g, state)
    return repeat * n * 4 / (time.perf_counter() - began) / 2**20


def shard_rates(n: int, shards: int, repeat: int) -> tuple[float, float]:
    plan = ShardPlan.build([("w", (n,))], shards)
    handles = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32), "adagrad",
                                     0.01) for i in range(shards)]
    client = PSClient(handles, plan)
    grad, flat = np.ones(n, np.float32), np.empty(n, np.float32)
    client.push(grad)
    client.wait()
    began = time.perf_counter()
    for _ in range(repeat):
        client.push(grad)
    client.wait()
    push = repeat * n * 4 / (time.perf_counter() - began) / 2**20
    began = time.perf_counter()
    for _ in range(repeat):
        client.fetch_into(flat)
    fetch = repeat * n * 4 / (time.perf_counter() - began) / 2**20
    for h in handles:
        ray.kill(h)
    return push, fetch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 64])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    cluster.connect(num_cpus=max(args.shards) + 1, object_store_memory=2 * 2**30)
    print(f"{'MB':>6} {'shards':>6} {'in-proc MB/s':>13} {'push MB/s':>10} {'ratio':>6} "
          f"{'fetch MB/s':>11}")
    for mb in args.sizes_mb:
        n = int(mb * 2**20 / 4)
        for shards in args.shards:
            base = in_process_rate(n, args.repeat)
            push, fetch = shard_rates(n, shards, args.repeat)
            print(f"{mb:>6g} {shards:>6} {base:>13.0f} {push:>10.0f} {push / base:>6.2f} "
                  f"{fetch:>11.0f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
