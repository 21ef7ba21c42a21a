"""Time to a test accuracy: Downpour SGD vs synchronous data-parallel SGD (DDP) vs one process,
and distbelief's own synchronous mode with backup workers.

Run: .venv/bin/python bench/sync.py [--workers 4] [--target 0.95] [--slow 2] [--repeats 3]
     [--backup-workers 1] [--methods downpour ddp sync single] [--out runs/bench-sync]
Same data (scikit-learn digits, the fixed 80/20 split of distbelief.data), same model (the
CLI's 64-HIDDEN-10 MLP, same seed), same optimizer and learning rate (Adagrad, --lr), same
mini-batch per worker (--batch-size), same sampling (data.ReplicaSampler with --data-split;
the default, "epoch", deals worker w every W-th row of a fresh permutation each epoch, as
DDP's DistributedSampler does) and the same number of workers W for Downpour (W replicas,
--shards shards) and PyTorch DistributedDataParallel over gloo on 127.0.0.1 (W processes from
torch.multiprocessing.spawn); the single process runs W * --steps steps. Each variant runs
as it is and with worker 0 slowed --slow times (it sleeps (F-1) x its own step time after
every step, the same rule as Downpour's --slow-replica). "sync" is DownpourSGD with
--backup-workers B on the same shards (Chen et al. 2016): --steps synchronous updates, each
the mean of the first W - B gradients of the current version, so W gradients a step as DDP
when B = 0; the straggler cost of each method (its time slowed / not) is printed.

Clocks start when every worker is ready and stop at the first evaluation reaching --target:
Ray start-up and actor construction are excluded for Downpour (its clock starts at the run's
"placement" event, logged once every shard and replica is constructed), process spawn and
init_process_group for DDP (rank 0 starts after a barrier), model construction for the single
process. Every method evaluates the whole test set every --eval-every seconds of wall time
(Downpour: the driver, from the shards, while replicas run; DDP: rank 0 between steps).
Prints times, the ratio Downpour/DDP with and without the straggler, and writes
OUT/sync.json (accuracy curves) and OUT/figure4.png.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import (
    accuracy,
    add_comparison_args,
    downpour_curve,
    fmt,
    free_port,
    time_to,
    write_results,
)
from _common import parser as make_parser
from figure4 import plot
from torch import nn

from distbelief import data, models
from distbelief.config import SPLITS
from distbelief.data import ReplicaSampler


def single_process(args, slow: float) -> list[tuple[float, float]]:
    """Plain SGD loop in this process: W * steps mini-batches, Adagrad on the whole model."""
    torch.set_num_threads(1)
    ds = data.digits()
    model = models.mlp(ds.features, args.hidden, ds.classes, args.seed)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    xt, yt = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    sampler = ReplicaSampler(len(x), 0, 1, args.batch_size, args.seed, args.data_split)
    loss_fn, curve = nn.CrossEntropyLoss(), []
    start = next_eval = time.perf_counter()
    for step in range(args.workers * args.steps):
        began = time.perf_counter()
        rows = torch.from_numpy(sampler.batch(step))
        opt.zero_grad()
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
        if slow > 1.0:
            time.sleep((slow - 1.0) * (time.perf_counter() - began))
        if time.perf_counter() >= next_eval:
            curve.append((time.perf_counter() - start, accuracy(model, xt, yt)))
            next_eval = time.perf_counter() + args.eval_every
            if curve[-1][1] >= args.target and args.stop_at_target:
                break
    curve.append((time.perf_counter() - start, accuracy(model, xt, yt)))
    return curve


def ddp_worker(rank: int, args, slow: float, port: int, out: str) -> None:
    """One DDP process: its own rows, gradients averaged by all-reduce every step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.workers)
    ds = data.digits()
    model = nn.parallel.DistributedDataParallel(
        models.mlp(ds.features, args.hidden, ds.classes, args.seed))
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    xt, yt = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    sampler = ReplicaSampler(len(x), rank, args.workers, args.batch_size, args.seed,
                             args.data_split)
    loss_fn, curve = nn.CrossEntropyLoss(), []
    factor = slow if rank == 0 else 1.0
    dist.barrier()
    start = next_eval = time.perf_counter()
    stop = torch.zeros(1)
    for step in range(args.steps):
        began = time.perf_counter()
        rows = torch.from_numpy(sampler.batch(step))
        opt.zero_grad()
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - began))
        if rank == 0 and time.perf_counter() >= next_eval:
            curve.append((time.perf_counter() - start, accuracy(model.module, xt, yt)))
            next_eval = time.perf_counter() + args.eval_every
            stop[0] = float(args.stop_at_target and curve[-1][1] >= args.target)
        if args.stop_at_target and step % 10 == 9:  # everyone stops at the same step
            dist.broadcast(stop, 0)
            if stop[0]:
                break
    if rank == 0:
        curve.append((time.perf_counter() - start, accuracy(model.module, xt, yt)))
        Path(out).write_text(json.dumps(curve))
    dist.destroy_process_group()


def ddp(args, slow: float) -> list[tuple[float, float]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curve.json")
        mp.spawn(ddp_worker, args=(args, slow, port, out), nprocs=args.workers, join=True)
        return [tuple(p) for p in json.loads(Path(out).read_text())]


def downpour(args, slow: float) -> list[tuple[float, float]]:
    from distbelief import DownpourSGD

    ds = data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, args.hidden, ds.classes, args.seed),
                          replicas=args.workers, shards=args.shards, optimizer="adagrad",
                          lr=args.lr, batch_size=args.batch_size, steps=args.steps,
                          n_fetch=args.n_fetch, n_push=args.n_push, seed=args.seed,
                          eval_every_s=args.eval_every, data_split=args.data_split,
                          slow_replicas={0: slow} if slow > 1.0 else {})
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    return downpour_curve(result.events)


def sync_backup(args, slow: float) -> list[tuple[float, float]]:
    """Downpour's shards and replicas in synchronous mode: --backup-workers B, --steps
    updates (the DDP comparison: one averaged update a step)."""
    from distbelief import DownpourSGD

    ds = data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, args.hidden, ds.classes, args.seed),
                          replicas=args.workers, shards=args.shards, optimizer="adagrad",
                          lr=args.lr, batch_size=args.batch_size, steps=args.steps,
                          seed=args.seed, eval_every_s=args.eval_every,
                          data_split=args.data_split, backup_workers=args.backup_workers,
                          slow_replicas={0: slow} if slow > 1.0 else {})
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    return downpour_curve(result.events)


def main() -> None:
    parser = make_parser(__doc__)
    add_comparison_args(parser, lr=0.05, lr_help="Adagrad, all three methods",
                        shards_help="Downpour's (one suits a 19 KB model: every shard is one "
                                    "more Ray call per step)")
    parser.add_argument("--data-split", default="epoch", choices=SPLITS)
    parser.add_argument("--slow", type=float, default=2.0)
    parser.add_argument("--run-to-end", dest="stop_at_target", action="store_false",
                        help="DDP and single process: run all steps instead of stopping at "
                             "the target (Downpour always runs all its steps)")
    parser.add_argument("--backup-workers", type=int, default=1,
                        help="the sync method's B (each update waits for W - B gradients)")
    parser.add_argument("--methods", nargs="+", default=["downpour", "ddp", "sync", "single"],
                        choices=["downpour", "ddp", "sync", "single"])
    parser.add_argument("--out", default="runs/bench-sync")
    args = parser.parse_args()
    every = {"downpour": downpour, "ddp": ddp, "sync": sync_backup, "single": single_process}
    methods = {name: every[name] for name in args.methods}
    times: dict[str, list[float | None]] = {}
    curves: dict[str, list] = {}
    for r in range(args.repeats):
        for slow in (1.0, args.slow):
            for name, run in methods.items():
                key = name if slow == 1.0 else f"{name} slow0x{slow:g}"
                curve = run(args, slow)
                t = time_to(curve, args.target)
                times.setdefault(key, []).append(t)
                curves.setdefault(key, curve)
                print(f"repeat {r} {key:<22} time to {args.target:.0%}: {fmt(t)}  "
                      f"final acc {curve[-1][1]:.4f} at {curve[-1][0]:.2f}s", flush=True)
    print(f"\nworkers={args.workers} shards={args.shards} batch={args.batch_size} "
          f"lr={args.lr} n_fetch={args.n_fetch} n_push={args.n_push} hidden={args.hidden} "
          f"backup_workers={args.backup_workers}")
    med = {}
    for key, ts in times.items():
        done = [t for t in ts if t is not None]
        med[key] = statistics.median(done) if len(done) == len(ts) else None
        rng = f"[{min(done):.2f}-{max(done):.2f}]" if done else ""
        print(f"{key:<22} median time to {args.target:.0%}: {fmt(med[key])} {rng} "
              f"({len(done)}/{len(ts)} reached)")
    for suffix, label in (("", "no straggler"), (f" slow0x{args.slow:g}", "worker 0 slowed")):
        d, s, one = (med.get(f"{m}{suffix}") for m in ("downpour", "ddp", "single"))
        if d and s:
            print(f"{label:<16}: downpour/ddp = {d / s:.2f}" +
                  (f", downpour/single = {d / one:.2f}, ddp/single = {s / one:.2f}"
                   if one else ""))
    for name in methods:
        plain, slowed = med.get(name), med.get(f"{name} slow0x{args.slow:g}")
        if plain and slowed:
            print(f"straggler cost of {name:<9}: slowed / not = {slowed / plain:.2f}")
    d, y = med.get(f"sync slow0x{args.slow:g}"), med.get(f"ddp slow0x{args.slow:g}")
    if d and y:
        print(f"worker 0 slowed  : sync(B={args.backup_workers})/ddp = {d / y:.2f}")
    written = write_results(args.out, "sync.json", {"args": vars(args), "times": times,
                                                     "curves": curves})
    print(f"wrote {written} and {plot(curves, Path(args.out) / 'figure4.png', args.target)}")


if __name__ == "__main__":
    main()
