"""Issue 16 on a real (embedded) Ray session: the evaluator actor's events, the fused
push+fetch of a gradient too large to travel inline and a fetch sent early, counted (no
timings)."""

import numpy as np
import pytest
import ray
import torch

from distbelief import DownpourSGD, data, evaluation, models
from distbelief.cluster import INLINE_BYTES
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_large_push_fuses_with_the_next_fetch_and_an_early_fetch_sees_the_last_push():
    model = torch.nn.Linear(800, 800)  # 640,800 parameters: 1.28 MB a shard
    plan = ShardPlan.build([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    flat = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    assert plan.shard_size(0) * 4 > INLINE_BYTES  # each part too large to travel in its call
    shards = [ParameterShard.remote(s, part, "sgd", 0.5) for s, part in
              enumerate(plan.split_flat(flat))]
    host = FlatHost(model, plan, shards)
    host.fetch()
    flat = host.flat.flat_np.copy()
    host.forward_backward(torch.ones(3, 800), lambda out: out.sum())
    grad = host.flat.grad.clone()
    host.end_step(True, None, fetch_next=True)  # push + fetch, fused
    assert (host.client.pushes, host.client.fetches) == (1, 2)
    host.fetch()  # the fused call already brought these parameters: no second call
    assert host.client.fetches == 2 and host.versions() == [1, 1]
    np.testing.assert_allclose(host.flat.flat_np, flat - 0.5 * grad.numpy(), rtol=1e-6)
    host.end_step(True, None, fetch_next=False)  # a push alone: no fetch
    assert (host.client.pushes, host.client.fetches) == (2, 2)
    host.prefetch()  # sent after that push: it must see it
    host.forward_backward(torch.ones(3, 800), lambda out: out.sum())
    host.fetch()
    assert host.client.fetches == 3 and host.versions() == [2, 2]
    host.finish(False)
    for s in shards:
        ray.kill(s)


@pytest.mark.parametrize("inline_below, where", [(0.0, "actor"), (float("inf"), "driver")])
def test_periodic_evaluations_score_a_sample_during_training_and_all_at_the_end(
        monkeypatch, inline_below, where):
    monkeypatch.setattr(evaluation, "INLINE_EVAL_S", inline_below)  # the probe's threshold
    ds = data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, 16, ds.classes, 0), replicas=2, shards=2,
                          steps=150, batch_size=16, lr=0.05, eval_every_s=0.05,
                          eval_budget=1.0, eval_rows=50, seed=0)
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    [placement] = [e for e in result.events if e["event"] == "placement"]
    assert placement["evaluator"] == where
    evals = [e for e in result.events if e["event"] == "eval"]
    *periodic, whole = evals  # the final evaluation also logs an eval event, of all rows
    assert "subset" not in whole
    assert len(periodic) >= 1  # the first is submitted at the start and collected at the end
    if where == "driver":  # the initial parameters are scored before training starts
        assert periodic[0]["updates"] == 0
        assert result.events.index(periodic[0]) < result.events.index(placement)
    for e in periodic:
        assert e["subset"] == 50 and 0 <= e["test_accuracy"] <= 1 and e["test_loss"] > 0
        assert e["updates"] == sum(e["versions"]) and e["elapsed_s"] >= 0
        assert e["cost_s"] >= 0  # what the budget counted: the evaluation's CPU time
    assert [e["updates"] for e in evals] == sorted(e["updates"] for e in evals)
    [final] = [e for e in result.events if e["event"] == "final"]
    assert "subset" not in final and final["updates"] == 2 * 150
    assert whole["updates"] == 2 * final["updates"]  # 2 shards: each push counts twice
    steps = [e for e in result.events if e["event"] == "step"]
    assert all(e[k] >= 0 for e in steps for k in ("compute_s", "fetch_wait_s",
                                                   "push_wait_s", "idle_s"))


def test_default_evaluations_score_trained_parameters_while_the_run_trains():
    """The evaluation of the initial parameters waits for the shards to start; what the
    budget counts of it (its CPU time) must not space the next one past the run, as counting
    the fetch's wall time did (the digits demo then had no evaluation between the first and
    the last)."""
    ds = data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, 16, ds.classes, 0), replicas=2, shards=2,
                          steps=300, batch_size=16, lr=0.05, eval_every_s=0.05, seed=0)
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    *periodic, _whole = [e for e in result.events if e["event"] == "eval"]
    assert periodic[0]["updates"] == 0
    assert any(0 < e["updates"] < 2 * 2 * 300 for e in periodic)  # scored during training
