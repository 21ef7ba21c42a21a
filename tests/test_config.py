"""TrainConfig on its own (no Ray): path fields and its JSON form."""

import json
from pathlib import Path

import pytest

from distbelief.config import TrainConfig
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
