"""Tensors on disk as safetensors, written atomically and read without unpickling."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from distbelief.errors import UserError


def save_arrays(path: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``arrays`` to ``path``: temp file, fsync, rename, so a crash leaves old or new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    save_file(contiguous, str(tmp), metadata=dict(metadata or {}))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a safetensors file; a missing or corrupt file is a :class:`UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: check the path")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"checkpoint {path} is corrupt or not safetensors ({err}): "
                        "use another checkpoint") from None


MANIFEST = "checkpoint-{:06d}.json"
KEEP = 2  # complete checkpoints kept in a run folder


def shard_file(run_dir: Path, number: int, shard: int, kind: str = "shard") -> Path:
    """Shard ``shard``'s file of checkpoint ``number`` (``kind="rowshard"``: its embedding
    rows)."""
    return Path(run_dir) / "checkpoints" / f"{number:06d}-{kind}{shard}.safetensors"


def write_manifest(run_dir: Path, number: int, versions: Sequence[int], plan,
                   state_names: Sequence[str], extra: Mapping) -> Path:
    """Name a complete set of shard files (written before this) as checkpoint ``number``.

    The manifest is written last and atomically, so a crash at any moment leaves the
    previous complete checkpoint as the newest one a resume finds. Older sets beyond
    ``KEEP`` are deleted.
    """
    folder = Path(run_dir) / "checkpoints"
    manifest = {
        "checkpoint": number, "time": time.time(),
        "shards": [{"file": shard_file(run_dir, number, i).name, "version": int(v)}
                   for i, v in enumerate(versions)],
        "tensors": [[t.name, list(t.shape)] for t in plan.tensors],
        "bounds": list(plan.bounds), "state": list(state_names), **extra,
    }
    path = folder / MANIFEST.format(number)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in sorted(folder.glob("checkpoint-*.json"))[:-KEEP]:
        number_old = int(old.stem.split("-")[1])
        for f in folder.glob(f"{number_old:06d}-*.safetensors"):
            f.unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(run_dir: str | os.PathLike, plan, state_names: Sequence[str],
                      scalar_names: Sequence[str] = ()
                      ) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """The newest complete checkpoint of ``run_dir`` that fits ``plan``: manifest + arrays
    (``scalar_names``: the state arrays of shape ``(1,)``, as :func:`load_checkpoint`).

    Raises :class:`UserError` (one line, naming the fix) when there is none, when files are
    missing or corrupt, or when the checkpoint belongs to a different model or optimizer.
    """
    folder = Path(run_dir) / "checkpoints"
    manifests = sorted(folder.glob("checkpoint-*.json"))
    if not manifests:
        raise UserError(f"--resume {run_dir}: no checkpoint found in {folder}: pass the run "
                        "folder of a run that wrote checkpoints")
    return load_checkpoint(run_dir, int(manifests[-1].stem.split("-")[1]), plan, state_names,
                           scalar_names=scalar_names)


def load_checkpoint(run_dir: str | os.PathLike, number: int, plan, state_names: Sequence[str],
                    shards: Sequence[int] | None = None, scalar_names: Sequence[str] = ()
                    ) -> tuple[dict, list[dict[str, np.ndarray] | None]]:
    """Checkpoint ``number`` of ``run_dir``, validated against ``plan``: manifest + arrays.

    ``parts[i]`` holds shard i's ``params``, rule state and any Sandblaster vectors
    (``vec:NAME``); only the shards listed in ``shards`` are read (the others are None).
    Every array has the slice's shape ``(size,)`` but the rule's ``scalar_names`` (``(1,)``:
    a step count).
    Each manifest shard entry gains the ``counters`` its file recorded. Errors as for
    :func:`latest_checkpoint`.
    """
    folder = Path(run_dir) / "checkpoints"
    path = folder / MANIFEST.format(number)
    manifest = read_manifest(run_dir, number)
    tensors = [[t.name, list(t.shape)] for t in plan.tensors]
    if manifest.get("tensors") != tensors or manifest.get("bounds") != list(plan.bounds):
        raise UserError(f"checkpoint {path} is of a different model or --shards: resume with "
                        "the model and --shards of the run that wrote it")
    if manifest.get("state") != list(state_names):
        raise UserError(f"checkpoint {path} was written with optimizer state "
                        f"{manifest.get('state')}: resume with the same --optimizer")
    parts: list[dict[str, np.ndarray] | None] = []
    for i, entry in enumerate(manifest["shards"]):
        if shards is not None and i not in shards:
            parts.append(None)
            continue
        arrays = load_arrays(folder / entry["file"])
        size = plan.bounds[i + 1] - plan.bounds[i]
        names = ("params", *state_names, *(k for k in arrays if k.startswith("vec:")))
        for name in names:
            n = 1 if name in scalar_names else size
            if name not in arrays or arrays[name].shape != (n,) \
                    or arrays[name].dtype != np.float32:
                raise UserError(f"checkpoint file {entry['file']} lacks a float32 {name!r} of "
                                f"{n} elements: it is damaged, use another checkpoint")
        entry["counters"] = _counters(folder / entry["file"])
        parts.append(arrays)
    return manifest, parts


def read_manifest(run_dir: str | os.PathLike, number: int) -> dict:
    """Checkpoint ``number``'s manifest as written (not validated against a model)."""
    path = Path(run_dir) / "checkpoints" / MANIFEST.format(number)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint manifest {path} is corrupt ({err}): delete it to fall "
                        "back to the previous checkpoint") from None


def load_shard(run_dir: str | os.PathLike, number: int, shard: int, plan,
               state_names: Sequence[str], scalar_names: Sequence[str] = ()) -> dict:
    """Dense shard ``shard``'s part of checkpoint ``number``, as a shard restores it:
    ``{"arrays", "version", "counters"}``."""
    manifest, parts = load_checkpoint(run_dir, number, plan, state_names, shards=[shard],
                                      scalar_names=scalar_names)
    entry = manifest["shards"][shard]
    return {"arrays": parts[shard], "version": entry["version"], "counters": entry["counters"]}


def load_row_shard(run_dir: str | os.PathLike, number: int, shard: int) -> dict:
    """Row shard ``shard``'s part of checkpoint ``number`` (its embedding rows), as an
    embedding shard restores it: ``{"arrays", "version"}``."""
    entry = read_manifest(run_dir, number)["row_shards"][shard]
    return {"arrays": load_arrays(Path(run_dir) / "checkpoints" / entry["file"]),
            "version": int(entry["version"])}


def _counters(path: Path) -> dict | None:
    """The shard counters (JSON in the file's metadata) a shard file recorded, if any."""
    with safe_open(str(path), framework="np") as fh:
        text = (fh.metadata() or {}).get("counters")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None
