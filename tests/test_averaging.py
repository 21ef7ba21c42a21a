"""Parameter averages (--average) and model buffers on the shards, without Ray."""

import numpy as np
import pytest
import torch
from torch import nn

from distbelief.checkpoint import load_arrays
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.flat import parameter_shapes
from distbelief.ps.average import AverageSpec, ParamAverage, parse_average
from distbelief.ps.buffers import BufferAverage, BufferPlan, BufferReporter
from distbelief.ps.optim import CHUNK, SGD
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ShardCore
from distbelief.trainer import Evaluator


def test_ema_after_k_updates_equals_the_closed_form():
    rng = np.random.default_rng(0)
    decay, k, n = 0.9, 7, 2 * CHUNK + 3  # more than two chunks
    p = [rng.normal(size=n).astype(np.float32) for _ in range(k + 1)]
    avg = ParamAverage(AverageSpec("ema", decay=decay), p[0])
    for j in range(1, k + 1):
        avg.update(p[j])
    closed = decay ** k * p[0].astype(np.float64) + (1 - decay) * sum(
        decay ** (k - j) * p[j].astype(np.float64) for j in range(1, k + 1))
    np.testing.assert_allclose(avg.values, closed, rtol=1e-5, atol=1e-6)
    assert avg.count == k


@pytest.mark.parametrize("start", [0, 3])
def test_polyak_is_the_uniform_mean_from_update_k(start):
    rng = np.random.default_rng(1)
    p = [rng.normal(size=10).astype(np.float32) for _ in range(9)]
    avg = ParamAverage(parse_average(f"polyak:{start}"), p[0])
    for j in range(1, 9):
        avg.update(p[j])
        if j < start:
            np.testing.assert_array_equal(avg.values, p[j])
    np.testing.assert_allclose(avg.values, np.mean(p[start:], axis=0), rtol=1e-5, atol=1e-6)


def test_average_specs_parse_and_bad_ones_are_one_line_errors():
    assert parse_average("ema:0.999") == AverageSpec("ema", decay=0.999)
    assert parse_average("polyak") == AverageSpec("polyak", start=0)
    assert str(parse_average("polyak:50")) == "polyak:50"
    for bad in ("ema", "ema:1", "ema:0", "ema:x", "polyak:-1", "swa", "polyak:1.5"):
        with pytest.raises(UserError, match="--average") as err:
            parse_average(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="--average"):
        TrainConfig(average="ema:2").validate()
    with pytest.raises(UserError, match="Downpour"):
        TrainConfig(average="ema:0.9", algorithm="sandblaster").validate()
    assert TrainConfig(average="polyak").validate().average_final is True


def test_shard_average_follows_pushes_and_survives_save_and_restore(tmp_path):
    init = np.arange(5, dtype=np.float32)
    core = ShardCore(0, init, SGD(0.5))
    core.keep_extras(None, parse_average("ema:0.5"))
    expected = init.copy()
    for g in (np.ones(5, np.float32), np.full(5, 2.0, np.float32)):
        assert core.push(g, core.version)
        expected = 0.5 * expected + 0.5 * core.params
    np.testing.assert_allclose(core.fetch_average()[1], expected)
    core.save(str(tmp_path / "s.safetensors"))
    arrays = load_arrays(tmp_path / "s.safetensors")
    back = ShardCore(0, init, SGD(0.5))
    back.keep_extras(None, parse_average("ema:0.5"))
    back.restore(arrays, 2)
    np.testing.assert_array_equal(back.fetch_average()[1], core.fetch_average()[1])
    assert back.average.count == 2
    plain = ShardCore(0, init, SGD(0.5))  # no --average: the slice itself, nothing saved
    assert "average" not in plain._saved_arrays(())
    np.testing.assert_array_equal(plain.fetch_average()[1], init)


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))


def test_buffer_plan_reads_writes_and_reports_count_deltas():
    model = bn_model()
    plan = BufferPlan.of(model)
    assert [n for n, _ in plan.floats] == ["1.running_mean", "1.running_var"]
    assert [n for n, _ in plan.counts] == ["1.num_batches_tracked"]
    assert not BufferPlan.of(nn.Linear(2, 2))
    reporter = BufferReporter(plan, model)
    model(torch.randn(8, 4))
    model(torch.randn(8, 4))
    floats, delta = reporter.report()
    np.testing.assert_array_equal(floats[:3], model[1].running_mean.numpy())
    assert delta.tolist() == [2]
    assert reporter.report()[1].tolist() == [0]
    reporter.load((np.full(6, 0.5, np.float32), np.array([40], np.int64)))
    assert model[1].running_var.tolist() == [0.5] * 3
    assert int(model[1].num_batches_tracked) == 40
    model(torch.randn(8, 4))
    assert reporter.report()[1].tolist() == [1]


def test_buffer_average_one_replica_is_exact_and_r_replicas_average():
    one = BufferAverage(np.zeros(2, np.float32), np.zeros(1, np.int64), replicas=1)
    one.report(np.array([0.3, -1.5], np.float32), np.array([4], np.int64))
    np.testing.assert_allclose(one.floats, [0.3, -1.5], atol=1e-7)
    four = BufferAverage(np.zeros(1, np.float32), np.array([10], np.int64), replicas=4)
    for r in (4.0, 4.0):
        four.report(np.array([r], np.float32), np.array([3], np.int64))
    np.testing.assert_allclose(four.floats, [4.0 * (1 - 0.75 ** 2)], rtol=1e-6)
    assert four.counts.tolist() == [16]
    assert not four.check((np.array([np.nan], np.float32), np.array([1], np.int64)))
    assert not four.check((np.zeros(2, np.float32), np.array([1], np.int64)))
    assert four.check((np.zeros(1, np.float32), np.array([1], np.int64)))


def test_shard_zero_folds_buffer_reports_serves_and_checkpoints_them(tmp_path):
    core = ShardCore(0, np.zeros(3, np.float32), SGD(1.0))
    core.keep_extras(BufferAverage(np.zeros(2, np.float32), np.zeros(1, np.int64), 2), None)
    report = (np.array([1.0, 2.0], np.float32), np.array([5], np.int64))
    assert core.push(np.ones(3, np.float32), 0, 0, buffers=report)
    assert not core.push(np.full(3, np.nan, np.float32), 0, 0, buffers=report)  # rejected
    applied, version, _, served = core.push_fetch(np.ones(3, np.float32), 1, 1, report)
    np.testing.assert_allclose(served[0], [0.75, 1.5])
    assert served[1].tolist() == [10] and core.stats()["buffer_reports"] == 2
    assert len(core.fetch()) == 2 and core.fetch(True)[2][1].tolist() == [10]
    core.save(str(tmp_path / "s.safetensors"))
    back = ShardCore(0, np.zeros(3, np.float32), SGD(1.0))
    back.keep_extras(BufferAverage(np.zeros(2, np.float32), np.zeros(1, np.int64), 2), None)
    back.restore(load_arrays(tmp_path / "s.safetensors"), 2)
    np.testing.assert_array_equal(back.fetch_buffers()[0], core.fetch_buffers()[0])
    assert back.fetch_buffers()[1].tolist() == [10]


def test_evaluation_runs_in_eval_mode_and_changes_no_buffer():
    model = bn_model()
    model.train()
    with torch.no_grad():
        model(torch.randn(16, 4) * 3 + 1)  # buffers away from their initial values
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = ShardPlan.build(parameter_shapes(model), 1)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = np.zeros(32, dtype=np.int64)
    evaluator = Evaluator(model, nn.CrossEntropyLoss(), plan, (x, y))
    first = evaluator.score(None)
    assert evaluator.score(None) == first
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        model.eval()
        expected = float(nn.CrossEntropyLoss()(model(torch.from_numpy(x)), torch.from_numpy(y)))
    assert first["test_loss"] == pytest.approx(expected, rel=1e-6)
