"""The shards' chunked NumPy rules vs the same update through torch.optim (TorchRule).

Run: .venv/bin/python bench/optim.py [--sizes-mb 4 64] [--repeat 10] [--rounds 3] [--threads 1]
Per slice size, each round times ``--repeat`` in-place updates of a float32 slice by each
NumPy rule, right after by its torch counterpart as the shards run it (``TorchRule``:
zero-copy views, torch's fused CPU kernel where it has one), and by the same torch
optimizer on its single-tensor path (``fused=False``, what the shards ran before
2026-12-05); the ratios torch/NumPy and fused/single are taken per round (so machine noise
hits both alike) and the medians printed: below 1 the first is faster. ``adagrad`` is
DistBelief's Adagrad against ``torch.optim.Adagrad(eps=0, initial_accumulator_value=1e-8)``,
the same numbers (how dense slices now run it); ``adam`` has no NumPy rule.
``--threads`` sets torch's intra-op threads (a shard actor runs with 1 CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from distbelief.ps.optim import SGD, Adagrad, Momentum
from distbelief.ps.torchrule import TorchRule

PAIRS = {  # name -> (NumPy rule or None, torch class, torch kwargs)
    "sgd": (SGD(0.01), torch.optim.SGD, {}),
    "momentum": (Momentum(0.01, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": (Adagrad(0.01), torch.optim.Adagrad,
                {"eps": 0.0, "initial_accumulator_value": 1e-8}),
    "adam": (None, torch.optim.Adam, {}),
}


def per_update(rule, n: int, repeat: int) -> float:
    """Seconds per ``rule.apply`` on a fresh slice of ``n`` elements (after one warm-up)."""
    p, g = np.zeros(n, np.float32), np.full(n, 0.5, np.float32)
    state = rule.init_state(n)
    rule.apply(p, g, state)  # touch every page, bind the torch optimizer
    start = time.perf_counter()
    for _ in range(repeat):
        rule.apply(p, g, state)
    return (time.perf_counter() - start) / repeat


def per_step_single(cls, kwargs: dict, n: int, repeat: int) -> float:
    """Seconds per step of ``cls`` on its single-tensor CPU path (no fused kernel)."""
    p = torch.zeros(n)
    opt = cls([p], lr=0.01, foreach=False, fused=False, **kwargs)
    p.grad = torch.full((n,), 0.5)
    opt.step()
    start = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 64])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); ms per update, median of "
          f"{args.rounds} rounds of {args.repeat}; ratios torch / NumPy and fused / single")
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4
        for name, (numpy_rule, cls, kwargs) in PAIRS.items():
            times: dict[str, list[float]] = {"numpy": [], "torch": [], "single": []}
            for _ in range(args.rounds):
                if numpy_rule is not None:
                    times["numpy"].append(per_update(numpy_rule, n, args.repeat))
                times["torch"].append(per_update(TorchRule(cls, 0.01, kwargs), n, args.repeat))
                times["single"].append(per_step_single(cls, kwargs, n, args.repeat))
            ms = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in times.items()}
            vs_single = statistics.median(t / u for t, u in zip(times["torch"], times["single"]))
            vs_numpy = (statistics.median(t / u for t, u in zip(times["torch"], times["numpy"]))
                        if times["numpy"] else float("nan"))
            print(f"{mb:6g} MB  {name:9s} numpy {ms['numpy']:8.3f}  torch {ms['torch']:8.3f}  "
                  f"single {ms['single']:8.3f}  torch/numpy {vs_numpy:5.2f}  "
                  f"fused/single {vs_single:5.2f}")

if __name__ == "__main__":
    main()
