"""Resource limits as input errors: what a run asks for against what the machine (or the
cluster) has, checked before any actor starts.

Every check is a pure function of the request and a :class:`Resources` figure, so it is tested
with small fake figures; :meth:`Resources.local` and :meth:`Resources.from_ray` measure the
real ones. A request that cannot fit is a one-line :class:`UserError` naming what was asked,
what is available and the fix; one that fits but runs badly (more replicas than cores) is a
one-line warning the caller prints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from distbelief import storage
from distbelief.errors import UserError

BYTES_PER_VALUE = 4  # parameters, gradients and optimizer state are float32
REPLICA_COPIES = 3  # a replica holds parameters, gradients and a push accumulator
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2}
# synthetic data: float32 inputs, then the float64 teacher's (n, 2f) pre-activations and their
# tanh while labelling (4 + 16 + 16 bytes a feature), plus 8-byte labels held twice
SYNTHETIC_BYTES_PER_FEATURE, SYNTHETIC_BYTES_PER_ROW = 36, 16
DATA_COPIES = 2  # in-memory data: the driver's arrays and the object store's copy
OVERSUBSCRIBE_LIMIT = 8  # more than this many replica processes a core is refused
STORE_DATA_COPIES = 4  # the object store holds in-memory data and the replicas' parts of it
STORE_REPLICA_COPIES = 3  # a replica's push in flight, a fetch's replies and an early fetch
STORE_SPARE_COPIES = 16  # the evaluator's fetch, checkpoints, snapshots, restarts
STORE_MIN, STORE_SHARE = 128 * 2**20, 0.3  # at least this; at most Ray's own default share


@dataclass(frozen=True)
class Resources:
    """What a run can use: ``memory`` bytes available, ``cpus`` cores, and whether these are
    a Ray cluster's (``cluster``: actors beyond its logical CPUs would wait forever)."""

    memory: int
    cpus: float
    cluster: bool = False

    @classmethod
    def local(cls) -> Resources:
        """This machine: available memory (psutil) and the cores this process may run on."""
        import psutil

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(int(psutil.virtual_memory().available), float(cores or os.cpu_count() or 1))

    @classmethod
    def from_ray(cls, resources: Mapping[str, float]) -> Resources:
        """A cluster's ``ray.available_resources()`` (or ``cluster_resources()``): its ``CPU``
        count and ``memory`` bytes (the heap Ray may give tasks and actors)."""
        return cls(int(resources.get("memory", 0)), float(resources.get("CPU", 0)), True)


def human(nbytes: float) -> str:
    """``1.5 GB``: bytes in the largest unit that keeps the number >= 1 (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.3g} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.3g} TB"


def where(res: Resources) -> str:
    return "the cluster has" if res.cluster else "this machine has"


def optimizer_slots(optimizer: str) -> int:
    """Values of state a shard keeps per parameter for ``optimizer`` (unknown names: 2)."""
    return OPTIMIZER_SLOTS.get(optimizer, 2)


def model_bytes(parameters: int, replicas: int, slots: int) -> int:
    """Bytes a Downpour run holds for a model of ``parameters`` float32 values: each replica's
    :data:`REPLICA_COPIES` (split over its partitions, so partitions add none), one copy on
    the shards (split over them, so shards add none), ``slots`` optimizer values per
    parameter there, and the driver's model."""
    return parameters * BYTES_PER_VALUE * (REPLICA_COPIES * replicas + 1 + slots + 1)


def check_model(parameters: int, replicas: int, optimizer: str, res: Resources) -> None:
    """Refuse a model whose copies (:func:`model_bytes`) exceed ``res.memory``."""
    slots = optimizer_slots(optimizer)
    need = model_bytes(parameters, replicas, slots)
    if need > res.memory:
        raise UserError(
            f"the model's {parameters:,} parameters need {human(need)} with --replicas "
            f"{replicas} and --optimizer {optimizer} ({REPLICA_COPIES} copies a replica, the "
            f"shards' copy and {slots} optimizer value(s) a parameter, float32), but "
            f"{where(res)} {human(res.memory)} available: use fewer --replicas, a smaller "
            "model, or a cluster (--address) with more memory")


def limited_store(data: int, parameters: int, replicas: int, memory: int) -> int:
    """Object-store size for an embedded run: ``data`` bytes of in-memory data
    (:data:`STORE_DATA_COPIES`) and the parameter-sized objects live at once
    (:data:`STORE_REPLICA_COPIES` a replica and :data:`STORE_SPARE_COPIES`), at least
    :data:`STORE_MIN` and at most :data:`STORE_SHARE` of ``memory`` (beyond that Ray refuses
    to start; a store too small for a moment's objects spills them to disk). No larger than
    that: each process faults every page of the store in the first time it passes through
    it, which a 17M-parameter MLP's short runs paid at 64 copies (BENCHMARKS.md, 2026-12-07)."""
    copies = STORE_REPLICA_COPIES * replicas + STORE_SPARE_COPIES
    want = STORE_DATA_COPIES * data + copies * parameters * BYTES_PER_VALUE
    return int(max(STORE_MIN, min(want, STORE_SHARE * memory)))


def synthetic_bytes(samples: int, features: int) -> int:
    """Peak bytes of generating and holding ``--dataset synthetic`` of that size."""
    return samples * (SYNTHETIC_BYTES_PER_FEATURE * features + SYNTHETIC_BYTES_PER_ROW)


def check_synthetic(samples: int, features: int, res: Resources) -> None:
    """Refuse ``--samples`` x ``--features`` of synthetic data beyond ``res.memory``."""
    need = synthetic_bytes(samples, features)
    if need > res.memory:
        most = res.memory // synthetic_bytes(1, features)
        raise UserError(
            f"--samples {samples:,} of {features} features need {human(need)} to generate, "
            f"but {where(res)} {human(res.memory)} available: pass --samples {most:,} or "
            "fewer, or write the data to a folder (distbelief.ondisk) and pass --dataset DIR")


def check_data(name: str, nbytes: int, res: Resources) -> None:
    """Refuse an in-memory data set of ``nbytes`` whose :data:`DATA_COPIES` exceed memory."""
    need = DATA_COPIES * nbytes
    if need > res.memory:
        raise UserError(
            f"--dataset {name} holds {human(nbytes)}, {human(need)} with the object store's "
            f"copy, but {where(res)} {human(res.memory)} available: write it to a folder "
            "(distbelief.ondisk.write_chunks) and pass --dataset DIR, which replicas read "
            "from disk")


def check_cpus(replicas: int, partitions: int, shards: int, res: Resources) -> str | None:
    """A warning line when replica processes (``replicas * partitions``) outnumber the cores
    (they run time-shared, and slower than with one a core), ``None`` when they fit.

    Refused: more than :data:`OVERSUBSCRIBE_LIMIT` processes a core, and on a cluster more
    actors (replica processes and shards, one logical CPU each) than its CPUs, since Ray
    would leave the rest waiting forever.
    """
    procs = replicas * partitions
    cpus = res.cpus
    if res.cluster and procs + shards > cpus:
        raise UserError(
            f"--replicas {replicas} x --partitions {partitions} and --shards {shards} need "
            f"{procs + shards} CPUs but the cluster has {cpus:g}: pass fewer --replicas or "
            "--shards, or add nodes")
    if procs > OVERSUBSCRIBE_LIMIT * cpus:
        raise UserError(
            f"--replicas {replicas} x --partitions {partitions} = {procs} processes on "
            f"{cpus:g} cores is over {OVERSUBSCRIBE_LIMIT} a core: pass --replicas "
            f"{max(1, int(cpus) // partitions)} (one a core) or run on a cluster (--address)")
    if procs > cpus:
        return (f"warning: --replicas {replicas} x --partitions {partitions} = {procs} "
                f"processes share {cpus:g} cores: each runs at about {cpus / procs:.2g} of a "
                f"core; --replicas {max(1, int(cpus) // partitions)} gives each its own")
    return None


def check_run_dir(path: str | os.PathLike[str]) -> None:
    """Refuse a ``--run-dir`` that is a file or cannot be created, without creating it; a
    URL (``s3://``) must take a probe object (:func:`~distbelief.storage.check_writable`)."""
    if storage.is_url(path):
        storage.check_writable(str(path))
        return
    run_dir = storage.local_path(path)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file: give the path of a folder")
    parent = run_dir
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"--run-dir {run_dir} cannot be created: {parent} is a file; give a "
                        "path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        verb = "written" if parent == run_dir else "created"
        raise UserError(f"--run-dir {run_dir} cannot be {verb}: no write permission in "
                        f"{parent}; pick a folder you can write to")
