"""Push+apply and fetch throughput of the shards vs the same Adagrad update in-process.

Run: .venv/bin/python bench/ps.py [--sizes-mb 4 64] [--shards 1 2] [--repeat 10] [--rounds 3]
     [--variants f32x1 f32x4 bf16x4 f16x4] [--pushers 2] [--sizes-mb 256 ...] [--backups 0 1]
Per gradient size and shard count, every variant runs ``--rounds`` rounds; each round
times ``--repeat`` Adagrad updates of the whole gradient in this process (the baseline:
the limit for a server-side apply) right before ``--repeat`` pushes of it through the
shards, and the ratio of the two is taken per round, so machine noise hits both alike.
The variants take turns within each round. Before any round, each variant pushes as many
bytes as the object store holds: a process's first pass through the store faults every page
in (a put then takes about three times as long), which would otherwise fall on whichever
variant runs first.
A variant ``<dtype>x<k>`` is one client pushing ``float32`` / ``bf16`` / ``f16`` gradients
with up to k pushes in flight; ``--pushers P`` adds P client actors pushing at once (each
with 2 in flight). Push MB/s counts float32 gradient bytes applied per second, whatever
went over the wire. Also prints fetch MB/s and the in-process rate of the pre-issue-6
update rule (whole-array NumPy with temporaries) for reference.

The ``floor`` variants (``null-f32x1``, ``null-f32x4``) push the same way to actors that
answer at once and never read the gradient: Ray's own cost of a push (the ``ray.put``, one
call per shard, the replies) with a free apply. Their ratio bounds what any shard-side
change can reach with Ray's calls on this machine. The ``read`` variants (``read-f32x1``,
``read-f32x4``) push to actors that read every byte of their part once (a sum) and keep
nothing: the least a shard that applies a push must add to Ray's cost. Per size and shard
count the script prints real / null-floor and real / read-floor push MB/s, and the most
real / null-floor can reach with one push in flight: a null push's time plus the in-process
apply of one shard's slice (the shards apply in parallel; the apply cannot overlap the push
it serves). The in-process apply reads a gradient already in cache, so this bound is
generous.

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

from distbelief.cluster import actor_options
from distbelief.ps.client import PSClient
from distbelief.ps.optim import make_rule
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
    """The baseline: the shards' own Adagrad rule (``make_rule("adagrad")``: torch's fused
    Adagrad with eps inside the root on a dense slice) on a whole gradient in this process."""

    def __init__(self, n: int) -> None:
        self.rule, self.p, self.g = make_rule("adagrad", 0.01), np.zeros(n, np.float32), \
            np.ones(n, np.float32)
        self.state = self.rule.init_state(n)
        self.legacy_acc = np.zeros(n, np.float32)
        self.rule.apply(self.p, self.g, self.state)  # touch every page once

    def rate(self, repeat: int, legacy: bool = False) -> float:
        began = time.perf_counter()
        for _ in range(repeat):
            if legacy:
                legacy_adagrad(self.p, self.g, self.legacy_acc)
            else:
                self.rule.apply(self.p, self.g, self.state)
        return repeat * self.g.nbytes / (time.perf_counter() - began) / 2**20


class Null:
    """Answers a push like a shard but does nothing with it: what Ray alone costs a push."""

    def __init__(self, size: int) -> None:
        self.size = size

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def push(self, grad: np.ndarray, fetched_version: int, replica: int = -1) -> bool:
        return self.take(grad)

    def push_part(self, grad: np.ndarray, lo: int, fetched_version: int,
                  replica: int = -1) -> bool:
        return self.take(grad[lo:lo + self.size])

    def take(self, part: np.ndarray) -> bool:
        return True


class Read(Null):
    """Reads every byte of its part of a push once (a sum) and keeps nothing: the least any
    shard that applies a push must do on top of Ray's cost (the gradient's pages are
    touched in this process for the first time)."""

    def take(self, part: np.ndarray) -> bool:
        return bool(np.isfinite(np.add.reduce(part)))


# every actor here is created as distbelief creates its own (Ray's task events off)
Shard = ParameterShard.options(**actor_options())
NullShard = ray.remote(num_cpus=0)(Null).options(**actor_options())
ReadShard = ray.remote(num_cpus=0)(Read).options(**actor_options())


@ray.remote(num_cpus=0, **actor_options())
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
                handles = [Shard.remote(i, np.zeros(plan.shard_size(i), np.float32),
                                        "adagrad", 0.01) for i in range(shards)]
                standbys = [Shard.remote(i, np.zeros(plan.shard_size(i), np.float32),
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
                        default=["f32x1", "f32x4", "bf16x4", "null-f32x1", "null-f32x4",
                                 "read-f32x1", "read-f32x4"])
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
    store = int(max(256 * 2**20, 16 * max(args.sizes_mb) * 2**20))
    with ray_session(max(args.shards) + 1, object_store_memory=store):
        print(f"rounds={args.rounds} repeat={args.repeat}; ratio = push MB/s / in-process MB/s, "
              "median [min-max] over rounds; variants take turns within each round")
        print(f"{'MB':>5} {'shards':>6} {'variant':>10} {'in-proc MB/s':>12} {'push MB/s':>10} "
              f"{'ratio':>6} {'range':>11} {'fetch MB/s':>10} {'in-shard ms':>11}")
        for mb in args.sizes_mb:
            n = int(mb * 2**20 / 4)
            base = InProcess(n)
            legacy = statistics.median(base.rate(args.repeat, legacy=True) for _ in range(3))
            new = statistics.median(base.rate(args.repeat) for _ in range(3))
            print(f"{mb:>5g} {'-':>6} {'rule':>10} in-process Adagrad: shards' {new:.0f} MB/s, "
                  f"pre-issue-6 {legacy:.0f} MB/s ({new / legacy:.2f}x)")
            for shards in args.shards:
                compare(args, base, n, shards, store)
            del base


def compare(args, base: InProcess, n: int, shards: int, store: int) -> None:
    """Every variant at one gradient size and shard count: warmed, then timed in turns."""
    mb = n * 4 / 2**20
    plan = ShardPlan.build([("w", (n,))], shards)
    handles = [Shard.remote(i, np.zeros(plan.shard_size(i), np.float32), "adagrad", 0.01)
               for i in range(shards)]
    grad, flat = np.ones(n, np.float32), np.empty(n, np.float32)
    floor_shards = {
        "null": [NullShard.remote(plan.shard_size(i)) for i in range(shards)],
        "read": [ReadShard.remote(plan.shard_size(i)) for i in range(shards)]}
    variants, clients = [], {}
    for variant, pushers in [(v, 1) for v in args.variants] + [("f32x2", p) for p in args.pushers]:
        kind, _, rest = variant.rpartition("-")
        dtype, k = rest.split("x")
        name = variant if pushers == 1 else f"{pushers}x{variant}"
        if pushers == 1:
            clients[name] = [PSClient(floor_shards[kind] if kind else handles, plan,
                                      grad_dtype=DTYPES[dtype], max_in_flight=int(k))]
        else:
            clients[name] = [Pusher.remote(handles, plan, DTYPES[dtype], int(k))
                             for _ in range(pushers)]
        variants.append(name)
        # Warm up: actors started, and every process has touched the object store's pages
        # (the first pass through the store faults each page in, in the writer and in each
        # reader: three times slower puts). Pushes of ``store`` bytes cycle through it.
        push_rate(clients[name], grad, -(-store // grad.nbytes) + 2)
    rounds: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    inside: dict[str, list[float]] = {v: [] for v in variants}  # ms in a shard per push
    for _ in range(args.rounds):
        for v in variants:
            before = ray.get([h.timings.remote() for h in handles])
            rounds[v].append((base.rate(args.repeat), push_rate(clients[v], grad, args.repeat)))
            after = ray.get([h.timings.remote() for h in handles])
            per_push = [1000 * (a["push_s"] - b["push_s"]) / (a["pushes"] - b["pushes"])
                        for a, b in zip(after, before) if a["pushes"] > b["pushes"]]
            if per_push:  # the slowest shard's: a push waits for every shard
                inside[v].append(max(per_push))
    fetcher = PSClient(handles, plan)
    fetch_rate(fetcher, flat, -(-store // grad.nbytes) + 2)  # warm up, as the pushes
    fetch = statistics.median(fetch_rate(fetcher, flat, args.repeat) for _ in range(args.rounds))
    medians = {}
    for v in variants:
        ratios = sorted(p / b for b, p in rounds[v])
        medians[v] = statistics.median(p for _, p in rounds[v])
        print(f"{mb:>5g} {shards:>6} {v:>10} "
              f"{statistics.median(b for b, _ in rounds[v]):>12.0f} {medians[v]:>10.0f} "
              f"{statistics.median(ratios):>6.2f} "
              f"{f'[{ratios[0]:.2f}-{ratios[-1]:.2f}]':>11} {fetch:>10.0f} "
              f"{statistics.median(inside[v]) if inside[v] else float('nan'):>11.2f}", flush=True)
    for kind in floor_shards:  # issue 16: real shards against the floors
        floors = [f"{v} {medians[v] / medians[f'{kind}-{v}']:.2f}" for v in medians
                  if f"{kind}-{v}" in medians]
        if floors:
            print(f"{mb:>5g} {shards:>6} real / {kind}-floor push MB/s: " + ", ".join(floors),
                  flush=True)
    if "null-f32x1" in medians:  # what a shard that applies can reach, one push at a time
        null_ms = 1000 * mb / medians["null-f32x1"]
        apply_ms = 1000 * mb / shards / statistics.median(b for b, _ in rounds["null-f32x1"])
        print(f"{mb:>5g} {shards:>6} bound on real / null-floor f32x1: "
              f"{null_ms / (null_ms + apply_ms):.2f} (a null push {null_ms:.2f} ms + the "
              f"in-process apply of one shard's slice {apply_ms:.2f} ms, shards in parallel)",
              flush=True)
        if inside.get("f32x1"):  # the same with the apply as it runs in a shard
            shard_ms = statistics.median(inside["f32x1"])
            print(f"{mb:>5g} {shards:>6} bound with the shards' own time: "
                  f"{null_ms / (null_ms + shard_ms):.2f} (a null push + {shard_ms:.2f} ms inside "
                  "the slowest shard per f32x1 push: checks and update, caches cold)", flush=True)
    for c in [c for cs in clients.values() for c in cs if not isinstance(c, PSClient)]:
        ray.kill(c)
    for h in handles + [a for group in floor_shards.values() for a in group]:
        ray.kill(h)


if __name__ == "__main__":
    main()
