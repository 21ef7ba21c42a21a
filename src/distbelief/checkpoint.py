"""Tensors as safetensors (on a local disk or any :mod:`distbelief.storage` URL), written
atomically and read without unpickling; numbered checkpoints of a run, re-sharded on read
when the run resumes on another shard count (:mod:`distbelief.reshard`)."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Mapping, Sequence

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from distbelief import storage
from distbelief.errors import UserError
from distbelief.reshard import reshard_dense, reshard_rows

__all__ = ["KEEP", "MANIFEST", "latest_checkpoint", "load_arrays", "load_checkpoint",
           "load_row_shard", "load_row_shards", "load_shard", "read_manifest", "save_arrays",
           "shard_file", "write_manifest"]


def save_arrays(path: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None) -> str:
    """Write ``arrays`` to ``path`` (a path or URL) atomically, so a crash leaves old or new."""
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    storage.write_bytes(path, save(contiguous, metadata=dict(metadata or {})))
    return str(path)


def load_arrays(path: str | os.PathLike, with_metadata: bool = False):
    """Read a safetensors file (path or URL); a missing or corrupt file is a
    :class:`UserError`. ``with_metadata``: also its metadata dict."""
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist: check the path") from None
    except IsADirectoryError:
        raise UserError(f"checkpoint {path} does not exist: check the path") from None
    try:
        arrays = load(data)
        metadata = _metadata(data)
    except (SafetensorError, OSError, ValueError, struct.error) as err:
        raise UserError(f"checkpoint {path} is corrupt or not safetensors ({err}): "
                        "use another checkpoint") from None
    return (arrays, metadata) if with_metadata else arrays


def _metadata(data: bytes) -> dict:
    """A safetensors file's ``__metadata__`` (its header is 8 bytes of length, then JSON)."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]).get("__metadata__") or {}


MANIFEST = "checkpoint-{:06d}.json"
KEEP = 2  # complete checkpoints kept in a run folder


def shard_file(run_dir: str | os.PathLike, number: int, shard: int, kind: str = "shard") -> str:
    """Shard ``shard``'s file of checkpoint ``number`` (``kind="rowshard"``: its embedding
    rows): a path, or a URL when the run folder is one."""
    return storage.join(run_dir, "checkpoints", f"{number:06d}-{kind}{shard}.safetensors")


def write_manifest(run_dir: str | os.PathLike, number: int, versions: Sequence[int], plan,
                   state_names: Sequence[str], extra: Mapping) -> str:
    """Name a complete set of shard files (written before this) as checkpoint ``number``.

    The manifest is written last and atomically, so a crash at any moment leaves the
    previous complete checkpoint as the newest one a resume finds. Older sets beyond
    ``KEEP`` are deleted.
    """
    folder = storage.join(run_dir, "checkpoints")
    manifest = {
        "checkpoint": number, "time": time.time(),
        "shards": [{"file": storage.basename(shard_file(run_dir, number, i)), "version": int(v)}
                   for i, v in enumerate(versions)],
        "tensors": [[t.name, list(t.shape)] for t in plan.tensors],
        "bounds": list(plan.bounds), "state": list(state_names), **extra,
    }
    path = storage.join(folder, MANIFEST.format(number))
    storage.write_bytes(path, json.dumps(manifest, indent=1).encode())
    names = storage.listdir(folder)
    for old in _manifests(names)[:-KEEP]:
        prefix = f"{old:06d}-"
        for f in names:
            if f.startswith(prefix) and f.endswith(".safetensors"):
                storage.remove(storage.join(folder, f))
        storage.remove(storage.join(folder, MANIFEST.format(old)))
    return path


def _manifests(names: Sequence[str]) -> list[int]:
    """The checkpoint numbers of the manifests among file ``names``, ascending."""
    return sorted(int(n[len("checkpoint-"):-len(".json")]) for n in names
                  if n.startswith("checkpoint-") and n.endswith(".json")
                  and n[len("checkpoint-"):-len(".json")].isdigit())


def latest_checkpoint(run_dir: str | os.PathLike, plan, state_names: Sequence[str],
                      scalar_names: Sequence[str] = ()
                      ) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """The newest complete checkpoint of ``run_dir`` for ``plan``'s model: manifest + arrays
    (``scalar_names``: the state arrays of shape ``(1,)``, as :func:`load_checkpoint`),
    re-sharded onto ``plan`` when written with another shard count.

    Raises :class:`UserError` (one line, naming the fix) when there is none, when files are
    missing or corrupt, or when the checkpoint belongs to a different model or optimizer.
    """
    folder = storage.join(run_dir, "checkpoints")
    numbers = _manifests(storage.listdir(folder))
    if not numbers:
        raise UserError(f"--resume {run_dir}: no checkpoint found in {folder}: pass the run "
                        "folder of a run that wrote checkpoints")
    return load_checkpoint(run_dir, numbers[-1], plan, state_names, scalar_names=scalar_names)


def load_checkpoint(run_dir: str | os.PathLike, number: int, plan, state_names: Sequence[str],
                    shards: Sequence[int] | None = None, scalar_names: Sequence[str] = ()
                    ) -> tuple[dict, list[dict[str, np.ndarray] | None]]:
    """Checkpoint ``number`` of ``run_dir``, validated against ``plan``: manifest + arrays.

    ``parts[i]`` holds shard i's ``params``, rule state and any Sandblaster vectors
    (``vec:NAME``); only the shards listed in ``shards`` are returned (the others are None).
    Every array has the slice's shape ``(size,)`` but the rule's ``scalar_names`` (``(1,)``:
    a step count). Each manifest shard entry gains the ``counters`` its file recorded.

    A checkpoint of the same model written with another shard count is read whole and
    re-sharded onto ``plan`` (:func:`~distbelief.reshard.reshard_dense`): the manifest's
    ``bounds`` and ``shards`` then describe ``plan``'s shards (counters start afresh) and
    ``resharded_from`` gives the old count. Errors as for :func:`latest_checkpoint`.
    """
    folder = storage.join(run_dir, "checkpoints")
    path = storage.join(folder, MANIFEST.format(number))
    manifest = read_manifest(run_dir, number)
    tensors = [[t.name, list(t.shape)] for t in plan.tensors]
    if manifest.get("tensors") != tensors:
        raise UserError(f"checkpoint {path} is of a different model: resume with the model "
                        "of the run that wrote it")
    if manifest.get("state") != list(state_names):
        raise UserError(f"checkpoint {path} was written with optimizer state "
                        f"{manifest.get('state')}: resume with the same --optimizer")
    bounds = manifest.get("bounds")
    if not isinstance(bounds, list) or len(bounds) < 2 or bounds[0] != 0 \
            or bounds[-1] != plan.numel or any(a >= b for a, b in zip(bounds, bounds[1:])) \
            or len(manifest.get("shards", [])) != len(bounds) - 1:
        raise UserError(f"checkpoint manifest {path} has damaged shard bounds: delete it to "
                        "fall back to the previous checkpoint")
    resharded = bounds != list(plan.bounds)
    parts: list[dict[str, np.ndarray] | None] = []
    for i, entry in enumerate(manifest["shards"]):
        if shards is not None and i not in shards and not resharded:
            parts.append(None)
            continue
        arrays, metadata = load_arrays(storage.join(folder, entry["file"]), with_metadata=True)
        size = bounds[i + 1] - bounds[i]
        names = ("params", *state_names, *(k for k in arrays if k.startswith("vec:")))
        for name in names:
            n = 1 if name in scalar_names else size
            if name not in arrays or arrays[name].shape != (n,) \
                    or arrays[name].dtype != np.float32:
                raise UserError(f"checkpoint file {entry['file']} lacks a float32 {name!r} of "
                                f"{n} elements: it is damaged, use another checkpoint")
        entry["counters"] = _counters(metadata)
        parts.append(arrays)
    if resharded:
        old = type(plan)(plan.tensors, tuple(bounds))
        try:
            parts, versions = reshard_dense(old, parts, [e["version"] for e in
                                                         manifest["shards"]], plan, scalar_names)
        except ValueError as err:
            raise UserError(f"checkpoint {path} cannot be re-sharded ({err}): use another "
                            "checkpoint") from None
        manifest = {**manifest, "resharded_from": old.shards, "bounds": list(plan.bounds),
                    "shards": [{"file": None, "version": v, "counters": None}
                               for v in versions]}
        parts = [p if shards is None or i in shards else None for i, p in enumerate(parts)]
    return manifest, parts


def read_manifest(run_dir: str | os.PathLike, number: int) -> dict:
    """Checkpoint ``number``'s manifest as written (not validated against a model)."""
    path = storage.join(run_dir, "checkpoints", MANIFEST.format(number))
    try:
        return json.loads(storage.read_bytes(path))
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint manifest {path} is corrupt ({err}): delete it to fall "
                        "back to the previous checkpoint") from None


def load_shard(run_dir: str | os.PathLike, number: int, shard: int, plan,
               state_names: Sequence[str], scalar_names: Sequence[str] = ()) -> dict:
    """Dense shard ``shard``'s part of checkpoint ``number``, as a shard restores it:
    ``{"arrays", "version", "counters"}`` (re-sharded onto ``plan`` if need be)."""
    manifest, parts = load_checkpoint(run_dir, number, plan, state_names, shards=[shard],
                                      scalar_names=scalar_names)
    entry = manifest["shards"][shard]
    return {"arrays": parts[shard], "version": entry["version"], "counters": entry["counters"]}


def load_row_shards(run_dir: str | os.PathLike, number: int, shards: int) -> list[dict]:
    """Every row shard's part of checkpoint ``number`` (its embedding rows) for ``shards``
    row shards, as embedding shards restore them: ``{"arrays", "version"}`` each; the rows
    are regrouped (:func:`~distbelief.reshard.reshard_rows`) when the checkpoint has
    another row-shard count."""
    entries = read_manifest(run_dir, number).get("row_shards", [])
    folder = storage.join(run_dir, "checkpoints")
    parts = [load_arrays(storage.join(folder, e["file"])) for e in entries]
    versions = [int(e["version"]) for e in entries]
    if len(entries) != shards:
        try:
            parts, versions = reshard_rows(parts, versions, shards)
        except ValueError as err:
            raise UserError(f"row checkpoint {number} of {run_dir} cannot be re-sharded "
                            f"({err}): use another checkpoint") from None
    return [{"arrays": a, "version": v} for a, v in zip(parts, versions)]


def load_row_shard(run_dir: str | os.PathLike, number: int, shard: int,
                   shards: int | None = None) -> dict:
    """Row shard ``shard``'s part of checkpoint ``number`` of ``shards`` row shards (None:
    the checkpoint's count), as an embedding shard restores it: ``{"arrays", "version"}``."""
    entries = read_manifest(run_dir, number)["row_shards"]
    if shards is None or shards == len(entries):
        entry = entries[shard]
        return {"arrays": load_arrays(storage.join(run_dir, "checkpoints", entry["file"])),
                "version": int(entry["version"])}
    return load_row_shards(run_dir, number, shards)[shard]


def _counters(metadata: Mapping[str, str]) -> dict | None:
    """The shard counters (JSON in a shard file's metadata) it recorded, if any."""
    text = metadata.get("counters")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None
