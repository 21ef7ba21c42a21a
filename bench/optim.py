"""The shards' chunked NumPy rules vs the same update through torch.optim (TorchRule).

Run: .venv/bin/python bench/optim.py [--sizes-mb 4 64] [--repeat 10] [--rounds 3] [--threads 1]
Per slice size, each round times ``--repeat`` in-place updates of a float32 slice by each
NumPy rule and right after by its torch counterpart bound to the same kind of buffers
(``TorchRule``: zero-copy views, single-tensor CPU path); the ratio torch/NumPy is taken
per round (so machine noise hits both alike) and the median printed: above 1 the NumPy
rule is faster. ``adagrad`` compares DistBelief's Adagrad with ``torch.optim.Adagrad``
(slightly different formula, same cost class); ``adam`` is printed for scale only.
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
    "adagrad": (Adagrad(0.01), torch.optim.Adagrad, {}),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 64])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); ms per update, median of "
          f"{args.rounds} rounds of {args.repeat}; ratio = torch / NumPy")
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4
        for name, (numpy_rule, cls, kwargs) in PAIRS.items():
            times: dict[str, list[float]] = {"numpy": [], "torch": []}
            for _ in range(args.rounds):
                if numpy_rule is not None:
                    times["numpy"].append(per_update(numpy_rule, n, args.repeat))
                times["torch"].append(per_update(TorchRule(cls, 0.01, kwargs), n, args.repeat))
            t_torch = statistics.median(times["torch"]) * 1e3
            if numpy_rule is None:
                print(f"{mb:6g} MB  {name:9s} numpy     -    torch {t_torch:8.3f}")
                continue
            t_numpy = statistics.median(times["numpy"]) * 1e3
            ratio = statistics.median(t / u for t, u in zip(times["torch"], times["numpy"]))
            print(f"{mb:6g} MB  {name:9s} numpy {t_numpy:8.3f}  torch {t_torch:8.3f}  "
                  f"ratio {ratio:5.2f}")


if __name__ == "__main__":
    main()
