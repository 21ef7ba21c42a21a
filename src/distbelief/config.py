"""Training configuration: one dataclass whose fields carry their section, help and flag.

Each field of :class:`TrainConfig` names its section (``data``, ``model``, ``parallelism``,
``downpour``, ``sandblaster``, ``run``) and its help text in its metadata. The command line
(:mod:`distbelief.cli`) and ``--config FILE.toml`` (one table per section) are generated
from them, so a new option is one field. Attribute access stays flat (``cfg.n_fetch``).
:meth:`TrainConfig.validate` checks every field, then :meth:`TrainConfig.resolve` decides
every automatic default, in one place, before any actor starts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from distbelief.config_checks import check_fields
from distbelief.devices import DEVICES, PRECISIONS, check_cuda_here
from distbelief.errors import UserError
from distbelief.formats import is_ctr_file

ALGORITHMS = ("downpour", "sandblaster")
# --optimizer names with a meaning of their own (distbelief.ps.optim.OPTIMIZERS); any
# element-wise torch.optim class name works too
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "adam", "adamw", "rmsprop")
DATASETS = ("digits", "mnist", "synthetic", "ctr")
ADAPTIVE = ("adam", "adamw", "rmsprop", "nadam", "radam", "adamax")  # --lr defaults to 0.001
MODELS = ("mlp", "lc", "cnn")  # built-in; --model MODULE:CALLABLE names a user factory
PARTITION_BY = ("auto", "space", "layers")
GRAD_DTYPES = ("float32", "float16", "bfloat16")  # wire formats, see distbelief.ps.codec
SPLITS = ("epoch", "fixed")  # how training rows are dealt to replicas, see data.ReplicaSampler
PORTIONS_PER_REPLICA = 10  # Sandblaster's portions per batch per replica unless --portions
SECTIONS = {
    "data": "what to train on",
    "model": "the model the command line builds",
    "parallelism": "replicas, parameter-server shards, model partitions",
    "downpour": "Downpour SGD (asynchronous mini-batch SGD)",
    "sandblaster": "Sandblaster L-BFGS (batch L-BFGS over portions)",
    "run": "algorithm, run folder, checkpoints, cluster, evaluation",
}


def option(default=None, *, section: str, help: str, factory=None, **meta) -> typing.Any:
    """A config field: ``default`` (or ``factory()``), its ``section`` and ``help`` text.

    ``meta`` may add ``flag`` (a flag other than ``--`` + the dashed name), ``choices``,
    ``metavar``, ``example`` (a ``KEY:VALUE`` flag's example), and ``auto``/``ctr``/``mnist``
    (what a ``None`` default resolves to for most data, click data and ``--dataset mnist``).
    """
    meta.update(section=section, help=help)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything a training run needs; each field's metadata holds its section and help.

    ``steps`` counts mini-batches per replica (warm-start steps included, on replica 0);
    ``lr`` is the server-side learning rate; ``eval_every_s`` is the least wall-clock
    period of held-out evaluations, in seconds (Downpour: ``eval_budget`` may space them
    more); ``hidden=0`` makes the CLI's model a softmax regression. Fields left ``None``
    (and ``portions=0``) are automatic: :meth:`resolve` fills them.
    """

    # data
    dataset: str = option("digits", section="data", choices=DATASETS,
                          metavar="|".join(DATASETS) + "|FILE.npz|DIR",
                          help="digits, mnist (5,000 real 28x28 digits, needs the data "
                               "extra), synthetic, ctr (click data), a .npz file's path, or a "
                               "data folder (python -m distbelief.ondisk writes one)")
    samples: int | None = option(section="data", auto=10000, ctr=2_000_000,
                                 help="synthetic, ctr: examples")
    features: int = option(32, section="data", help="synthetic: columns")
    classes: int = option(10, section="data", help="synthetic: classes")
    rows: int = option(1_000_000, section="data",
                       help="ctr: rows of each embedding table (may far exceed memory)")
    batch_size: int | None = option(section="data", auto=32, ctr=1024, help="mini-batch rows")
    data_split: str = option("epoch", section="data", choices=SPLITS,
                             help="downpour: epoch deals each epoch a fresh permutation of all "
                                  "rows to the replicas; fixed keeps each replica on its own "
                                  "rows (the paper's data shards)")
    # model
    model: str = option("mlp", section="model", choices=MODELS,
                        metavar="|".join(MODELS) + "|MODULE:CALLABLE",
                        help="mlp, lc (two locally connected layers and a linear readout), cnn "
                             "(a small image CNN), or your factory MODULE:CALLABLE returning an "
                             "nn.Module (MODULE: importable name or a .py file's path)")
    model_args: list[str] = option(section="model", factory=list, flag="--model-arg",
                                   metavar="KEY=VALUE",
                                   help="a keyword argument of --model MODULE:CALLABLE "
                                        "(repeatable; values are Python literals or text)")
    hidden: int = option(64, section="model",
                         help="hidden units of the MLP (0: softmax regression)")
    channels: int = option(8, section="model", help="lc: channels of each locally connected layer")
    # parallelism
    replicas: int = option(2, section="parallelism", help="model replicas")
    shards: int = option(2, section="parallelism", help="parameter-server shards")
    shard_backups: int = option(0, section="parallelism", metavar="N",
                                help="downpour: hot standbys per shard; a dead shard fails over "
                                     "to one and loses no push (0: restart from checkpoint)")
    partitions: int = option(1, section="parallelism",
                             help="split each replica's model over K partition actors")
    partition_by: str = option("auto", section="parallelism", choices=PARTITION_BY,
                               help="space (within layers: blocks of units), layers (stages), "
                                    "auto (the partition planner picks one for the model)")
    slow_replicas: dict[int, float] = option(
        section="parallelism", factory=dict, flag="--slow-replica", metavar="INDEX:FACTOR",
        example="0:4", help="make a replica slower (repeatable)")
    device: str = option("cpu", section="parallelism", choices=DEVICES,
                         help="where replicas compute: cpu, cuda, or auto (cuda where the "
                              "replica's process sees a GPU; cpu when --gpus-per-replica is 0)")
    precision: str = option("float32", section="parallelism", choices=PRECISIONS,
                            help="what replicas compute forward in: float32, or bfloat16 "
                                 "(torch.autocast: products and convolutions in bfloat16; "
                                 "parameters, gradients and shards stay float32; Downpour)")
    gpus_per_replica: float = option(0.0, section="parallelism",
                                     help="GPUs Ray reserves for each replica (fractions share "
                                          "one GPU; > 0 with --device cuda); shards stay on CPU")
    # downpour
    optimizer: str | None = option(
        section="downpour", metavar="NAME", auto="adagrad", ctr="adagrad", mnist="adam",
        help="the shards' update rule: " + ", ".join(OPTIMIZERS) + " (adagrad is DistBelief's), "
             "or any element-wise torch.optim class by name (e.g. NAdam, Adagrad)")
    lr: float | None = option(section="downpour", auto=0.05,
                              help="server-side learning rate; 0.001 for adaptive optimizers ("
                                   + ", ".join(ADAPTIVE) + ")")
    momentum: float = option(0.9, section="downpour", help="for --optimizer momentum")
    optimizer_args: dict[str, str] = option(
        section="downpour", factory=dict, flag="--optimizer-arg", metavar="KEY=VALUE", sep="=",
        example="weight_decay=0.01",
        help="an argument of the torch.optim optimizer, e.g. weight_decay=0.01, betas=0.9,0.99, "
             "amsgrad=true (repeatable)")
    lr_schedule: str = option("constant", section="downpour", metavar="SCHEDULE",
                              help="learning-rate schedule keyed on each shard's update count: "
                                   "warmup:N, cosine:T[:FLOOR], step:N:GAMMA, comma-separated "
                                   "(e.g. warmup:100,cosine:5000)")
    steps: int | None = option(section="downpour", auto=300, ctr=450,
                               help="mini-batches per replica")
    warmstart_steps: int = option(0, section="downpour",
                                  help="steps replica 0 runs alone before the others start")
    n_fetch: int = option(1, section="downpour", help="fetch every N steps")
    n_push: int = option(1, section="downpour", help="push every N steps")
    local_update: bool = option(True, section="downpour",
                                help="do not apply gradients locally between fetches")
    grad_dtype: str = option("float32", section="downpour", choices=GRAD_DTYPES,
                             help="gradients on the wire: float32, or float16/bfloat16 (half "
                                  "the bytes); shards keep float32 either way")
    clip_grad_norm: float = option(0.0, section="downpour", metavar="MAX",
                                   help="each replica scales a step's gradient down to L2 norm "
                                        "MAX before it is pushed or accrued; step events record "
                                        "the norm before (0: off; Downpour)")
    max_rejected: int = option(1000, section="downpour",
                               help="abort once the shards rejected more pushes (NaN/inf, "
                                    "bad shape)")
    average: str | None = option(section="downpour", metavar="ema:DECAY|polyak[:K]",
                                 help="keep an average of the parameters on the shards, "
                                      "updated at every update: ema:DECAY (e.g. ema:0.999) or "
                                      "polyak[:K] (uniform mean from update K); evaluations "
                                      "score it and it is the final model (default: off)")
    average_final: bool = option(True, section="downpour",
                                 help="with --average: return and save the last parameters, "
                                      "not the average (periodic evaluations still score it)")
    max_staleness: int | None = option(section="downpour", metavar="K", help="SSP: a replica "
                                       "starts step s once every replica has done s-K steps "
                                       "(0: lockstep; default: unbounded)")
    staleness_lr: bool = option(False, section="downpour", help="divide each push's lr by its "
                                "staleness (shard version at apply - version fetched), if > 1")
    delay_compensation: float = option(0.0, section="downpour", metavar="LAMBDA", help="DC-ASGD"
                                       ": push g + LAMBDA*g*g*(w_now - w_fetched); each shard "
                                       "keeps every replica's last fetch (memory: replicas x "
                                       "model over all shards; 0: off)")
    backup_workers: int | None = option(section="downpour", metavar="B",
                                        help="synchronous SGD (Chen et al. 2016): each update "
                                             "of a shard waits for the first replicas - B "
                                             "gradients of its version and drops the rest; "
                                             "--steps counts updates (0: wait for all; "
                                             "default: off, asynchronous)")
    # sandblaster
    iterations: int = option(40, section="sandblaster", help="L-BFGS iterations at most")
    portions: int = option(0, section="sandblaster",
                           help=f"portions per batch (0: {PORTIONS_PER_REPLICA} per replica)")
    portions_per_push: int = option(4, section="sandblaster",
                                    help="accepted portions a replica sums before staging them")
    history: int = option(10, section="sandblaster", help="L-BFGS m (pairs kept)")
    l2: float = option(1e-4, section="sandblaster", help="weight of the l2/2 |x|^2 term")
    backups: bool = option(True, section="sandblaster",
                           help="no backup copies of unfinished portions")
    # run
    algorithm: str = option("downpour", section="run", choices=ALGORITHMS,
                            help="the training algorithm")
    seed: int = option(0, section="run", help="seed of data, model and sampling")
    run_dir: str | None = option(section="run", metavar="DIR",
                                 help="output folder or fsspec URL, e.g. s3://bucket/run "
                                      "(default runs/<time>; with --resume, its folder)")
    resume: str | None = option(section="run", metavar="RUN_DIR",
                                help="continue the run in RUN_DIR (path or URL) from its "
                                     "newest checkpoint, on any --shards count")
    checkpoint_every_s: float = option(
        0.0, section="run", flag="--checkpoint-every", metavar="SECONDS",
        help="seconds between shard checkpoints (downpour 0: only at the end and on Ctrl-C; "
             "sandblaster: after the first iteration that many seconds after the last, so 0 "
             "is every iteration)")
    eval_every_s: float = option(0.5, section="run", flag="--eval-every", metavar="SECONDS",
                                 help="least seconds between held-out evaluations "
                                      "(downpour: see --eval-budget) and between its "
                                      "rejection checks")
    # evaluation off the critical path (downpour: an evaluator actor, issue 16)
    # 3%, not 5%: at 5% the 17M MLP's evaluations cost it 6-7% of its throughput (their
    # passes also slow the replicas beside them); at 3%, 3% in the median of six runs
    # (BENCHMARKS.md, 2026-12-07)
    eval_budget: float = option(0.03, section="run", metavar="FRACTION",
                                help="downpour: most of the job's CPU time (its cores x "
                                     "wall time) the evaluator actor may spend evaluating "
                                     "(with --eval-every as the least period between "
                                     "evaluations, the later one wins)")
    eval_rows: int = option(1000, section="run", metavar="ROWS",
                            help="downpour: test rows (a fixed seeded sample) scored during "
                                 "training; the final evaluation scores the whole test set")
    address: str | None = option(section="run", metavar="HOST:PORT",
                                 help="Ray cluster to join (command line: default "
                                      "$RAY_ADDRESS, else an embedded local Ray)")
    num_cpus: int | None = option(section="run",
                                  help="embedded Ray's logical CPUs (default: one per actor, "
                                       "at least 2)")

    @property
    def click_data(self) -> bool:
        """Whether ``dataset`` is click data (``ctr`` or a .npz of ids/labels)."""
        return self.dataset == "ctr" or is_ctr_file(self.dataset)

    def validate(self, *, command_line: bool = False) -> TrainConfig:
        """Raise :class:`UserError` naming the first bad field's flag and the fix, then
        :meth:`resolve` the automatic defaults; returns self.

        Path fields may be given as :class:`os.PathLike` (``pathlib.Path``); they become
        ``str`` here, so the config stays JSON-ready.
        """
        check_fields(self, flag)
        self.resolve(command_line=command_line)
        if self.warmstart_steps > self.steps:
            raise UserError(f"{flag('warmstart_steps')} ({self.warmstart_steps}) exceeds "
                            f"{flag('steps')} ({self.steps}): warm-start steps are part of "
                            "replica 0's steps, so pass a smaller value")
        check_cuda_here(self.device, self.gpus_per_replica, self.address)
        return self

    @property
    def quorum(self) -> int | None:
        """With ``--backup-workers B``: the gradients each synchronous update waits for,
        ``replicas - B``; None when updates are asynchronous."""
        return None if self.backup_workers is None else self.replicas - self.backup_workers

    @property
    def sync_end(self) -> int | None:
        """With ``--backup-workers``: the shards' version at which the run ends (``steps``
        synchronous updates); None when updates are asynchronous."""
        return None if self.backup_workers is None else self.steps

    @property
    def ranged_updates(self) -> bool:
        """Whether the shards apply pushes to gathered rows or ranges (row-sparse tables of
        click data, model-parallel Downpour partitions), which only NumPy rules can."""
        return self.click_data or (self.partitions > 1 and self.algorithm == "downpour")

    def update_rule(self, rows: bool | None = None):
        """The shards' update rule (``--optimizer``, ``--lr``, ``--momentum``,
        ``--optimizer-arg``, ``--lr-schedule``), for dense slices or, with ``rows`` (default
        :attr:`ranged_updates`), for gathered rows; a one-line :class:`UserError` if bad."""
        from distbelief.ps.optim import make_rule

        rows = self.ranged_updates if rows is None else rows
        return make_rule(self.optimizer, self.lr, self.momentum, self.optimizer_args,
                         self.lr_schedule, rows=rows)

    def resolve(self, *, command_line: bool = False) -> TrainConfig:
        """Fill every automatic default in place; the one place they are decided. Returns
        self; resolving again changes nothing (pass the unresolved config to derive a run
        with other replicas or shards).

        - ``samples``, ``batch_size``, ``steps``, ``optimizer``, ``lr`` left ``None``: the
          field's ``auto`` value, its ``ctr`` value for click data (:attr:`click_data`), its
          ``mnist`` value for ``--dataset mnist`` (Adam: a CNN on real MNIST reaches 0.95 with
          it, Adagrad at 0.05 did not); ``lr`` is 0.001 for the :data:`ADAPTIVE` optimizers.
        - ``portions`` 0: ``PORTIONS_PER_REPLICA`` per replica (Sandblaster caps it at the
          training rows).
        - ``num_cpus`` ``None``: one logical CPU per actor, ``replicas * partitions +
          shards * (1 + shard_backups)``, at least 2 (used by an embedded Ray only).
        - ``run_dir`` ``None``: the ``resume`` folder; else, on the command line
          (``command_line=True``), ``runs/<local time>`` (the Python API keeps none).
        - ``address`` ``None``: on the command line, ``$RAY_ADDRESS`` (else embedded).
        - ``device`` ``auto`` with ``gpus_per_replica`` 0: ``cpu`` (a replica Ray gives no
          GPU sees none); with GPUs, each replica picks cuda if its process sees one.

        ``partition_by="auto"`` depends on the model; the partition planner
        (``distbelief.modelpar``) decides it.
        """
        self._fill_automatic()
        if self.portions == 0:
            self.portions = PORTIONS_PER_REPLICA * self.replicas
        if self.device == "auto" and self.gpus_per_replica == 0:
            self.device = "cpu"
        if self.num_cpus is None:
            self.num_cpus = max(2, self.replicas * self.partitions
                                + self.shards * (1 + self.shard_backups))
        if self.run_dir is None:
            self.run_dir = self.resume
        if command_line:
            if self.run_dir is None:
                self.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
            if self.address is None:
                self.address = os.environ.get("RAY_ADDRESS") or None
        return self

    def _fill_automatic(self) -> None:
        kind = "ctr" if self.click_data else "mnist" if self.dataset == "mnist" else "auto"
        for f in dataclasses.fields(self):  # ``optimizer`` before ``lr``, which depends on it
            if "auto" in f.metadata and getattr(self, f.name) is None:
                value = f.metadata.get(kind, f.metadata["auto"])
                adaptive = f.name == "lr" and self.optimizer.lower() in ADAPTIVE
                setattr(self, f.name, 0.001 if adaptive else value)

    def to_dict(self) -> dict:
        """A flat JSON-ready copy (slow-replica keys become strings), as in config.json."""
        out = dataclasses.asdict(self)
        out["slow_replicas"] = {str(k): v for k, v in self.slow_replicas.items()}
        return out


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def flag(name: str) -> str:
    """The command-line flag of a config field: ``n_fetch`` -> ``--n-fetch``; a field's
    ``flag`` metadata names another (``--eval-every``); a boolean on by default is
    ``--no-...``."""
    f = FIELDS.get(name)
    if f is not None and "flag" in f.metadata:
        return f.metadata["flag"]
    if f is not None and f.default is True:
        return "--no-" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


@functools.cache
def field_type(name: str) -> type:
    """The value type of field ``name``: int, float, str, bool, dict or list (``None``
    aside)."""
    hint = typing.get_type_hints(TrainConfig)[name]
    if isinstance(hint, types.UnionType):  # ``int | None``
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return typing.get_origin(hint) or hint

