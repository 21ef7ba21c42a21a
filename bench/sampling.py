"""What the way rows are dealt to workers does to final accuracy, with no system in the way.

Run: .venv/bin/python bench/sampling.py [--seeds 30] [--workers 4] [--steps 250] [--lr 0.2]
     [--batch-size 32] [--hidden 64]
bench/peers.py compares final test accuracy after a fixed budget of mini-batches, and the
systems there feed their workers differently: Ray's example gives every worker a shuffled
DataLoader over the whole training set, while a Downpour replica draws from
data.ReplicaSampler (last partial batch dropped) with --data-split "epoch" (the default: a
fresh permutation of all rows each epoch, replica r taking every W-th row of it) or "fixed"
(the paper's fixed data splits: replica r keeps rows r, r + W, ... for the whole run). This script
runs the feeding orders through one plain in-process SGD loop (one torch thread, the same
model, seed, lr and W x --steps mini-batches as bench/peers.py, gradients applied at once, so
no staleness and no Ray), once per seed:
- fixed, epoch: W ReplicaSamplers with that split, taken in turn (replica 0's step 0,
  replica 1's step 0, ...), the order in which an unloaded Downpour run sees them;
- whole: a shuffled pass over all training rows at a time, partial last batch kept (what
  torch's DataLoader(shuffle=True) does), W x --steps batches.
The model's initial weights are the same for every run (seed 0, as in bench/peers.py); the
seed sets the data order. Prints each scheme's mean and median final test accuracy over the
seeds and the mean paired difference of each split against "whole" with a 95% interval, in
points and in test images.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from _common import parser as make_parser
from scipy.stats import t
from torch import nn

from distbelief import data, models
from distbelief.data import ReplicaSampler


def replica_order(split: str):
    def order(n: int, workers: int, steps: int, batch: int, seed: int) -> list:
        samplers = [ReplicaSampler(n, r, workers, batch, seed, split) for r in range(workers)]
        return [samplers[r].batch(k) for k in range(steps) for r in range(workers)]
    return order


def whole_order(n: int, workers: int, steps: int, batch: int, seed: int) -> list:
    rng, out = np.random.default_rng(seed), []
    while len(out) < workers * steps:
        perm = rng.permutation(n)
        out += [perm[i: i + batch] for i in range(0, n, batch)]
    return out[: workers * steps]


def final_accuracy(ds: data.Dataset, order: list, args) -> float:
    model = models.mlp(ds.features, args.hidden, ds.classes, 0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    for rows in order:
        rows = torch.from_numpy(np.asarray(rows))
        opt.zero_grad()
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
    with torch.no_grad():
        return float((model(torch.from_numpy(ds.x_test)).argmax(1)
                      == torch.from_numpy(ds.y_test)).float().mean())


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=250, help="mini-batches per worker")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds = data.digits()
    orders = {"fixed": replica_order("fixed"), "epoch": replica_order("epoch"),
              "whole": whole_order}
    n, acc = len(ds.x_train), {name: [] for name in orders}
    for seed in range(args.seeds):
        for name, order in orders.items():
            acc[name].append(final_accuracy(
                ds, order(n, args.workers, args.steps, args.batch_size, seed), args))
    print(f"plain SGD lr={args.lr}, {args.workers} x {args.steps} mini-batches of "
          f"{args.batch_size}, hidden={args.hidden}, {args.seeds} data orders; "
          f"{len(ds.x_test)} test images")
    for name, a in acc.items():
        print(f"{name:<9} final accuracy mean {statistics.mean(a):.4f} median "
              f"{statistics.median(a):.4f} [{min(a):.4f}-{max(a):.4f}]")
    for name in ("fixed", "epoch"):
        diff = [d - w for d, w in zip(acc[name], acc["whole"])]
        mean = statistics.mean(diff)
        half = t.ppf(0.975, len(diff) - 1) * statistics.stdev(diff) / len(diff) ** 0.5
        print(f"{name} - whole: {100 * mean:+.2f} points ({mean * len(ds.x_test):+.1f} test "
              f"images), 95% interval [{100 * (mean - half):+.2f}, {100 * (mean + half):+.2f}]")


if __name__ == "__main__":
    main()
