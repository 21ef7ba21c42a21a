"""Two Ray nodes (ray.cluster_utils.Cluster: a head and one added node): replicas placed on
the second node read their own rows from the data folder; the driver ships only its path."""

import json

import pytest
from support.cluster import two_node_cluster

from distbelief import DownpourSGD, data, models, ondisk


@pytest.fixture
def two_nodes():
    with two_node_cluster(2, 2) as (cluster, second):
        yield cluster, second.node_id


@pytest.mark.timeout(300)
def test_replicas_on_the_second_node_read_their_rows_from_the_data_folder(two_nodes, tmp_path):
    cluster, second = two_nodes
    ds = data.digits()
    folder = ondisk.write_arrays(tmp_path / "digits", ds.x_train, ds.y_train, ds.x_test,
                                 ds.y_test, rows_per_file=300)
    trainer = DownpourSGD(models.mlp(64, 32, 10), replicas=2, shards=1, steps=100,
                          address=cluster.address, run_dir=tmp_path / "run")
    result = trainer.fit(ondisk.DiskRows(folder), None, ondisk.DiskRows(folder, "test"))
    assert result.test_accuracy > 0.85
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    read = [e for e in events if e["event"] == "replica_data"]
    assert len(read) == 2 and {e["data_source"] for e in read} == {"DiskRows"}
    on_second = [e["replica"] for e in read if e["node"] == second]
    assert on_second, read  # SPREAD placed a replica there; it read DiskRows itself
    placement = next(e for e in events if e["event"] == "placement")
    assert second in placement["replicas"]
