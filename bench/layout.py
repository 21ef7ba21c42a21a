"""The CNN's activation layout: channels-last (models.cnn as shipped) against NCHW, same run.

``distbelief.models.cnn`` starts with :class:`~distbelief.models.ImageRows`, which lays the
images out channels-last, so the convolutions keep their outputs channels-last and
``max_pool2d`` takes its vectorised CPU kernel. This script times that model against the
same network with a plain ``nn.Unflatten`` (activations in PyTorch's default NCHW order),
the same parameters in both, on real MNIST: a training step (forward, backward and Adam at
batch ``--batch-size``) and a no-grad pass over the 1,000 test rows, for each thread count.
Rounds alternate between the two layouts; it prints the medians and NCHW / channels-last.

    .venv/bin/python bench/layout.py
"""

from __future__ import annotations

import statistics
import time

from _common import parser


def nchw_copy(model):
    """The same network and parameters with a plain ``nn.Unflatten`` and default strides."""
    import copy

    import torch
    from torch import nn

    plain = copy.deepcopy(model)
    plain[0] = nn.Unflatten(plain[0].dim, plain[0].unflattened_size)
    for p in plain.parameters():  # the first convolution's weight has channels-last strides
        p.data = torch.empty(p.shape).copy_(p.data)
    return plain


def step_ms(model, x, y, batch: int, steps: int) -> float:
    """Mean wall milliseconds of a training step (forward, backward, Adam) over ``steps``
    mini-batches of ``batch`` rows drawn without replacement, after three warm-up steps."""
    import torch

    opt = torch.optim.Adam(model.parameters(), 1e-3)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    for k in range(steps + 3):
        if k == 3:
            start = time.perf_counter()
        rows = order[(k * batch) % (len(y) - batch + 1):][:batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return (time.perf_counter() - start) / steps * 1e3


def eval_ms(model, x) -> float:
    """Wall milliseconds of one no-grad forward pass over ``x`` (after one warm-up pass)."""
    import torch

    with torch.no_grad():
        model(x)
        start = time.perf_counter()
        model(x)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch thread counts (default: 1 and this machine's cores)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="timed training steps a round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per layout")
    args = p.parse_args()
    if min(args.threads or [1]) < 1 or args.batch_size < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--threads, --batch-size, --steps and --rounds must be at least 1")

    import copy
    import os

    import torch

    from distbelief import models
    from distbelief.data import mnist

    ds = mnist()
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    x_test = torch.from_numpy(ds.x_test)
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or sorted({1, cores})
    shipped = models.cnn(ds.features, ds.classes, seed=0)
    plain = nchw_copy(shipped)
    with torch.no_grad():
        gap = float((shipped(x_test) - plain(x_test)).abs().max())
    print(f"CNN {sum(p.numel() for p in shipped.parameters()):,} parameters, real MNIST, "
          f"batch {args.batch_size}; largest logit difference between the layouts {gap:.1e}")
    print(f"{'threads':>7}  {'layout':<14} {'train step ms':>13} {'eval 1,000 rows ms':>19}")
    layouts = {"nchw": lambda: nchw_copy(shipped), "channels-last": lambda: copy.deepcopy(shipped)}
    for n in threads:
        torch.set_num_threads(n)
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in layouts}
        for _ in range(args.rounds):
            for name, factory in layouts.items():
                model = factory()
                times[name][0].append(step_ms(model, x, y, args.batch_size, args.steps))
                times[name][1].append(eval_ms(model, x_test))
        med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in times.items()}
        for name, (s, e) in med.items():
            print(f"{n:>7}  {name:<14} {s:>13.1f} {e:>19.1f}")
        (s_old, e_old), (s_new, e_new) = med["nchw"], med["channels-last"]
        print(f"{n:>7}  nchw / channels-last: train step {s_old / s_new:.2f}, "
              f"eval {e_old / e_new:.2f}")


if __name__ == "__main__":
    main()
