import pytest
import ray

from distbelief import cluster


@pytest.fixture(scope="module")
def ray_local():
    """One embedded, loopback-only Ray session per test module, shut down after it."""
    cluster.connect(num_cpus=4, object_store_memory=256 * 2**20)
    yield
    ray.shutdown()
