"""--run-dir s3://... on real Ray against a real S3-compatible server (moto) on loopback: the
shards write their checkpoint files to the bucket, a run resumes from it and continues, and
on two nodes the shards (all on the second node) need no shared run folder."""

from __future__ import annotations

import json

import pytest
import ray
from support.cluster import two_node_cluster
from support.s3 import objects, s3_server

from distbelief import DownpourSGD, data, models, storage
from distbelief.checkpoint import read_manifest
from distbelief.cli import main


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:  # before any Ray process starts: they inherit the variables
        yield endpoint


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def events_of(url: str) -> list[dict]:
    return [json.loads(line) for line in
            storage.read_bytes(storage.join(url, "metrics.jsonl")).decode().splitlines()]


def test_cli_run_checkpoints_to_s3_resumes_from_it_and_continues(s3, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.chdir(tmp_path)  # the local mirror of the metrics goes under runs/mirror
    url = "s3://runs/cli"
    common = ["train", "--no-progress", "--replicas", "2", "--shards", "2"]
    assert main([*common, "--steps", "30", "--run-dir", url]) == 0, capsys.readouterr().err
    keys = objects("cli/")
    assert {"cli/metrics.jsonl", "cli/params.safetensors", "cli/config.json",
            "cli/plot.png"} <= set(keys)
    manifests = [k for k in keys if k.startswith("cli/checkpoints/checkpoint-")]
    first = read_manifest(url, int(manifests[-1].split("-")[1].split(".")[0]))
    assert [s["version"] for s in first["shards"]] == [60, 60]
    assert not (tmp_path / "runs" / "mirror" / "s3" / "runs" / "cli" / "checkpoints").exists()
    # resume from the bucket (the run folder defaults to it) on 3 shards and go on
    assert main([*common[:-1], "3", "--steps", "45", "--resume", url]) == 0, \
        capsys.readouterr().err
    events = events_of(url)
    assert [e["event"] for e in events].count("final") == 2  # one log across both runs
    second = events[[e["event"] for e in events].index("final") + 1:]
    assert next(e for e in second if e["event"] == "placement")["versions"] == [60] * 3
    last = [e for e in second if e["event"] == "checkpoint"][-1]
    assert last["versions"] == [90] * 3
    assert sorted({e["step"] for e in second if e["event"] == "step"}) == list(range(30, 45))


def test_cli_refuses_an_unwritable_bucket_in_one_line_before_training(s3, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--no-progress", "--steps", "5", "--run-dir", "s3://no-bucket/x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--run-dir s3://no-bucket/x cannot be written" in err[0]
    assert not (tmp_path / "runs").exists() and not ray.is_initialized()


@pytest.fixture
def two_nodes(s3):
    """A head with no CPUs (the driver) and a second node where every actor runs."""
    with two_node_cluster(0, 3) as (cluster, second):
        yield cluster, second.node_id


@pytest.mark.timeout(300)
def test_shards_on_the_second_node_checkpoint_into_s3(two_nodes, digits, tmp_path,
                                                      monkeypatch):
    cluster, second = two_nodes
    monkeypatch.chdir(tmp_path)
    url = "s3://runs/twonode"
    trainer = DownpourSGD(models.mlp(digits.features, 16, 10, 0), replicas=1, shards=2,
                          steps=40, seed=1, address=cluster.address, run_dir=url)
    result = trainer.fit(digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    assert result.run_dir == url and result.test_accuracy > 0.5
    placement = next(e for e in events_of(url) if e["event"] == "placement")
    assert placement["shards"] == [second, second]  # the shards wrote from the second node
    keys = objects("twonode/checkpoints/")
    assert "twonode/checkpoints/000001-shard0.safetensors" in keys
    assert "twonode/checkpoints/000001-shard1.safetensors" in keys
    assert [s["version"] for s in read_manifest(url, 1)["shards"]] == [40, 40]
    # locally only the driver's mirror: its final parameters, no checkpoint file
    assert {p.name for p in tmp_path.rglob("*.safetensors*")} <= {"params.safetensors"}
