"""The cluster path is real: two Ray nodes started with `ray start`, trained on with --address.

Nodes advertise 127.0.0.2 (loopback range; Ray rewrites 127.0.0.1 to the machine's external
address), and token authentication stays on with a token made for this test.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HOST = "127.0.0.2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(secrets.token_hex(32))
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    address = f"{HOST}:{port}"
    common = ["--node-ip-address", HOST, "--num-cpus", "2", "--disable-usage-stats"]
    try:
        subprocess.run([ray_cli, "start", "--head", "--port", str(port),
                        "--include-dashboard=false", *common], env=env, check=True,
                       capture_output=True, timeout=120)
        subprocess.run([ray_cli, "start", "--address", address, *common], env=env, check=True,
                       capture_output=True, timeout=120)
        yield address, env
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_train_on_a_two_node_cluster(two_nodes, tmp_path):
    address, env = two_nodes
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.cli", "train", "--address", address,
         "--replicas", "2", "--shards", "2", "--steps", "80", "--run-dir", str(run_dir),
         "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final test_accuracy=")
    assert float(last.split()[1].split("=")[1]) > 0.8
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    placement = next(e for e in events if e["event"] == "placement")
    nodes = set(placement["shards"]) | set(placement["replicas"])
    assert len(nodes) == 2, placement
    assert Path(run_dir / "params.safetensors").is_file()


def test_more_actors_than_the_clusters_cpus_is_one_line_and_exit_2(two_nodes, tmp_path):
    """The check uses the cluster's CPUs (4 here), not this machine's."""
    address, env = two_nodes
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.cli", "train", "--address", address,
         "--replicas", "4", "--shards", "2", "--run-dir", str(run_dir), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "need 6 CPUs but the cluster has 4" in lines[0] and "Traceback" not in proc.stderr
    assert not run_dir.exists()
