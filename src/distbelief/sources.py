"""Where a replica's mini-batches come from, without the driver holding the training set.

Two kinds of source:

- **Rows** (map-style): anything with ``len(source)``, ``source.feature_shape`` and
  ``source.rows(idx) -> (x float32 (k, *feature_shape), y int64 (k,))``. Arrays
  (:class:`ArrayRows`), a torch map-style ``Dataset`` (:class:`TorchRows`) and a data folder
  on disk (:class:`distbelief.ondisk.DiskRows`) all serve rows; a replica draws its batches
  through the same pure, seeded :class:`distbelief.data.ReplicaSampler` as for arrays
  (:func:`sampled_batches`), so a restarted replica resumes at the same batch.
- **Streams**: a factory ``factory(replica, replicas, seed) -> iterable of (x, y) batches``
  that each replica calls for itself (an ``IterableDataset`` behind a ``DataLoader``, a
  generator reading the replica's own files, ...). :func:`replica_stream` checks and
  converts its batches and calls the factory again when an iterable ends (a new epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import count
from typing import Any, Protocol, runtime_checkable

import numpy as np

from distbelief.data import ReplicaSampler
from distbelief.errors import UserError

Batch = tuple[np.ndarray, np.ndarray]
StreamFactory = Callable[[int, int, int], Iterable[Any]]


@runtime_checkable
class Rows(Protocol):
    """A map-style source of training rows (see the module docstring)."""

    feature_shape: tuple[int, ...]

    def __len__(self) -> int: ...

    def rows(self, idx: np.ndarray) -> Batch: ...


class ArrayRows:
    """In-memory arrays ``x (n, *feature_shape)`` and labels ``y (n,)`` as a :class:`Rows`."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = np.asarray(x, np.float32), np.asarray(y, np.int64)
        self.feature_shape = tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)

    def rows(self, idx: np.ndarray) -> Batch:
        return self.x[idx], self.y[idx]


def to_batch(item: Any, where: str) -> Batch:
    """An ``(x, y)`` pair of tensors, arrays or numbers as ``(float32 array, int64 array)``."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise UserError(f"{where} gave a {type(item).__name__}, not an (x, y) pair: return "
                        "features and labels")
    x, y = item
    x, y = (v.detach().cpu().numpy() if hasattr(v, "detach") else v for v in (x, y))
    x, y = np.asarray(x, np.float32), np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer):
        raise UserError(f"{where}: labels are {y.dtype}, not integers: give class indices")
    return x, y.astype(np.int64, copy=False)


class TorchRows:
    """A torch map-style ``Dataset`` (``ds[i] -> (x, y)``, ``len(ds)``) as a :class:`Rows`:
    ``rows(idx)`` fetches the items one by one and stacks them. The dataset travels with it,
    so it should open its files lazily (as torchvision's datasets do)."""

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise UserError(f"a {type(dataset).__name__} is not a map-style Dataset: give "
                            "one with __len__ and __getitem__, or a stream factory")
        if len(dataset) == 0:
            raise UserError("the training Dataset is empty: give it at least one row")
        self.dataset = dataset
        x, _ = to_batch(dataset[0], "Dataset[0]")
        self.feature_shape = tuple(x.shape)

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, idx: np.ndarray) -> Batch:
        items = [to_batch(self.dataset[int(i)], f"Dataset[{int(i)}]") for i in idx]
        x = np.stack([x for x, _ in items]) if items else np.empty((0, *self.feature_shape))
        return x.astype(np.float32, copy=False), np.array([int(y) for _, y in items], np.int64)


def as_rows(data: Any) -> Rows:
    """Arrays ``(x, y)``, a :class:`Rows` or a torch map-style ``Dataset``, as a :class:`Rows`."""
    if isinstance(data, Rows):
        return data
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(a, np.ndarray)
                                                           for a in data):
        return ArrayRows(*data)
    return TorchRows(data)


def sampled_batches(source: Rows, replica: int, replicas: int, batch_size: int, seed: int,
                    split: str = "epoch", start_step: int = 0) -> Iterator[Batch]:
    """Replica ``replica``'s batches from step ``start_step`` on, endlessly: the rows that
    ``ReplicaSampler(len(source), ...)`` picks, read from ``source``."""
    sampler = ReplicaSampler(len(source), replica, replicas, batch_size, seed, split)
    step = start_step
    while True:
        yield source.rows(sampler.batch(step))
        step += 1


def replica_stream(factory: StreamFactory, replica: int, replicas: int, seed: int,
                   feature_shape: tuple[int, ...] | None = None) -> Iterator[Batch]:
    """Replica ``replica``'s batches from its own stream, endlessly: ``factory(replica,
    replicas, seed)`` gives an iterable of ``(x, y)`` batches; when it ends the factory is
    called again (the next epoch). Each batch is converted with :func:`to_batch` and checked
    against ``feature_shape`` (rows ``(k, *feature_shape)``) when given.

    A stream has no step index, so a restarted replica starts a fresh stream.
    """
    where = f"the data factory {getattr(factory, '__name__', type(factory).__name__)}"
    while True:
        try:
            iterable = iter(factory(replica, replicas, seed))
        except Exception as err:
            raise UserError(f"{where}({replica}, {replicas}, {seed}) raised "
                            f"{type(err).__name__}: {' '.join(str(err).split())}: it must "
                            "take (replica, replicas, seed) and return an iterable of "
                            "(x, y) batches") from None
        empty = True
        for item in iterable:
            x, y = to_batch(item, where)
            if x.ndim < 1 or len(x) != len(y) or len(y) == 0:
                raise UserError(f"{where} gave a batch of {x.shape} features and {y.shape} "
                                "labels: give one label per row, at least one row")
            if feature_shape is not None and tuple(x.shape[1:]) != tuple(feature_shape):
                raise UserError(f"{where} gave rows of shape {tuple(x.shape[1:])}, not "
                                f"{tuple(feature_shape)}: batch the rows as (k, "
                                f"{', '.join(map(str, feature_shape))})")
            empty = False
            yield x, y
        if empty:
            raise UserError(f"{where} gave replica {replica} no batches: return a non-empty "
                            "iterable")


def replica_batches(data: Any, y: np.ndarray | None, replica: int, replicas: int,
                    batch_size: int, seed: int, split: str = "epoch", start_step: int = 0
                    ) -> Iterator[Batch]:
    """Replica ``replica``'s batches from step ``start_step`` on, whatever the driver shipped:

    - arrays ``data`` (features) and ``y`` (labels), indexed as they are (no dtype change,
      so click data's integer ids stay ids) with :class:`ReplicaSampler`'s rows;
    - a :class:`Rows` (``y`` None): :func:`sampled_batches`, the same rows as for arrays;
    - a stream factory (``y`` None): :func:`replica_stream` (a restart starts it afresh).
    """
    if y is not None:
        sampler = ReplicaSampler(len(data), replica, replicas, batch_size, seed, split)
        return ((data[idx], y[idx]) for idx in map(sampler.batch, count(start_step)))
    if isinstance(data, Rows):
        return sampled_batches(data, replica, replicas, batch_size, seed, split, start_step)
    return replica_stream(data, replica, replicas, seed)


def source_kind(data: Any, y: np.ndarray | None) -> str:
    """What a replica reads its rows from: ``arrays``, a Rows class name, or ``stream``."""
    if y is not None:
        return "arrays"
    return type(data).__name__ if isinstance(data, Rows) else "stream"
