"""Row-sparse embedding shards, the client and sparse Downpour on a real embedded Ray."""

import sys

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
    (["--dataset", "ctr", "--resume", "/nonexistent"], "--resume does not restore sparse"),
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
