"""usermodel: --model MODULE:CALLABLE and --model-arg, every failure one line naming the flag."""

import sys

import pytest
import torch
from torch import nn

from distbelief.errors import UserError
from distbelief.usermodel import build_model, is_factory_spec, load_factory, parse_model_args

NETS = """
from torch import nn

def build(features=64, hidden=16, classes=10, bias=True):
    return nn.Sequential(nn.Linear(features, hidden, bias=bias), nn.ReLU(),
                         nn.Linear(hidden, classes))

class Net:
    @staticmethod
    def make(width=8):
        return nn.Sequential(nn.Linear(64, width), nn.Linear(width, 10))

def not_a_module():
    return [1, 2]

def broken():
    raise ValueError("no\\nway")

def normed():
    return nn.Sequential(nn.Linear(64, 10), nn.BatchNorm1d(10))

NUMBER = 3
"""


@pytest.fixture
def nets(tmp_path, monkeypatch):
    path = tmp_path / "user_nets.py"
    path.write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("user_nets", None)


def one_line_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "--model" in message
    return message


def test_model_args_are_parsed_as_literals():
    args = parse_model_args(["hidden=128", "rate=0.5", "bias=false", "act=relu", "tag='7'",
                             "flag=True", "none=None", "expr=1+"])
    assert args == {"hidden": 128, "rate": 0.5, "bias": False, "act": "relu", "tag": "7",
                    "flag": True, "none": None, "expr": "1+"}
    assert parse_model_args([]) == {}


@pytest.mark.parametrize("items, match", [
    (["hidden"], "--model-arg 'hidden' is not KEY=VALUE"),
    (["=3"], "is not KEY=VALUE"),
    (["a b=3"], "is not KEY=VALUE"),
    (["h=1", "h=2"], "--model-arg h is given twice"),
])
def test_bad_model_args_are_one_line(items, match):
    with pytest.raises(UserError, match=match):
        parse_model_args(items)


def test_builtin_names_stay_names():
    assert not is_factory_spec("mlp") and not is_factory_spec("cnn")
    assert is_factory_spec("pkg.mod:build") and is_factory_spec("./net.py:build")


def test_factory_by_module_name_and_by_file_path(nets):
    by_name = build_model("user_nets:build", {"hidden": 8}, (64,), 10, seed=3)
    by_path = build_model(f"{nets}:build", {"hidden": 8}, (64,), 10, seed=3)
    assert by_name[0].out_features == 8
    for a, b in zip(by_name.parameters(), by_path.parameters()):
        assert torch.equal(a, b)  # seeded: same weights either way
    assert isinstance(build_model(f"{nets}:Net.make", {}, (64,), 10), nn.Module)


def test_the_dummy_forward_leaves_training_mode_and_batchnorm_statistics_alone(nets):
    model = build_model("user_nets:normed", {}, (64,), 10)
    assert model.training
    assert torch.equal(model[1].running_mean, torch.zeros(10))
    assert int(model[1].num_batches_tracked) == 0


@pytest.mark.parametrize("spec, args, shape, match", [
    ("nosuchmod_xyz:build", {}, (64,), "no module named 'nosuchmod_xyz': put its folder on "
     "PYTHONPATH"),
    ("{path}x:build", {}, (64,), "no such file"),
    ("user_nets:missing", {}, (64,), "user_nets has no attribute 'missing'"),
    ("user_nets:NUMBER", {}, (64,), r"NUMBER is not callable \(int\)"),
    ("user_nets:not_a_module", {}, (64,), "returned a list, not a torch.nn.Module"),
    ("user_nets:broken", {}, (64,), "raised ValueError: no way: fix the factory"),
    ("user_nets:build", {"depth": 2}, (64,), "match --model-arg to its parameters"),
    ("user_nets:build", {}, (784,), r"does not fit the data: a batch of shape \(2, 784\)"),
    ("user_nets:build", {"classes": 3}, (64,), r"to \(2, 3\), not \(2, 10\)"),
    ("build", {}, (64,), "neither mlp, lc, cnn nor MODULE:CALLABLE"),
    ("user_nets:", {}, (64,), "nor MODULE:CALLABLE"),
])
def test_every_factory_failure_is_one_line_naming_the_flag(nets, spec, args, shape, match):
    one_line_error(match, build_model, spec.format(path=nets), args, shape, 10)


def test_a_file_that_fails_to_import_is_one_line(tmp_path):
    bad = tmp_path / "bad_net.py"
    bad.write_text("import torch\nraise RuntimeError('boom')\n")
    one_line_error("importing bad_net.py raised RuntimeError: boom: fix the file",
                   load_factory, f"{bad}:build")
    needs = tmp_path / "needs_net.py"
    needs.write_text("import not_installed_pkg_xyz\n")
    one_line_error("raised ModuleNotFoundError", load_factory, f"{needs}:build")


CUSTOM = """
import torch
from torch import nn

class Doubler(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.linear = nn.Linear(features, 10)

    def forward(self, x):
        return 2 * self.linear(x)

def build(features=64):
    return Doubler(features)
"""


def test_a_model_from_a_file_reaches_a_process_that_cannot_import_the_file(tmp_path):
    import subprocess

    from ray import cloudpickle

    from distbelief.usermodel import ship_by_value

    path = tmp_path / "custom_net.py"
    path.write_text(CUSTOM)
    spec = f"{path}:build"
    model = build_model(spec, {"features": 4}, (4,), 10, seed=0)
    ship_by_value(load_factory(spec))
    blob = cloudpickle.dumps(model)
    path.unlink()
    code = ("import pickle, sys, torch; m = pickle.loads(sys.stdin.buffer.read()); "
            "print(type(m).__name__, m(torch.ones(1, 4)).shape[1])")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == ["Doubler", "10"]


def test_parameters_are_counted_without_allocating_them():
    from distbelief import models
    from distbelief.usermodel import count_parameters

    huge = count_parameters(lambda: models.mlp(100_000, 1_000_000, 10))  # 400 GB in float32
    assert huge == 100_000 * 1_000_000 + 1_000_000 + 1_000_000 * 10 + 10
    assert count_parameters(lambda: models.cnn(784, 10)) == 454_922
