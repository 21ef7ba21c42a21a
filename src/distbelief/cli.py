"""``distbelief train | plot``: the command line over the Python API."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from distbelief.config import ALGORITHMS, DATASETS, OPTIMIZERS, TrainConfig
from distbelief.errors import UserError
from distbelief.sparse.ctr import CTR_DEFAULTS, is_ctr_file


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, exit code 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"distbelief: error: {message} (see `{self.prog} --help`)\n")


def _slow(text: str) -> tuple[int, float]:
    index, sep, factor = text.partition(":")
    try:
        return int(index), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not INDEX:FACTOR, e.g. 0:4") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    parser = _Parser(prog="distbelief", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a model (Downpour SGD by default)")
    t.add_argument("--algorithm", default=d.algorithm, help=f"one of {', '.join(ALGORITHMS)}")
    t.add_argument("--dataset", default=d.dataset, help=f"one of {', '.join(DATASETS)}")
    t.add_argument("--samples", type=int, default=None,
                   help=f"synthetic, ctr: examples (default {d.samples}; ctr "
                        f"{CTR_DEFAULTS['samples']})")
    t.add_argument("--rows", type=int, default=d.rows,
                   help="ctr: rows of each embedding table (may far exceed memory)")
    t.add_argument("--features", type=int, default=d.features, help="synthetic: columns")
    t.add_argument("--classes", type=int, default=d.classes, help="synthetic: classes")
    t.add_argument("--hidden", type=int, default=d.hidden, help="hidden units of the MLP")
    t.add_argument("--model", default=d.model,
                   help="mlp, or lc: two locally connected layers and a linear readout")
    t.add_argument("--channels", type=int, default=d.channels,
                   help="lc: channels of each locally connected layer")
    t.add_argument("--partitions", type=int, default=d.partitions,
                   help="split each replica's model over K partition actors")
    t.add_argument("--partition-by", default=d.partition_by,
                   help="space (within layers: blocks of units), layers (stages), auto")
    t.add_argument("--replicas", type=int, default=d.replicas, help="model replicas")
    t.add_argument("--shards", type=int, default=d.shards, help="parameter-server shards")
    t.add_argument("--n-fetch", type=int, default=d.n_fetch, help="fetch every N steps")
    t.add_argument("--n-push", type=int, default=d.n_push, help="push every N steps")
    t.add_argument("--optimizer", default=d.optimizer, help=f"one of {', '.join(OPTIMIZERS)}")
    t.add_argument("--lr", type=float, default=d.lr, help="server-side learning rate")
    t.add_argument("--momentum", type=float, default=d.momentum, help="for --optimizer momentum")
    t.add_argument("--batch-size", type=int, default=None,
                   help=f"mini-batch rows (default {d.batch_size}; ctr "
                        f"{CTR_DEFAULTS['batch_size']})")
    t.add_argument("--steps", type=int, default=None,
                   help=f"mini-batches per replica (default {d.steps}; ctr "
                        f"{CTR_DEFAULTS['steps']})")
    t.add_argument("--warmstart-steps", type=int, default=d.warmstart_steps,
                   help="steps replica 0 runs alone before the others start")
    t.add_argument("--no-local-update", dest="local_update", action="store_false",
                   help="do not apply gradients locally between fetches")
    t.add_argument("--data-split", default=d.data_split,
                   help="downpour: epoch deals each epoch a fresh permutation of all rows "
                        "to the replicas (default); fixed keeps each replica on its own "
                        "rows (the paper's data shards)")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--eval-every", dest="eval_every_s", type=float, default=d.eval_every_s,
                   help="seconds between held-out evaluations")
    t.add_argument("--address", default=None,
                   help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, else embedded local)")
    t.add_argument("--num-cpus", type=int, default=None, help="embedded Ray's logical CPUs")
    t.add_argument("--run-dir", default=None, help="output folder (default runs/<time>)")
    t.add_argument("--slow-replica", dest="slow_replicas", type=_slow, action="append",
                   default=[], metavar="INDEX:FACTOR", help="make a replica slower (repeatable)")
    t.add_argument("--grad-dtype", default=d.grad_dtype,
                   help="gradients on the wire: float32, or float16/bfloat16 (half the bytes)")
    t.add_argument("--max-rejected", type=int, default=d.max_rejected,
                   help="abort once the shards rejected more pushes (NaN/inf, bad shape)")
    t.add_argument("--checkpoint-every", dest="checkpoint_every_s", type=float,
                   default=d.checkpoint_every_s,
                   help="seconds between shard checkpoints (downpour 0: only at the end and "
                        "on Ctrl-C; sandblaster: after the first iteration that many seconds "
                        "after the last, so 0 is every iteration)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint")
    t.add_argument("--iterations", type=int, default=d.iterations,
                   help="sandblaster: L-BFGS iterations at most")
    t.add_argument("--portions", type=int, default=d.portions,
                   help="sandblaster: portions per batch (default 10 per replica)")
    t.add_argument("--portions-per-push", type=int, default=d.portions_per_push,
                   help="sandblaster: accepted portions a replica sums before staging them")
    t.add_argument("--history", type=int, default=d.history, help="sandblaster: L-BFGS m")
    t.add_argument("--l2", type=float, default=d.l2,
                   help="sandblaster: weight of the l2/2 |x|^2 term")
    t.add_argument("--no-backups", dest="backups", action="store_false",
                   help="sandblaster: no backup copies of unfinished portions")
    t.add_argument("--no-progress", dest="progress", action="store_false")
    p = sub.add_parser("plot", help="(re)draw a run folder's plot.png")
    p.add_argument("run_dir")
    b = sub.add_parser("bench", help="run bench/NAME.py of this checkout (ps, sync, scale, ...)",
                       add_help=False)
    b.add_argument("name")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def train(args: argparse.Namespace) -> int:
    from distbelief import cluster, data, models

    fields = {k: v for k, v in vars(args).items() if k not in ("command", "progress")}
    fields["slow_replicas"] = dict(fields["slow_replicas"])
    fields["address"] = fields["address"] or cluster.default_address()
    if fields["run_dir"] is None:
        fields["run_dir"] = fields["resume"] or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    sparse = fields["dataset"] == "ctr" or is_ctr_file(fields["dataset"])
    for name, value in (CTR_DEFAULTS if sparse else {}).items():
        fields[name] = value if fields[name] is None else fields[name]
    fields = {k: v for k, v in fields.items() if v is not None or k not in CTR_DEFAULTS}
    cfg = TrainConfig(**fields).validate()
    if sparse:  # click data: row-sparse embedding tables, a wide-and-deep model, AUC
        from distbelief.sparse.trainer import train_ctr

        return train_ctr(cfg, progress=args.progress)
    ds = data.load(cfg.dataset, cfg.samples, cfg.features, cfg.classes, cfg.seed)
    if cfg.model == "lc":
        model = models.lc(ds.features, cfg.channels, ds.classes, cfg.seed)
    else:
        model = models.mlp(ds.features, cfg.hidden, ds.classes, cfg.seed)
    if cfg.algorithm == "sandblaster":
        from distbelief.sandblaster.trainer import SandblasterLBFGS as Algorithm
    else:
        from distbelief.downpour import DownpourSGD as Algorithm
    trainer = Algorithm(model, config=cfg)
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test, progress=args.progress)
    print(f"run folder: {result.run_dir} (metrics.jsonl, params.safetensors, plot.png)",
          file=sys.stderr)
    print(f"final test_accuracy={result.test_accuracy:.4f} updates={result.updates} "
          f"wall_s={result.wall_s:.1f}")
    return 0


def bench(name: str, argv: list[str]) -> int:
    """Run ``bench/NAME.py`` of the repository checkout with ``argv``, as its own script."""
    import runpy

    folder = Path(__file__).resolve().parents[2] / "bench"
    script = folder / f"{name}.py"
    if not script.is_file():
        found = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
        raise UserError(f"no benchmark {name!r} in {folder}: choose one of "
                        f"{', '.join(found) or '(none: run from a source checkout)'}")
    saved = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(folder))  # as `python bench/NAME.py` would: bench helpers import
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train(args)
        if args.command == "bench":
            return bench(args.name, args.bench_args)
        from distbelief.metrics import plot_run

        print(plot_run(args.run_dir))
        return 0
    except UserError as err:
        print(f"distbelief: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("distbelief: interrupted; the shards' state was checkpointed (see --resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
