"""Tensors on disk as safetensors, written atomically and read without unpickling."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
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
