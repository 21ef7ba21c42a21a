"""Push+apply and fetch throughput of the shards vs the same Adagrad update in-process.

Run: .venv/bin/python bench/ps.py [--sizes-mb 4 64] [--shards 1 2] [--repeat 10] [--rounds 3]
     [--variants f32x1 f32x4 bf16x4 f16x4] [--pushers 2] [--sizes-mb 256 ...] [--backups 0 1]
Per gradient size and shard count, every variant runs ``--rounds`` rounds; each round
times ``--repeat`` Adagrad updates of the whole gradient in this process (the baseline:
the limit for a server-side apply) right before ``--repeat`` pushes of it through the
shards, and the ratio of the two is taken per round, so machine noise hits both alike.
A variant ``<dtype>x<k>`` is one client pushing ``float32`` / ``bf16`` / ``f16`` gradients
with up to k pushes in flight; ``--pushers P`` adds P client actors pushing at once (each
with 2 in flight). Push MB/s counts float32 gradient bytes applied per second, whatever
went over the wire. Also prints fetch MB/s and the in-process rate of the pre-issue-6
update rule (whole-array NumPy with temporaries) for reference.

The ``floor`` variants (``null-f32x1``, ``null-f32x4``) push the same way to actors that
answer at once and never read the gradient: Ray's own cost of a push (the ``ray.put``, one
call per shard, the replies) with a free apply. Their ratio bounds what any shard-side
change can reach with Ray's calls on this machine.

``--backups 0 1`` measures instead what hot standbys (``--shard-backups``) cost a push: per
gradient size and shard count, one shard group per backup count (each primary with that
many standbys attached), pushed to by one client (f32, 1 in flight, push ids as replicas
send them) in turn, round after round, so machine noise hits every count alike; it prints
the milliseconds a push takes (median over rounds) and its ratio to the first count's.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import ray
from _common import parser as make_parser
from _common import ray_session

from distbelief.ps.client import PSClient
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def legacy_adagrad(p: np.ndarray, g: np.ndarray, acc: np.ndarray, lr: float = 0.01) -> None:
    """The update rule as it was before issue 6 (allocates two full-size temporaries)."""
    acc += g * g
    step = acc + np.float32(1e-8)
    np.sqrt(step, out=step)
    np.divide(g, step, out=step)
    step *= np.float32(lr)
    p -= step


class InProcess:
    """The baseline: the shards' own Adagrad rule on a whole gradient in this process."""

    def __init__(self, n: int) -> None:
        self.rule, self.p, self.g = Adagrad(0.01), np.zeros(n, np.float32), np.ones(n, np.float32)
        self.state = self.rule.init_state(n)
        self.rule.apply(self.p, self.g, self.state)  # touch every page once

    def rate(self, repeat: int, legacy: bool = False) -> float:
        began = time.perf_counter()
        for _ in range(repeat):
            if legacy:
                legacy_adagrad(self.p, self.g, self.state["accumulator"])
            else:
                self.rule.apply(self.p, self.g, self.state)
        return repeat * self.g.nbytes / (time.perf_counter() - began) / 2**20


@ray.remote(num_cpus=0)
class NullShard:
    """Answers a push like a shard but does nothing with it: what Ray alone costs a push."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def push(self, grad: np.ndarray, fetched_version: int, replica: int = -1) -> bool:
        return True

    def push_part(self, grad: np.ndarray, lo: int, fetched_version: int,
                  replica: int = -1) -> bool:
        return True


@ray.remote(num_cpus=0)
class Pusher:
    """A client in its own process, like a replica: pushes one gradient ``repeat`` times."""

    def __init__(self, shards: list, plan: ShardPlan, grad_dtype: str, in_flight: int) -> None:
        self.client = PSClient(shards, plan, grad_dtype=grad_dtype, max_in_flight=in_flight)
        self.grad = np.ones(plan.numel, np.float32)

    def push(self, repeat: int) -> None:
        for _ in range(repeat):
            self.client.push(self.grad)
        self.client.wait()


def push_rate(clients: list, grad: np.ndarray, repeat: int) -> float:
    """Aggregate MB/s of float32 gradient applied: ``repeat`` pushes by every client."""
    began = time.perf_counter()
    if isinstance(clients[0], PSClient):
        for _ in range(repeat):
            clients[0].push(grad)
        clients[0].wait()
    else:
        ray.get([c.push.remote(repeat) for c in clients])
    return len(clients) * repeat * grad.nbytes / (time.perf_counter() - began) / 2**20


def fetch_rate(client: PSClient, flat: np.ndarray, repeat: int) -> float:
    began = time.perf_counter()
    for _ in range(repeat):
        client.fetch_into(flat)
    return repeat * flat.nbytes / (time.perf_counter() - began) / 2**20


def backup_costs(args) -> None:
    """``--backups``: milliseconds per push with each backup count, counts alternated."""
    print(f"rounds={args.rounds} repeat={args.repeat}; ms per push (f32, 1 in flight), "
          f"median [min-max] over rounds; ratio to --backups {args.backups[0]} per round")
    print(f"{'MB':>5} {'shards':>6} {'backups':>7} {'ms/push':>8} {'range':>15} "
          f"{'ratio':>6} {'range':>11}")
    for mb in args.sizes_mb:
        n = int(mb * 2**20 / 4)
        grad = np.ones(n, np.float32)
        for shards in args.shards:
            plan = ShardPlan.build([("w", (n,))], shards)
            groups, clients = [], []
            for b in args.backups:
                handles = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32),
                                                 "adagrad", 0.01) for i in range(shards)]
                standbys = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32),
                                                  "adagrad", 0.01)
                            for i in range(shards) for _ in range(b)]
                ray.get([h.attach.remote(s) for k, h in enumerate(handles)
                         for s in standbys[k * b:(k + 1) * b]])
                groups.append(handles + standbys)
                clients.append(PSClient(handles, plan, replica=0, incarnation=1))
            for c in clients:
                push_rate([c], grad, 2)  # warm up: pages touched
            ms: list[list[float]] = [[] for _ in args.backups]
            for _ in range(args.rounds):
                for k, c in enumerate(clients):
                    mb_s = push_rate([c], grad, args.repeat)
                    ms[k].append(1000 * grad.nbytes / 2**20 / mb_s)
            for k, b in enumerate(args.backups):
                ratios = sorted(x / y for x, y in zip(ms[k], ms[0]))
                t = sorted(ms[k])
                print(f"{mb:>5g} {shards:>6} {b:>7} {statistics.median(t):>8.2f} "
                      f"{f'[{t[0]:.2f}-{t[-1]:.2f}]':>15} {statistics.median(ratios):>6.2f} "
                      f"{f'[{ratios[0]:.2f}-{ratios[-1]:.2f}]':>11}", flush=True)
            for g in groups:
                for h in g:
                    ray.kill(h)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 64])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+",
                        default=["f32x1", "f32x4", "bf16x4", "null-f32x1", "null-f32x4"])
    parser.add_argument("--pushers", type=int, nargs="*", default=[2],
                        help="also run P concurrent client actors (f32, 2 in flight each)")
    parser.add_argument("--backups", type=int, nargs="*", default=[],
                        help="instead: ms per push with each count of standbys per shard")
    args = parser.parse_args()
    if args.backups:
        with ray_session(max(args.shards) * (len(args.backups) + sum(args.backups)) + 1,
                         object_store_memory=int(max(2 * 2**30,
                                                     12 * max(args.sizes_mb) * 2**20))):
            backup_costs(args)
        return
    with ray_session(max(args.shards) + 1,
                     object_store_memory=int(max(2 * 2**30, 12 * max(args.sizes_mb) * 2**20))):
        print(f"rounds={args.rounds} repeat={args.repeat}; ratio = push MB/s / in-process MB/s, "
              "median [min-max] over rounds")
        print(f"{'MB':>5} {'shards':>6} {'variant':>10} {'in-proc MB/s':>12} {'push MB/s':>10} "
              f"{'ratio':>6} {'range':>11} {'fetch MB/s':>10}")
        for mb in args.sizes_mb:
            n = int(mb * 2**20 / 4)
            base = InProcess(n)
            legacy = statistics.median(base.rate(args.repeat, legacy=True) for _ in range(3))
            new = statistics.median(base.rate(args.repeat) for _ in range(3))
            print(f"{mb:>5g} {'-':>6} {'rule':>10} in-process Adagrad: chunked {new:.0f} MB/s, "
                  f"pre-issue-6 {legacy:.0f} MB/s ({new / legacy:.2f}x)")
            for shards in args.shards:
                plan = ShardPlan.build([("w", (n,))], shards)
                handles = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32),
                                                 "adagrad", 0.01) for i in range(shards)]
                grad, flat = np.ones(n, np.float32), np.empty(n, np.float32)
                variants = [(v, 1) for v in args.variants] + [("f32x2", p) for p in args.pushers]
                fetch = 0.0
                nulls = [NullShard.remote() for _ in range(shards)]
                for variant, pushers in variants:
                    null, dtype, k = variant.startswith("null-"), *variant.removeprefix(
                        "null-").split("x")
                    if pushers == 1:
                        clients = [PSClient(nulls if null else handles, plan,
                                            grad_dtype=DTYPES[dtype], max_in_flight=int(k))]
                    else:
                        clients = [Pusher.remote(handles, plan, DTYPES[dtype], int(k))
                                   for _ in range(pushers)]
                    push_rate(clients, grad, 1)  # warm up: actors up, pages touched
                    rounds = []
                    for _ in range(args.rounds):
                        b = base.rate(args.repeat)
                        rounds.append((b, push_rate(clients, grad, args.repeat)))
                    if not fetch and not null:
                        fetch = statistics.median(fetch_rate(clients[0], flat, args.repeat)
                                                  for _ in range(args.rounds))
                    ratios = sorted(p / b for b, p in rounds)
                    name = variant if pushers == 1 else f"{pushers}x{variant}"
                    print(f"{mb:>5g} {shards:>6} {name:>10} "
                          f"{statistics.median(b for b, _ in rounds):>12.0f} "
                          f"{statistics.median(p for _, p in rounds):>10.0f} "
                          f"{statistics.median(ratios):>6.2f} "
                          f"{f'[{ratios[0]:.2f}-{ratios[-1]:.2f}]':>11} {fetch:>10.0f}", flush=True)
                    for c in clients:
                        if not isinstance(c, PSClient):
                            ray.kill(c)
                for h in handles + nulls:
                    ray.kill(h)
            del base


if __name__ == "__main__":
    main()
