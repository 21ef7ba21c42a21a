"""Sandblaster batch time with one straggler: dynamic portions + backups vs a static split.

Run: .venv/bin/python bench/sandblaster.py [--replicas 3] [--slow 4] [--iterations 3]
Both variants run in the same Ray session on the same model and data: a static equal split
(one portion per replica, no backups) and the paper's scheme (10 portions per replica,
handed out as replicas become free, backup copies near the end). Replica 0 is made
``--slow`` times slower. Prints the median batch (loss+gradient evaluation) time of each
and their ratio.
"""

from __future__ import annotations

import statistics

from _common import parser as make_parser
from _common import ray_session

from distbelief import data, models
from distbelief.sandblaster.trainer import SandblasterLBFGS


def fmt(seconds: dict) -> str:
    return "{" + ", ".join(f"{k}: {v * 1000:.0f}" for k, v in sorted(seconds.items())) + "}"


def batch_times(ds, args, portions: int, backups: bool) -> list[float]:
    model = models.mlp(ds.features, args.hidden, ds.classes, seed=0)
    trainer = SandblasterLBFGS(model, replicas=args.replicas, shards=2,
                               iterations=args.iterations, portions=portions,
                               backups=backups, slow_replicas={0: args.slow},
                               portions_per_push=args.portions_per_push)
    result = trainer.fit(ds.x_train, ds.y_train)
    batches = [e for e in result.events if e["event"] == "batch"]
    for e in batches:
        print(f"  portions={portions:<3} backups={backups!s:<5} batch {e['batch']:>2}: "
              f"{e['wall_s'] * 1000:7.1f} ms, portions by replica {e['portions_by_replica']}, "
              f"backups {e['backups']}, rounds {e['rounds']}, recomputed {e['recomputed']}, "
              f"compute ms {fmt(e['compute_s'])}, fetch ms {fmt(e['fetch_s'])}")
    return [e["wall_s"] for e in batches]


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--slow", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--portions-per-push", type=int, default=4)
    parser.add_argument("--samples", type=int, default=48000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    ds = data.synthetic(args.samples, args.features, 10, seed=0)
    with ray_session(args.replicas + 2, object_store_memory=512 * 2**20):
        static = batch_times(ds, args, portions=args.replicas, backups=False)
        dynamic = batch_times(ds, args, portions=10 * args.replicas, backups=True)
    s, d = statistics.median(static), statistics.median(dynamic)
    print(f"replicas={args.replicas} slow replica 0 x{args.slow:g} rows={len(ds.x_train)} "
          f"model={args.features}-{args.hidden}-10")
    print(f"static equal split      : median batch {s * 1000:8.1f} ms over {len(static)} batches")
    print(f"dynamic portions+backups: median batch {d * 1000:8.1f} ms over {len(dynamic)} batches")
    print(f"ratio dynamic/static = {d / s:.2f}")


if __name__ == "__main__":
    main()
