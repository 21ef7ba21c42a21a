"""A cluster node that leaves mid-run (ray.cluster_utils.Cluster: a head and a second node,
removed while training): its replicas start again on the head, its shard copy fails over
to the standby there, and the job goes on to the end with exact push accounting."""

import threading
import time

import pytest
from support.cluster import two_node_cluster

from distbelief import DownpourSGD, data, models

FAST_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
              "health_check_failure_threshold": 3}  # a dead node noticed in seconds


@pytest.fixture
def two_nodes():
    # 2 + 2 CPUs for a shard, its standby and 2 replicas (one CPU each): with the standby
    # spread off its primary's node, each node has room for one replica
    with two_node_cluster(2, 2, _system_config=FAST_DEATH) as (cluster, second):
        yield cluster, second


@pytest.mark.timeout(300)
def test_a_node_that_leaves_has_its_replicas_started_again_without_stopping_the_job(two_nodes):
    cluster, second = two_nodes
    ds = data.digits()
    trainer = DownpourSGD(models.mlp(64, 32, 10), replicas=2, shards=1, shard_backups=1,
                          steps=300, address=cluster.address)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=trainer.fit(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test)))
    thread.start()
    placed = None
    while placed is None and thread.is_alive():
        events = trainer.job.events if trainer.job else []
        placed = next((e for e in events if e["event"] == "placement"), None)
        time.sleep(0.05)
    on_second = [i for i, node in enumerate(placed["replicas"]) if node == second.node_id]
    while thread.is_alive() and sum(e["event"] == "step" for e in trainer.job.events) < 100:
        time.sleep(0.05)
    cluster.remove_node(second)
    thread.join(timeout=240)
    result = outcome["r"]
    assert on_second, placed  # SPREAD put a replica on the second node
    failed = sorted({e["replica"] for e in result.events if e["event"] == "replica_failed"})
    assert failed == on_second  # the second node's replicas died with it, and only those
    steps = [e for e in result.events if e["event"] == "step"]
    for i in range(2):  # ... and were started again: every replica ran all its steps
        assert max(e["step"] for e in steps if e["replica"] == i) == 299
    assert result.test_accuracy > 0.85
    [accounting] = [e for e in result.events if e["event"] == "push_accounting"]
    assert accounting["exact"]
    assert all(a["lost_with_shard"] == 0 for a in accounting["shards"])
