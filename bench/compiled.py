"""Ray's Compiled Graphs against plain actor calls for a Downpour push+fetch: speed and fit.

A Downpour replica sends one push+fetch call per shard each step (``n_fetch = n_push = 1``).
Ray's Compiled Graphs (``ray.dag``, ``experimental_compile``) replace an actor call by
shared-memory channels set up once, so they promise a far lower per-call cost. This script
measures, on one Ray session with the given logical CPUs:

1. **per call**: one client actor sending the same push+fetch (a float32 gradient of
   ``--params`` split over ``--shards`` toy shards that apply ``w -= lr g`` and return their
   slice) as plain actor calls and through a compiled graph it compiled itself: wall time per
   call and the CPU of the client and of the shards per call (from ``/proc`` via psutil);
2. **idle cost**: the shards' CPU share while the graph is compiled but no call is made, as
   happens between a replica's steps (a replica computes for ~30 ms between calls on the CNN);
3. **sharing**: whether a second client can compile its own graph over the same shards and
   complete a call within ``--timeout`` seconds (Downpour's replicas share every shard).

Items 2 and 3 decide whether Compiled Graphs can carry Downpour; the script prints the
verdict from its own figures. The shards here are toys, not distbelief's ``ParameterShard``:
the question is Ray's transport, not our update. Both actors keep freed memory and skip
Ray's task events, as distbelief's actors do (``distbelief.allocator``,
``distbelief.cluster.actor_options``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from _common import cpu_seconds, ray_session
from _common import parser as make_parser


def actors():
    """The toy shard and the client, as Ray actor classes (built after Ray is imported)."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    from distbelief.allocator import keep_freed_memory
    from distbelief.cluster import actor_options

    @ray.remote
    class ToyShard:
        def __init__(self, size: int) -> None:
            keep_freed_memory()  # as distbelief's actors do
            self.w = np.zeros(size, np.float32)

        def push_fetch(self, grad: np.ndarray) -> np.ndarray:
            self.w -= 0.01 * grad
            return self.w

        def pid(self) -> int:
            return os.getpid()

    @ray.remote
    class Client:
        def __init__(self, shards: list, size: int) -> None:
            keep_freed_memory()
            self.shards, self.grad, self.graph = shards, np.ones(size, np.float32), None

        def pid(self) -> int:
            return os.getpid()

        def compile(self) -> bool:
            with InputNode() as grad:
                out = MultiOutputNode([s.push_fetch.bind(grad) for s in self.shards])
            self.graph = out.experimental_compile()
            return True

        def calls(self, n: int, compiled: bool) -> float:
            """Seconds for ``n`` back-to-back push+fetch calls to every shard."""
            start = time.perf_counter()
            for _ in range(n):
                if compiled:
                    ray.get(self.graph.execute(self.grad))
                else:
                    ray.get([s.push_fetch.remote(self.grad) for s in self.shards])
            return time.perf_counter() - start

        def teardown(self) -> bool:
            self.graph.teardown()
            return True

    options = actor_options()
    return ToyShard.options(**options), Client.options(**options)


def per_call(client, pids_client, pids_shards, calls: int, rounds: int,
             compiled: bool) -> tuple[float, float, float]:
    """Median over rounds of (wall ms, client CPU ms, shards' CPU ms) per call."""
    import ray

    ray.get(client.calls.remote(max(10, calls // 10), compiled))  # warm
    rows = []
    for _ in range(rounds):
        c0, s0 = cpu_seconds(pids_client), cpu_seconds(pids_shards)
        wall = ray.get(client.calls.remote(calls, compiled))
        c1, s1 = cpu_seconds(pids_client), cpu_seconds(pids_shards)
        rows.append((wall / calls * 1e3, (c1 - c0) / calls * 1e3, (s1 - s0) / calls * 1e3))
    return tuple(statistics.median(r[i] for r in rows) for i in range(3))


def main() -> None:
    p = make_parser(__doc__)
    p.add_argument("--params", type=int, default=455_000,
                   help="gradient length (default: the CNN on MNIST's 455k)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2, help="Ray's logical CPUs")
    p.add_argument("--calls", type=int, default=500, help="calls per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle measurement")
    p.add_argument("--timeout", type=int, default=10,
                   help="seconds the second graph's call may take (RAY_CGRAPH_get_timeout)")
    args = p.parse_args()
    for name in ("shards", "cpus", "calls", "rounds", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.params < args.shards or args.idle <= 0:
        p.error("--params must be at least --shards and --idle above 0 "
                f"(got {args.params}, {args.shards}, {args.idle})")
    os.environ["RAY_CGRAPH_get_timeout"] = str(args.timeout)
    import ray

    with ray_session(args.cpus):
        ToyShard, Client = actors()
        size = args.params // args.shards
        shards = [ToyShard.remote(size) for _ in range(args.shards)]
        pids_shards = ray.get([s.pid.remote() for s in shards])
        first, second = Client.remote(shards, size), Client.remote(shards, size)
        pids_first = [ray.get(first.pid.remote())]
        print(f"{args.params} float32 parameters over {args.shards} shards, {args.cpus} CPUs, "
              f"{args.rounds} rounds of {args.calls} calls; per push+fetch (median of rounds):")
        print(f"{'transport':>10} {'wall ms':>8} {'client CPU ms':>13} {'shards CPU ms':>13}")
        plain = per_call(first, pids_first, pids_shards, args.calls, args.rounds, False)
        print(f"{'plain':>10} {plain[0]:>8.2f} {plain[1]:>13.2f} {plain[2]:>13.2f}")
        ray.get(first.compile.remote())
        graph = per_call(first, pids_first, pids_shards, args.calls, args.rounds, True)
        print(f"{'compiled':>10} {graph[0]:>8.2f} {graph[1]:>13.2f} {graph[2]:>13.2f}")
        s0 = cpu_seconds(pids_shards)
        time.sleep(args.idle)
        idle = (cpu_seconds(pids_shards) - s0) / args.idle
        print(f"idle, graph compiled: the {args.shards} shards use {idle:.2f} cores "
              f"({idle / args.shards:.0%} of a core each)")
        try:
            ray.get(second.compile.remote())
            ray.get(second.calls.remote(1, True))
            shared = "completed"
        except ray.exceptions.RayError as e:
            timed_out = "RayChannelTimeoutError" in str(e)
            shared = (f"did not complete in {args.timeout} s (RayChannelTimeoutError)"
                      if timed_out else f"failed: {type(e).__name__}")
        print(f"a second client's graph over the same shards: first call {shared}")
        ray.get(first.teardown.remote())
        print(f"compiled / plain wall per call: {graph[0] / plain[0]:.2f}")
        fit = shared == "completed" and idle < 0.1 * args.shards
        print("verdict: " + ("Compiled Graphs could carry Downpour here" if fit else
              "Compiled Graphs cannot carry Downpour here: "
              + ("shards in a graph spin while idle; " if idle >= 0.1 * args.shards else "")
              + ("replicas cannot share a shard's graph" if shared != "completed" else "")))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
