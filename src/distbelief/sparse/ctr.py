"""A synthetic click-through dataset with a known answer, and CTR-shaped user data (.npz).

``ctr`` draws ``fields`` categorical ids per example, each Zipf-distributed over its own
block of ``rows // fields`` table rows (field ``f`` uses rows ``f * per_field ...``), so one
table of ``rows`` rows serves every field. The label is Bernoulli of a hidden logistic model,
``sigmoid(bias + sum_f w[id_f])``, whose per-row weights ``w`` come from a counter-based hash
of ``(seed, row)``: a table of 1e7 hidden weights costs no memory, and the hidden model's own
test AUC (the best any model can do on these labels) is computable and reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from distbelief.data import TEST_FRACTION
from distbelief.errors import UserError
from distbelief.sparse.table import hash_keys, uniform01

FIELDS = 8
ZIPF_EXPONENT = 1.5  # id popularity ~ 1 / rank**s within each field
WEIGHT_SCALE = 0.6  # std of each hidden per-row weight (sets the truth's AUC, about 0.8)
BIAS = -1.5  # hidden intercept (the click rate also depends on the head ids' weights)
MAX_TEST = 100_000
_WEIGHT_KEY = 0x5EED_C7A  # separates the hidden weights' hash stream from the tables'


@dataclass
class CTRData:
    """Ids int64 ``(n, fields)`` (global table rows), labels float32 ``(n,)`` in {0, 1}.

    ``truth_test`` is the hidden model's click probability for each test example (None for a
    user's file, whose truth is unknown).
    """

    name: str
    rows: int
    ids_train: np.ndarray
    y_train: np.ndarray
    ids_test: np.ndarray
    y_test: np.ndarray
    truth_test: np.ndarray | None = None

    @property
    def fields(self) -> int:
        return int(self.ids_train.shape[1])

    def truth_auc(self) -> float | None:
        """Test AUC of the hidden model that made the labels (None if unknown)."""
        if self.truth_test is None:
            return None
        return auc(self.y_test, self.truth_test)


def zipf_ranks(u: np.ndarray, n: int, s: float = ZIPF_EXPONENT) -> np.ndarray:
    """Ranks in ``0..n-1`` with ``P(rank >= k)`` following a power law of exponent ``s``.

    Inverse CDF of the continuous bounded power law on ``[1, n + 1)``, floored: O(1) memory
    for any ``n`` (no table of ``n`` probabilities). ``u`` are uniforms in [0, 1).
    """
    a = 1.0 - s
    x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, n - 1)


def hidden_weights(rows: np.ndarray, seed: int) -> np.ndarray:
    """The hidden model's weight of each table row (float64, same shape as ``rows``)."""
    u1 = uniform01(hash_keys(seed, _WEIGHT_KEY, rows, 1))
    u2 = uniform01(hash_keys(seed, _WEIGHT_KEY, rows, 2))
    normal = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller
    return WEIGHT_SCALE * normal


def truth_logits(ids: np.ndarray, seed: int) -> np.ndarray:
    """The hidden model's logit for each example of ``ids`` ``(n, fields)``: float64 ``(n,)``."""
    return BIAS + hidden_weights(ids, seed).sum(axis=1)


def synthetic_ctr(samples: int, rows: int, seed: int = 0, fields: int = FIELDS) -> CTRData:
    """``samples`` seeded examples over a table of ``rows`` rows; the same arguments always
    give the same data. The last ``TEST_FRACTION`` (at most ``MAX_TEST``) are the test set."""
    if rows < fields:
        raise UserError(f"--rows {rows} is smaller than the {fields} ctr fields: pass "
                        f"--rows {fields} or more")
    if samples < 10:
        raise UserError(f"--samples {samples} is too few for ctr: pass at least 10")
    per_field = rows // fields
    rng = np.random.default_rng([seed, samples, rows, fields])
    ranks = zipf_ranks(rng.random((samples, fields)), per_field)
    ids = ranks + np.arange(fields, dtype=np.int64) * per_field
    p = 1.0 / (1.0 + np.exp(-truth_logits(ids, seed)))
    labels = (rng.random(samples) < p).astype(np.float32)
    n_test = max(1, min(MAX_TEST, int(samples * TEST_FRACTION)))
    cut = samples - n_test
    return CTRData("ctr", rows, ids[:cut], labels[:cut], ids[cut:], labels[cut:], p[cut:])


def ctr_from_npz(path: str, rows: int) -> CTRData:
    """A user's click data from a ``.npz`` with ``ids`` (integer ``(n, fields)``, each in
    ``0..rows-1``) and ``labels`` (``(n,)``, 0 or 1). A fixed 80/20 split gives the test set.

    Loaded with ``allow_pickle=False``; problems are one-line :class:`UserError` s.
    """
    if not os.path.isfile(path):
        raise UserError(f"--dataset {path}: no such file: check the path")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in ("ids", "labels") if k not in npz.files]
            if missing:
                raise UserError(f"--dataset {path} lacks {', '.join(missing)}: save click data "
                                "as numpy.savez(path, ids=..., labels=...)")
            ids, labels = npz["ids"], npz["labels"]
    except UserError:
        raise
    except (OSError, ValueError) as err:
        raise UserError(f"--dataset {path} is not a readable .npz ({err}): re-save it with "
                        "numpy.savez") from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[1] == 0:
        raise UserError(f"--dataset {path}: ids must be a 2-D integer array (examples, fields), "
                        f"got {ids.dtype} of shape {ids.shape}")
    if labels.ndim != 1 or len(labels) != len(ids):
        raise UserError(f"--dataset {path}: labels must be 1-D with one entry per row of ids "
                        f"({len(ids)}), got shape {labels.shape}")
    if len(ids) < 2:
        raise UserError(f"--dataset {path}: {len(ids)} examples are too few: pass at least 2")
    if not np.issubdtype(labels.dtype, np.number) or not np.isin(labels, (0, 1)).all():
        raise UserError(f"--dataset {path}: labels must be 0 or 1 (clicks)")
    if ids.min() < 0 or ids.max() >= rows:
        raise UserError(f"--dataset {path}: ids span {ids.min()}..{ids.max()} but --rows is "
                        f"{rows}: pass --rows {int(ids.max()) + 1} or more (ids must be >= 0)")
    ids, labels = ids.astype(np.int64), labels.astype(np.float32)
    order = np.random.default_rng(0).permutation(len(ids))
    n_test = max(1, int(len(ids) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return CTRData(path, rows, ids[train], labels[train], ids[test], labels[test])


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count one half).

    Rank-based (Mann-Whitney U): O(n log n), no thresholds. NaN if only one class occurs.
    """
    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))
