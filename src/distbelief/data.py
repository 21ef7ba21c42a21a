"""Datasets (shipped real data and a seeded synthetic generator) and per-replica sampling.

Nothing here downloads: ``digits`` is scikit-learn's bundled 8x8 handwritten digits
(1797 images, 10 classes) and ``synthetic`` is generated from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distbelief.errors import UserError

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
    """The dataset called ``name``: ``digits`` or ``synthetic`` (sized by the other args)."""
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic(samples, features, classes, seed)
    raise UserError(f"--dataset {name!r} is unknown: choose digits or synthetic")


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
    """Mini-batches for one replica, a pure function of (seed, replica, step).

    Each epoch over the replica's rows uses a fresh seeded permutation; the last partial
    batch of an epoch is dropped. ``batch(k)`` gives the k-th mini-batch's row indices,
    so a restarted replica resumes exactly where it stopped.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int, replica: int) -> None:
        if len(indices) == 0:
            raise UserError(f"replica {replica} got no training rows: pass fewer --replicas")
        self.indices = np.asarray(indices)
        self.batch_size = min(batch_size, len(indices))
        self.per_epoch = len(indices) // self.batch_size
        self.seed = seed
        self.replica = replica
        self._epoch, self._perm = -1, self.indices

    def batch(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.replica, epoch])
            self._epoch, self._perm = epoch, self.indices[rng.permutation(len(self.indices))]
        return self._perm[k * self.batch_size: (k + 1) * self.batch_size]
