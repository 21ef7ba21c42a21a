"""Downpour throughput by replicas and shards, and parameter-server cost as the model grows.

Run: .venv/bin/python bench/scale.py [--replicas 1 2 4 8] [--shards 1 2 4]
     [--sizes 1e5 1e6 1e7 1e8] [--out runs/bench-scale]

Part 1, throughput: for every (replicas R, shards S) the real DownpourSGD trainer trains the
same MLP (digits, 64-HIDDEN-10, seed 0, Adagrad, batch --batch-size, --n-fetch and --n-push 1)
for --total-steps steps in all (total / R per replica), each run in the same Ray session.
Steps/s is counted from the replicas' step events over the window in which every replica is
running (from the last replica's first step to the first replica's last step), so actor
start-up and the ragged end are left out; samples/s = steps/s x batch. Baselines measured in
the same invocation: Downpour with 1 replica and 1 shard (run first and again last, so drift
over the run shows; ratios are against the first), and one process running the same model,
batch and Adagrad in a plain loop (one torch thread).

Part 2, cost by model size: for each size N (parameters, float32) and shard count, the
shards are bench/ps.py's: real ParameterShard actors with Adagrad, pushed to by a PSClient
in this process (float32, one push in flight, as a Downpour replica does). Per round,
--rounds of them: time per update of the same Adagrad rule on the whole N in this process
(the baseline, ps.InProcess), then time per push+apply through the shards, then time per
fetch of all N, and a NumPy copy of N float32 in this process (the fetch baseline). Ratios
are baseline time / measured time (1.0 = as fast as in process), median over rounds.
Memory per shard is the shard actor process's own resident memory as psutil reports it
inside the actor, RSS and USS (USS: pages private to the process, so it leaves out object
store pages the shard has mapped), against the bytes the shard must hold (its slice of
parameters + Adagrad accumulator) and against an idle shard of 1,000 parameters measured
first. Prints both tables and the object store size, and writes OUT/scale.json and
OUT/scale.png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import ray
import torch
from _common import parser as make_parser
from _common import pyplot, ray_session, save_figure, write_results
from ps import InProcess  # bench/ps.py (this folder is on sys.path): the same baseline
from torch import nn

from distbelief import DownpourSGD, data, models
from distbelief.data import ReplicaSampler
from distbelief.downpour import SEGMENT_STEPS
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

MB = 2**20


# ---------------------------------------------------------------- part 1: replicas x shards

def window_rate(events: list[dict]) -> tuple[float, int, float]:
    """Aggregate steps/s while every replica runs: (rate, steps counted, window seconds).

    The window opens when the last replica logs its first step and closes when the first
    replica logs its last; a window under 3 steps falls back to first to last step overall.
    """
    by: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            by.setdefault(e["replica"], []).append(e["t"])
    t0 = max(min(ts) for ts in by.values())
    t1 = min(max(ts) for ts in by.values())
    n = sum(t0 < t <= t1 for ts in by.values() for t in ts)
    if n < 3 or t1 <= t0:
        every = sorted(t for ts in by.values() for t in ts)
        t0, t1, n = every[0], every[-1], len(every) - 1
    return n / (t1 - t0), n, t1 - t0


def downpour_rate(args, ds, replicas: int, shards: int) -> dict:
    steps = max(SEGMENT_STEPS, args.total_steps // replicas)
    trainer = DownpourSGD(models.mlp(ds.features, args.hidden, ds.classes, args.seed),
                          replicas=replicas, shards=shards, optimizer="adagrad", lr=args.lr,
                          batch_size=args.batch_size, steps=steps, seed=args.seed,
                          n_fetch=args.n_fetch, n_push=args.n_push,
                          eval_every_s=1e6)  # evaluate at the start and end only
    began = time.perf_counter()
    result = trainer.fit(ds.x_train, ds.y_train)
    rate, n, window = window_rate(result.events)
    return {"replicas": replicas, "shards": shards, "steps_per_replica": steps,
            "steps_s": rate, "samples_s": rate * args.batch_size, "window_steps": n,
            "window_s": window, "updates": result.updates,
            "wall_s": time.perf_counter() - began}


def single_rate(args, ds) -> float:
    """Steps/s of one process: the same model, batch and Adagrad, in a plain loop."""
    torch.set_num_threads(1)
    model = models.mlp(ds.features, args.hidden, ds.classes, args.seed)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    sampler = ReplicaSampler(len(x), 0, 1, args.batch_size, args.seed)
    loss_fn = nn.CrossEntropyLoss()
    rates = []
    for _ in range(3):
        began = time.perf_counter()
        for step in range(args.total_steps):
            rows = torch.from_numpy(sampler.batch(step))
            opt.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            opt.step()
        rates.append(args.total_steps / (time.perf_counter() - began))
    return statistics.median(rates)


# ---------------------------------------------------------------- part 2: cost by model size

def shard_memory(shard) -> tuple[int, int]:
    """(RSS, USS) in bytes of the shard actor's own process, as psutil sees it there."""

    def measure(self) -> tuple[int, int]:
        import psutil

        info = psutil.Process().memory_full_info()
        return info.rss, info.uss

    return ray.get(shard.__ray_call__.remote(measure))


def idle_shard_memory() -> tuple[int, int]:
    shard = ParameterShard.remote(0, np.zeros(1000, np.float32), "adagrad", 0.01)
    mem = shard_memory(shard)
    ray.kill(shard)
    return mem


def per_call(fn, repeat: int) -> float:
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - began) / repeat


def size_cost(n: int, shards: int, repeat: int, rounds: int, base: InProcess,
              idle: tuple[int, int]) -> dict:
    plan = ShardPlan.build([("w", (n,))], shards)
    handles = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32),
                                     "adagrad", 0.01) for i in range(shards)]
    client = PSClient(handles, plan)
    flat = np.empty(n, np.float32)

    def push() -> None:
        client.push(base.g)

    def wait_pushes() -> None:
        for _ in range(repeat):
            push()
        client.wait()

    wait_pushes()  # warm up: actors up, pages touched
    client.fetch_into(flat)
    times = {"inproc": [], "push": [], "fetch": [], "copy": []}
    for _ in range(rounds):
        times["inproc"].append(per_call(lambda: base.rule.apply(base.p, base.g, base.state),
                                        repeat))
        times["push"].append(per_call(wait_pushes, 1) / repeat)
        times["fetch"].append(per_call(lambda: client.fetch_into(flat), repeat))
        times["copy"].append(per_call(lambda: np.copyto(flat, base.p), repeat))
    mems = [shard_memory(h) for h in handles]
    for h in handles:
        ray.kill(h)
    per_shard = max(plan.shard_size(i) for i in range(shards))
    held = per_shard * 4 * (1 + len(base.state))  # parameters + Adagrad accumulator
    rss, uss = max(m[0] for m in mems), max(m[1] for m in mems)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"params": n, "shards": shards, "repeat": repeat,
            "inproc_s": med["inproc"], "push_s": med["push"],
            "push_ratio": statistics.median(b / p for b, p in zip(times["inproc"],
                                                                  times["push"])),
            "copy_s": med["copy"], "fetch_s": med["fetch"],
            "fetch_ratio": statistics.median(c / f for c, f in zip(times["copy"],
                                                                   times["fetch"])),
            "shard_rss": rss, "shard_uss": uss, "held_bytes": held,
            "uss_growth_over_held": (uss - idle[1]) / held}


def repeats_for(n: int, budget: float) -> int:
    """Updates per round: about ``budget`` parameter-updates' worth, at least 3."""
    return max(3, min(50, int(budget / n)))


# ---------------------------------------------------------------- report

def plot(grid: list[dict], single: float, costs: list[dict], idle: tuple[int, int],
         out: Path) -> Path:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.8))
    base = grid[0]["samples_s"]
    for s in sorted({g["shards"] for g in grid}):
        rows = sorted((g for g in grid[:-1] if g["shards"] == s), key=lambda g: g["replicas"])
        a.plot([g["replicas"] for g in rows], [g["samples_s"] for g in rows], marker="o",
               label=f"Downpour, {s} shard{'s' if s > 1 else ''}")
    batch = grid[0]["samples_s"] / grid[0]["steps_s"]
    a.axhline(single * batch, color="grey", ls="--", lw=1, label="one process, plain loop")
    a.axhline(base, color="black", ls=":", lw=1, label="1 replica / 1 shard (baseline)")
    a.set(xscale="log", yscale="log", xlabel="replicas", ylabel="samples/s (all replicas)",
          title="Downpour throughput, digits MLP (2 cores)")
    a.set_xticks(sorted({g["replicas"] for g in grid}), [str(r) for r in
                                                        sorted({g["replicas"] for g in grid})])
    a.xaxis.set_minor_formatter(NullFormatter())
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    for s in sorted({r["shards"] for r in costs}):
        rows = [r for r in costs if r["shards"] == s]
        n = [r["params"] for r in rows]
        line, = b.plot(n, [r["push_s"] * 1e3 for r in rows], marker="o",
                       label=f"push+apply, {s} sh")
        b.plot(n, [r["fetch_s"] * 1e3 for r in rows], marker="s", ls="--",
               color=line.get_color(), label=f"fetch, {s} sh")
        line, = c.plot(n, [r["shard_uss"] / MB for r in rows], marker="o",
                       label=f"USS, {s} shard{'s' if s > 1 else ''}")
        c.plot(n, [(idle[1] + r["held_bytes"]) / MB for r in rows], color=line.get_color(),
               ls=":", lw=1)
    one = sorted({r["params"]: r for r in costs}.values(), key=lambda r: r["params"])
    b.plot([r["params"] for r in one], [r["inproc_s"] * 1e3 for r in one], color="black",
           marker="x", label="Adagrad in process")
    b.plot([r["params"] for r in one], [r["copy_s"] * 1e3 for r in one], color="grey",
           marker="x", ls=":", label="copy in process")
    b.set(xscale="log", yscale="log", xlabel="model parameters (float32)",
          ylabel="ms per call", title="Cost per update and per fetch")
    c.plot([], [], color="grey", ls=":", lw=1, label="idle shard + its params + accumulator")
    c.set(xscale="log", yscale="log", xlabel="model parameters (float32)",
          ylabel="MB per shard (largest shard)", title="Shard process memory")
    for ax in (b, c):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return save_figure(fig, out)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--total-steps", type=int, default=400,
                        help="steps per Downpour run, all replicas together")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--n-fetch", type=int, default=1)
    parser.add_argument("--n-push", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7, 1e8],
                        help="model sizes in parameters for the cost part")
    parser.add_argument("--size-shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=2e8,
                        help="parameter-updates per round and size (sets repeats per size)")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-sizes", action="store_true")
    parser.add_argument("--out", default="runs/bench-scale")
    args = parser.parse_args()
    largest = int(max(args.sizes)) * 4 if not args.skip_sizes else 0
    store = max(1024 * MB, 6 * largest)
    began = time.perf_counter()
    with ray_session(max(args.replicas) + max(args.shards + args.size_shards),
                     object_store_memory=store):
        store_real = ray.cluster_resources().get("object_store_memory", store)
        print(f"Ray {ray.__version__}, object store {store_real / 2**30:.2f} GiB "
              f"(/dev/shm), {ray.cluster_resources().get('CPU', 0):.0f} logical CPUs on "
              f"{__import__('os').cpu_count()} cores", flush=True)
        grid: list[dict] = []
        costs: list[dict] = []
        single, idle = 0.0, (0, 0)
        if not args.skip_grid:
            ds = data.digits()
            single = single_rate(args, ds)
            n_params = sum(p.numel() for p in models.mlp(ds.features, args.hidden,
                                                         ds.classes).parameters())
            print(f"\n[1] Downpour on digits: MLP 64-{args.hidden}-10 ({n_params} parameters), "
                  f"batch {args.batch_size}, {args.total_steps} steps per run in all, "
                  f"n_fetch={args.n_fetch} n_push={args.n_push}; one process: {single:.0f} "
                  "steps/s", flush=True)
            configs = [(1, 1)] + [(r, s) for s in args.shards for r in args.replicas
                                  if (r, s) != (1, 1)] + [(1, 1)]
            for r, s in configs:
                row = downpour_rate(args, ds, r, s)
                grid.append(row)
                print(f"  R={r} S={s}: {row['steps_s']:.0f} steps/s over {row['window_steps']}"
                      f" steps in {row['window_s']:.2f}s (run {row['wall_s']:.1f}s)", flush=True)
            report_grid(grid, single, args.batch_size)
        if not args.skip_sizes:
            idle = idle_shard_memory()
            print(f"\n[2] cost by model size (float32, Adagrad, 1 push in flight); idle shard "
                  f"process: RSS {idle[0] / MB:.0f} MB, USS {idle[1] / MB:.0f} MB", flush=True)
            for size in args.sizes:
                n = int(size)
                base = InProcess(n)
                for s in args.size_shards:
                    costs.append(size_cost(n, s, repeats_for(n, args.budget), args.rounds,
                                           base, idle))
                    print_cost(costs[-1], header=len(costs) == 1)
                del base
    written = [write_results(args.out, "scale.json",
                             {"args": vars(args), "object_store_bytes": store_real,
                              "single_steps_s": single, "idle_shard_rss_uss": idle,
                              "grid": grid, "costs": costs})]
    if grid and costs:
        written.append(plot(grid, single, costs, idle, Path(args.out) / "scale.png"))
    print(f"\nwrote {', '.join(map(str, written))} in {time.perf_counter() - began:.0f} s")


def report_grid(grid: list[dict], single: float, batch: int) -> None:
    base, last = grid[0], grid[-1]
    print(f"\n{'replicas':>8} {'shards':>6} {'steps/s':>8} {'samples/s':>10} "
          f"{'per replica':>11} {'vs 1x1':>7} {'vs 1 proc':>9}")
    for g in grid[:-1]:
        print(f"{g['replicas']:>8} {g['shards']:>6} {g['steps_s']:>8.0f} {g['samples_s']:>10.0f} "
              f"{g['steps_s'] / g['replicas']:>11.0f} {g['steps_s'] / base['steps_s']:>7.2f} "
              f"{g['steps_s'] / single:>9.2f}")
    print(f"baseline 1 replica/1 shard: {base['steps_s']:.0f} steps/s first, "
          f"{last['steps_s']:.0f} last ({last['steps_s'] / base['steps_s']:.2f}x: drift "
          f"over the run); one process: {single:.0f} steps/s = {single * batch:.0f} samples/s "
          f"({base['steps_s'] / single:.2f}x for Downpour 1x1)")
    best = max(grid, key=lambda g: g["steps_s"])
    print(f"best: {best['replicas']} replicas / {best['shards']} shards at "
          f"{best['steps_s']:.0f} steps/s, {best['steps_s'] / base['steps_s']:.2f}x of 1x1")


def print_cost(r: dict, header: bool) -> None:
    if header:
        print(f"{'params':>7} {'sh':>2} {'Adagrad ms':>10} {'push ms':>8} {'ratio':>5} "
              f"{'copy ms':>8} {'fetch ms':>8} {'ratio':>5} {'RSS MB':>7} {'USS MB':>7} "
              f"{'held MB':>7} {'USS-idle/held':>13}")
    print(f"{r['params']:>7.0e} {r['shards']:>2} {r['inproc_s'] * 1e3:>10.2f} "
          f"{r['push_s'] * 1e3:>8.2f} {r['push_ratio']:>5.2f} {r['copy_s'] * 1e3:>8.2f} "
          f"{r['fetch_s'] * 1e3:>8.2f} {r['fetch_ratio']:>5.2f} {r['shard_rss'] / MB:>7.0f} "
          f"{r['shard_uss'] / MB:>7.0f} {r['held_bytes'] / MB:>7.1f} "
          f"{r['uss_growth_over_held']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
