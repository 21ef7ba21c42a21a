"""BatchNorm buffers and --average through DownpourSGD.fit on a real (embedded) Ray."""

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from distbelief import DownpourSGD, data
from distbelief.checkpoint import load_arrays
from distbelief.data import ReplicaSampler

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def bn_model(ds, seed=0, hidden=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(ds.features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Linear(hidden, ds.classes))


def eval_accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(x))
    return int((out.argmax(1) == torch.from_numpy(y)).sum()) / len(y)  # as the evaluator counts


def test_batchnorm_fit_accuracy_equals_the_returned_models_eval_accuracy(digits, tmp_path):
    model = bn_model(digits)
    initial_var = model[1].running_var.clone()
    result = DownpourSGD(model, replicas=2, shards=2, optimizer="adagrad", lr=0.05,
                         steps=150, seed=0, run_dir=tmp_path / "run", num_cpus=4).fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    assert result.test_accuracy > 0.8
    assert eval_accuracy(model, digits.x_test, digits.y_test) == result.test_accuracy
    assert not torch.equal(model[1].running_var, initial_var)  # trained statistics
    assert int(model[1].num_batches_tracked) == 300  # every batch of both replicas
    saved = load_arrays(tmp_path / "run" / "params.safetensors")
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(saved[name], value.numpy())
        np.testing.assert_array_equal(result.params[name], value.numpy())


def test_one_replica_batchnorm_equals_single_process_training(digits):
    lr, bs, steps, seed = 0.1, 32, 30, 2
    model = bn_model(digits, seed)
    reference = copy.deepcopy(model)
    DownpourSGD(model, replicas=1, shards=2, n_fetch=1, n_push=1, optimizer="sgd", lr=lr,
                batch_size=bs, steps=steps, seed=seed, num_cpus=4).fit(
        digits.x_train, digits.y_train)
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    sampler = ReplicaSampler(len(digits.x_train), 0, 1, bs, seed)
    x, y = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    for k in range(steps):
        rows = torch.from_numpy(sampler.batch(k))
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x[rows]), y[rows]).backward()
        opt.step()
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), atol=1e-5, err_msg=name)


def test_ema_is_evaluated_returned_checkpointed_and_resumed(digits, tmp_path):
    run = tmp_path / "run"
    cfg = dict(replicas=1, shards=2, optimizer="adagrad", lr=0.05, steps=60, seed=1,
               average="ema:0.9", run_dir=run, num_cpus=4)
    model = bn_model(digits, 1)
    result = DownpourSGD(model, **cfg).fit(digits.x_train, digits.y_train,
                                           digits.x_test, digits.y_test)
    evals = [e for e in result.events if e["event"] == "eval"]
    assert evals and all(e["evaluated"] == "ema:0.9" for e in evals)
    manifest = json.loads((run / "checkpoints" / "checkpoint-000001.json").read_text())
    shards = [load_arrays(run / "checkpoints" / s["file"]) for s in manifest["shards"]]
    average = np.concatenate([s["average"] for s in shards])
    assert all(s["average_count"][0] == s_m["version"]
               for s, s_m in zip(shards, manifest["shards"]))
    flat = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    np.testing.assert_array_equal(flat, average)  # the returned model is the average
    last = np.concatenate([s["params"] for s in shards])
    assert not np.allclose(last, average)
    assert eval_accuracy(model, digits.x_test, digits.y_test) == result.test_accuracy
    resumed = bn_model(digits, 5)
    again = DownpourSGD(resumed, **{**cfg, "resume": str(run)}).fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    flat = np.concatenate([p.detach().reshape(-1).numpy() for p in resumed.parameters()])
    np.testing.assert_array_equal(flat, average)  # the average came back from the checkpoint
    assert again.test_accuracy == result.test_accuracy
    for name, value in model.state_dict().items():  # and the buffers with it
        np.testing.assert_array_equal(resumed.state_dict()[name].numpy(), value.numpy())
    last_model = bn_model(digits, 1)
    DownpourSGD(last_model, **{**cfg, "resume": str(run), "average_final": False,
                               "run_dir": str(run)}).fit(digits.x_train, digits.y_train)
    flat = np.concatenate([p.detach().reshape(-1).numpy() for p in last_model.parameters()])
    np.testing.assert_array_equal(flat, last)  # --no-average-final: the last parameters
