"""TrainConfig on its own (no Ray): path fields, sections, resolved defaults, TOML files."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from distbelief import config
from distbelief.config import FIELDS, PORTIONS_PER_REPLICA, SECTIONS, TrainConfig, flag
from distbelief.config_file import load_toml, sections, to_toml
from distbelief.errors import UserError


def test_path_fields_accept_pathlib_and_stay_json_ready(tmp_path):
    cfg = TrainConfig(run_dir=tmp_path / "run", resume=tmp_path / "old",
                      dataset=Path("data.npz")).validate()
    assert (cfg.run_dir, cfg.resume, cfg.dataset) == (str(tmp_path / "run"),
                                                     str(tmp_path / "old"), "data.npz")
    assert json.loads(json.dumps(cfg.to_dict()))["run_dir"] == str(tmp_path / "run")


def test_a_pathlib_dataset_that_is_no_npz_is_a_one_line_error():
    with pytest.raises(UserError, match="--dataset 'digits.csv' is unknown"):
        TrainConfig(dataset=Path("digits.csv")).validate()


def test_every_field_has_a_section_and_help_text():
    assert len(FIELDS) == len(dataclasses.fields(TrainConfig))
    for name, f in FIELDS.items():
        assert f.metadata["section"] in SECTIONS, name
        assert len(f.metadata["help"]) > 5, name
    assert {f.metadata["section"] for f in FIELDS.values()} == set(SECTIONS)


def test_flags_keep_their_spellings():
    assert [flag(n) for n in ("n_fetch", "eval_every_s", "checkpoint_every_s", "slow_replicas",
                              "local_update", "backups", "partition_by")] == [
        "--n-fetch", "--eval-every", "--checkpoint-every", "--slow-replica",
        "--no-local-update", "--no-backups", "--partition-by"]


def test_resolve_fills_every_automatic_default_in_one_place(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = TrainConfig(replicas=3, shards=2, partitions=2).validate()
    assert (cfg.samples, cfg.batch_size, cfg.steps) == (10000, 32, 300)
    assert cfg.portions == PORTIONS_PER_REPLICA * 3
    assert cfg.num_cpus == 3 * 2 + 2
    assert cfg.run_dir is None and cfg.address is None  # the Python API: no folder, embedded
    assert TrainConfig(replicas=1, shards=1).validate().num_cpus == 2
    cli = TrainConfig().validate(command_line=True)
    assert cli.address == "10.0.0.1:6379" and cli.run_dir.startswith("runs" + os.sep)
    monkeypatch.delenv("RAY_ADDRESS")
    assert TrainConfig().validate(command_line=True).address is None
    assert TrainConfig(resume="old").validate().run_dir == "old"
    assert TrainConfig(resume="old", run_dir="new").validate(command_line=True).run_dir == "new"


def test_resolve_keeps_given_values_and_is_idempotent():
    cfg = TrainConfig(samples=5, batch_size=7, steps=9, portions=3, num_cpus=1,
                      address="h:1", run_dir="r").validate(command_line=True)
    again = dataclasses.replace(cfg).validate(command_line=True)
    assert again == cfg
    assert (cfg.samples, cfg.batch_size, cfg.steps, cfg.portions, cfg.num_cpus, cfg.address,
            cfg.run_dir) == (5, 7, 9, 3, 1, "h:1", "r")


def test_click_data_gets_its_own_defaults(tmp_path):
    ctr = TrainConfig(dataset="ctr").validate()
    assert (ctr.samples, ctr.batch_size, ctr.steps) == (2_000_000, 1024, 450)
    assert TrainConfig(dataset="ctr", steps=10).validate().steps == 10
    clicks = tmp_path / "clicks.npz"
    np.savez(clicks, ids=np.zeros((4, 2), np.int64), labels=np.zeros(4))
    dense = tmp_path / "dense.npz"
    np.savez(dense, x_train=np.zeros((4, 2)))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    assert TrainConfig(dataset=clicks).validate().steps == 450
    assert TrainConfig(dataset=str(dense)).validate().steps == 300
    assert not TrainConfig(dataset=str(junk)).click_data
    assert not TrainConfig(dataset=str(tmp_path / "missing.npz")).click_data


def test_warmstart_is_checked_against_the_resolved_steps():
    with pytest.raises(UserError, match=r"--warmstart-steps \(301\) exceeds --steps \(300\)"):
        TrainConfig(warmstart_steps=301).validate()
    assert TrainConfig(dataset="ctr", warmstart_steps=400).validate().steps == 450


def test_toml_round_trip(tmp_path):
    cfg = TrainConfig(replicas=3, n_fetch=2, lr=0.1, slow_replicas={1: 2.5}, local_update=False,
                      run_dir=str(tmp_path / 'a "quoted"\\dir'), l2=1e-5).validate()
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert TrainConfig(**load_toml(path)) == cfg
    assert sections(cfg)["downpour"]["n_fetch"] == 2
    assert "address" not in sections(cfg)["run"]  # None values are left out
    assert "[downpour]\n" in to_toml(cfg)


def test_toml_file_sets_fields_by_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[downpour]\nn_fetch = 2\nlr = 1\n[parallelism]\nreplicas = 3\n'
                    'slow_replicas = { 0 = 4 }\n[sandblaster]\nbackups = false\n'
                    '[data]\ndataset = "synthetic"\n')
    assert load_toml(path) == {"n_fetch": 2, "lr": 1.0, "replicas": 3, "slow_replicas": {0: 4.0},
                               "backups": False, "dataset": "synthetic"}
    assert isinstance(load_toml(path)["lr"], float)


BAD_TOML = [
    ("[downpour\nn_fetch = 2\n", "is not valid TOML ("),
    ("[optimizers]\nlr = 1.0\n", "unknown section [optimizers]: use [data], [model]"),
    ("lr = 1.0\n", "lr is outside any section: write it under [downpour]"),
    ("downpour = 1\n", "downpour must be a table: write [downpour] and its options below it"),
    ("[downpour]\nn_fetches = 2\n", "[downpour] has no option 'n_fetches': choose from"),
    ("[model]\nn_fetch = 2\n", "n_fetch belongs in [downpour], not [model]: move it there"),
    ("[downpour]\nn_fetch = \"two\"\n", '[downpour] n_fetch = "two" must be an integer, e.g. '
                                        "n_fetch = 1"),
    ("[downpour]\nn_fetch = 2.5\n", "n_fetch = 2.5 must be an integer"),
    ("[downpour]\nn_fetch = true\n", "n_fetch = true must be an integer"),
    ("[downpour]\nlr = true\n", "lr = true must be a number, e.g. lr = 0.05"),
    ("[downpour]\nlocal_update = 0\n", "local_update = 0 must be true or false"),
    ("[run]\nrun_dir = 3\n", 'run_dir = 3 must be a string, e.g. run_dir = "TEXT"'),
    ("[run]\nnum_cpus = \"4\"\n", 'num_cpus = "4" must be an integer, e.g. num_cpus = 2'),
    ("[data]\nsteps = 3\n", "steps belongs in [downpour], not [data]"),
    ("[downpour]\nsteps = \"x\"\n", "steps = \"x\" must be an integer, e.g. steps = 300"),
    ("[parallelism]\nslow_replicas = { x = 4.0 }\n", "slow_replicas must be a table of index"),
    ("[parallelism]\nslow_replicas = [\"0:4\"]\n", "e.g. slow_replicas = { 0 = 4.0 }"),
]


@pytest.mark.parametrize("text,message", BAD_TOML, ids=[m for _, m in BAD_TOML])
def test_bad_toml_is_a_one_line_user_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_toml(path)
    assert message in str(err.value) and str(err.value).startswith(f"--config {path}")
    assert len(str(err.value).splitlines()) == 1


def test_unreadable_config_files(tmp_path):
    with pytest.raises(UserError, match="nope.toml: no such file: check the path"):
        load_toml(tmp_path / "nope.toml")
    with pytest.raises(UserError, match="cannot read it"):
        load_toml(tmp_path)
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_toml(binary)


def test_shared_constants_are_defined_once():
    from distbelief import data
    from distbelief.ps import codec
    from distbelief.sandblaster import schedule
    from distbelief.sparse import ctr

    assert codec.GRAD_DTYPES is config.GRAD_DTYPES and set(codec.WIRE_DTYPES) == set(
        config.GRAD_DTYPES)
    assert ctr.TEST_FRACTION is data.TEST_FRACTION
    assert schedule.PORTIONS_PER_REPLICA is config.PORTIONS_PER_REPLICA


def test_mnist_and_adaptive_optimizers_get_their_own_automatic_defaults():
    assert (TrainConfig().validate().optimizer, TrainConfig().validate().lr) == ("adagrad", 0.05)
    mnist = TrainConfig(dataset="mnist").validate()
    assert (mnist.optimizer, mnist.lr) == ("adam", 0.001)
    assert TrainConfig(dataset="mnist", optimizer="adagrad").validate().lr == 0.05
    assert TrainConfig(optimizer="AdamW").validate().lr == 0.001  # any spelling of the class
    assert TrainConfig(dataset="mnist", lr=0.01).validate().lr == 0.01  # a given value stays
