"""--precision bfloat16: replicas' forward under torch.autocast, float32 everywhere else."""

import json

import numpy as np
import pytest
import torch

from distbelief import models
from distbelief.cli import main
from distbelief.devices import CPU, autocast
from distbelief.errors import UserError
from distbelief.flat import parameter_shapes
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan


def test_autocast_is_nothing_for_float32_and_bfloat16_products_otherwise():
    layer, x = torch.nn.Linear(4, 3), torch.ones(2, 4)
    with autocast(CPU, "float32"):
        assert layer(x).dtype == torch.float32
    with autocast(CPU, "bfloat16"):
        out = layer(x)
        assert out.dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(out, torch.tensor([0, 1])).dtype == torch.float32
    with pytest.raises(UserError, match="--precision 'fp8' is unknown: choose one of float32"):
        autocast(CPU, "fp8")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_flat_hosts_forward_runs_in_its_precision_and_its_gradient_stays_float32(precision):
    """The host's forward (no shard is called) runs its products in ``precision``; the
    gradient it keeps for the shards is float32 and, in bfloat16, close to float32's."""
    reference = models.cnn(64, 10, seed=3)
    plan = ShardPlan.build(parameter_shapes(reference), 2)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(16, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 16))
    grads = {}
    for p in (precision, "float32"):
        host = FlatHost(models.cnn(64, 10, seed=3), plan, [None, None], precision=p)
        seen: list[torch.dtype] = []
        host.flat.model[1].register_forward_hook(lambda m, i, out, seen=seen:
                                                 seen.append(out.dtype))
        loss = host.forward_backward(x, lambda out: torch.nn.functional.cross_entropy(out, y))
        assert isinstance(loss, float) and np.isfinite(loss)
        assert seen == [torch.bfloat16 if p == "bfloat16" else torch.float32]
        assert host.flat.grad.dtype == torch.float32 and host.flat.grad.abs().sum() > 0
        grads[p] = host.flat.grad.clone()
    cosine = torch.nn.functional.cosine_similarity(grads[precision], grads["float32"], dim=0)
    assert cosine > (0.99 if precision == "bfloat16" else 1 - 1e-6)


@pytest.mark.parametrize("argv", [["--algorithm", "sandblaster"],
                                  ["--algorithm", "sandblaster", "--partitions", "2"],
                                  ["--dataset", "ctr"]])
def test_bfloat16_outside_dense_downpour_replicas_is_one_line_exit_2(argv, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--precision", "bfloat16", "--run-dir", str(run), *argv]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--precision bfloat16 runs in dense Downpour replicas (whole or --partitions) only: "
        "drop it for this run (--algorithm sandblaster, click data)")
    assert not run.exists()


@pytest.mark.timeout(120)
def test_bfloat16_replicas_train_digits_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--dataset", "digits", "--precision", "bfloat16", "--replicas", "2",
                 "--num-cpus", "2", "--no-progress", "--run-dir", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["precision"] == "bfloat16"
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and evals[-1]["test_accuracy"] >= 0.9  # 0.95-0.97 in float32 and bfloat16
