"""Row-sparse embedding shards, the client and sparse Downpour on a real embedded Ray."""

import sys
import threading
import time

import numpy as np
import pytest
import ray
import torch

from distbelief.cli import main
from distbelief.errors import UserError
from distbelief.sparse.client import SparseClient
from distbelief.sparse.ctr import auc, synthetic_ctr
from distbelief.sparse.models import WideAndDeep
from distbelief.sparse.shard import EmbeddingShard
from distbelief.sparse.table import TableSpec, initial_rows
from distbelief.sparse.trainer import SparseDownpourSGD

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPECS = [TableSpec("deep", 1000, 3, 0.1, 0), TableSpec("wide", 1000, 1, 0.0, 0)]


@pytest.fixture(scope="module")
def shards(ray_local):
    actors = [EmbeddingShard.remote(i, 3, SPECS, "sgd", 1.0) for i in range(3)]
    yield actors
    for a in actors:
        ray.kill(a)


def test_client_splits_rows_over_shards_and_reassembles_in_order(shards):
    client = SparseClient(shards, SPECS, replica=0)
    rows = np.array([999, 0, 4, 5, 301, 2])
    got = client.fetch_many({"deep": rows, "wide": rows})
    np.testing.assert_array_equal(got["deep"], initial_rows(SPECS[0], rows))
    np.testing.assert_array_equal(got["wide"], np.zeros((6, 1), np.float32))
    grads = np.ones((7, 3), np.float32)
    client.push_many({"deep": (np.append(rows, 4), grads)})  # row 4 twice: summed
    client.wait()
    after = client.fetch_many({"deep": rows})["deep"]
    expect = initial_rows(SPECS[0], rows) - 1.0
    expect[rows == 4] -= 1.0
    np.testing.assert_allclose(after, expect, rtol=1e-6)
    stats = ray.get([s.stats.remote() for s in shards])
    owned = {s["shard"]: s["tables"]["deep"]["materialized"] for s in stats}
    assert owned == {0: 2, 1: 2, 2: 2}  # rows % 3: {999, 0}, {4, 301}, {5, 2}
    assert client.bytes_fetched == 6 * (3 * 4 + 8) + 6 * (1 * 4 + 8) + 6 * (3 * 4 + 8)
    assert client.counters()["sparse_rejected"] == 0


def test_pushes_naming_bad_rows_are_rejected_and_counted(shards):
    client = SparseClient(shards, SPECS, replica=1)
    client.push_many({"deep": (np.array([1000]), np.ones((1, 3), np.float32))})
    client.wait()
    assert client.rejected == 1
    assert "row 1000 is out of range 0..999" in client.last_rejection
    client.push_many({"wide": (np.array([3]), np.full((1, 1), np.inf, np.float32))})
    client.wait()
    assert client.rejected == 2 and "NaN or inf" in client.last_rejection
    with pytest.raises(ValueError, match="fall outside 0..999"):
        client.fetch_many({"deep": np.array([5, 1200])})
    stats = ray.get([s.stats.remote() for s in shards])
    assert sum(s["rejected_total"] for s in stats) == 2


def test_sparse_downpour_reaches_the_truths_auc_and_keeps_rows_off_the_replicas(ray_local):
    data = synthetic_ctr(30_000, rows=4_000, seed=1)
    model = WideAndDeep(data.rows, data.fields, hidden=16, seed=1)
    trainer = SparseDownpourSGD(model, replicas=2, shards=2, batch_size=256, steps=50,
                                lr=0.1, n_fetch=2, n_push=2)
    result = trainer.fit(data.ids_train, data.y_train, data.ids_test, data.y_test)
    truth = data.truth_auc()
    assert result.test_auc > truth - 0.06, (result.test_auc, truth)
    assert result.updates == 2 * 25
    steps = [e for e in result.events if e["event"] == "step"]
    assert len(steps) == 100
    assert all(e["rows"] > 0 for e in steps if e["fetched"])
    for c in result.replica_counters.values():
        # a replica fetched only rows its batches use, never the whole table
        assert c["rows_fetched"] < 25 * 2 * 2 * 512 * 8
        assert c["bytes_fetched"] < 25 * 2 * data.rows * (8 + 1) * 4
        assert c["rejected"] == 0
    materialized = sum(t["materialized"] for s in result.sparse_stats
                       for t in s["tables"].values())
    assert 0 < materialized < 2 * data.rows
    # after fit the user's model holds the trained rows and dense parameters
    with torch.no_grad():
        logits = model(torch.from_numpy(data.ids_test))
    assert auc(data.y_test, logits.numpy()) == pytest.approx(result.test_auc, abs=1e-6)


def test_a_sparse_replica_sends_the_next_fetch_with_its_rows_early(ray_local):
    """n_fetch 4, n_push 3 over 24 steps: the pushes at steps 2, 5, 14 and 17 are the last
    before the fetches at 4, 8, 16 and 20, so those fetches (dense parameters and the rows of
    their 4 batches) are sent right after them; each fetching step takes the one sent."""
    data = synthetic_ctr(4_000, rows=500, seed=2)
    model = WideAndDeep(data.rows, data.fields, hidden=8, seed=2)
    result = SparseDownpourSGD(model, replicas=1, shards=2, batch_size=64, steps=24, lr=0.1,
                               n_fetch=4, n_push=3).fit(data.ids_train, data.y_train,
                                                        data.ids_test, data.y_test)
    [c] = result.replica_counters.values()
    assert (c["fetches"], c["sparse_fetches"], c["early_fetches"]) == (6, 6, 4)
    assert (c["pushes"], c["rejected"]) == (8, 0)
    steps = [e for e in result.events if e["event"] == "step"]
    assert [e["step"] for e in steps if e["fetched"]] == [0, 4, 8, 12, 16, 20]
    assert all(e["rows"] > 0 for e in steps if e["fetched"])


def test_non_integer_or_out_of_range_ids_are_refused_before_training(ray_local):
    model = WideAndDeep(100, 2, hidden=0)
    trainer = SparseDownpourSGD(model, replicas=1, shards=1, steps=1)
    with pytest.raises(UserError, match="pass integer table rows"):
        trainer.fit(np.zeros((4, 2), np.float32), np.zeros(4))
    with pytest.raises(UserError, match="ids span 0..100 but the tables have 100 rows"):
        trainer.fit(np.array([[0, 100]] * 4), np.zeros(4))
    with pytest.raises(UserError, match="no SparseEmbedding"):
        SparseDownpourSGD(torch.nn.Linear(2, 1))


def test_cli_trains_ctr_and_prints_auc_and_truth(ray_local, tmp_path, capsys):
    code = main(["train", "--dataset", "ctr", "--rows", "4000", "--samples", "20000",
                 "--replicas", "2", "--shards", "2", "--steps", "30", "--batch-size", "256",
                 "--hidden", "8", "--lr", "0.1", "--no-progress", "--run-dir",
                 str(tmp_path / "run")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    final = dict(kv.split("=") for kv in out[-1].split()[1:])
    assert out[-1].startswith("final test_auc=")
    assert set(final) == {"test_auc", "truth_auc", "updates", "wall_s"}
    assert float(final["test_auc"]) > float(final["truth_auc"]) - 0.08
    assert int(final["updates"]) == 60
    assert (tmp_path / "run" / "plot.png").exists()


def test_cli_trains_a_users_ctr_npz(ray_local, tmp_path, capsys):
    data = synthetic_ctr(6000, rows=800, seed=0)
    path = tmp_path / "clicks.npz"
    np.savez(path, ids=np.concatenate([data.ids_train, data.ids_test]),
             labels=np.concatenate([data.y_train, data.y_test]))
    code = main(["train", "--dataset", str(path), "--rows", "800", "--replicas", "1",
                 "--shards", "1", "--steps", "10", "--batch-size", "128", "--no-progress",
                 "--run-dir", str(tmp_path / "run")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("final test_auc=") and "truth_auc" not in last


BAD = [
    (["--dataset", "ctr", "--rows", "0"], "--rows must be an integer >= 1 (got 0)"),
    (["--dataset", "ctr", "--rows", "5"], "--rows 5 is smaller than the 8 ctr fields"),
    (["--dataset", "ctr", "--rows", "x"], "argument --rows: invalid int value: 'x'"),
    (["--dataset", "ctr", "--algorithm", "sandblaster"], "trains with --algorithm downpour"),
    (["--dataset", "ctr", "--samples", "5"], "--samples 5 is too few for ctr"),
    (["--dataset", "ctr", "--partitions", "2"], "--partitions > 1 does not work with sparse"),
    (["--dataset", "ctr", "--resume", "/nonexistent"], "no checkpoint found"),
    (["--dataset", "ctr", "--shards", "99999"], "--shards 99999 exceeds the model's"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_ctr_input_is_one_line_exit_2(argv, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    try:
        code = main(["train", "--run-dir", str(run_dir), "--no-progress", "--samples", "1000",
                     *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("distbelief: error: ") and message in err[0]
    assert not run_dir.exists()


def test_bad_ctr_npz_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "clicks.npz"
    np.savez(path, ids=np.full((10, 3), 50), labels=np.zeros(10))
    code = main(["train", "--dataset", str(path), "--rows", "50", "--no-progress",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pass --rows 51 or more" in err[0]


# ------------------------------------------------------------------------------------------
# Checkpoints of the embedding rows: resume, a killed row shard, damaged files


def ctr_trainer(data, run_dir=None, steps=40, resume=None, every=0.0):
    """One replica (the row shards' checkpoints are the point), two row shards."""
    model = WideAndDeep(data.rows, data.fields, hidden=8, seed=1)
    return SparseDownpourSGD(model, replicas=1, shards=2, batch_size=256, steps=steps, lr=0.1,
                             seed=3, run_dir=run_dir, resume=resume, checkpoint_every_s=every)


def fit(trainer, data):
    return trainer.fit(data.ids_train, data.y_train, data.ids_test, data.y_test)


def row_state(result):
    return [(s["version"], {t: v["materialized"] for t, v in s["tables"].items()})
            for s in result.sparse_stats]


@pytest.fixture(scope="module")
def clicks():
    return synthetic_ctr(20_000, rows=3_000, seed=2)


def test_resume_restores_every_row_its_rule_state_and_version(ray_local, clicks, tmp_path):
    run = str(tmp_path / "run")
    first = fit(ctr_trainer(clicks, run), clicks)
    files = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "000001-rowshard0.safetensors" in files and "000001-rowshard1.safetensors" in files
    # nothing left to train: the resumed tables and dense slices are exactly the first run's
    same = fit(ctr_trainer(clicks, run, resume=run), clicks)
    assert row_state(same) == row_state(first)
    assert same.test_auc == first.test_auc
    # more steps continue from there: each row shard's version goes on from the checkpoint's
    more = fit(ctr_trainer(clicks, run, steps=60, resume=run), clicks)
    for (v_more, _), (v_first, _) in zip(row_state(more), row_state(first)):
        assert v_more == v_first + 20  # 20 more steps, one push each
    assert more.test_auc > 0.6


def test_damaged_or_foreign_row_checkpoints_are_one_line_errors_and_left_alone(
        ray_local, clicks, tmp_path):
    run = tmp_path / "run"
    fit(ctr_trainer(clicks, str(run), steps=5), clicks)
    rows_file = run / "checkpoints" / "000001-rowshard1.safetensors"
    other = synthetic_ctr(20_000, rows=4_000, seed=2)
    with pytest.raises(UserError, match="resume with the --rows and model of the run"):
        fit(ctr_trainer(other, str(run), resume=str(run)), other)
    for damage in (lambda b: b[: len(b) // 2], lambda b: b"\0" * len(b)):
        good = rows_file.read_bytes()
        rows_file.write_bytes(damage(good))
        bad = rows_file.read_bytes()
        with pytest.raises(UserError, match="000001-rowshard1.safetensors") as err:
            fit(ctr_trainer(clicks, str(run), resume=str(run)), clicks)
        assert "\n" not in str(err.value)
        assert rows_file.read_bytes() == bad  # untouched
        rows_file.write_bytes(good)


def test_killed_row_shard_is_restored_from_its_checkpoint_and_auc_holds(ray_local, clicks,
                                                                        tmp_path):
    unfaulted = fit(ctr_trainer(clicks, steps=150), clicks)
    trainer = ctr_trainer(clicks, str(tmp_path / "run"), steps=150, every=0.3)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=fit(trainer, clicks)))
    thread.start()
    while trainer.checkpoints < 1 and thread.is_alive():
        time.sleep(0.02)
    victim = ray.get_actor(trainer.actor_name("rowshard", 1))
    time.sleep(0.2)  # it applies more pushes after that checkpoint, then dies
    ray.kill(victim)
    thread.join(timeout=300)
    result = outcome["r"]
    by = {name: [e for e in result.events if e["event"] == name]
          for name in ("row_shard_failed", "row_shard_restored", "checkpoint")}
    assert [e["shard"] for e in by["row_shard_failed"]] == [1]
    [restored] = by["row_shard_restored"]
    before = [e for e in by["checkpoint"] if e["t"] < by["row_shard_failed"][0]["t"]][-1]
    assert restored["shard"] == 1 and restored["checkpoint"] == before["number"]
    assert restored["version"] == before["row_shards"][1]["version"] > 0
    steps = [e for e in result.events if e["event"] == "step"]
    assert max(e["step"] for e in steps) == 149 and {e["replica"] for e in steps} == {0}
    assert abs(result.test_auc - unfaulted.test_auc) <= 0.01
