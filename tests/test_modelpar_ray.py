"""Model parallelism on Ray: partition actors against the whole model, the PS, and Downpour."""

import copy
import threading
import time
from functools import partial

import numpy as np
import pytest
import ray
import torch
from torch import nn

from distbelief import DownpourSGD, data, models
from distbelief.modelpar.core import flat_runs, owned_ranges
from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d
from distbelief.modelpar.layerwise import plan_layerwise
from distbelief.modelpar.plan import plan_partitions
from distbelief.modelpar.spatial import plan_spatial
from distbelief.modelpar.worker import PartitionGroup
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

pytestmark = pytest.mark.usefixtures("ray_local")


def lc2d(readout=True):
    torch.manual_seed(0)
    layers = [nn.Unflatten(1, (2, 9, 8)),
              LocallyConnected2d(2, 3, (9, 8), 3, padding=1), nn.ReLU(),
              LocallyConnected2d(3, 2, (9, 8), (3, 2), stride=(2, 1)), nn.Tanh()]
    if readout:
        layers += [nn.Flatten(), nn.Linear(2 * 4 * 7, 5)]
    return nn.Sequential(*layers).double(), torch.randn(6, 2 * 9 * 8, dtype=torch.float64)


def lc1d():
    torch.manual_seed(0)
    model = nn.Sequential(LocallyConnected1d(2, 3, 24, 3, padding=1), nn.Tanh(),
                          LocallyConnected1d(3, 4, 24, 4, stride=2, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 12, 5))
    return model.double(), torch.randn(6, 2, 24, dtype=torch.float64)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    return model.double(), torch.randn(6, 12, dtype=torch.float64)


def loss_of(out):
    return (out ** 2).sum() / 2 + out.sin().sum()


CASES = [("spatial-2d", lc2d, lambda m, x, k: plan_spatial(m, k)),
         ("spatial-2d-no-readout", lambda: lc2d(readout=False), lambda m, x, k: plan_spatial(m, k)),
         ("spatial-1d", lc1d, lambda m, x, k: plan_spatial(m, k)),
         ("layerwise-lc", lc1d, lambda m, x, k: plan_layerwise(m, k, x.shape[1:])),
         ("layerwise-mlp", mlp, lambda m, x, k: plan_layerwise(m, k, x.shape[1:]))]


# Each planner and model kind once through real actors, 3 partitions where a middle one
# exchanges halos both ways; tests/test_modelpar_partition.py checks every case and count
# of partitions in one process (the same partition code, without Ray).
ON_RAY = [(CASES[0], 3), (CASES[1], 2), (CASES[2], 2), (CASES[3], 3), (CASES[4], 2)]


@pytest.mark.parametrize("name,build,planner,k", [(*c, k) for c, k in ON_RAY],
                         ids=[f"{c[0]}-{k}" for c, k in ON_RAY])
def test_partition_actors_give_the_whole_models_loss_and_gradients(name, build, planner, k):
    model, x = build()
    reference = copy.deepcopy(model)
    expected_loss = loss_of(reference(x))
    expected_loss.backward()
    group = PartitionGroup(model, planner(model, x, k))
    try:
        loss = group.step(x, loss_of)
        params, grads = group.gather()
    finally:
        group.kill()
    assert loss == pytest.approx(float(expected_loss.detach()), abs=1e-5)
    for n, p in reference.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=["spatial-2d", "layerwise-mlp"])
def test_the_groups_gradient_norm_is_the_whole_models_and_end_step_scales_by_it(case):
    """--clip-grad-norm across partitions: the norm summed over the partitions' disjoint
    slices is the whole model's, and end_step's scale multiplies the local update."""
    _, build, planner = case
    model, x = build()
    reference = copy.deepcopy(model)
    loss_of(reference(x)).backward()
    whole = torch.sqrt(sum((p.grad ** 2).sum() for p in reference.parameters()))
    group = PartitionGroup(model, planner(model, x, 2))
    try:
        group.step(x, loss_of)
        norm = group.grad_norm()
        before, grads = group.gather()
        group.end_step(False, 0.1, 0.25)  # local SGD at lr 0.1 on a quarter of the gradient
        after, _ = group.gather()
    finally:
        group.kill()
    assert norm == pytest.approx(float(whole), rel=1e-9)
    for n in before:
        torch.testing.assert_close(after[n], before[n] - 0.1 * 0.25 * grads[n])


def test_flat_runs_and_owned_ranges_cover_each_slice_in_order():
    assert flat_runs(np.array([3, 4, 5, 9, 10, 12])) == [(3, 6), (9, 11), (12, 13)]
    assert flat_runs(np.zeros(0, np.int64)) == []
    model, _ = lc2d()
    shard_plan = ShardPlan.build([(n, tuple(p.shape)) for n, p in model.named_parameters()], 3)
    plan = plan_spatial(model, 2)
    covered = []
    for k in range(2):
        _, ranges = owned_ranges(plan.params(k), shard_plan)
        covered += [i for lo, hi in ranges for i in range(lo, hi)]
    assert sorted(covered) == list(range(shard_plan.numel))  # every element, exactly once


def test_each_partition_fetches_and_pushes_exactly_its_own_parameters():
    """One SGD step (lr 1) through partition actors equals the whole model's SGD step."""
    model, x = lc2d()
    model = model.float()
    x = x.float()
    names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shard_plan = ShardPlan.build(names, 3)
    flat = shard_plan.flatten({n: p.detach().numpy() for n, p in model.named_parameters()})
    shards = [ParameterShard.remote(i, part, "sgd", 1.0, 0.0, rows=True)
              for i, part in enumerate(shard_plan.split_flat(flat))]
    reference = copy.deepcopy(model)
    loss_of(reference(x)).backward()
    group = PartitionGroup(copy.deepcopy(model), plan_spatial(model, 2), shard_plan, shards)
    try:
        ray.get(group.fetch())
        group.step(x, loss_of)
        group.end_step(push=True, local_lr=None)
        group.finish()
        parts = [ray.get(s.fetch.remote())[1] for s in shards]
    finally:
        group.kill()
        for s in shards:
            ray.kill(s)
    after = shard_plan.assemble(parts)
    for n, p in reference.named_parameters():
        np.testing.assert_allclose(after[n], (p - p.grad).detach().numpy(), atol=1e-5)


def test_a_partition_fetch_sent_early_sees_the_push_before_it_and_is_not_sent_again():
    """The replica's prefetch (n_fetch > 1): each partition sends its next fetch right after
    its last push, the step between computes, and the fetching step takes those values."""
    from distbelief.modelpar.host import PartitionedHost

    model, x = lc2d()
    model, x = model.float(), x.float()
    names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shard_plan, plan = ShardPlan.build(names, 3), plan_spatial(model, 2)
    flat = shard_plan.flatten({n: p.detach().numpy() for n, p in model.named_parameters()})
    shards = [ParameterShard.remote(i, part, "sgd", 1.0, 0.0, rows=True)
              for i, part in enumerate(shard_plan.split_flat(flat))]
    bounds = shard_plan.bounds
    asked = [{s for s in range(3) for lo, hi in owned_ranges(plan.params(k), shard_plan)[1]
              if lo < bounds[s + 1] and hi > bounds[s]} for k in range(2)]
    host = PartitionedHost(copy.deepcopy(model), shard_plan, shards, plan)
    try:
        host.fetch()
        host.forward_backward(x, loss_of)
        host.end_step(True, None, fetch_next=False)  # the last push before the fetch
        host.prefetch()  # sent after that push
        host.forward_backward(x, loss_of)  # the step between, computed meanwhile
        host.end_step(False, None, fetch_next=True)
        host.fetch()  # takes the prefetched values: no call of its own
        host.forward_backward(x, loss_of)
        stats = ray.get([s.stats.remote() for s in shards])
        params, _ = host.group.gather()
        parts = [ray.get(s.fetch.remote())[1] for s in shards]
    finally:
        host.group.kill()
        for s in shards:
            ray.kill(s)
    # every partition's push reached its shards before that partition's early fetch
    assert host.versions() == [sum(s in a for a in asked) for s in range(3)]
    # each partition asked each of its shards twice: the first fetch and the early one
    assert [st["fetches"] for st in stats] == [2 * sum(s in a for a in asked) for s in range(3)]
    after = shard_plan.assemble(parts)
    for n, p in params.items():
        np.testing.assert_allclose(p.numpy(), after[n], rtol=1e-6)


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def test_downpour_with_model_parallel_replicas_trains_lc_on_digits(digits):
    """The issue's acceptance run: --model lc --replicas 2 --partitions 2 --shards 2."""
    model = models.lc(digits.features, 8, digits.classes, 0)
    result = DownpourSGD(model, replicas=2, partitions=2, shards=2, steps=150).fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    assert result.test_accuracy >= 0.9
    steps = [e for e in result.events if e["event"] == "step"]
    plan = plan_partitions(model, 2)
    assert {e["boundary_bytes"] for e in steps} == {plan.planned_bytes(32, 4)}
    assert steps[0]["naive_bytes"] == plan.naive_bytes(32, 4) > steps[0]["boundary_bytes"]
    assert all(c["pushes"] == 150 and c["rejected"] == 0
               for c in result.replica_counters.values())


def test_bfloat16_model_parallel_replicas_train_lc_and_send_half_the_boundary_bytes(digits):
    model = models.lc(digits.features, 8, digits.classes, 0)
    result = DownpourSGD(model, replicas=2, partitions=2, shards=2, steps=150,
                         precision="bfloat16").fit(digits.x_train, digits.y_train,
                                                   digits.x_test, digits.y_test)
    assert result.test_accuracy >= 0.9  # seeds 0-2: 0.972-0.978, float32 0.969-0.978
    steps = [e for e in result.events if e["event"] == "step"]
    plan = plan_partitions(model, 2)
    assert {e["boundary_bytes"] for e in steps} == {plan.planned_bytes(32, 2)}
    assert steps[0]["naive_bytes"] == plan.naive_bytes(32, 2)
    assert all(c["pushes"] == 150 and c["rejected"] == 0
               for c in result.replica_counters.values())


def test_clipped_model_parallel_replicas_scale_every_step_and_record_the_norms(digits):
    result = DownpourSGD(models.lc(digits.features, 8, digits.classes, 0), replicas=2,
                         partitions=2, shards=2, steps=40, clip_grad_norm=1e-3).fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    steps = [e for e in result.events if e["event"] == "step"]
    assert len(steps) == 80 and all(e["grad_norm"] > 1e-3 for e in steps)
    assert [c["clipped"] for c in result.replica_counters.values()] == [40, 40]
    assert all(c["rejected"] == 0 for c in result.replica_counters.values())


def test_model_parallel_replicas_run_with_early_fetches_between_pushes(digits):
    """n_fetch 5, n_push 2: the push at step 5k + 3 is the last before the fetch at 5k + 5,
    so the replica sends that fetch early (PartitionedHost.prefetch); the run's counts hold."""
    model = models.lc(digits.features, 4, digits.classes, 0)
    result = DownpourSGD(model, replicas=1, partitions=2, shards=2, steps=60, n_fetch=5,
                         n_push=2).fit(digits.x_train, digits.y_train, digits.x_test,
                                       digits.y_test)
    [counters] = result.replica_counters.values()
    assert (counters["fetches"], counters["pushes"], counters["rejected"]) == (12, 30, 0)
    steps = [e for e in result.events if e["event"] == "step"]
    assert [e["step"] for e in steps if e["fetched"]] == list(range(0, 60, 5))
    assert result.test_accuracy > 0.5


def test_a_killed_partition_restarts_its_replica_and_the_run_finishes(digits):
    trainer = DownpourSGD(models.lc(digits.features, 4, digits.classes, 0), replicas=2,
                          partitions=2, shards=1, steps=120, slow_replicas={1: 3.0})
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=trainer.fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)))
    thread.start()
    replica = None
    while replica is None and thread.is_alive():
        try:
            replica = ray.get_actor(trainer.actor_name("replica", 1))
        except ValueError:
            time.sleep(0.05)
    victim = ray.get(replica.partitions.remote())[1]
    time.sleep(1.0)
    ray.kill(victim)
    thread.join(timeout=240)
    result = outcome["r"]
    failures = [e for e in result.events if e["event"] == "replica_failed"]
    assert [f["replica"] for f in failures] == [1]
    last = {r: max(e["step"] for e in result.events
                   if e["event"] == "step" and e["replica"] == r) for r in (0, 1)}
    assert last == {0: 119, 1: 119}
    assert result.test_accuracy >= 0.85


def test_model_parallel_sandblaster_replicas_give_the_exact_full_batch_gradient(digits):
    """Portions on 2 model-parallel replicas (one slow, so backups run): every portion counts
    once, the gradient staged part by part equals the whole model's full-batch gradient."""
    from distbelief.modelpar.host import PartitionedHost
    from distbelief.sandblaster.coordinator import PortionRunner, ShardVectorSpace
    from distbelief.sandblaster.replica import SandblasterReplica

    x, y = digits.x_train[:600], digits.y_train[:600]
    model = models.lc(digits.features, 4, digits.classes, 1)
    reference = copy.deepcopy(model)
    want_loss = nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y),
                                            reduction="sum")
    want_loss.backward()
    want = np.concatenate([p.grad.numpy().ravel() for p in reference.parameters()])
    shard_plan = ShardPlan.build([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    flat = shard_plan.flatten({n: p.detach().numpy() for n, p in model.named_parameters()})
    shards = [ParameterShard.remote(i, part, "sgd", 1.0)
              for i, part in enumerate(shard_plan.split_flat(flat))]
    plan, x_ref, y_ref, actors = plan_partitions(model, 2), ray.put(x), ray.put(y), []

    def start(i):
        host = partial(PartitionedHost, copy.deepcopy(model), shard_plan, shards, plan)
        actors.append(SandblasterReplica.remote(i, host, nn.CrossEntropyLoss(), x_ref, y_ref,
                                                4.0 if i == 0 else 1.0))
        return actors[-1]

    try:
        runner = PortionRunner(ShardVectorSpace(shards), start, 2, len(x), 12, 2, backups=True)
        loss = runner.run("x", "g")
        got = np.concatenate(ray.get([s.fetch_vector.remote("g") for s in shards]))
    finally:
        for a in [*actors, *shards]:
            ray.kill(a)
    np.testing.assert_allclose(loss, float(want_loss.detach()), rtol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    [batch] = runner.history
    assert sum(batch.portions_by_replica.values()) == 12 + batch.recomputed  # each once
