"""A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) for the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def two_node_cluster(head_cpus: int, second_cpus: int, **head_args
                     ) -> Iterator[tuple[Cluster, object]]:
    """A head with ``head_cpus`` CPUs and a second node with ``second_cpus``; yields the
    cluster and the second node (``.node_id``), and shuts both down (and any Ray session
    connected to them) afterwards, even when the test failed."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, **head_args})
    second = cluster.add_node(num_cpus=second_cpus)
    cluster.wait_for_nodes()
    try:
        yield cluster, second
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
