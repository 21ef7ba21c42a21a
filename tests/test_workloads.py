"""Your data and your model: a user's factory file from the command line, a torch Dataset and
a per-replica stream factory through the API, a data folder trained on through the API."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from distbelief import DownpourSGD, SandblasterLBFGS, data, models, ondisk
from distbelief.errors import UserError

pytestmark = pytest.mark.usefixtures("ray_local")

NET = '''
import torch
from torch import nn


class Net(nn.Module):  # a class of this file only: replicas get it pickled by value
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def build(hidden=8):
    return Net(hidden)
'''


def final_accuracy(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("final test_accuracy="), stdout
    return float(last.split()[1].split("=")[1])


def test_a_user_factory_file_trains_from_the_command_line(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "net.py").write_text(NET)
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.cli", "train", "--model", "./tmp/net.py:build",
         "--model-arg", "hidden=32", "--replicas", "2", "--shards", "1", "--steps", "100",
         "--num-cpus", "2", "--run-dir", "run", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_accuracy(proc.stdout) > 0.85
    assert '"model_args": [' in (tmp_path / "run" / "config.json").read_text()


def test_the_cnn_on_real_mnist_reaches_95_percent_with_the_command_lines_defaults(tmp_path):
    """Issue 15's acceptance command as a newcomer types it: ``--dataset mnist`` resolves to
    Adam (lr 0.001) on the shards, 300 steps of 32 per replica."""
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.cli", "train", "--dataset", "mnist", "--model", "cnn",
         "--replicas", "2", "--shards", "2", "--run-dir", "run", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_accuracy(proc.stdout) >= 0.95
    assert '"optimizer": "adam"' in (tmp_path / "run" / "config.json").read_text()


def test_a_data_folder_trains_from_the_command_line(tmp_path):
    # the folder tool in this process (tests/test_ondisk.py checks what it writes)
    assert ondisk.main(["digits", str(tmp_path / "data"), "--rows-per-file", "500"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.cli", "train", "--dataset", "data", "--replicas",
         "2", "--shards", "1", "--steps", "100", "--num-cpus", "2", "--run-dir", "run",
         "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_accuracy(proc.stdout) > 0.85  # scored on the folder's test split


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def trainer(**overrides) -> DownpourSGD:
    cfg = dict(replicas=2, shards=1, steps=150, batch_size=32, eval_every_s=5.0)
    return DownpourSGD(models.mlp(64, 32, 10, seed=0), **(cfg | overrides))


def sources(result) -> set[str]:
    """What the replicas read their rows from (their ``replica_data`` events)."""
    return {e["data_source"] for e in result.events if e["event"] == "replica_data"}


def test_a_torch_dataset_trains_through_the_api(digits):
    train = TensorDataset(torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train))
    test = TensorDataset(torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test))
    result = trainer().fit(train, None, test)  # the test Dataset is scored in batches
    assert result.test_accuracy > 0.85
    assert sources(result) == {"TorchRows"}


def test_a_dataset_gives_the_same_batches_as_the_arrays(digits):
    arrays = trainer(replicas=1, steps=30, n_fetch=1).fit(digits.x_train, digits.y_train)
    rows = trainer(replicas=1, steps=30, n_fetch=1).fit(
        TensorDataset(torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)))
    for name, value in arrays.params.items():  # one replica: a deterministic run
        np.testing.assert_allclose(rows.params[name], value, atol=1e-6)


def test_a_per_replica_stream_factory_trains_through_the_api(digits):
    def batches(replica: int, replicas: int, seed: int):
        """Each replica builds its own data: its rows of digits, shuffled each epoch."""
        from distbelief.data import digits as load

        ds = load()
        x, y = ds.x_train[replica::replicas], ds.y_train[replica::replicas]
        order = np.random.default_rng([seed, replica]).permutation(len(y))
        for start in range(0, len(y) - 31, 32):
            rows = order[start:start + 32]
            yield torch.from_numpy(x[rows]), torch.from_numpy(y[rows])

    result = trainer().fit(batches, None, digits.x_test, digits.y_test)
    assert result.test_accuracy > 0.85
    assert sources(result) == {"stream"}


def test_a_data_folder_trains_through_the_api(digits, tmp_path):
    ondisk.write_arrays(tmp_path / "d", digits.x_train, digits.y_train, digits.x_test,
                        digits.y_test, rows_per_file=300)
    train, test = ondisk.DiskRows(tmp_path / "d"), ondisk.DiskRows(tmp_path / "d", "test")
    result = trainer().fit(train, None, test)
    assert result.test_accuracy > 0.85
    assert sources(result) == {"DiskRows"}


def test_sandblaster_refuses_a_dataset_in_one_line(digits):
    train = TensorDataset(torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train))
    model = models.mlp(64, 8, 10)
    with pytest.raises(UserError, match="SandblasterLBFGS needs the training rows as arrays"):
        SandblasterLBFGS(model, replicas=1, shards=1).fit(train)
