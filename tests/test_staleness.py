"""Staleness control: SSP's segment bound, staleness-aware lr and DC-ASGD on a shard (pure),
and --max-staleness on real replicas (Ray)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief import DownpourSGD, data, models
from distbelief.errors import UserError
from distbelief.ps.optim import SGD, Adagrad
from distbelief.ps.shard import ShardCore
from distbelief.ps.staleness import StalenessControl, compensate, lr_scale
from distbelief.segments import WorkPool


def test_lr_scale_is_one_over_staleness_at_least_one():
    assert [lr_scale(s) for s in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]


def test_compensate_matches_a_hand_computation():
    g = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    now = np.array([0.3, 1.0, -1.0], dtype=np.float32)
    fetched = np.array([0.1, 1.5, -1.0], dtype=np.float32)
    # g + 0.5 * g^2 * (now - fetched): 1 + 0.5*1*0.2, -2 + 0.5*4*(-0.5), 0.5 + 0
    expected = np.array([1.1, -3.0, 0.5], dtype=np.float32)
    out = np.empty(3, dtype=np.float32)
    np.testing.assert_allclose(compensate(g, now, fetched, 0.5, out), expected, rtol=1e-6)
    np.testing.assert_array_equal(g, [1.0, -2.0, 0.5])  # the pushed gradient is untouched


def shard(rule, control=None, n=3):
    core = ShardCore(0, np.zeros(n, dtype=np.float32), rule)
    core.keep_extras(None, None, control)
    return core


def test_staleness_lr_divides_the_lr_by_the_pushs_staleness():
    core = shard(SGD(0.1), StalenessControl(lr=True))
    g = np.ones(3, dtype=np.float32)
    core.fetch(replica=0)
    core.fetch(replica=1)
    core.fetch(replica=2)
    core.push(g, 0, 0)  # staleness 0: lr 0.1
    core.push(g, 0, 1)  # staleness 1: lr 0.1
    core.push(g, 0, 2)  # staleness 2: lr 0.05
    np.testing.assert_allclose(core.params, -(0.1 + 0.1 + 0.05), rtol=1e-6)
    assert dict(core.staleness) == {0: 1, 1: 1, 2: 1}


def test_staleness_lr_off_by_default_and_adaptive_rules_scale_their_step():
    plain, scaled = shard(Adagrad(0.1)), shard(Adagrad(0.1), StalenessControl(lr=True))
    g = np.array([1.0, -2.0, 3.0], dtype=np.float32)
    for core in (plain, scaled):
        core.push(g, 0, 0)  # staleness 0: the same step
        core.push(g, 0, 0)  # staleness 1: the same step
    np.testing.assert_array_equal(plain.params, scaled.params)
    before = scaled.params.copy()
    plain.push(g, 0, 0)
    scaled.push(g, 0, 0)  # staleness 2: half of plain's step
    np.testing.assert_allclose(scaled.params - before, (plain.params - before) / 2, rtol=1e-6)


def test_delay_compensation_uses_the_replicas_last_fetch_and_states_its_memory():
    lam = 0.5
    core = shard(SGD(1.0), StalenessControl(dc_lambda=lam), n=4)
    version, w0 = core.fetch(replica=0)
    w0 = w0.copy()
    core.fetch(replica=1)
    other = np.array([1.0, 2.0, -1.0, 0.0], dtype=np.float32)
    core.push(other, 0, 1)  # replica 1 had nothing to compensate for: plain SGD
    np.testing.assert_allclose(core.params, -other)
    g = np.array([0.5, -1.0, 2.0, 3.0], dtype=np.float32)
    w_now = core.params.copy()
    core.push(g, version, 0)
    expected = w_now - (g + lam * g * g * (w_now - w0))
    np.testing.assert_allclose(core.params, expected, rtol=1e-6)
    core.fetch(replica=-1)  # the driver's evaluations keep no copy
    assert core.stats()["fetched_copies_bytes"] == 2 * 4 * 4  # replicas x slice float32
    assert shard(SGD(1.0)).stats()["fetched_copies_bytes"] == 0


def check_ssp(order, replicas, steps, k, segment):
    """Drive a WorkPool with max_staleness k, returning replicas in the order ``order``
    picks and feeding every idle one after each return (as the driver does); every segment
    handed out respects the bound and every step runs once."""
    pool = WorkPool.from_done(replicas, steps, {}, segment, max_staleness=k)
    pool.assign(range(replicas))
    running: dict[int, tuple] = {}

    def feed():
        for i in range(replicas):
            if i not in running:
                seg = pool.next(i)
                if seg is not None:
                    last = pool.ran[i] + seg[2] - seg[1] - 1  # the segment's last step
                    assert last - k <= min(pool.ran.values())
                    running[i] = seg
    feed()
    picks = iter(order)
    while running:
        i = sorted(running)[next(picks, 0) % len(running)]
        running.pop(i)
        pool.done(i)
        feed()
    assert pool.left() == 0 and all(v == steps for v in pool.ran.values())


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(0, 50), max_size=400), replicas=st.integers(1, 5),
       steps=st.integers(1, 40), k=st.integers(0, 4), segment=st.integers(1, 10))
def test_ssp_schedule_never_lets_a_replica_run_more_than_k_ahead(order, replicas, steps, k,
                                                                  segment):
    check_ssp(order, replicas, steps, k, segment)


def test_a_removed_worker_no_longer_holds_the_others_back():
    pool = WorkPool.from_done(3, 30, {0: 3, 1: 10, 2: 10}, 10, max_staleness=0)
    pool.assign(range(3))
    assert pool.next(1) is None  # waits for replica 0
    pool.remove(0)
    assert pool.next(1) == (1, 10, 11)  # lockstep with replica 2 only


def test_an_added_worker_starts_level_with_the_slowest():
    pool = WorkPool.from_done(2, 30, {0: 4, 1: 9}, 10, max_staleness=1)
    pool.assign(range(2))
    pool.balance = True
    seg = pool.next(2)  # a scale-up's new worker: may run up to the slowest + K + 1
    assert pool.ran[2] == 4 and seg is not None and seg[2] - seg[1] == 2


def test_unbounded_schedule_is_unchanged():
    pool = WorkPool.from_done(2, 30, {0: 0, 1: 25}, 10)
    pool.assign(range(2))
    assert pool.next(0) == (0, 0, 10) and pool.next(1) == (1, 25, 30)


def ahead_violations(events, k):
    """Steps some replica finished before every replica had finished step s - K - 1 (the
    step it had to wait for): end times of step events, compared across replicas."""
    steps = [e for e in events if e["event"] == "step"]
    ends = {(e["replica"], e["step"]): e["t"] for e in steps}
    replicas = {e["replica"] for e in steps}
    bad = 0
    for e in steps:
        need = e["step"] - k - 1
        if need >= 0 and any(ends[(j, need)] > e["t"] for j in replicas):
            bad += 1
    return bad


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("k", [None, 0, 2])
def test_max_staleness_holds_replicas_to_the_slowest(k):
    ds = data.digits()
    result = DownpourSGD(models.mlp(ds.features, 16, ds.classes, 0), replicas=3, shards=1,
                         lr=0.05, batch_size=16, steps=30, seed=0, max_staleness=k,
                         slow_replicas={0: 4.0}, eval_every_s=60).fit(
        ds.x_train, ds.y_train)
    steps = [e for e in result.events if e["event"] == "step"]
    assert len(steps) == 90
    if k is None:  # unbounded: the slowed replica 0 falls behind the others
        assert ahead_violations(result.events, 0) > 0
    else:
        assert ahead_violations(result.events, k) == 0


def sim(replicas, **kw):
    from torch import nn

    from distbelief.asyncsim import SimConfig, simulate

    ds = data.digits()
    return simulate(models.mlp(ds.features, 16, ds.classes, 0), nn.CrossEntropyLoss(),
                    ds.x_train, ds.y_train, ds.x_test, ds.y_test,
                    SimConfig(replicas, 12, 0.05, eval_every=12, **kw))


def test_simulated_equal_speed_replicas_push_about_r_minus_1_stale():
    plain = sim(4)
    assert plain.updates == 48 and len(plain.curve) == 4
    per_shard = {k: v // 2 for k, v in plain.staleness.items()}  # 2 shards count each push
    assert sum(per_shard.values()) == 48
    assert abs(plain.mean_staleness() - 3) < 0.5  # jitter swaps some pushes, not the mean
    assert sim(4) == plain  # seeded: the same run twice


def test_simulated_shards_take_the_optimizers_arguments():
    plain = sim(2, optimizer="adam")
    assert sim(2, optimizer="adam", optimizer_args=("betas=0.9,0.999",)) == plain  # torch's
    low = sim(2, optimizer="adam", optimizer_args=("betas=0.5,0.999",))
    assert low.staleness == plain.staleness and low.curve != plain.curve
    with pytest.raises(UserError, match="no_such_arg"):
        sim(2, optimizer="adam", optimizer_args=("no_such_arg=1",))


def test_simulated_lockstep_spreads_staleness_over_0_to_r_minus_1():
    lockstep = sim(4, max_staleness=0)
    per_shard = {k: v // 2 for k, v in lockstep.staleness.items()}
    assert set(per_shard) <= {0, 1, 2, 3} and per_shard[0] == 12  # one fresh push a round


def test_simulated_synchronous_sgd_applies_one_mean_per_version_and_drops_the_backups():
    every = sim(4, backup_workers=0)  # 12 synchronous updates, each of all 4 gradients
    assert every.updates == 48 and every.staleness == {0: 96}  # none late, 2 shards
    backups = sim(4, backup_workers=1)  # each version takes the first 3 and drops the 4th
    fresh, late = backups.staleness[0] // 2, sum(v for k, v in backups.staleness.items() if k)
    assert fresh == 12 * 3 and late > 0
    assert backups.updates == fresh + late // 2  # every push either made a quorum or was late
    assert sim(4, backup_workers=1) == backups


@pytest.mark.usefixtures("ray_local")
def test_shard_remedies_run_end_to_end_and_keep_one_fetch_per_replica():
    ds = data.digits()
    result = DownpourSGD(models.mlp(ds.features, 16, ds.classes, 0), replicas=2, shards=2,
                         lr=0.05, batch_size=16, steps=40, seed=0, staleness_lr=True,
                         delay_compensation=1.0, eval_every_s=60).fit(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    for s in result.shard_stats:
        assert s["fetched_copies_bytes"] == 2 * s["size"] * 4  # replicas x slice, float32
        assert s["updates"] == 80 and s["rejected_total"] == 0
    assert result.test_accuracy > 0.5  # it trains (chance is 0.1)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam", "rmsprop"])
def test_scale_equals_a_rule_at_the_scaled_lr(name):
    from distbelief.ps.optim import make_rule

    grads = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    scaled, reference = make_rule(name, 0.1), make_rule(name, 0.025)
    p1, p2 = np.ones(5, dtype=np.float32), np.ones(5, dtype=np.float32)
    s1, s2 = scaled.init_state(5), reference.init_state(5)
    for g in grads:
        scaled.apply(p1, g.copy(), s1, update=0, scale=0.25)
        reference.apply(p2, g.copy(), s2, update=0)
    np.testing.assert_allclose(p1, p2, rtol=1e-6, atol=1e-7)
