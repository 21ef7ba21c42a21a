"""limits: requests beyond memory, cores or a writable run folder, with fake resources."""

import os

import pytest

from distbelief.errors import UserError
from distbelief.limits import (
    Resources,
    check_cpus,
    check_data,
    check_model,
    check_run_dir,
    check_synthetic,
    human,
    limited_store,
    model_bytes,
    synthetic_bytes,
)

GB = 2**30


def one_line(match: str, fn, *args) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_object_store_holds_data_and_the_live_parameter_copies_within_memory():
    mb = 2**20
    # 17M parameters (69 MB), 2 replicas, 10 MB of data: 4 data copies, 3 a replica + 16
    assert limited_store(10 * mb, 17_000_000, 2, 24 * GB) == 40 * mb + 22 * 68_000_000
    more = limited_store(10 * mb, 17_000_000, 3, 24 * GB)
    assert more - limited_store(10 * mb, 17_000_000, 2, 24 * GB) == 3 * 68_000_000
    assert limited_store(0, 5_000, 4, 24 * GB) == 128 * mb  # small models: the floor
    # 100M parameters: 22 copies are 8.8 GB, which 64 GB holds; on 24 GB the store is held
    # to Ray's default share (30%), where ray.init would refuse more (64 copies: 25.6 GB)
    assert limited_store(0, 100_000_000, 2, 64 * GB) == 22 * 400_000_000
    assert limited_store(0, 100_000_000, 2, 24 * GB) == int(0.3 * 24 * GB)


def test_human_sizes():
    assert [human(n) for n in (512, 2048, 3 * 2**20, 1.5 * GB, 2**41)] == [
        "512 B", "2 KB", "3 MB", "1.5 GB", "2 TB"]


def test_model_copies_count_replicas_shards_optimizer_and_driver():
    assert model_bytes(1000, replicas=1, slots=0) == 1000 * 4 * 5
    assert model_bytes(1000, replicas=4, slots=1) == 1000 * 4 * (12 + 3)


def test_a_model_beyond_memory_is_refused_naming_the_flags():
    ram = Resources(memory=16 * GB, cpus=8)
    check_model(100_000_000, 4, "adagrad", ram)  # 6 GB fits
    message = one_line(r"the model's 300,000,000 parameters need 16.8 GB with --replicas 4 "
                       r"and --optimizer adagrad .* but this machine has 16 GB available: use "
                       "fewer --replicas", check_model, 300_000_000, 4, "adagrad", ram)
    assert "cluster" in message
    one_line("the cluster has 1 GB", check_model, 10**8, 1, "sgd", Resources(GB, 64, True))


def test_synthetic_samples_beyond_memory_are_refused_with_the_largest_that_fits():
    ram = Resources(memory=GB, cpus=2)
    check_synthetic(10_000, 32, ram)
    assert synthetic_bytes(10_000, 32) < 12 * 2**20
    one_line(r"--samples 100,000,000 of 32 features need 109 GB to generate, but this machine "
             r"has 1 GB available: pass --samples 919,299 or fewer", check_synthetic,
             100_000_000, 32, ram)
    check_synthetic(919_299, 32, ram)
    one_line("--samples 919,300 of 32", check_synthetic, 919_300, 32, ram)


def test_in_memory_data_beyond_memory_points_to_a_data_folder():
    check_data("big.npz", GB // 4, Resources(GB, 2))
    one_line("--dataset big.npz holds 600 MB, 1.17 GB with the object store's copy, but this "
             "machine has 1 GB available: write it to a folder", check_data, "big.npz",
             600 * 2**20, Resources(GB, 2))


def test_replicas_beyond_cores_warn_and_an_absurd_count_is_refused():
    two = Resources(GB, 2)
    assert check_cpus(2, 1, 2, two) is None
    warning = check_cpus(4, 1, 2, two)
    assert warning == ("warning: --replicas 4 x --partitions 1 = 4 processes share 2 cores: each "
                       "runs at about 0.5 of a core; --replicas 2 gives each its own")
    assert check_cpus(16, 1, 4, two) is not None  # 8 a core still runs
    one_line(r"--replicas 9 x --partitions 2 = 18 processes on 2 cores is over 8 a core: pass "
             r"--replicas 1 \(one a core\)", check_cpus, 9, 2, 1, two)


def test_on_a_cluster_actors_beyond_its_cpus_are_refused():
    cluster = Resources.from_ray({"CPU": 8.0, "memory": 4.0 * GB, "object_store_memory": 1e9})
    assert cluster == Resources(4 * GB, 8.0, True)
    assert check_cpus(6, 1, 2, cluster) is None
    one_line("--replicas 7 x --partitions 1 and --shards 2 need 9 CPUs but the cluster has 8: "
             "pass fewer --replicas or --shards, or add nodes", check_cpus, 7, 1, 2, cluster)


def test_local_resources_are_measured():
    local = Resources.local()
    assert local.memory > 0 and local.cpus >= 1 and not local.cluster


def test_a_run_dir_that_is_a_file_or_under_a_file_is_refused_and_nothing_is_created(tmp_path):
    check_run_dir(tmp_path / "runs" / "a")  # creatable
    check_run_dir(tmp_path)  # exists
    assert not (tmp_path / "runs").exists()
    (tmp_path / "f").write_text("x")
    one_line("--run-dir .* is a file: give the path of a folder", check_run_dir, tmp_path / "f")
    one_line(r"--run-dir .*f/sub/run cannot be created: .*/f is a file", check_run_dir,
             tmp_path / "f" / "sub" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_run_dir_in_a_read_only_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    one_line("cannot be created: no write permission in", check_run_dir, locked / "run")
    one_line("cannot be written: no write permission in", check_run_dir, locked)


def test_a_run_dir_without_write_permission_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as root sees a 0o555 folder
    one_line("cannot be created: no write permission in", check_run_dir, tmp_path / "run")
    one_line("cannot be written: no write permission in", check_run_dir, tmp_path)
