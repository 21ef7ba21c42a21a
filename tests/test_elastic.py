"""Elastic replicas on real Ray (issue 18): a running Downpour job grows 2 -> 4 and shrinks to
1 through the Python API, and grows 2 -> 4 through `distbelief scale`, and keeps its total
work: the same samples as an unchanged run, exact push accounting, accuracy no more than 2
points below that run."""

import json
import subprocess
import sys
import threading
import time

import pytest

from distbelief import DownpourSGD, data, models
from distbelief.checkpoint import read_manifest
from distbelief.cli import main

STEPS = 400  # per replica at the start; 2 x 400 steps end near digits' plateau
CLI_STEPS = 1500  # long enough for a `distbelief scale` process to start on 2 cores


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def events_in(run_dir):
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_for(events, what, alive):
    """Wait (while ``alive()``) until some event of ``events()`` satisfies ``what``."""
    while alive():
        if any(what(e) for e in events()):
            return
        time.sleep(0.05)
    raise AssertionError("the run ended first")


def stepped(replicas):
    return lambda e: e["event"] == "step" and e["replica"] in replicas


def assert_scaled_and_exact(events, steps_each=STEPS, slots=2, shrunk_to_one=True):
    scales = [(e["from"], e["to"]) for e in events if e["event"] == "scale"]
    assert scales == ([(2, 4), (4, 1)] if shrunk_to_one else [(2, 4)])
    grown, *shrunk = [e for e in events if e["event"] == "scale"]
    assert grown["replicas"] == [0, 1, 2, 3]
    stopped = sorted(e["replica"] for e in events if e["event"] == "replica_stopped")
    if shrunk_to_one:
        assert shrunk[0]["replicas"] == [0] and stopped == [1, 2, 3]
    else:
        assert stopped == []
    steps = [e for e in events if e["event"] == "step"]
    assert {e["replica"] for e in steps} == {0, 1, 2, 3}
    assert len(steps) == slots * steps_each  # the fixed work: no step more, none less
    [accounting] = [e for e in events if e["event"] == "push_accounting"]
    assert accounting["exact"]
    for a in accounting["shards"]:
        assert a["sent"] == a["applied"] == slots * steps_each  # n_push 1: a push a step
        assert a["lost_with_shard"] == a["dropped"] == a["rejected"] == 0


def assert_same_samples(run_dir, steps=STEPS):
    """The final checkpoint: every slot ran all its steps (its batches, once each)."""
    manifest = read_manifest(run_dir, max(int(p.stem.split("-")[1]) for p in
                                          (run_dir / "checkpoints").glob("checkpoint-*.json")))
    assert manifest["replica_steps"] == {"0": steps, "1": steps}
    assert manifest["work"] == {"0": [], "1": []}


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "distbelief.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def refused(capsys, *args) -> str:
    """`distbelief ARGS` run in this process (no Ray, no torch import to pay again): its one
    line on stderr, having exited with code 2."""
    capsys.readouterr()
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_cli_scales_a_running_run_and_refuses_bad_requests_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, "-m", "distbelief.cli", "train", "--replicas", "2", "--shards", "1",
         "--steps", str(CLI_STEPS), "--n-fetch", "1", "--n-push", "1", "--eval-every", "0.2",
         "--num-cpus", "6", "--slow-replica", "0:3", "--slow-replica", "1:3",  # time to ask
         "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        alive = lambda: train.poll() is None  # noqa: E731
        wait_for(lambda: events_in(run_dir), stepped({0, 1}), alive)
        proc = cli("scale", str(run_dir), "--replicas", "4")
        assert proc.returncode == 0, proc.stderr
        assert "at least one replica" in refused(capsys, "scale", str(run_dir), "--replicas",
                                                 "0")
        wait_for(lambda: events_in(run_dir), lambda e: e["event"] == "scale", alive)
        out, err = train.communicate(timeout=180)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 0, err[-3000:]
    assert "final test_accuracy=" in out
    # the shrink is the API test's; here the two unslowed replicas finish the work sooner
    assert_scaled_and_exact(events_in(run_dir), CLI_STEPS, shrunk_to_one=False)
    assert_same_samples(run_dir, CLI_STEPS)
    # the run is over
    assert "not a running run" in refused(capsys, "scale", str(run_dir), "--replicas", "2")
    assert "not a running run" in refused(capsys, "scale", str(tmp_path / "nowhere"),
                                          "--replicas", "2")


@pytest.mark.usefixtures("ray_local")
def test_api_grows_a_running_job_to_four_and_shrinks_it_to_one(digits, tmp_path):
    def trainer(run_dir=None, slow=None):
        return DownpourSGD(models.mlp(digits.features, 64, 10, 0), replicas=2, shards=1,
                           steps=STEPS, n_fetch=1, n_push=1, seed=5, eval_every_s=0.2,
                           run_dir=run_dir, slow_replicas=slow or {})

    unchanged = trainer().fit(digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    elastic = trainer(tmp_path, {0: 3.0, 1: 3.0})  # slowed: time to scale it twice
    with pytest.raises(Exception, match="no run in progress"):
        elastic.scale(replicas=4)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=elastic.fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)))
    thread.start()
    events = lambda: elastic.job.events if elastic.job else []  # noqa: E731
    wait_for(events, stepped({0, 1}), thread.is_alive)
    elastic.scale(replicas=4)
    wait_for(events, stepped({2, 3}), thread.is_alive)
    elastic.scale(replicas=1)
    thread.join(timeout=180)
    result = outcome["r"]
    assert_scaled_and_exact(result.events)
    assert_same_samples(tmp_path)
    # asynchronous runs of one seed differ by a few test images; scaling loses nothing more
    assert result.test_accuracy >= unchanged.test_accuracy - 0.02 - 1e-9
    assert not (tmp_path / "running.json").exists()
