"""Shard failover with hot standbys (--shard-backups) and exact push accounting (issue 18).

Every fault is a real process killed with SIGKILL (its pid from the actor); no mocks.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest
import ray

from distbelief import DownpourSGD, cluster, data, models
from distbelief.ps.shard import ParameterShard


@pytest.fixture(scope="module")
def ray_six():
    """One embedded Ray session for the module: 2 shards x 2 copies and 2 replicas."""
    cluster.connect(num_cpus=6, object_store_memory=256 * 2**20)
    yield
    ray.shutdown()


pytestmark = pytest.mark.usefixtures("ray_six")


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def trainer(ds, backups=1, replicas=1, steps=300, **kw):
    """One replica fetching and pushing every step: a deterministic order of pushes."""
    return DownpourSGD(models.mlp(ds.features, 32, ds.classes, 0), replicas=replicas,
                       shards=2, shard_backups=backups, n_fetch=1, n_push=1, steps=steps,
                       seed=3, **kw)


def fit(t, ds):
    return t.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)


@pytest.fixture(scope="module")
def unfaulted(digits):
    """The same run without standbys and without faults: the bit-exact reference."""
    return fit(trainer(digits, backups=0), digits)


def by_event(result, name):
    return [e for e in result.events if e["event"] == name]


def actor(name, alive):
    while alive():
        try:
            return ray.get_actor(name)
        except ValueError:
            time.sleep(0.02)
    raise AssertionError(f"{name} never appeared")


def fit_killing(t, ds, victim_of, after_version=100):
    """Fit ``t`` in a thread; SIGKILL the process of actor ``victim_of(t, alive)`` once
    shard 1 has applied ``after_version`` pushes."""
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=fit(t, ds)))
    thread.start()
    shard = actor(t.actor_name("shard", 1), thread.is_alive)
    while ray.get(shard.stats.remote())["version"] < after_version and thread.is_alive():
        time.sleep(0.01)
    victim = victim_of(t, thread.is_alive)
    os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
    thread.join(timeout=240)
    return outcome["r"]


def primary(i):
    def find(t, alive):
        directory = actor(t.actor_name("directory", 0), alive)
        return ray.get(directory.get.remote(i))
    return find


def assert_nothing_lost(result, sent):
    [accounting] = by_event(result, "push_accounting")
    assert accounting["exact"]
    for a in accounting["shards"]:
        assert a["sent"] == sent and a["lost_with_shard"] == 0 and a["dropped"] == 0
        assert a["sent"] == a["applied"] + a["rejected"] + a["dropped"]
    return accounting["shards"]


def assert_same_params(a, b):
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert np.array_equal(a.params[name], b.params[name]), name


def test_sigkilled_primary_fails_over_to_its_standby_and_loses_nothing(digits, unfaulted):
    result = fit_killing(trainer(digits), digits, primary(1))
    assert [e["shard"] for e in by_event(result, "shard_failed")] == [1]
    [promoted] = by_event(result, "shard_promoted")
    assert promoted["shard"] == 1 and promoted["version"] >= 100
    assert not by_event(result, "shard_restored")  # no checkpoint was needed
    assert_nothing_lost(result, 300)
    assert all(s["version"] == 300 for s in result.shard_stats)
    # the same pushes in the same order, each applied once: bit-equal parameters
    assert_same_params(result, unfaulted)
    assert result.test_accuracy == unfaulted.test_accuracy


def test_sigkilled_standby_is_replaced_and_the_run_goes_on(digits, unfaulted):

    def standby_of_shard_1(t, alive):  # standbys 1 and 2 belong to shards 0 and 1
        return actor(t.actor_name("standby", 2), alive)

    result = fit_killing(trainer(digits), digits, standby_of_shard_1)
    assert [e["shard"] for e in by_event(result, "standby_failed")] == [1]
    assert [e["standbys"] for e in by_event(result, "standby_started")] == [[3]]
    assert all(s["standbys"] == 1 for s in result.shard_stats)
    assert not by_event(result, "shard_failed")
    assert_nothing_lost(result, 300)
    assert_same_params(result, unfaulted)


def test_sigkilled_replica_keeps_the_push_accounting_exact(digits):
    t = trainer(digits, backups=0, replicas=2, steps=200)

    def replica_1(t, alive):
        return actor(t.actor_name("replica", 1), alive)

    result = fit_killing(t, digits, replica_1, after_version=150)
    [failed] = by_event(result, "replica_failed")
    assert failed["replica"] == 1
    [accounting] = by_event(result, "push_accounting")
    assert accounting["exact"]
    for a in accounting["shards"]:
        # the dead incarnation's pushes count up to the last each shard took; none lost
        assert a["sent"] == a["applied"] + a["rejected"] + a["dropped"]
        assert a["lost_with_shard"] == a["dropped"] == 0
        assert a["applied"] == result.shard_stats[a["shard"]]["version"]
    assert all(c["pushes"] > 0 for c in result.replica_counters.values())


def test_a_primary_keeps_its_standby_bit_equal_and_a_promoted_one_takes_resends_once():
    init = np.linspace(-1, 1, 50, dtype=np.float32)
    first, standby = (ParameterShard.remote(0, init, "adagrad", 0.1) for _ in range(2))
    ray.get(first.push.remote(np.ones(50, np.float32), 0, 0, pid=(0, 1, 1)))
    assert ray.get(first.attach.remote(standby)) == 1  # a copy of what it holds now
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(5)]
    for seq, g in enumerate(grads, 2):
        assert ray.get(first.push_fetch.remote(g, 0, 0, pid=(0, 1, seq)))[0]
    [a, b] = ray.get([first.fetch.remote(), standby.fetch.remote()])
    assert a[0] == b[0] == 6 and np.array_equal(a[1], b[1])
    os.kill(ray.get(first.pid.remote()), signal.SIGKILL)
    ray.get(standby.promote.remote())
    assert ray.get(standby.push.remote(grads[-1], 0, 0, pid=(0, 1, 6)))  # a resend
    version, values = ray.get(standby.fetch.remote())
    assert version == 6 and np.array_equal(values, b[1])
    assert ray.get(standby.stats.remote())["ledger"] == {"0:1": [6, 6, 0, 1, 0]}
    ray.kill(standby)
