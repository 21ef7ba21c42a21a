"""Synchronous SGD with backup workers (--backup-workers): the shard's aggregation (pure),
the flag checks, and real replicas with a straggler (Ray)."""

import threading

import numpy as np
import pytest
import torch

from distbelief import DownpourSGD, data, models
from distbelief.errors import UserError
from distbelief.ps.ledger import PushLedger
from distbelief.ps.optim import SGD, Adagrad
from distbelief.ps.shard import ShardCore
from distbelief.ps.sync import SyncAggregator, check_sync_flags


def sync_shard(quorum, rule=None, n=4):
    core = ShardCore(0, np.ones(n, dtype=np.float32), rule or SGD(0.1))
    core.keep_sync(quorum)
    return core


def grads(k, n=4, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def test_the_mean_of_a_quorum_is_applied_once_and_equals_a_torch_sgd_step():
    core, g = sync_shard(3), grads(4)
    assert core.push(g[0], 0, 0) and core.push(g[1], 0, 1)
    assert core.version == 0 and (core.params == 1).all()  # 2 of 3: nothing applied yet
    assert core.push(g[2], 0, 2)
    assert core.version == 1
    p = torch.ones(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.from_numpy(g[:3]).mean(0)
    opt.step()
    np.testing.assert_allclose(core.params, p.detach().numpy(), rtol=1e-6)
    assert not core.push(g[3], 0, 3)  # the 4th (a backup worker's) is late: dropped
    np.testing.assert_allclose(core.params, p.detach().numpy(), rtol=1e-6)
    sync = core.stats()["sync"]
    assert sync == {"quorum": 3, "accepted": 3, "dropped_late": 1,
                    "dropped_late_by_replica": {"3": 1}, "repeats": 0, "after_end": 0,
                    "updates": 1, "pending": 0}
    assert core.stats()["staleness"] == {"0": 3, "1": 1}  # the drop shows its staleness
    assert core.stats()["pushes_by_replica"] == {"0": 1, "1": 1, "2": 1}


def test_versions_count_updates_and_adaptive_rules_see_one_step_per_update():
    core, ref = sync_shard(2, Adagrad(0.1)), Adagrad(0.1)
    params, state = np.ones(4, dtype=np.float32), ref.init_state(4)
    g = grads(6, seed=1)
    for v in range(3):
        assert core.push(g[2 * v], v, 0) and core.push(g[2 * v + 1], v, 1)
        ref.apply(params, (g[2 * v] + g[2 * v + 1]) / np.float32(2), state, update=v)
        assert core.version == v + 1
    np.testing.assert_allclose(core.params, params, rtol=1e-6)
    assert core.stats()["updates"] == 3 and core.stats()["sync"]["accepted"] == 6


def test_a_replicas_second_gradient_of_a_version_is_dropped():
    core, g = sync_shard(2), grads(3)
    assert core.push(g[0], 0, 5)
    assert not core.push(g[1], 0, 5)  # e.g. replica 5 restarted and computed again
    assert core.version == 0 and core.stats()["sync"]["repeats"] == 1
    assert core.push(g[2], 0, 6) and core.version == 1
    np.testing.assert_allclose(core.params, 1 - 0.1 * (g[0] + g[2]) / 2, rtol=1e-6)


def test_a_duplicate_push_id_is_taken_exactly_once():
    core, g = sync_shard(2), grads(2)
    assert core.push(g[0], 0, 0, pid=(0, 1, 1))
    assert core.push(g[0], 0, 0, pid=(0, 1, 1))  # a resend: answered as before
    assert core.version == 0 and core.stats()["sync"]["accepted"] == 1
    assert core.push(g[1], 0, 1, pid=(1, 1, 1))
    assert core.version == 1
    assert not core.push(g[1], 0, 1, pid=(1, 1, 2))  # version 0 is past: late
    assert core.ledger.to_json() == {"0:1": [1, 1, 0, 1, 0], "1:1": [2, 1, 1, 0, 0]}


def test_a_shard_at_the_runs_end_takes_no_more_gradients():
    core, g = sync_shard(1), grads(3)
    core.keep_sync(1, end=2)
    assert core.push(g[0], 0, 0) and core.push(g[1], 1, 0)
    assert not core.push(g[2], 2, 0)  # a replica that saw another shard before the end
    assert core.version == 2 and core.stats()["sync"]["after_end"] == 1


def test_malformed_pushes_are_rejected_before_they_count():
    core = sync_shard(1)
    assert not core.push(np.full(4, np.nan, dtype=np.float32), 0, 0)
    assert core.version == 0 and core.stats()["rejected"] == {"nonfinite": 1}
    assert core.stats()["sync"]["accepted"] == 0


def test_aggregator_counts_and_restores_its_counters():
    agg = SyncAggregator(2, 3)
    one = np.ones(3, dtype=np.float32)
    assert agg.offer(one, 0, 0) and not agg.full()
    assert not agg.offer(one, 2, 1) and agg.offer(3 * one, 0, 1) and agg.full()
    np.testing.assert_array_equal(agg.mean(), 2 * one)
    agg.clear()
    assert agg.count == 0 and not agg.contributors and (agg.sum == 0).all()
    again = SyncAggregator(2, 3)
    again.restore(agg.counters())
    assert again.counters() == agg.counters()
    with pytest.raises(ValueError):
        SyncAggregator(0, 3)


def test_checkpointed_counters_keep_the_sync_counters_but_not_an_unfinished_sum():
    core, g = sync_shard(2), grads(3)
    core.push(g[0], 0, 0)
    core.push(g[1], 0, 1)
    core.push(g[2], 1, 0)  # pending: one of two
    snap = core.snapshot()
    back = sync_shard(2)
    back.restore(snap["arrays"], snap["version"], snap["counters"])
    assert back.version == 1 and back.stats()["sync"]["accepted"] == 3
    assert back.stats()["sync"]["pending"] == 0  # the unfinished version starts afresh
    assert isinstance(back.ledger, PushLedger)


def test_wait_version_returns_when_the_version_moves_or_times_out():
    core, g = sync_shard(1), grads(1)
    assert core.wait_version(0, 0.01) == 0  # timed out: the current version
    got = []
    waiter = threading.Thread(target=lambda: got.append(core.wait_version(0, 30.0)))
    waiter.start()
    core.push(g[0], 0, 0)
    waiter.join(30)
    assert got == [1]


def test_asynchronous_shards_are_unchanged():
    core = ShardCore(0, np.ones(4, dtype=np.float32), SGD(0.1))
    g = grads(2)
    assert core.push(g[0], 0, 0) and core.push(g[1], 0, 1)
    assert core.version == 2 and "sync" not in core.stats()


@pytest.mark.parametrize("kw, words", [
    ({"backup_workers": -1}, "from 0 to --replicas - 1 = 2"),
    ({"backup_workers": 3}, "from 0 to --replicas - 1 = 2"),
    ({"backup_workers": 1.5}, "from 0 to"),
    ({"backup_workers": 1, "algorithm": "sandblaster"}, "downpour only"),
    ({"backup_workers": 1, "ranged": True}, "dense pushes only"),
    ({"backup_workers": 1, "max_staleness": 2}, "--max-staleness"),
    ({"backup_workers": 1, "staleness_lr": True}, "--staleness-lr"),
    ({"backup_workers": 1, "delay_compensation": 0.5}, "--delay-compensation"),
    ({"backup_workers": 1, "shard_backups": 1}, "--shard-backups"),
    ({"backup_workers": 1, "warmstart_steps": 5}, "--warmstart-steps"),
    ({"backup_workers": 1, "n_fetch": 2}, "--n-fetch 1 and --n-push 1"),
    ({"backup_workers": 0, "n_push": 3}, "--n-fetch 1 and --n-push 1"),
])
def test_bad_backup_workers_flags_are_one_line_errors(kw, words):
    args = {"replicas": 3, "algorithm": "downpour", "ranged": False} | kw
    b = args.pop("backup_workers")
    with pytest.raises(UserError) as err:
        check_sync_flags(b, args.pop("replicas"), args.pop("algorithm"), args.pop("ranged"),
                         **args)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_good_backup_workers_flags_pass():
    check_sync_flags(None, 1, "sandblaster", True, max_staleness=3)  # off: anything goes
    check_sync_flags(0, 1, "downpour", False)
    check_sync_flags(2, 3, "downpour", False)


@pytest.mark.parametrize("argv, message", [
    (["--backup-workers", "2"], "--backup-workers must be an integer from 0 to --replicas - 1"),
    (["--backup-workers", "-1"], "--backup-workers must be an integer from 0"),
    (["--backup-workers", "1", "--n-push", "2"], "--backup-workers needs --n-fetch 1"),
    (["--backup-workers", "1", "--algorithm", "sandblaster"], "downpour only"),
    (["--backup-workers", "1", "--partitions", "2"], "dense pushes only"),
    (["--backup-workers", "0", "--max-staleness", "1"], "--backup-workers with --max-staleness"),
])
def test_cli_refuses_bad_backup_workers_in_one_line(argv, message, tmp_path, capsys):
    import ray

    from distbelief.cli import main

    try:
        code = main(["train", "--replicas", "2", "--run-dir", str(tmp_path / "run"),
                     "--no-progress", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("distbelief: error: ") and message in lines[0]
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


# Real replicas: one Ray session for the module (conftest's ray_local).

def sync_run(replicas, backup, steps, slow=None, **kw):
    ds = data.digits()
    return DownpourSGD(models.mlp(ds.features, 32, ds.classes, 0), replicas=replicas,
                       shards=2, lr=0.1, batch_size=32, steps=steps, seed=0,
                       backup_workers=backup, slow_replicas=slow or {}, eval_every_s=60,
                       **kw).fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)


def steps_by_replica(result):
    out = {}
    for e in result.events:
        if e["event"] == "step":
            out[e["replica"]] = out.get(e["replica"], 0) + 1
    return out


@pytest.mark.usefixtures("ray_local")
def test_a_straggler_does_not_slow_the_synchronous_updates():
    updates = 150
    result = sync_run(3, 1, updates, slow={0: 4.0})
    steps = steps_by_replica(result)
    for s in result.shard_stats:
        agg = s["sync"]
        assert s["version"] == updates and agg["updates"] == updates  # the run's length
        assert agg["quorum"] == 2 and agg["pending"] <= 1
        # every update took exactly 2 gradients (one may wait, unfinished, at the end)
        assert agg["accepted"] == 2 * updates + agg["pending"]
        for r in range(3):  # each gradient a replica computed was taken or dropped
            taken = s["pushes_by_replica"].get(str(r), 0)
            late = agg["dropped_late_by_replica"].get(str(r), 0)
            assert taken + late <= steps[r] <= taken + late + agg["after_end"] + agg["repeats"]
        # replica 0, slowed 4x, was in fewer than half the updates: the others went on
        # without it
        assert s["pushes_by_replica"]["0"] <= steps[0] < 0.5 * updates
    # the fast replicas were in (almost) every update
    assert steps[1] >= 0.9 * updates and steps[2] >= 0.9 * updates
    assert result.test_accuracy > 0.85
    [event] = [e for e in result.events if e["event"] == "sync"]
    assert event["quorum"] == 2 and len(event["shards"]) == 2


@pytest.mark.usefixtures("ray_local")
def test_without_backup_workers_every_update_takes_every_replicas_gradient():
    updates = 60
    result = sync_run(3, 0, updates)
    assert steps_by_replica(result) == {0: updates, 1: updates, 2: updates}  # lockstep
    assert result.updates == updates
    for s in result.shard_stats:
        agg = s["sync"]
        assert s["version"] == updates and agg["quorum"] == 3
        assert agg["accepted"] == 3 * updates and agg["dropped_late"] == 0
        assert agg["repeats"] == agg["after_end"] == agg["pending"] == 0
        assert s["pushes_by_replica"] == {"0": updates, "1": updates, "2": updates}
        assert s["staleness"] == {"0": 3 * updates}
    versions = {}
    for e in result.events:  # each replica's k-th step computed on version k everywhere
        if e["event"] == "step":
            versions.setdefault(e["replica"], []).append(e["versions"])
    for seen in versions.values():
        assert seen == [[k, k] for k in range(updates)]


@pytest.mark.usefixtures("ray_local")
def test_a_killed_replica_rejoins_a_fully_synchronous_run(tmp_path):
    """B = 0: every update waits for the killed replica until its restart pushes."""
    import json
    import time

    import ray

    updates, ds = 60, data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, 32, ds.classes, 0), replicas=2, shards=2,
                          lr=0.1, batch_size=32, steps=updates, seed=0, backup_workers=0,
                          eval_every_s=60, run_dir=tmp_path)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=trainer.fit(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test)))
    thread.start()

    def replica_1_stepped():
        try:
            with open(tmp_path / "metrics.jsonl", encoding="utf-8") as fh:
                events = [json.loads(line) for line in fh if line.endswith("\n")]
        except FileNotFoundError:
            return False
        return any(e["event"] == "step" and e["replica"] == 1 for e in events)

    while thread.is_alive() and not replica_1_stepped():
        time.sleep(0.05)
    ray.kill(ray.get_actor(trainer.actor_name("replica", 1)))
    thread.join(timeout=240)
    result = outcome["r"]
    assert [e["replica"] for e in result.events if e["event"] == "replica_failed"] == [1]
    for s in result.shard_stats:
        agg = s["sync"]
        assert s["version"] == updates and agg["updates"] == updates and agg["pending"] == 0
        assert agg["accepted"] == 2 * updates and agg["dropped_late"] == 0  # 2 a version
        assert s["pushes_by_replica"] == {"0": updates, "1": updates}  # both in every one
