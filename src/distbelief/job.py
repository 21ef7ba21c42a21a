"""One run of a trainer: its folder and event log, progress bar, checkpoint numbering, result.

A :class:`Job` is opened by :meth:`~distbelief.trainer.Trainer.fit` once Ray is up and is
what the driver and its collaborators log to. :class:`Checkpointer` writes numbered
checkpoints through the run's shards (see :mod:`distbelief.ps.group`); :class:`Cadence`
says when something periodic is due.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distbelief import storage
from distbelief.checkpoint import save_arrays
from distbelief.cluster import actor_options
from distbelief.metrics import RunLog, plot_run

ACTOR_NAME_TRIES = 200  # 50 ms apart: how long a dead actor's name may take Ray to free


@dataclass
class TrainResult:
    """What a run produced: final parameters by name and the run's figures."""

    params: dict[str, np.ndarray]
    test_accuracy: float | None
    test_loss: float | None
    updates: int
    wall_s: float
    shard_stats: list[dict]
    replica_counters: dict[int, dict]
    events: list[dict] = field(repr=False)
    run_dir: str | None = None


def node_for(nodes: list[str], index: int) -> str | None:
    """The node that the actor numbered ``index`` within its role is placed on, given the
    live nodes able to run it (``None`` with fewer than two: the scheduler's choice).
    Round-robin by index over the sorted nodes, so replicas and shards spread evenly and a
    restarted actor returns to its node while that node lives; standbys (whose index counts
    from 1 over the run) start one node along, so standby ``k`` of shard ``k - 1`` is off
    its primary's node."""
    if len(nodes) < 2:
        return None
    return sorted(nodes)[index % len(nodes)]


def live_nodes(resource: str = "CPU") -> list[str]:
    """The ids of the cluster's live nodes that have some ``resource``."""
    return [n["NodeID"] for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0]


def actor_name(run_id: str, role: str, index: int) -> str:
    """The Ray actor name of a shard, row shard or replica of run ``run_id``."""
    return f"distbelief-{run_id}-{role}-{index}"


class Job:
    """A run in progress: ``run_dir`` (None: events kept in memory only), the event log, the
    progress bar (with ``progress``), the number of the newest checkpoint (``checkpoint``:
    the one resumed from, 0 for none) and the result.

    ``store`` is where checkpoints go: ``run_dir`` itself, which may be a URL
    (``s3://bucket/prefix``, :mod:`distbelief.storage`); then the events, config, final
    parameters and plot are written to ``run_dir``, a local mirror folder
    (:func:`~distbelief.storage.local_mirror`), and uploaded next to the checkpoints at each
    checkpoint and at the end (:meth:`mirror`)."""

    def __init__(self, run_id: str, algorithm: str, run_dir: str | Path | None,
                 progress: bool = False, checkpoint: int = 0) -> None:
        self.run_id = run_id
        self.algorithm = algorithm
        self.store = None if run_dir is None else str(run_dir)
        if run_dir is not None and storage.is_url(run_dir):
            run_dir = storage.local_mirror(str(run_dir))
            storage.download_events(self.store, run_dir)  # a resume appends to them
        elif run_dir is not None:
            run_dir = storage.local_path(run_dir)
            self.store = str(run_dir)
        self._log = RunLog(run_dir)
        self.run_dir = self._log.run_dir
        self.began = time.time()
        self.checkpoints = checkpoint
        self.accuracy: float | None = None  # the latest test accuracy, shown by the bar
        self._show_progress = progress
        self._bar = None

    @property
    def events(self) -> list[dict]:
        return self._log.events

    def log(self, event: str, **fields) -> dict:
        """Append one event (see :class:`~distbelief.metrics.RunLog`)."""
        return self._log.log(event, **fields)

    def write_json(self, name: str, obj: dict) -> None:
        self._log.write_json(name, obj)

    def elapsed_s(self) -> float:
        return time.time() - self.began

    def actor(self, actor_class, role: str, index: int, *args, options: dict | None = None,
              **kwargs) -> ray.actor.ActorHandle:
        """``actor_class(*args, **kwargs)`` as the actor named ``actor_name(run_id, role,
        index)``, spread over the nodes (with Ray actor ``options`` such as ``num_gpus``);
        retried while a dead predecessor's name is still being freed (Ray frees it
        asynchronously).

        On a cluster of several nodes the actor is placed by :func:`node_for` (a soft node
        affinity: Ray places it elsewhere when that node cannot take it); Ray's own
        ``SPREAD`` is best-effort and, since actors hold no CPU once placed, may put every
        replica on one node."""
        options = actor_options() | dict(options or {})
        if "scheduling_strategy" not in options:
            node = node_for(live_nodes("GPU" if options.get("num_gpus") else "CPU"), index)
            options["scheduling_strategy"] = "SPREAD" if node is None else \
                NodeAffinitySchedulingStrategy(node, soft=True)
        for _ in range(ACTOR_NAME_TRIES):
            try:
                return actor_class.options(name=actor_name(self.run_id, role, index),
                                           **options).remote(*args, **kwargs)
            except ray.exceptions.ActorAlreadyExistsError:
                time.sleep(0.05)
        raise RuntimeError(f"{role} {index}'s actor name is still taken after it died")

    def progress(self, total: int) -> None:
        """Open the progress bar (when asked for) over ``total`` steps."""
        if self._show_progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def tick(self, steps: int, loss: float) -> None:
        """``steps`` more steps done, the last at ``loss``."""
        if self._bar is None:
            return
        self._bar.update(steps)
        rate = self._bar.format_dict.get("rate") or 0.0
        acc = "" if self.accuracy is None else f" acc={self.accuracy:.3f}"
        self._bar.set_postfix_str(f"loss={loss:.3f}{acc} updates/s={rate:.0f}")

    def evaluated(self, scores: dict) -> None:
        """Remember the test accuracy of an evaluation for the progress bar."""
        self.accuracy = scores.get("test_accuracy", self.accuracy)

    def next_checkpoint(self) -> int | None:
        """The number the next checkpoint gets; None when the run has no folder."""
        return None if self.run_dir is None else self.checkpoints + 1

    def finish(self, params: dict[str, np.ndarray], final: dict, updates: int,
               shard_stats: list[dict], counters: dict) -> TrainResult:
        """Log the final event, write params.safetensors and plot.png, build the result."""
        wall = self.elapsed_s()
        self.log("final", updates=updates, wall_s=wall, shard_stats=shard_stats, **final)
        if self.run_dir is not None:
            save_arrays(self.run_dir / "params.safetensors", params,
                        {"updates": str(updates), "algorithm": self.algorithm})
            self._log.close()
            plot_run(self.run_dir)
            self.mirror()
        return TrainResult(params, final.get("test_accuracy"), final.get("test_loss"),
                           updates, wall, shard_stats, counters, self._log.events, self.store)

    def mirror(self) -> None:
        """Upload the local files of a run whose folder is a URL (events, config, final
        parameters, plot) next to its checkpoints; nothing for a local run folder."""
        if self.store is not None and storage.is_url(self.store):
            storage.upload_folder(self.run_dir, self.store)

    def close(self) -> None:
        self._log.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Cadence:
    """Something done every ``every_s`` seconds of wall time (``inf``: never by itself);
    first due now (``due_now``) or ``every_s`` from now."""

    def __init__(self, every_s: float, due_now: bool = False) -> None:
        self.every_s = every_s
        self.at = time.time() if due_now else time.time() + every_s

    def due(self) -> bool:
        return time.time() >= self.at

    def restart(self) -> None:
        """Done now: next due ``every_s`` from now."""
        self.at = time.time() + self.every_s
