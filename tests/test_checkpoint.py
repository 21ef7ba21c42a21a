"""Checkpoints: atomic writes survive SIGKILL, resume carries versions, bad files fail cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from distbelief.checkpoint import load_arrays, save_arrays
from distbelief.cli import main
from distbelief.ps.optim import Adagrad
from distbelief.ps.shard import ShardCore

WRITER = """
import sys, numpy as np
from distbelief.checkpoint import save_arrays
path, n = sys.argv[1], 0
while True:
    n += 1
    save_arrays(path, {"w": np.full(8_000_000, n, np.float32)}, {"n": str(n)})
    print(n, flush=True)
"""


def test_sigkill_during_checkpoint_writes_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "shard.safetensors"
    save_arrays(path, {"w": np.zeros(8_000_000, np.float32)})
    for delay in (0.3, 0.7, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        arrays = load_arrays(path)  # never a torn file: the old one or a whole new one
        w = arrays["w"]
        assert w.shape == (8_000_000,) and np.all(w == w[0])


def test_shard_save_and_restore_carry_params_state_and_version(tmp_path):
    core = ShardCore(0, np.zeros(6, np.float32), Adagrad(0.1))
    for k in range(3):
        core.push(np.full(6, k + 1.0, np.float32), core.version)
    core.save(str(tmp_path / "s.safetensors"))
    again = ShardCore(0, np.ones(6, np.float32), Adagrad(0.1))
    again.restore(load_arrays(tmp_path / "s.safetensors"), core.version)
    assert again.version == 3
    np.testing.assert_array_equal(again.params, core.params)
    np.testing.assert_array_equal(again.state["accumulator"], core.state["accumulator"])


def cli(argv, capsys):
    try:
        code = main(["train", "--no-progress", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", "--no-progress", "--replicas", "2", "--shards", "2", "--steps", "30",
                 "--run-dir", str(run)]) == 0
    assert not ray.is_initialized()
    return run


def snapshot(run):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes())
            for p in (run / "checkpoints").iterdir()}


def test_resume_continues_the_same_run(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    manifest = json.loads(sorted((run / "checkpoints").glob("checkpoint-*.json"))[-1]
                          .read_text())
    saved = [s["version"] for s in manifest["shards"]]
    assert saved == [60, 60] and manifest["replica_steps"] == {"0": 30, "1": 30}
    code, out = cli(["--replicas", "2", "--shards", "2", "--steps", "50", "--resume", str(run)],
                    capsys)
    assert code == 0, out.err
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    second = events[[e["event"] for e in events].index("final") + 1:]
    placement = next(e for e in second if e["event"] == "placement")
    assert placement["versions"] == saved  # the shards came back at the saved versions
    steps = [e for e in second if e["event"] == "step"]
    assert sorted({e["step"] for e in steps}) == list(range(30, 50))  # replicas resumed at 30
    final = [e for e in second if e["event"] == "checkpoint"][-1]
    assert final["versions"] == [100, 100]
    # the resumed replicas are new incarnations (the shards' ledgers came back with the
    # checkpoint), so their pushes are neither duplicates nor lost: accounting is exact
    [accounting] = [e for e in second if e["event"] == "push_accounting"]
    assert accounting["exact"]
    assert all(a["sent"] == a["applied"] == 40 and a["duplicates"] == a["lost_with_shard"] == 0
               for a in accounting["shards"])


@pytest.mark.parametrize("damage,message", [
    ("truncate", "is corrupt or not safetensors"),
    ("garbage", "is corrupt or not safetensors"),
    ("manifest", "manifest"),
])
def test_corrupt_checkpoint_is_one_line_exit_2_and_untouched(finished_run, tmp_path, capsys,
                                                            damage, message):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    folder = run / "checkpoints"
    shard = sorted(folder.glob("*-shard0.safetensors"))[-1]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "garbage":
        shard.write_bytes(os.urandom(4096))
    else:
        sorted(folder.glob("checkpoint-*.json"))[-1].write_text("{not json")
    before = snapshot(run)
    code, out = cli(["--replicas", "2", "--shards", "2", "--steps", "40", "--resume", str(run)],
                    capsys)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.err
    assert snapshot(run) == before
    assert not ray.is_initialized()


def test_checkpoint_of_a_different_model_is_refused(finished_run, capsys):
    before = snapshot(finished_run)
    code, out = cli(["--replicas", "2", "--shards", "2", "--hidden", "32", "--steps", "40",
                     "--resume", str(finished_run)], capsys)
    assert code == 2
    assert "is of a different model" in out.err and len(out.err.splitlines()) == 1
    code, out = cli(["--replicas", "2", "--shards", "2", "--optimizer", "sgd", "--steps", "40",
                     "--resume", str(finished_run)], capsys)
    assert code == 2 and "resume with the same --optimizer" in out.err
    assert snapshot(finished_run) == before


def test_resume_with_other_replica_count_is_refused_before_starting(finished_run, capsys):
    code, out = cli(["--replicas", "3", "--shards", "2", "--steps", "40",
                     "--resume", str(finished_run)], capsys)
    assert code == 2 and "resume with the same --algorithm and --replicas" in out.err
    assert not ray.is_initialized()


def test_sigterm_checkpoints_and_leaves_no_ray_processes(tmp_path):
    import psutil

    run = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "distbelief.cli", "train", "--no-progress",
                             "--replicas", "2", "--steps", "100000", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    def stepped() -> set[int]:
        """Replicas with a step logged (metrics.jsonl is line-buffered, so events show at
        once; a replica's steps are logged when its checkpointed position moves on)."""
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        events = [json.loads(line) for line in lines if line.endswith("}")]
        return {e["replica"] for e in events if e["event"] == "step"}

    while time.time() < deadline and stepped() != {0, 1}:
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "Ray processes should be running under the driver"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "checkpointed" in err and "Traceback" not in err
    manifest = json.loads(sorted((run / "checkpoints").glob("checkpoint-*.json"))[-1]
                          .read_text())
    assert all(v > 0 for v in manifest["replica_steps"].values())
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]


@pytest.mark.usefixtures("ray_local")  # its 3 runs share one Ray session, as in a notebook
def test_adam_and_schedule_state_survive_resume_exactly(tmp_path, capsys):
    """Adam (amsgrad: four state arrays, one a (1,) step count) with a warm-up/cosine schedule
    on 2 shards, 1 replica (deterministic): 20 steps, then a resume to 40 steps ends exactly
    where a straight 40-step run does (moments, step counts and the schedule's position all
    came back)."""
    common = ["--replicas", "1", "--shards", "2", "--optimizer", "adam", "--lr", "0.01",
              "--optimizer-arg", "amsgrad=true", "--lr-schedule", "warmup:10,cosine:60"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli([*common, "--steps", "40", "--run-dir", str(straight)], capsys)[0] == 0
    assert cli([*common, "--steps", "20", "--run-dir", str(split)], capsys)[0] == 0
    manifest = json.loads(sorted((split / "checkpoints").glob("checkpoint-*.json"))[-1]
                          .read_text())
    assert manifest["state"] == ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    saved = [load_arrays(split / "checkpoints" / s["file"]) for s in manifest["shards"]]
    assert [a["step"].tolist() for a in saved] == [[20.0], [20.0]]

    code, out = cli([*common, "--steps", "40", "--resume", str(split)], capsys)
    assert code == 0, out.err
    last = json.loads(sorted((split / "checkpoints").glob("checkpoint-*.json"))[-1].read_text())
    assert [s["version"] for s in last["shards"]] == [40, 40]
    for entry in last["shards"]:
        assert load_arrays(split / "checkpoints" / entry["file"])["step"].tolist() == [40.0]
    expected = load_arrays(straight / "params.safetensors")
    resumed = load_arrays(split / "params.safetensors")
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=0, atol=1e-6,
                                   err_msg=name)
