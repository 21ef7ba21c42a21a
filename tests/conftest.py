import os
import tempfile

import pytest
import ray

from distbelief import cluster

# Every Ray process this test run starts (embedded sessions, `ray start` nodes, CLI
# subprocesses) keeps its session under this folder, so the leftover check below sees
# only this run's processes, not those of another test run on the same machine.
RAY_ROOT = tempfile.mkdtemp(prefix="dbt-", dir="/tmp")
os.environ["RAY_TMPDIR"] = RAY_ROOT


@pytest.fixture(scope="module")
def ray_local():
    """One embedded, loopback-only Ray session per test module, shut down after it."""
    cluster.connect(num_cpus=4, object_store_memory=256 * 2**20)
    yield
    ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left Ray server processes behind."""
    import time

    import psutil

    def leftovers():
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if any(("raylet" in part or "gcs_server" in part) and "ray/core" in part
                       for part in (p.info["cmdline"] or []))
                and any(RAY_ROOT in part for part in (p.info["cmdline"] or []))]

    deadline = time.time() + 15
    while leftovers() and time.time() < deadline:
        time.sleep(0.5)
    if leftovers():
        print(f"\nRay processes left behind by the tests: {leftovers()}")
        session.exitstatus = 1
