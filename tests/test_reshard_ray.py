"""--resume onto another --shards count on a real embedded Ray: a 2-shard checkpoint comes
back on 3 shards, parameters, Adagrad state and embedding rows bit for bit, and a run goes on
from it on 1 shard (tests/test_reshard.py covers every count without Ray). One replica per
run: the replica count is not what changes here."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from distbelief import DownpourSGD, SandblasterLBFGS, data, models
from distbelief.checkpoint import latest_checkpoint, load_row_shards, read_manifest
from distbelief.flat import parameter_shapes
from distbelief.ps.plan import ShardPlan
from distbelief.sparse.ctr import synthetic_ctr
from distbelief.sparse.models import WideAndDeep
from distbelief.sparse.trainer import SparseDownpourSGD

pytestmark = pytest.mark.usefixtures("ray_local")


def newest(run) -> dict:
    folder = run / "checkpoints"
    number = max(int(p.stem.split("-")[1]) for p in folder.glob("checkpoint-*.json"))
    return read_manifest(run, number)


def gathered(run, trainer) -> dict[str, bytes]:
    """The newest checkpoint's dense arrays (parameters, every per-element state array of the
    trainer's rule) laid end to end, and its scalar state per shard, read with the
    checkpoint's own shard count."""
    rule = trainer._rule()
    shards = len(newest(run)["shards"])
    plan = ShardPlan.build(parameter_shapes(trainer.model), shards)
    manifest, parts = latest_checkpoint(run, plan, rule.state_names, rule.scalar_names)
    assert "resharded_from" not in manifest  # written by shards of that count
    per_element = ["params", *(n for n in rule.state_names if n not in rule.scalar_names)]
    assert len(per_element) >= 2  # Adagrad keeps a per-element sum of squares
    out = {n: np.concatenate([p[n] for p in parts]).tobytes() for n in per_element}
    out |= {n: {p[n].tobytes() for p in parts} for n in rule.scalar_names}
    return out


def rows_of(run) -> dict[tuple[str, int], bytes]:
    """Every embedding row of the newest checkpoint: (table, row) -> values + accumulator."""
    manifest = newest(run)
    out = {}
    for part in load_row_shards(run, manifest["checkpoint"], len(manifest["row_shards"])):
        arrays = part["arrays"]
        for table in {k.rpartition("/")[0] for k in arrays}:
            for i, row in enumerate(arrays[f"{table}/rows"]):
                out[(table, int(row))] = (arrays[f"{table}/values"][i].tobytes()
                                          + arrays[f"{table}/accumulator"][i].tobytes())
    return out


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def dense(digits, run, shards, steps, resume=None):
    return DownpourSGD(models.mlp(digits.features, 16, 10, 0), replicas=1, shards=shards,
                       steps=steps, seed=5, optimizer="adagrad", run_dir=str(run),
                       resume=None if resume is None else str(resume))


def test_dense_checkpoint_resumes_on_3_shards_bit_for_bit_and_goes_on_on_1(digits, tmp_path):
    first_run = tmp_path / "two"
    trainer = dense(digits, first_run, 2, 30)
    first = trainer.fit(digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    want = gathered(first_run, trainer)
    saved = newest(first_run)
    assert len(saved["shards"]) == 2 and {s["version"] for s in saved["shards"]} == {30}
    # on 3 shards with nothing left to train: the shards load the re-sharded checkpoint and
    # write it back
    run = tmp_path / "on3"
    shutil.copytree(first_run, run)
    same = dense(digits, run, 3, 30, resume=run).fit(digits.x_train, digits.y_train,
                                                     digits.x_test, digits.y_test)
    assert [s["version"] for s in newest(run)["shards"]] == [30] * 3
    assert gathered(run, trainer) == want  # parameters and Adagrad state, bit for bit
    assert all(same.params[k].tobytes() == first.params[k].tobytes() for k in first.params)
    assert same.test_accuracy == first.test_accuracy
    # on 1 shard, a continued run goes on from the same point
    run = tmp_path / "on1"
    shutil.copytree(first_run, run)
    more = dense(digits, run, 1, 40, resume=run).fit(digits.x_train, digits.y_train,
                                                     digits.x_test, digits.y_test)
    assert [s["version"] for s in newest(run)["shards"]] == [40]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "placement"][-1]["versions"] == [30]
    assert more.test_accuracy > 0.5


@pytest.fixture(scope="module")
def clicks():
    return synthetic_ctr(12_000, rows=2_000, seed=2)


def ctr(clicks, run, shards, steps, resume=None):
    model = WideAndDeep(clicks.rows, clicks.fields, hidden=8, seed=1)
    return SparseDownpourSGD(model, replicas=1, shards=shards, batch_size=256, steps=steps,
                             lr=0.1, seed=3, run_dir=str(run),
                             resume=None if resume is None else str(resume))


def fit(trainer, clicks):
    return trainer.fit(clicks.ids_train, clicks.y_train, clicks.ids_test, clicks.y_test)


def test_ctr_rows_resume_on_3_shards_bit_for_bit_and_go_on_on_1(clicks, tmp_path):
    first_run = tmp_path / "two"
    first = fit(ctr(clicks, first_run, 2, 20), clicks)
    want = rows_of(first_run)
    assert len(newest(first_run)["row_shards"]) == 2 and len(want) > 100
    run = tmp_path / "on3"
    shutil.copytree(first_run, run)
    same = fit(ctr(clicks, run, 3, 20, resume=run), clicks)
    assert len(newest(run)["row_shards"]) == 3
    assert rows_of(run) == want  # every row, its values and Adagrad state
    assert same.test_auc == first.test_auc
    run = tmp_path / "on1"
    shutil.copytree(first_run, run)
    more = fit(ctr(clicks, run, 1, 30, resume=run), clicks)
    top = max(s["version"] for s in newest(first_run)["row_shards"])
    [after] = newest(run)["row_shards"]
    assert after["version"] > top
    assert more.test_auc > 0.55


def test_sandblaster_resumes_on_3_shards_with_its_vectors_and_history(digits, tmp_path):
    def lbfgs(shards, iterations, run, resume=None):
        return SandblasterLBFGS(models.mlp(digits.features, 0, 10, 0), replicas=1,
                                shards=shards, iterations=iterations, seed=1, run_dir=str(run),
                                resume=None if resume is None else str(resume))

    straight = lbfgs(2, 8, tmp_path / "ref").fit(digits.x_train, digits.y_train,
                                                 digits.x_test, digits.y_test)
    run = tmp_path / "run"
    lbfgs(2, 4, run).fit(digits.x_train, digits.y_train)
    saved = newest(run)
    assert saved["lbfgs"]["iteration"] == 4 and len(saved["shards"]) == 2
    resumed = lbfgs(3, 8, run, resume=run).fit(digits.x_train, digits.y_train,
                                               digits.x_test, digits.y_test)
    assert len(newest(run)["shards"]) == 3 and newest(run)["lbfgs"]["iteration"] == 8
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in events if e["event"] == "resumed"] == [4]
    # the same L-BFGS path (x, g and the (s, y) history re-sharded), up to float summation
    # order of the shards' dot products
    assert abs(resumed.test_accuracy - straight.test_accuracy) <= 0.01 + 1e-9
