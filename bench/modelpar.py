"""Model parallelism: step throughput of one locally connected model on 1 vs K partitions.

Run: .venv/bin/python bench/modelpar.py [--partitions 2] [--steps 8] [--size 32] [--batch-size 128]
     [--bfloat16]

One model (two 5x5 locally connected layers of 16 channels over a 32x32 image, untied
weights, and a linear readout: 8.4 M parameters) runs forward + backward + a local SGD
update on batches of 128, in the same Ray session. Untied weights are each used once per
example, so the batch is what makes compute, not memory traffic, dominate a step (the two
cores share memory bandwidth):
- 1 partition actor (the whole model in one actor, one torch thread, like a replica), and
- K partition actors of the spatial plan (each owns a block of rows of every layer and
  exchanges only the halos its windows need, one torch thread each).
For reference it also times the unpartitioned model in this process with 1 and with 2 torch
threads. Prints steps/s of each, the speed-up K vs 1 partition, and the bytes per step that
crossed partition boundaries against a naive exchange of whole activations. With
``--bfloat16`` the same K partitions also run with ``precision="bfloat16"`` (forward under
autocast, boundary tensors in bfloat16), in the same rounds, and it prints their steps/s
and bytes against float32's.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from _common import parser as make_parser
from _common import ray_session
from torch import nn

from distbelief.allocator import keep_freed_memory
from distbelief.modelpar.layers import LocallyConnected2d
from distbelief.modelpar.spatial import plan_spatial
from distbelief.modelpar.worker import PartitionGroup

LR = 0.01


def build(size: int, channels: int, kernel: int) -> nn.Sequential:
    torch.manual_seed(0)
    pad = kernel // 2
    return nn.Sequential(
        LocallyConnected2d(4, channels, size, kernel, padding=pad), nn.ReLU(),
        LocallyConnected2d(channels, channels, size, kernel, padding=pad), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * size * size, 10))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def in_process(model: nn.Module, x, y, steps: int, threads: int) -> float:
    """Steps per second of the whole model in this process with ``threads`` torch threads,
    with glibc's malloc keeping freed memory as every partition actor's does (with the
    default thresholds this loop ran at 1.69-1.75 steps/s against 2.28-2.76 in a /tmp
    timing of one thread, 2026-12-07: each step's buffers were mapped afresh)."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - began)


def timed(group: PartitionGroup, x, y, steps: int) -> tuple[float, float]:
    """Steps/s of ``steps`` training steps on ``group``; bytes crossed per step."""
    before = sum(c["bytes_sent"] for c in group.counters())
    began = time.perf_counter()
    for _ in range(steps):
        group.step(x, lambda out: loss_fn(out, y))
        group.end_step(False, LR)
    after = sum(c["bytes_sent"] for c in group.counters())  # waits for the last step
    return steps / (time.perf_counter() - began), (after - before) / steps


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--kernel", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bfloat16", action="store_true",
                        help="also time the K partitions in bfloat16")
    args = parser.parse_args()

    model = build(args.size, args.channels, args.kernel)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 4, args.size, args.size, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    print(f"model: 2 LC layers {args.channels} ch, {args.kernel}x{args.kernel} windows over "
          f"{args.size}x{args.size}, {params / 1e6:.1f} M parameters; batch {args.batch_size}, "
          f"{args.steps} timed steps each")
    with ray_session(args.num_cpus):
        plan = plan_spatial(model, args.partitions)
        groups = {1: PartitionGroup(model, plan_spatial(model, 1)),
                  args.partitions: PartitionGroup(model, plan)}
        if args.bfloat16:
            groups["bf16"] = PartitionGroup(model, plan, precision="bfloat16")
        rates: dict = {k: [] for k in groups}
        crossed: dict = {}
        try:
            for g in groups.values():
                timed(g, x, y, 2)  # warm up: actor start, first allocations
            for _ in range(args.repeats):  # alternate, so drift hits all alike
                for k, g in groups.items():
                    rate, crossed[k] = timed(g, x, y, args.steps)
                    rates[k].append(rate)
        finally:
            for g in groups.values():
                g.kill()
    naive = plan.naive_bytes(args.batch_size, 4)
    single = in_process(model, x, y, args.steps, 1)
    double = in_process(model, x, y, args.steps, 2)
    one, many = statistics.median(rates[1]), statistics.median(rates[args.partitions])
    ratios = [b / a for a, b in zip(rates[1], rates[args.partitions])]
    print(f"in process, 1 torch thread   : {single:6.2f} steps/s")
    print(f"in process, 2 torch threads  : {double:6.2f} steps/s")
    print(f"1 partition actor            : {one:6.2f} steps/s (median of {args.repeats})")
    print(f"{args.partitions} partition actors           : {many:6.2f} steps/s")
    print(f"speed-up {args.partitions} vs 1 partition      : {many / one:.2f}x (per repeat "
          f"{min(ratios):.2f}x - {max(ratios):.2f}x)")
    print(f"speed-up vs in-process 1 thr : {many / single:.2f}x; vs 2 threads "
          f"{many / double:.2f}x")
    k = args.partitions
    print(f"boundary bytes per step      : {crossed[k] / 1e6:.2f} MB vs naive whole-activation "
          f"exchange {naive / 1e6:.2f} MB: ratio {crossed[k] / naive:.3f}")
    if args.bfloat16:
        half = statistics.median(rates["bf16"])
        per = [b / a for a, b in zip(rates[k], rates["bf16"])]
        print(f"{k} partition actors, bfloat16 : {half:6.2f} steps/s, {half / many:.2f}x float32's "
              f"(per repeat {min(per):.2f}x - {max(per):.2f}x); boundary bytes per step "
              f"{crossed['bf16'] / 1e6:.2f} MB, {crossed['bf16'] / crossed[k]:.2f} of float32's")


if __name__ == "__main__":
    main()
