"""ShardCore without Ray: applies good pushes, rejects bad ones, measures staleness."""

import numpy as np
import pytest

from distbelief.ps.optim import SGD
from distbelief.ps.shard import ShardCore


@pytest.fixture
def core():
    return ShardCore(0, np.zeros(4, np.float32), SGD(1.0))


def test_push_applies_and_bumps_version(core):
    assert core.push(np.ones(4, np.float32), fetched_version=0, replica=2)
    version, params = core.fetch()
    assert version == 1 and np.allclose(params, -1.0)
    assert not params.flags.writeable
    assert core.stats()["pushes_by_replica"] == {"2": 1}


@pytest.mark.parametrize("grad,reason", [
    (np.array([1.0, np.nan, 0.0, 0.0], np.float32), "nonfinite"),
    (np.array([1.0, np.inf, 0.0, 0.0], np.float32), "nonfinite"),
    (np.ones(5, np.float32), "shape"),
    (np.ones((2, 2), np.float32), "shape"),
    (np.ones(4, np.float64), "dtype"),
    ([1.0, 1.0, 1.0, 1.0], "type"),
])
def test_bad_push_is_rejected_counted_and_not_applied(core, grad, reason):
    assert not core.push(grad, fetched_version=0)
    version, params = core.fetch()
    assert version == 0 and np.all(params == 0.0)
    stats = core.stats()
    assert stats["rejected"] == {reason: 1} and stats["rejected_total"] == 1
    assert stats["updates"] == 0


def test_staleness_is_version_at_apply_minus_fetched_version(core):
    g = np.ones(4, np.float32)
    core.push(g, 0)  # fresh
    core.push(g, 0)  # one update behind
    core.push(g, 0)  # two behind
    core.push(g, 3)  # fresh again
    assert core.stats()["staleness"] == {"0": 2, "1": 1, "2": 1}
