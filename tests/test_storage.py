"""storage.py and checkpoint.py against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import numpy as np
import pytest
from support.s3 import objects, s3_server

from distbelief import storage
from distbelief.checkpoint import (
    latest_checkpoint,
    load_arrays,
    save_arrays,
    shard_file,
    write_manifest,
)
from distbelief.errors import UserError
from distbelief.limits import check_run_dir
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ShardCore


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        yield endpoint


def test_paths_and_urls_join_and_split():
    assert storage.join("s3://b/p/", "checkpoints", "x.json") == "s3://b/p/checkpoints/x.json"
    assert storage.join("runs/a", "checkpoints") == "runs/a/checkpoints"
    assert storage.join("file:///tmp/a", "c") == "/tmp/a/c"
    assert storage.is_url("s3://b") and not storage.is_url("file:///x")
    assert not storage.is_url("runs/a")
    assert storage.basename("s3://b/p/c/x.safetensors") == "x.safetensors"
    assert storage.local_mirror("s3://b/p/q").as_posix() == "runs/mirror/s3/b/p/q"


def test_bytes_round_trip_list_and_remove_on_s3(s3):
    base = "s3://runs/pure"
    storage.write_bytes(storage.join(base, "a", "one.bin"), b"1")
    storage.write_bytes(storage.join(base, "a", "two.bin"), b"22")
    assert storage.read_bytes(storage.join(base, "a", "two.bin")) == b"22"
    assert storage.listdir(storage.join(base, "a")) == ["one.bin", "two.bin"]
    assert storage.listdir(storage.join(base, "none")) == []
    storage.remove(storage.join(base, "a", "one.bin"))
    storage.remove(storage.join(base, "a", "never.bin"))  # absent: nothing to do
    assert objects("pure/") == ["pure/a/two.bin"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(base, "a", "one.bin"))


def test_safetensors_go_to_s3_whole_and_come_back_bit_for_bit(s3):
    arrays = {"params": np.arange(7, dtype=np.float32) / 3, "n": np.array([5], np.int64)}
    save_arrays("s3://runs/st/x.safetensors", arrays, {"version": "4"})
    back, metadata = load_arrays("s3://runs/st/x.safetensors", with_metadata=True)
    assert metadata == {"version": "4"}
    assert all(back[k].tobytes() == arrays[k].tobytes() and back[k].dtype == arrays[k].dtype
               for k in arrays)
    with pytest.raises(UserError, match="does not exist"):
        load_arrays("s3://runs/st/missing.safetensors")
    storage.write_bytes("s3://runs/st/bad.safetensors", b"\0" * 64)
    with pytest.raises(UserError, match="is corrupt or not safetensors"):
        load_arrays("s3://runs/st/bad.safetensors")


def test_checkpoints_on_s3_keep_the_newest_two_and_resume_on_another_count(s3):
    run = "s3://runs/ckpt"
    plan = ShardPlan.build([("w", (6,)), ("b", (3,))], 2)
    cores = [ShardCore(i, np.full(plan.shard_size(i), i, np.float32), Adagrad(0.1))
             for i in range(2)]
    for number in (1, 2, 3):
        for core in cores:
            core.push(np.ones(core.params.size, np.float32), core.version)
        for i, core in enumerate(cores):
            core.save(shard_file(run, number, i))
        write_manifest(run, number, [c.version for c in cores], plan, ["accumulator"], {})
    assert objects("ckpt/") == [f"ckpt/checkpoints/{name}" for name in (
        "000002-shard0.safetensors", "000002-shard1.safetensors",
        "000003-shard0.safetensors", "000003-shard1.safetensors",
        "checkpoint-000002.json", "checkpoint-000003.json")]
    manifest, parts = latest_checkpoint(run, ShardPlan.build([("w", (6,)), ("b", (3,))], 3),
                                        ["accumulator"])
    assert manifest["checkpoint"] == 3 and manifest["resharded_from"] == 2
    want = np.concatenate([c.params for c in cores]).tobytes()
    assert np.concatenate([p["params"] for p in parts]).tobytes() == want


def test_unwritable_or_unknown_run_dirs_are_one_line_user_errors(s3):
    check_run_dir("s3://runs/fine")  # writable: the probe object is gone again
    assert objects("fine/") == []
    with pytest.raises(UserError, match="--run-dir s3://no-such-bucket/x cannot be written") \
            as err:
        check_run_dir("s3://no-such-bucket/x")
    assert "\n" not in str(err.value) and "AWS_ENDPOINT_URL" in str(err.value)
    with pytest.raises(UserError, match="needs a library that is not installed") as err:
        check_run_dir("gcs://bucket/x")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="nosuchscheme"):
        check_run_dir("nosuchscheme://bucket/x")


def test_s3_run_dir_without_a_server_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(UserError, match="cannot be written") as err:
        check_run_dir("s3://runs/unreachable")
    assert "\n" not in str(err.value)
