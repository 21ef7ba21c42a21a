"""Row-sparse embeddings: replica memory and bytes fetched per step as the table grows.

Run: .venv/bin/python bench/sparse.py [--rows 1e5 1e6 1e7] [--samples 200000] [--steps 100]

For each table size, in one Ray session, the same wide-and-deep model (a deep table of
rows x 8 and a wide table of rows x 1, plus a 64-unit MLP) trains with sparse Downpour SGD
(2 replicas, 2 shards, batches of 1024) on ``--samples`` synthetic click examples whose ids
spread over ``rows`` table rows. After the last step every replica reports its resident
memory (psutil RSS of the replica actor's process) and the bytes it fetched from the
embedding shards (row values + int64 row ids). Printed per size: replica RSS, bytes fetched
per step against what one dense fetch of both tables would move (rows x 9 x 4 bytes), rows
the shards materialised, and test AUC against the hidden model's. Last line: replica RSS
growth from the smallest to the largest table (the goal is <= 1.5x).
"""

from __future__ import annotations

import time

from _common import parser as make_parser
from _common import ray_session

from distbelief.sparse.ctr import synthetic_ctr
from distbelief.sparse.models import WideAndDeep
from distbelief.sparse.trainer import SparseDownpourSGD

MB = 2**20


def run(rows: int, samples: int, steps: int, batch: int) -> dict:
    data = synthetic_ctr(samples, rows, seed=0)
    model = WideAndDeep(rows, data.fields, hidden=64, seed=0)
    trainer = SparseDownpourSGD(model, replicas=2, shards=2, batch_size=batch, steps=steps,
                                lr=0.05, eval_every_s=5.0)
    began = time.perf_counter()
    result = trainer.fit(data.ids_train, data.y_train, data.ids_test, data.y_test)
    counters = list(result.replica_counters.values())
    dense_bytes = sum(s.nominal_bytes for s in trainer.specs)
    fetched = sum(c["bytes_fetched"] for c in counters) / sum(c["sparse_fetches"]
                                                              for c in counters)
    return {"rows": rows, "rss": max(c["rss_bytes"] for c in counters),
            "fetched": fetched, "dense": dense_bytes,
            "materialized": sum(t["materialized"] for s in result.sparse_stats
                                for t in s["tables"].values()),
            "shard_rss": max(s["rss_bytes"] for s in result.sparse_stats),
            "auc": result.test_auc, "truth": data.truth_auc(),
            "wall": time.perf_counter() - began}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--rows", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args()
    with ray_session(4, object_store_memory=512 * MB):
        results = [run(int(r), args.samples, args.steps, args.batch_size) for r in args.rows]
    print(f"samples={args.samples} replicas=2 shards=2 steps/replica={args.steps} "
          f"batch={args.batch_size} tables: deep rows x 8 + wide rows x 1 (float32)")
    print(f"{'rows':>10} {'replica RSS MB':>15} {'fetched/step KB':>16} {'dense fetch MB':>15} "
          f"{'sparse/dense':>13} {'rows made':>10} {'shard RSS MB':>13} {'AUC':>7} "
          f"{'truth':>7} {'wall s':>7}")
    for r in results:
        print(f"{r['rows']:>10.0e} {r['rss'] / MB:>15.1f} {r['fetched'] / 1024:>16.1f} "
              f"{r['dense'] / MB:>15.1f} {r['fetched'] / r['dense']:>13.2e} "
              f"{r['materialized']:>10} {r['shard_rss'] / MB:>13.1f} {r['auc']:>7.4f} "
              f"{r['truth']:>7.4f} {r['wall']:>7.1f}")
    first, last = results[0], results[-1]
    print(f"replica RSS growth {first['rows']:.0e} -> {last['rows']:.0e} rows: "
          f"{last['rss'] / first['rss']:.2f}x (table {last['rows'] / first['rows']:.0f}x larger)")


if __name__ == "__main__":
    main()
