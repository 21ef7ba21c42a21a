"""The embedded default opens no port to the network, returns results up to
``INLINE_BYTES`` inside the reply, and our actors' calls skip Ray's task events."""

import ipaddress
import os
import time

import numpy as np
import psutil
import pytest
import ray

from distbelief import cluster
from distbelief.errors import UserError
from distbelief.job import Job

pytestmark = pytest.mark.usefixtures("ray_local")


def test_embedded_ray_listens_on_loopback_only():
    @ray.remote
    def ping():
        return os.getpid()

    ray.get(ping.remote())  # make sure worker processes exist too
    me = psutil.Process()
    ray_procs = [me, *me.children(recursive=True)]
    listening = []
    for proc in ray_procs:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [(proc.name(), c.laddr.ip, c.laddr.port) for c in conns
                      if c.status == psutil.CONN_LISTEN]
    names = {name for name, _, _ in listening}
    assert any("gcs" in n for n in names) and any("raylet" in n for n in names), names
    exposed = [(n, ip, port) for n, ip, port in listening
               if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
    assert exposed == []


def test_embedded_ray_returns_results_up_to_a_mebibyte_inline():
    @ray.remote(num_cpus=0)
    class Slice:
        def fetch(self, nbytes: int) -> np.ndarray:
            return np.ones(nbytes // 4, np.float32)

    shard = Slice.remote()
    small, large = (shard.fetch.remote(n) for n in (cluster.INLINE_BYTES - 4096,
                                                     2 * cluster.INLINE_BYTES))
    assert ray.get(small).nbytes > 100 * 1024  # above Ray's own default limit
    ray.get(large)
    # The owner may learn a stored object's location after the reply (one CI run of many
    # saw it empty right after the get), so ask until the large one's arrives
    deadline = time.monotonic() + 10
    where = ray.experimental.get_object_locations([small, large])
    while not where[large]["node_ids"] and time.monotonic() < deadline:
        time.sleep(0.05)
        where = ray.experimental.get_object_locations([small, large])
    assert where[small]["node_ids"] == []  # in the reply: no object-store copy anywhere
    assert len(where[large]["node_ids"]) == 1  # through the node's object store


def test_inline_bytes_comes_from_the_environment_or_names_the_fix(monkeypatch):
    monkeypatch.delenv(cluster.INLINE_ENV, raising=False)
    assert cluster.inline_bytes() == cluster.INLINE_BYTES
    monkeypatch.setenv(cluster.INLINE_ENV, "102400")
    assert cluster.inline_bytes() == 102400
    monkeypatch.setenv(cluster.INLINE_ENV, "1MB")
    with pytest.raises(UserError, match="DISTBELIEF_INLINE_BYTES='1MB' is not a byte"):
        cluster.inline_bytes()


def test_task_events_are_off_unless_the_environment_turns_them_on(monkeypatch):
    monkeypatch.delenv(cluster.TASK_EVENTS_ENV, raising=False)
    assert cluster.actor_options() == {"enable_task_events": False}
    monkeypatch.setenv(cluster.TASK_EVENTS_ENV, "1")
    assert cluster.actor_options() == {"enable_task_events": True}
    monkeypatch.setenv(cluster.TASK_EVENTS_ENV, "0")
    assert cluster.actor_options() == {"enable_task_events": False}
    monkeypatch.setenv(cluster.TASK_EVENTS_ENV, "yes")
    with pytest.raises(UserError, match="DISTBELIEF_TASK_EVENTS='yes': set it to 1"):
        cluster.actor_options()


def test_actors_made_by_a_job_skip_task_events_and_their_handles_carry_it(monkeypatch):
    """What ``enable_task_events`` an actor's calls get is its handle's
    ``_ray_enable_task_events`` (Ray's documented handle attribute), also where the handle
    travels to: a replica calls its shards through handles passed to it."""
    @ray.remote(num_cpus=0)
    class Probe:
        def flag(self, handles: list) -> bool:
            return handles[0]._ray_enable_task_events

    job = Job("events", "downpour", None)
    monkeypatch.delenv(cluster.TASK_EVENTS_ENV, raising=False)
    off = job.actor(Probe, "probe", 0)
    monkeypatch.setenv(cluster.TASK_EVENTS_ENV, "1")
    on = job.actor(Probe, "probe", 1)
    assert (off._ray_enable_task_events, on._ray_enable_task_events) == (False, True)
    assert ray.get(on.flag.remote([off])) is False
    assert ray.get(off.flag.remote([on])) is True
    for handle in (off, on):
        ray.kill(handle)
