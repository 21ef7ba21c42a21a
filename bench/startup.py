"""Shard start-up: CPU seconds and time to first answer of a shard actor as it starts now
(torch.optim without torch's compiler, ``ps/torchrule.without_compiler``) against the same
actor with ``torch._dynamo`` imported first (what every shard did before).

Run: .venv/bin/python bench/startup.py [--rounds 5] [--optimizer adam] [--mb 4]
Each round starts one shard of each kind (the same shard class; "before" imports
torch._dynamo first), in alternating order, on an embedded Ray of this machine. Per shard:
seconds from ``.remote()`` to its first ``stats()`` reply, and the CPU seconds its process
has used by then (psutil). Prints the medians and their ratios (now / before).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

from distbelief import cluster
from distbelief.ps.shard import WAITERS, ParameterShard


class ShardWithCompiler(ParameterShard.__ray_actor_class__):
    """The shard as it started before: torch._dynamo imported (torch.optim's first call
    did that), so without_compiler() finds it loaded and does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        import torch._dynamo  # noqa: F401

        super().__init__(*args, **kwargs)


BEFORE = ray.remote(concurrency_groups={"wait": WAITERS})(ShardWithCompiler)
NOW = ParameterShard


def cpu_seconds(self) -> float:
    import psutil

    used = psutil.Process().cpu_times()
    return used.user + used.system


def compiler_loaded(self) -> bool:
    import sys

    return type(sys.modules.get("torch._dynamo")).__name__ == "module"  # the real one


def start_one(actor_class, init: np.ndarray, optimizer: str) -> tuple[float, float, bool]:
    began = time.perf_counter()
    shard = actor_class.remote(0, init, optimizer, 0.01)
    ray.get(shard.stats.remote())
    wall = time.perf_counter() - began
    cpu = ray.get(shard.__ray_call__.remote(cpu_seconds))
    real = ray.get(shard.__ray_call__.remote(compiler_loaded))
    ray.kill(shard)
    return wall, cpu, real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--mb", type=float, default=4.0, help="the shard's slice, in MB")
    args = parser.parse_args()
    init = np.zeros(int(args.mb * 2**20) // 4, np.float32)
    cluster.connect(num_cpus=2)
    try:
        kinds = {"now": NOW, "before": BEFORE}
        got: dict[str, list[tuple[float, float, bool]]] = {k: [] for k in kinds}
        start_one(NOW, init, args.optimizer)  # the session's first actor pays one-off costs
        for r in range(args.rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                got[kind].append(start_one(kinds[kind], init, args.optimizer))
                time.sleep(0.5)  # let the killed process go
    finally:
        ray.shutdown()
    print(f"shard start-up, --optimizer {args.optimizer}, {args.mb:g} MB slice, median of "
          f"{args.rounds} rounds")
    med = {}
    for kind, rows in got.items():
        wall = statistics.median(w for w, _, _ in rows)
        cpu = statistics.median(c for _, c, _ in rows)
        med[kind] = (wall, cpu)
        loaded = {real for _, _, real in rows}
        print(f"  {kind:6s}: to first answer {wall:.2f} s, process CPU {cpu:.2f} s, "
              f"torch._dynamo loaded: {sorted(loaded)}")
    print(f"  now / before: to first answer {med['now'][0] / med['before'][0]:.2f}, "
          f"process CPU {med['now'][1] / med['before'][1]:.2f}")


if __name__ == "__main__":
    main()
