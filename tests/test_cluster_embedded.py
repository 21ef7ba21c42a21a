"""The embedded default opens no port to the network."""

import ipaddress
import os

import psutil
import pytest
import ray

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
