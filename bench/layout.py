"""The CNN's layout and op order: models.cnn as shipped against the textbook CNN, same run.

``distbelief.models.cnn`` makes two changes to the textbook CNN that leave every value and
gradient as it was. It starts with :class:`~distbelief.models.ImageRows`, which lays the
images out channels-last, so the convolutions keep their outputs channels-last and
``max_pool2d`` takes its vectorised CPU kernel; and it pools before the ReLU (the two
commute), so the ReLU runs on a quarter of the activations. This script times three
variants with the same parameters on real MNIST: the textbook one (a plain ``nn.Unflatten``,
activations in PyTorch's default NCHW order, ReLU then pool), the channels-last one with
ReLU then pool, and the shipped one. For each thread count it times a training step
(forward, backward and Adam at batch ``--batch-size``) and a no-grad pass over the 1,000
test rows, in rounds that alternate between the variants, and prints the medians and each
variant's speed-up over the textbook one.

    .venv/bin/python bench/layout.py
"""

from __future__ import annotations

import statistics
import time

from _common import parser


def variant(shipped, channels_last: bool, pool_first: bool):
    """``shipped`` (a ``models.cnn``) copied with the same parameters, its leading
    ``ImageRows`` a plain ``nn.Unflatten`` unless ``channels_last``, and each convolution's
    ReLU before its pool unless ``pool_first``; parameters get default strides (the shipped
    first convolution's one-channel weight has channels-last ones)."""
    import copy

    import torch
    from torch import nn

    m = list(copy.deepcopy(shipped))  # ImageRows, conv, pool, ReLU, conv, pool, ReLU, ...
    if not channels_last:
        m[0] = nn.Unflatten(m[0].dim, m[0].unflattened_size)
    if not pool_first:
        m[2], m[3], m[5], m[6] = m[3], m[2], m[6], m[5]
    model = nn.Sequential(*m)
    if not channels_last:
        for p in model.parameters():
            p.data = torch.empty(p.shape).copy_(p.data)
    return model


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
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per variant")
    args = p.parse_args()
    if min(args.threads or [1]) < 1 or args.batch_size < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--threads, --batch-size, --steps and --rounds must be at least 1")

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
    variants = {"textbook": (False, False), "channels-last": (True, False),
                "shipped": (True, True)}
    with torch.no_grad():
        logits = {name: variant(shipped, *v)(x_test) for name, v in variants.items()}
    gap = max(float((z - logits["textbook"]).abs().max()) for z in logits.values())
    print(f"CNN {sum(p.numel() for p in shipped.parameters()):,} parameters, real MNIST, "
          f"batch {args.batch_size}; largest logit difference to the textbook CNN {gap:.1e}")
    print("textbook: NCHW, ReLU then pool; channels-last: ImageRows, ReLU then pool; "
          "shipped: ImageRows, pool then ReLU")
    print(f"{'threads':>7}  {'variant':<14} {'train step ms':>13} {'eval 1,000 rows ms':>19}"
          f"  {'textbook / it: train, eval':>26}")
    for n in threads:
        torch.set_num_threads(n)
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in variants}
        for _ in range(args.rounds):
            for name, v in variants.items():
                model = variant(shipped, *v)
                times[name][0].append(step_ms(model, x, y, args.batch_size, args.steps))
                times[name][1].append(eval_ms(model, x_test))
        med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in times.items()}
        base_s, base_e = med["textbook"]
        for name, (s, e) in med.items():
            print(f"{n:>7}  {name:<14} {s:>13.1f} {e:>19.1f}  "
                  f"{base_s / s:>20.2f}, {base_e / e:.2f}")


if __name__ == "__main__":
    main()
