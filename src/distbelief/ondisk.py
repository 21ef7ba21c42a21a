"""A data set on disk, larger than memory, that each replica reads for itself.

Layout of a data folder ``DIR`` (``--dataset DIR``)::

    DIR/meta.json            {"format": "distbelief-rows", "version": 1, "classes": C,
                              "feature_shape": [F, ...], "x_dtype": "float32",
                              "y_dtype": "int64", "train": [n0, n1, ...], "test": [m0, ...]}
    DIR/train-x-00000.npy    float32 (n0, F, ...)   features of the first n0 training rows
    DIR/train-y-00000.npy    int64   (n0,)          their labels 0..C-1
    DIR/train-x-00001.npy    ...                    the next n1 rows, and so on
    DIR/test-x-00000.npy     float32 (m0, F, ...)   the test split, likewise
    DIR/test-y-00000.npy     int64   (m0,)

Each ``.npy`` is a plain NumPy array file (``numpy.save``); the lists in ``meta.json`` give the
row count of each file in order, so row ``i`` of a split is found without opening any file.
Write it with :func:`write_arrays` (arrays in memory) or :func:`write_chunks` (an iterator of
chunks, so a set larger than memory can be produced piece by piece); ``meta.json`` is written
last, so a folder whose writing was cut short has none and is refused.

:class:`DiskRows` serves rows by global index. Files are checked against ``meta.json`` when it
opens (headers only, ``allow_pickle=False``: a file cannot run code) and memory-mapped per
read, the maps dropped after each gather, so a reader's resident memory stays at about one
batch however large the set is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from distbelief.errors import UserError

FORMAT, VERSION = "distbelief-rows", 1
META = "meta.json"
SPLITS = ("train", "test")
X_DTYPE, Y_DTYPE = np.dtype(np.float32), np.dtype(np.int64)
Chunk = tuple[np.ndarray, np.ndarray]


def file_name(split: str, kind: str, index: int) -> str:
    """``train-x-00003.npy``: the ``kind`` (``x`` or ``y``) file number ``index`` of ``split``."""
    return f"{split}-{kind}-{index:05d}.npy"


def is_data_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a ``meta.json`` (``--dataset DIR``)."""
    return (Path(path) / META).is_file()


def _checked_chunk(x: Any, y: Any, shape: tuple[int, ...] | None, where: str) -> Chunk:
    x = np.ascontiguousarray(x, dtype=X_DTYPE)
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise UserError(f"{where}: labels must be a 1-D integer array, got {y.dtype} of shape "
                        f"{y.shape}")
    if x.ndim < 2 or len(x) != len(y):
        raise UserError(f"{where}: features {x.shape} and labels {y.shape} must have one "
                        "label per row")
    if shape is not None and x.shape[1:] != shape:
        raise UserError(f"{where}: rows of shape {x.shape[1:]}, earlier ones {shape}: give "
                        "every chunk the same row shape")
    if len(y) and y.min() < 0:
        raise UserError(f"{where}: labels must be 0..classes-1, found {int(y.min())}")
    if not np.isfinite(x).all():
        raise UserError(f"{where}: features contain NaN or inf")
    return x, y.astype(Y_DTYPE, copy=False)


def write_chunks(path: str | os.PathLike[str], train: Iterable[Chunk], test: Iterable[Chunk],
                 classes: int | None = None) -> Path:
    """Write the layout above into the new or empty folder ``path``, one file pair per chunk
    ``(x (k, *row_shape), y (k,))`` of ``train`` and ``test``; only one chunk is held at a time.

    ``classes`` defaults to the largest label + 1. Returns the folder.
    """
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder: write the data set to a new "
                        "folder")
    out.mkdir(parents=True, exist_ok=True)
    shape: tuple[int, ...] | None = None
    counts: dict[str, list[int]] = {}
    top = -1
    for split, chunks in zip(SPLITS, (train, test)):
        counts[split] = []
        for i, (x_raw, y_raw) in enumerate(chunks):
            x, y = _checked_chunk(x_raw, y_raw, shape, f"{split} chunk {i}")
            shape = x.shape[1:]
            if len(y) == 0:
                continue
            index = len(counts[split])
            np.save(out / file_name(split, "x", index), x, allow_pickle=False)
            np.save(out / file_name(split, "y", index), y, allow_pickle=False)
            counts[split].append(len(y))
            top = max(top, int(y.max()))
        if not counts[split]:
            raise UserError(f"the {split} split has no rows: give it at least one chunk")
    classes = top + 1 if classes is None else classes
    if classes < 2 or top >= classes:
        raise UserError(f"labels run to {top} but classes is {classes}: labels must be "
                        "0..classes-1 with classes >= 2")
    assert shape is not None
    meta = {"format": FORMAT, "version": VERSION, "classes": classes,
            "feature_shape": list(shape), "x_dtype": X_DTYPE.name, "y_dtype": Y_DTYPE.name,
            **counts}
    tmp = out / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / META)
    return out


def chunked(x: np.ndarray, y: np.ndarray, rows_per_file: int) -> Iterator[Chunk]:
    """``(x, y)`` in consecutive pieces of at most ``rows_per_file`` rows (views, no copy)."""
    for start in range(0, len(x), rows_per_file):
        yield x[start: start + rows_per_file], y[start: start + rows_per_file]


def write_arrays(path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray,
                 x_test: np.ndarray, y_test: np.ndarray, rows_per_file: int = 16384,
                 classes: int | None = None) -> Path:
    """Write in-memory arrays (features ``(n, *row_shape)``, labels ``(n,)``) in the layout
    above, ``rows_per_file`` rows a file."""
    if rows_per_file < 1:
        raise UserError(f"rows_per_file must be >= 1, got {rows_per_file}")
    return write_chunks(path, chunked(x, y, rows_per_file), chunked(x_test, y_test,
                                                                    rows_per_file), classes)


def read_meta(path: Path) -> dict[str, Any]:
    """``DIR/meta.json``, checked for the fields :class:`DiskRows` needs."""
    where = f"--dataset {path}"
    if not path.is_dir():
        raise UserError(f"{where}: no such folder: check the path")
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise UserError(f"{where} has no {META}: write the folder with "
                        "distbelief.ondisk.write_arrays or write_chunks") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{where}: {META} is not readable JSON ({err}): write the folder "
                        "again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != 1:
        raise UserError(f"{where}: {META} is not a {FORMAT} version 1 file: write the folder "
                        "with distbelief.ondisk.write_arrays")
    try:
        shape = tuple(int(d) for d in meta["feature_shape"])
        counts = {s: [int(n) for n in meta[s]] for s in SPLITS}
        classes = int(meta["classes"])
        dtypes = (np.dtype(meta["x_dtype"]), np.dtype(meta["y_dtype"]))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{where}: {META} lacks or garbles {err}: write the folder "
                        "again") from None
    if dtypes != (X_DTYPE, Y_DTYPE) or min(map(min, counts.values()), default=0) < 1:
        raise UserError(f"{where}: {META} must list float32 features, int64 labels and "
                        "positive row counts: write the folder again")
    return {"feature_shape": shape, "classes": classes, **counts}


class DiskRows:
    """The rows of one split (``train`` or ``test``) of a data folder, read on demand.

    ``len(rows)`` rows of shape ``feature_shape``; ``rows(idx)`` gathers any global row
    indices (in any order, across files) as ``(x float32 (k, *feature_shape), y int64 (k,))``.
    Pickles as its path alone, so a Ray actor that receives one opens the files itself.
    """

    def __init__(self, path: str | os.PathLike[str], split: str = "train") -> None:
        if split not in SPLITS:
            raise UserError(f"split {split!r} is unknown: choose train or test")
        self.path, self.split = Path(path), split
        meta = read_meta(self.path)
        self.feature_shape: tuple[int, ...] = meta["feature_shape"]
        self.classes: int = meta["classes"]
        counts = meta[split]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._x = [self._open(file_name(split, "x", i), (n, *self.feature_shape), X_DTYPE)
                   for i, n in enumerate(counts)]
        self._y = [self._open(file_name(split, "y", i), (n,), Y_DTYPE)
                   for i, n in enumerate(counts)]

    def _open(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Path, int]:
        """Check one file's header against meta; its path and the byte offset of its data."""
        file = self.path / name
        where = f"--dataset {self.path}: {name}"
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise UserError(f"{where} is missing: write the folder again") from None
        except (OSError, ValueError) as err:
            raise UserError(f"{where} is not a readable .npy ({' '.join(str(err).split())}): "
                            "write the folder again") from None
        if not isinstance(array, np.memmap):
            raise UserError(f"{where} is not a plain .npy array: write the folder again")
        found = (array.shape, array.dtype, array.flags.c_contiguous)
        offset = int(array.offset)
        del array
        if found != (shape, dtype, True):
            raise UserError(f"{where} holds {found[1]} {found[0]}, but {META} says {dtype} "
                            f"{shape}: write the folder again")
        return file, offset

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return DiskRows, (str(self.path), self.split)

    @property
    def nbytes(self) -> int:
        """Bytes of features and labels of this split on disk (without headers)."""
        per_row = X_DTYPE.itemsize * int(np.prod(self.feature_shape)) + Y_DTYPE.itemsize
        return len(self) * per_row

    def rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``idx`` (int array of global indices, ``0 <= i < len(self)``), in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range 0..{len(self) - 1}")
        x = np.empty((len(idx), *self.feature_shape), X_DTYPE)
        y = np.empty(len(idx), Y_DTYPE)
        files = np.searchsorted(self.starts, idx, side="right") - 1
        for f in np.unique(files):
            at = np.flatnonzero(files == f)
            local = idx[at] - self.starts[f]
            order = np.argsort(local, kind="stable")  # read each file front to back
            n = int(self.starts[f + 1] - self.starts[f])
            x[at[order]] = self._map(self._x[f], (n, *self.feature_shape), X_DTYPE)[local[order]]
            y[at[order]] = self._map(self._y[f], (n,), Y_DTYPE)[local[order]]
        return x, y

    @staticmethod
    def _map(file: tuple[Path, int], shape: tuple[int, ...], dtype: np.dtype) -> np.memmap:
        """A fresh read-only map of one file's data; unmapped when the caller drops it."""
        path, offset = file
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)

    def batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """All rows in order, ``batch_size`` at a time (the last batch may be smaller)."""
        for start in range(0, len(self), batch_size):
            yield self.rows(np.arange(start, min(start + batch_size, len(self))))


def main(argv: list[str] | None = None) -> int:
    """``python -m distbelief.ondisk SOURCE DIR``: write ``digits``, ``mnist`` or a ``.npz``
    (see ``data.from_npz``) as a data folder ``DIR`` for ``--dataset DIR``."""
    import argparse
    import sys

    from distbelief import data

    parser = argparse.ArgumentParser(prog="python -m distbelief.ondisk", description=main.__doc__)
    parser.add_argument("source", help="digits, mnist or the path of a .npz file")
    parser.add_argument("dir", help="a new (or empty) folder to write")
    parser.add_argument("--rows-per-file", type=int, default=16384)
    args = parser.parse_args(argv)
    try:
        if args.source not in ("digits", "mnist") and not args.source.endswith(".npz"):
            raise UserError(f"SOURCE {args.source!r} is unknown: choose digits, mnist or a .npz")
        ds = data.load(args.source)
        out = write_arrays(args.dir, ds.x_train, ds.y_train, ds.x_test, ds.y_test,
                           args.rows_per_file, ds.classes)
    except UserError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(ds.y_train)} training and {len(ds.y_test)} test rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
