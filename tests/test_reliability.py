"""Faults injected into real runs: killed shards, a killed coordinator, a long soak.

See RELIABILITY.md for the whole table of faults and what each loses.
"""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
from support.faults import NaNEvery

from distbelief import DownpourSGD, UserError, data, models
from distbelief.checkpoint import load_checkpoint, shard_file, write_manifest
from distbelief.cli import main
from distbelief.downpour import push_accounting
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ShardCore

# Classes defined here (a loss that turns NaN) travel to Ray workers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def digits():
    return data.digits()


# Pure parts: shard state round trip, one-shard checkpoint loading, push accounting.

def test_shard_checkpoint_carries_counters_and_sandblaster_vectors(tmp_path):
    core = ShardCore(0, np.zeros(5, np.float32), Adagrad(0.1))
    core.push(np.ones(5, np.float32), 0, replica=1)
    core.push(np.full(5, np.nan, np.float32), 0, replica=1)
    core.lincomb("g", [(2.0, "x")])
    core.vector("s0")[:] = 3.0
    (tmp_path / "checkpoints").mkdir()
    core.save(str(shard_file(tmp_path, 1, 0)), ("g", "s0", "y7"))  # y7 does not exist
    plan = ShardPlan.build([("w", (5,))], 1)
    write_manifest(tmp_path, 1, [core.version], plan, ["accumulator"], {})
    manifest, parts = load_checkpoint(tmp_path, 1, plan, ["accumulator"])
    assert sorted(parts[0]) == ["accumulator", "params", "vec:g", "vec:s0"]
    again = ShardCore(0, np.zeros(5, np.float32), Adagrad(0.1))
    entry = manifest["shards"][0]
    again.restore(parts[0], entry["version"], entry["counters"])
    assert again.stats() == core.stats()
    np.testing.assert_array_equal(again.vector("g"), core.vector("g"))
    np.testing.assert_array_equal(again.vector("s0"), np.full(5, 3.0, np.float32))


def test_load_checkpoint_reads_only_the_asked_shard_and_refuses_bad_vectors(tmp_path):
    plan = ShardPlan.build([("w", (6,))], 2)
    (tmp_path / "checkpoints").mkdir()
    cores = [ShardCore(i, np.zeros(3, np.float32), Adagrad(0.1)) for i in range(2)]
    for i, core in enumerate(cores):
        core.save(str(shard_file(tmp_path, 4, i)))
    write_manifest(tmp_path, 4, [0, 0], plan, ["accumulator"], {"algorithm": "downpour"})
    Path(shard_file(tmp_path, 4, 0)).write_bytes(b"damaged")
    _, parts = load_checkpoint(tmp_path, 4, plan, ["accumulator"], shards=[1])
    assert parts[0] is None and parts[1]["params"].shape == (3,)
    from safetensors.numpy import save_file

    save_file({"params": np.zeros(3, np.float32), "accumulator": np.zeros(3, np.float32),
               "vec:g": np.zeros(2, np.float32)}, str(shard_file(tmp_path, 4, 1)))
    with pytest.raises(UserError, match="lacks a float32 'vec:g' of 3 elements"):
        load_checkpoint(tmp_path, 4, plan, ["accumulator"], shards=[1])


def test_push_accounting_splits_sent_into_where_it_went():
    # shard ledgers per replica incarnation: [high seq, applied, rejected, duplicates, gaps]
    first = [{"ledger": {"0:1": [4, 4, 0, 0, 0]}}, {"ledger": {"0:1": [4, 4, 0, 0, 0]}}]
    last = [{"ledger": {"0:1": [4, 4, 0, 0, 0], "0:2": [12, 11, 1, 0, 0],
                        "1:3": [10, 9, 1, 0, 0]}},
            {"ledger": {"0:1": [4, 4, 0, 0, 0], "0:2": [12, 7, 0, 0, 2],
                        "1:3": [10, 5, 1, 0, 2]}}]  # restored from a checkpoint mid-run
    finished = {0: {"incarnation": 2, "pushes": 12, "dropped_by_shard": [0, 1]},
                1: {"incarnation": 3, "pushes": 10, "dropped_by_shard": [0, 2]}}
    healthy, restored = push_accounting(first, last, finished)
    assert healthy == {"shard": 0, "sent": 22, "applied": 20, "rejected": 2, "dropped": 0,
                       "lost_with_shard": 0, "duplicates": 0, "exact": True}
    assert restored == {"shard": 1, "sent": 22, "applied": 12, "rejected": 1, "dropped": 3,
                        "lost_with_shard": 6, "duplicates": 0, "exact": True}


# Downpour: a shard actor killed mid-run.

def by_event(result, name):
    return [e for e in result.events if e["event"] == name]


def fit_killing_shard(trainer, ds, shard, after_checkpoints=0, after_version=50):
    """Fit in a thread; ray.kill shard ``shard`` once ``after_checkpoints`` were written and
    it has applied ``after_version`` pushes."""
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=trainer.fit(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test)))
    thread.start()
    name = trainer.actor_name("shard", shard)
    victim = None
    while victim is None and thread.is_alive():
        try:
            victim = ray.get_actor(name)
        except ValueError:
            time.sleep(0.05)
    while trainer.checkpoints < after_checkpoints and thread.is_alive():
        time.sleep(0.02)
    while ray.get(victim.stats.remote())["version"] < after_version and thread.is_alive():
        time.sleep(0.02)
    time.sleep(0.2)  # it applies more pushes after that checkpoint, then dies
    ray.kill(victim)
    thread.join(timeout=300)
    return outcome["r"]


@pytest.mark.usefixtures("ray_local")
def test_killed_shard_is_restored_from_its_checkpoint_and_accuracy_holds(digits, tmp_path):
    def trainer(run_dir):
        return DownpourSGD(models.mlp(digits.features, 64, 10, 0), replicas=2, shards=2,
                           steps=300, seed=5, checkpoint_every_s=0.3, run_dir=run_dir)

    unfaulted = trainer(None).fit(digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    result = fit_killing_shard(trainer(str(tmp_path / "run")), digits, shard=1,
                               after_checkpoints=2)

    failed, restored = by_event(result, "shard_failed"), by_event(result, "shard_restored")
    assert [e["shard"] for e in failed] == [1] and [e["shard"] for e in restored] == [1]
    before = [e for e in by_event(result, "checkpoint") if e["t"] < failed[0]["t"]][-1]
    # it came back with the newest checkpoint's slice, state and version: what it lost is
    # at most the updates of one checkpoint interval
    assert restored[0]["checkpoint"] == before["number"] >= 2
    assert restored[0]["version"] == before["versions"][1] > 0
    [accounting] = by_event(result, "push_accounting")
    assert accounting["exact"]
    healthy, revived = accounting["shards"]
    assert healthy["applied"] == healthy["sent"] == 600
    assert healthy["dropped"] == healthy["lost_with_shard"] == 0
    assert revived["sent"] == 600 and revived["lost_with_shard"] >= 0 and revived["dropped"] >= 0
    assert revived["sent"] == (revived["applied"] + revived["rejected"] + revived["dropped"]
                               + revived["lost_with_shard"])
    assert revived["lost_with_shard"] + revived["dropped"] > 0  # the kill did cost updates
    counters = result.replica_counters.values()
    assert sum(c["push_dropped"] for c in counters) == revived["dropped"]
    assert all(c["pushes"] == 300 for c in counters)  # no replica died or stopped pushing
    steps = by_event(result, "step")
    assert all(len([e for e in steps if e["replica"] == r]) == 300 for r in (0, 1))
    assert abs(result.test_accuracy - unfaulted.test_accuracy) <= 0.01 + 1e-9


@pytest.mark.usefixtures("ray_local")
def test_shard_killed_before_any_checkpoint_restarts_from_initial_parameters(digits):
    trainer = DownpourSGD(models.mlp(digits.features, 16, 10, 0), replicas=2, shards=2,
                          steps=200, seed=1)  # no run folder: no checkpoints at all
    result = fit_killing_shard(trainer, digits, shard=0)
    [restored] = by_event(result, "shard_restored")
    assert restored["shard"] == 0 and restored["checkpoint"] is None
    assert restored["version"] == 0  # the initial parameters, as documented
    healthy = by_event(result, "push_accounting")[0]["shards"][1]
    assert healthy["applied"] == healthy["sent"] == 400
    assert result.test_accuracy > 0.8  # it trained on from there


# Sandblaster: the coordinator (the driver process) SIGKILLed mid-run, then --resume.

SANDBLASTER = ["train", "--algorithm", "sandblaster", "--replicas", "2", "--shards", "2",
               "--hidden", "0", "--iterations", "14", "--seed", "1", "--no-progress"]


def events(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_accuracy(out: str) -> float:
    return float(out.strip().splitlines()[-1].split()[1].split("=")[1])


def test_killed_coordinator_resumes_from_last_iteration(tmp_path, capsys):
    assert main([*SANDBLASTER, "--run-dir", str(tmp_path / "ref")]) == 0
    unfaulted = final_accuracy(capsys.readouterr().out)

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "distbelief.cli", *SANDBLASTER,
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (
            metrics.exists() and metrics.read_text().count('"event": "checkpoint"') >= 4):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    for child in children:  # what Ray leaves of a SIGKILLed driver, if anything
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    assert not any(e["event"] == "final" for e in events(run))
    newest = sorted((run / "checkpoints").glob("checkpoint-*.json"))[-1]
    at_kill = json.loads(newest.read_text())["lbfgs"]["iteration"]
    assert 4 <= at_kill < 14  # it died mid-run

    assert main([*SANDBLASTER, "--resume", str(run)]) == 0
    resumed = final_accuracy(capsys.readouterr().out)
    after = events(run)  # both processes' events
    [mark] = [e for e in after if e["event"] == "resumed"]
    assert mark["iteration"] == at_kill
    steps = [e["step"] for e in after if e["event"] == "step" and e["t"] > mark["t"]]
    assert steps == list(range(at_kill + 1, 15))  # continued after the last checkpoint
    assert abs(resumed - unfaulted) <= 0.01 + 1e-9

    for wrong, message in ((["--history", "5"], "resume with --history 10"),
                           (["--algorithm", "downpour"], "resume with the same --algorithm")):
        assert main([*SANDBLASTER, *wrong, "--resume", str(run)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err


# Soak: many replicas, thousands of pushes, nothing unaccounted, no memory growth.

def shard_rss(trainer, shards=2) -> list[int]:
    import os

    pids = [ray.get(ray.get_actor(trainer.actor_name("shard", i)).__ray_call__.remote(
        lambda self: os.getpid())) for i in range(shards)]
    return [psutil.Process(pid).memory_info().rss for pid in pids]


@pytest.mark.usefixtures("ray_local")
def test_soak_sixteen_replicas_every_push_accounted_and_memory_flat(digits):
    replicas, steps = 16, 150
    trainer = DownpourSGD(models.mlp(digits.features, 64, 10, 0), loss_fn=NaNEvery(50),
                          replicas=replicas, shards=2, steps=steps, batch_size=8, n_push=1,
                          lr=0.05, eval_every_s=1.0)
    outcome, samples = {}, {}
    thread = threading.Thread(target=lambda: outcome.update(r=trainer.fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)))
    thread.start()
    total = replicas * steps
    while thread.is_alive():
        try:
            version = ray.get(ray.get_actor(trainer.actor_name("shard", 0)).stats.remote())[
                "version"]
        except (ValueError, ray.exceptions.RayActorError):
            time.sleep(0.1)
            continue
        if "early" not in samples and version >= total // 8:
            samples["early"] = shard_rss(trainer)
        if "late" not in samples and version >= total * 7 // 8:
            samples["late"] = shard_rss(trainer)
            break
        time.sleep(0.05)
    thread.join(timeout=300)
    result = outcome["r"]
    sent = sum(c["pushes"] for c in result.replica_counters.values())
    assert sent == total
    for s in result.shard_stats:
        assert s["updates"] + s["rejected_total"] == sent
        assert s["rejected"] == {"nonfinite": replicas * (steps // 50)}
        assert sum(s["pushes_by_replica"].values()) == s["updates"]
    for r, c in result.replica_counters.items():
        assert c["rejected"] == 2 * (steps // 50) and c["push_dropped"] == 0
        assert all(int(s["pushes_by_replica"][str(r)]) == steps - steps // 50
                   for s in result.shard_stats)
    [accounting] = by_event(result, "push_accounting")
    assert all(a["lost_with_shard"] == a["dropped"] == 0 for a in accounting["shards"])
    grown = [late - early for early, late in zip(samples["early"], samples["late"])]
    # flat: keeping one slice (about 2400 float32) per push would add over 16 MB by then
    assert max(grown) < 8 * 2**20, grown
