"""PSClient on real shard actors: pipelined pushes and 16-bit wire formats."""

import numpy as np
import pytest
import ray

from distbelief.ps.client import INLINE_BYTES, PSClient
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.parametrize("grad_dtype,max_in_flight", [("float32", 1), ("float32", 3),
                                                      ("bfloat16", 2), ("float16", 2)])
def test_pushes_in_flight_are_all_applied_in_order(grad_dtype, max_in_flight):
    n = INLINE_BYTES // 2  # each shard's slice is above or below the inline limit
    plan = ShardPlan.build([("a", (n // 3,)), ("b", (n - n // 3,))], 2)
    shards = [ParameterShard.remote(i, np.zeros(plan.shard_size(i), np.float32), "sgd", 1.0)
              for i in range(2)]
    try:
        client = PSClient(shards, plan, replica=0, grad_dtype=grad_dtype,
                          max_in_flight=max_in_flight)
        grad = np.empty(n, np.float32)
        for k in range(5):
            grad.fill(k + 1.0)  # overwritten at once: the push must have copied it
            client.push(grad)
        assert len(client._in_flight) <= max_in_flight
        client.wait()
        flat = np.empty(n, np.float32)
        assert client.fetch_into(flat) == [5, 5]
        np.testing.assert_array_equal(flat, -15.0)
        assert client.rejected == 0 and client.pushes == 5
        client.push(np.full(n, np.nan, np.float32))
        client.wait()
        assert client.rejected == 2
    finally:
        for s in shards:
            ray.kill(s)


def test_downpour_trains_with_bfloat16_gradients():
    from distbelief import DownpourSGD, data, models

    ds = data.digits()
    result = DownpourSGD(models.mlp(ds.features, 32, ds.classes, 0), replicas=2, shards=2,
                         steps=150, grad_dtype="bfloat16").fit(ds.x_train, ds.y_train,
                                                               ds.x_test, ds.y_test)
    assert result.test_accuracy > 0.85
    assert sum(s["rejected_total"] for s in result.shard_stats) == 0
