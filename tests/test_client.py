"""PSClient on real shard actors: pipelined pushes and 16-bit wire formats."""

import numpy as np
import pytest
import ray

from distbelief.cluster import INLINE_BYTES
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

pytestmark = pytest.mark.usefixtures("ray_local")


N = INLINE_BYTES // 2 + 1024  # float32 parts above the inline limit (one object), 16-bit ones below
PLAN = ShardPlan.build([("a", (N // 3,)), ("b", (N - N // 3,))], 2)


@pytest.fixture(scope="module")
def sgd_shards():
    """Two SGD shards (lr 1) for the in-flight tests, put back to zeros at version 0 by each."""
    shards = [ParameterShard.remote(i, np.zeros(PLAN.shard_size(i), np.float32), "sgd", 1.0)
              for i in range(2)]
    yield shards
    for s in shards:
        ray.kill(s)


@pytest.mark.parametrize("grad_dtype,max_in_flight", [("float32", 1), ("float32", 3),
                                                      ("bfloat16", 2), ("float16", 2)])
def test_pushes_in_flight_are_all_applied_in_order(sgd_shards, grad_dtype, max_in_flight):
    shards = sgd_shards
    ray.get([s.load.remote({"arrays": {"params": np.zeros(PLAN.shard_size(i), np.float32)},
                            "version": 0, "counters": {"fetches": 0}})  # all reset
             for i, s in enumerate(shards)])
    client = PSClient(shards, PLAN, replica=0, grad_dtype=grad_dtype,
                      max_in_flight=max_in_flight)
    grad = np.empty(N, np.float32)
    for k in range(5):
        grad.fill(k + 1.0)  # overwritten at once: the push must have copied it
        client.push(grad)
    assert len(client._in_flight) <= max_in_flight
    client.wait()
    flat = np.empty(N, np.float32)
    assert client.fetch_into(flat) == [5, 5]
    np.testing.assert_array_equal(flat, -15.0)
    assert client.rejected == 0 and client.pushes == 5
    client.push(np.full(N, np.nan, np.float32))
    client.wait()
    assert client.rejected == 2


def test_shards_step_torch_optim_without_loading_the_compiler(sgd_shards):
    """Shard processes skip importing torch._dynamo (ps/torchrule.without_compiler), which
    cost each shard start about 1.1 s of CPU; their torch SGD still steps."""
    import sys

    client = PSClient(sgd_shards, PLAN, replica=0)
    before = np.empty(N, np.float32)
    client.fetch_into(before)
    client.push(np.ones(N, np.float32))
    client.wait()
    after = np.empty(N, np.float32)
    client.fetch_into(after)
    np.testing.assert_array_equal(after, before - 1.0)  # lr 1
    loaded = ray.get([s.__ray_call__.remote(
        lambda self: type(sys.modules.get("torch._dynamo")).__name__) for s in sgd_shards])
    assert loaded == ["_CompilerOnDemand"] * 2


def test_downpour_trains_with_bfloat16_gradients():
    from distbelief import DownpourSGD, data, models

    ds = data.digits()
    result = DownpourSGD(models.mlp(ds.features, 32, ds.classes, 0), replicas=2, shards=2,
                         steps=150, grad_dtype="bfloat16").fit(ds.x_train, ds.y_train,
                                                               ds.x_test, ds.y_test)
    assert result.test_accuracy > 0.85
    assert sum(s["rejected_total"] for s in result.shard_stats) == 0


@pytest.mark.parametrize("grad_dtype", ["float32", "float16"])
def test_push_fetch_is_a_push_then_a_fetch_in_one_call(grad_dtype):
    plan = ShardPlan.build([("a", (7,)), ("b", (5, 2))], 2)
    start = np.linspace(-1, 1, 17, dtype=np.float32)
    rigs = []
    for _ in range(2):  # the same shards twice: one driven by push + fetch, one by push_fetch
        shards = [ParameterShard.remote(i, part, "adagrad", 0.1)
                  for i, part in enumerate(plan.split_flat(start))]
        rigs.append((shards, PSClient(shards, plan, replica=0, grad_dtype=grad_dtype)))
    try:
        (_, two), (_, one) = rigs
        a, b = np.empty(17, np.float32), np.empty(17, np.float32)
        gen = np.random.default_rng(0)
        for _ in range(4):
            grad = gen.normal(size=17).astype(np.float32)
            two.push(grad)
            versions = two.fetch_into(a)
            assert one.push_fetch_into(grad, b) == versions
            np.testing.assert_array_equal(a, b)
        assert (one.pushes, one.fetches, one.rejected) == (4, 4, 0)
        one.push_fetch_into(np.full(17, np.inf, np.float32), b)  # rejected, still fetched
        assert one.rejected == 2 and one.versions == [4, 4]
        np.testing.assert_array_equal(a, b)
    finally:
        for shards, _ in rigs:
            for s in shards:
                ray.kill(s)


def test_push_fetch_to_a_dead_shard_is_dropped_counted_and_refetched_from_its_restart():
    import threading
    import time

    plan = ShardPlan.build([("a", (6,))], 2)
    names = [f"pf-test-shard-{i}" for i in range(2)]

    def shard(i):
        return ParameterShard.options(name=names[i]).remote(i, np.zeros(3, np.float32),
                                                            "sgd", 1.0)

    shards = [shard(0), shard(1)]
    client = PSClient(shards, plan, replica=0, names=names)
    flat = np.empty(6, np.float32)
    client.push_fetch_into(np.ones(6, np.float32), flat)
    ray.kill(shards[1])
    while True:  # ray.kill is asynchronous: a call sent at once may still be served
        try:
            ray.get(shards[1].pid.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
    restarted = []

    def restart():  # what the driver does: a new shard under the dead one's name
        time.sleep(0.5)
        restarted.append(shard(1))

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        client.push_fetch_into(np.ones(6, np.float32), flat)
        thread.join()
        assert client.dropped_by_shard == [0, 1] and client.retried == 1
        np.testing.assert_array_equal(flat, [-2, -2, -2, 0, 0, 0])  # shard 1 starts afresh
        assert client.versions == [2, 0]
    finally:
        for s in [shards[0], *restarted]:
            ray.kill(s)
