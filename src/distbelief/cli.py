"""``distbelief train | plot | scale``: the command line over the Python API.

``train``'s flags are generated from :class:`~distbelief.config.TrainConfig`'s fields, one
argument group per config section; ``--config FILE.toml`` sets fields by section and the
flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from distbelief.config import FIELDS, SECTIONS, TrainConfig, field_type, flag
from distbelief.config_file import load_toml
from distbelief.errors import UserError

BENCH_GONE = ("`distbelief bench` is gone: benchmarks are scripts of the source checkout, "
              "run `python bench/NAME.py` there (e.g. python bench/ps.py --help)")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, exit code 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"distbelief: error: {message} (see `{self.prog} --help`)\n")


def _pair(name: str, metavar: str, example: str, sep: str = ":"):
    """The argparse type of mapping field ``name``: ``KEY:VALUE`` (``sep`` between) ->
    ``(key, value)``."""
    key, value = typing.get_args(typing.get_type_hints(TrainConfig)[name])

    def parse(text: str) -> tuple:
        left, found, right = text.partition(sep)
        try:
            if not (found and left.strip() and right.strip()):
                raise ValueError(text)
            return key(left.strip()), value(right.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {metavar}, e.g. {example}"
                                             ) from None

    return parse


def _help(f: dataclasses.Field) -> str:
    """A field's help text with its default, escaped for argparse."""
    meta, text = f.metadata, f.metadata["help"]
    if "auto" in meta:
        text += f" (default {meta['auto']}" + "".join(
            f"; {kind} {meta[kind]}" for kind in ("ctr", "mnist") if kind in meta) + ")"
    elif f.default not in (None, dataclasses.MISSING) and not isinstance(f.default, bool):
        text += f" (default {f.default})"
    return text.replace("%", "%%")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`TrainConfig` field, grouped by section. Every default is
    ``argparse.SUPPRESS``, so the parsed namespace holds only the flags actually given."""
    for section, about in SECTIONS.items():
        group = parser.add_argument_group(section, about)
        for f in FIELDS.values():
            if f.metadata["section"] != section:
                continue
            kind, common = field_type(f.name), {"dest": f.name, "default": argparse.SUPPRESS,
                                                "help": _help(f)}
            if kind is bool:
                action = "store_false" if f.default is True else "store_true"
                group.add_argument(flag(f.name), action=action, **common)
            elif kind is dict:
                parse = _pair(f.name, f.metadata["metavar"], f.metadata["example"],
                              f.metadata.get("sep", ":"))
                group.add_argument(flag(f.name), type=parse, action="append",
                                   metavar=f.metadata["metavar"], **common)
            elif kind is list:
                group.add_argument(flag(f.name), action="append",
                                   metavar=f.metadata["metavar"], **common)
            else:
                choices = "|".join(f.metadata.get("choices", ()))
                group.add_argument(flag(f.name), type=kind,
                                   metavar=f.metadata.get("metavar", choices or None), **common)
        if section == "run":
            group.add_argument("--no-progress", dest="progress", action="store_false",
                               help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distbelief", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a model (Downpour SGD by default)",
                       description="Train a model. Every option is a TrainConfig field.")
    t.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of one table per section below ([data], [downpour], ...; "
                        "keys are the field names, e.g. n_fetch = 2); flags override it")
    add_config_arguments(t)
    p = sub.add_parser("plot", help="(re)draw a run folder's plot.png")
    p.add_argument("run_dir")
    s = sub.add_parser("scale", help="set the replica count of a running Downpour run",
                       description="Ask the Downpour run training into RUN_DIR for N replicas; "
                       "its driver applies it within --eval-every seconds, keeping the run's "
                       "total steps (see README, Elastic replicas).")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--replicas", type=int, required=True, metavar="N")
    return parser


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    """The fields ``train`` sets: the ``--config`` file's, overridden by the flags given."""
    values = load_toml(args.config) if args.config else {}
    given = {k: v for k, v in vars(args).items() if k in FIELDS}
    for name in given:
        if field_type(name) is dict:  # (key, value) pairs of a repeatable flag
            given[name] = dict(given[name])
    return values | given


def train(args: argparse.Namespace) -> int:
    from distbelief import workload

    cfg = TrainConfig(**config_values(args)).validate(command_line=True)
    res = workload.resources(cfg)
    workload.check_resources(cfg, res)  # before anything heavy starts
    if cfg.click_data:  # click data: row-sparse embedding tables, a wide-and-deep model, AUC
        from distbelief.sparse.trainer import train_ctr

        return train_ctr(cfg, progress=args.progress)
    ds = workload.load_data(cfg)
    model = workload.build(cfg, ds.feature_shape, ds.classes, res)
    if cfg.algorithm == "sandblaster":
        from distbelief.sandblaster.trainer import SandblasterLBFGS as Algorithm
    else:
        from distbelief.downpour import DownpourSGD as Algorithm
    trainer = Algorithm(model, config=cfg)
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test, progress=args.progress)
    print(f"run folder: {result.run_dir} (metrics.jsonl, params.safetensors, plot.png)",
          file=sys.stderr)
    clipped = [c["clipped"] for c in result.replica_counters.values() if "clipped" in c]
    print(f"final test_accuracy={result.test_accuracy:.4f} updates={result.updates} "
          f"wall_s={result.wall_s:.1f}" + (f" clipped_steps={sum(clipped)}" if clipped else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `distbelief` program: its process is ours (see without_compiler)
        from distbelief.ps.torchrule import without_compiler

        without_compiler()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        print(f"distbelief: error: {BENCH_GONE}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train(args)
        if args.command == "scale":
            from distbelief.elastic import request_scale

            request_scale(args.run_dir, args.replicas)
            print(f"asked the run in {args.run_dir} for {args.replicas} replicas (applied "
                  "at its next probe; see the scale event in its metrics.jsonl)")
            return 0
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
