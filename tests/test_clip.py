"""--clip-grad-norm: each replica scales a step's gradient down to a norm before pushing."""

import json
import math

import numpy as np
import pytest
import torch

from distbelief import DownpourSGD, data, metrics, models
from distbelief.cli import main
from distbelief.flat import parameter_shapes
from distbelief.metrics import running_mean
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan


def host_and_batch(clip: float, seed: int = 0):
    """A CNN's flat host (no shard is called) and a batch of random rows and labels."""
    model = models.cnn(64, 10, seed=3)
    plan = ShardPlan.build(parameter_shapes(model), 2)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(16, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 16))
    return FlatHost(model, plan, [None, None], clip=clip), x, y


def loss_of(y):
    return lambda out: torch.nn.functional.cross_entropy(out, y)


def step_gradient(clip: float, seed: int = 0) -> tuple[torch.Tensor, FlatHost]:
    host, x, y = host_and_batch(clip, seed)
    host.forward_backward(x, loss_of(y))
    return host.flat.grad.clone(), host


def test_a_gradient_above_the_norm_is_scaled_to_it_in_the_same_direction():
    raw, _ = step_gradient(0.0)
    norm = float(raw.norm())
    clipped, host = step_gradient(norm / 4)
    assert float(clipped.norm()) == pytest.approx(norm / 4, rel=1e-5)
    assert float(torch.nn.functional.cosine_similarity(clipped, raw, dim=0)) > 1 - 1e-6
    events = [{"step": 0}]
    counters = host.after_run(events)
    assert events[0]["grad_norm"] == pytest.approx(norm, rel=1e-6)  # the norm before
    assert counters["clipped"] == 1
    assert host.after_run([{}]) == counters and host.clipping.norms == []  # per run


def test_a_gradient_below_the_norm_and_clipping_off_leave_it_as_it_is():
    raw, off = step_gradient(0.0)
    kept, host = step_gradient(float(raw.norm()) * 2)
    assert torch.equal(kept, raw)
    events = [{}]
    assert host.after_run(events)["clipped"] == 0 and "grad_norm" in events[0]
    events = [{}]
    assert "clipped" not in off.after_run(events) and events == [{}]  # off: nothing added


def test_steps_between_pushes_accrue_their_clipped_gradients():
    """n_push 2: the pushed sum is the sum of the two steps' clipped gradients."""
    clip = 0.01
    host, x1, y1 = host_and_batch(clip, seed=1)
    _, x2, y2 = host_and_batch(clip, seed=2)
    host.forward_backward(x1, loss_of(y1))
    first = host.flat.grad.clone()
    host.end_step(False, None, False)  # no push: the step's gradient starts the sum
    host.forward_backward(x2, loss_of(y2))
    second = host.flat.grad.clone()
    for g in (first, second):
        assert float(g.norm()) == pytest.approx(clip, rel=1e-5)
    assert torch.allclose(host.accrued, first + second)
    assert host.counters()["clipped"] == 2


def test_a_non_finite_gradient_is_not_scaled_and_is_left_to_the_shards():
    grads = []
    for clip in (0.5, 0.0):
        host, x, y = host_and_batch(clip)
        host.forward_backward(x, lambda out, y=y: loss_of(y)(out) * float("nan"))
        grads.append(host.flat.grad.clone())
        if clip:
            events = [{}]
            assert host.after_run(events)["clipped"] == 0
            assert math.isnan(events[0]["grad_norm"])
    assert torch.isnan(grads[0]).any()
    assert torch.equal(torch.nan_to_num(grads[0]), torch.nan_to_num(grads[1]))  # as it was


@pytest.mark.parametrize("argv, message", [
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a finite number >= 0 (0: off; got -1"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number >= 0"),
    (["--clip-grad-norm", "1", "--algorithm", "sandblaster"],
     "--clip-grad-norm 1.0 runs in dense Downpour replicas (whole or --partitions) only: drop "
     "it for this run (--algorithm sandblaster, click data)"),
    (["--clip-grad-norm", "1", "--algorithm", "sandblaster", "--partitions", "2"],
     "runs in dense Downpour replicas (whole or --partitions) only"),
    (["--clip-grad-norm", "1", "--dataset", "ctr"], "runs in dense Downpour replicas"),
])
def test_a_bad_or_unsupported_clip_is_one_line_exit_2(argv, message, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()


@pytest.mark.timeout(120)
def test_clipped_replicas_train_digits_and_record_the_norms(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--dataset", "digits", "--clip-grad-norm", "0.5", "--replicas", "2",
                 "--num-cpus", "2", "--no-progress", "--run-dir", str(run)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads((run / "config.json").read_text())["clip_grad_norm"] == 0.5
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 600 and all(e["grad_norm"] > 0 for e in steps)
    clipped = sum(e["grad_norm"] > 0.5 for e in steps)
    assert clipped > 0 and summary.endswith(f" clipped_steps={clipped}")  # 215 of 600 once
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[-1]["test_accuracy"] >= 0.9  # 0.969 once; 0.95-0.97 unclipped


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_local")  # the last test here: CLI runs start their own Ray
def test_the_python_api_counts_the_clipped_steps_of_every_replica():
    ds = data.digits()
    result = DownpourSGD(models.mlp(ds.features, 32, 10, 0), replicas=2, shards=2, steps=50,
                         clip_grad_norm=1e-3, eval_every_s=1000.0
                         ).fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    assert [c["clipped"] for c in result.replica_counters.values()] == [50, 50]


def test_running_mean_orders_by_time_and_averages_a_fiftieth():
    t, v, tm, mean = running_mean(np.array([3.0, 1.0, 2.0]), np.array([30.0, 10.0, 20.0]))
    assert t.tolist() == [1, 2, 3] and v.tolist() == [10, 20, 30]
    assert tm.tolist() == [1, 2, 3] and mean.tolist() == [10, 20, 30]  # window 1
    _, _, tm, mean = running_mean(np.arange(100.0), np.arange(100.0) * 2)
    assert tm[0] == 1 and mean[0] == 1.0 and len(mean) == 99  # window 2: (0 + 2) / 2


def test_the_plot_draws_the_norms_and_the_bar_from_the_run_folder(tmp_path, monkeypatch):
    """A run folder whose steps carry grad_norm (one NaN) gets the norm curve, with the bar
    read from its config.json."""
    steps = [{"event": "step", "t": 100.0 + i, "replica": i % 2, "step": i // 2,
              "loss": 1.0 / (i + 1), "grad_norm": float("nan") if i == 3 else 2.0 + i}
             for i in range(60)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    (tmp_path / "config.json").write_text(json.dumps({"clip_grad_norm": 0.5}))
    drawn, inner = [], metrics.plot_grad_norms

    def recording(ax, normed, start, clip):
        drawn.append((len(normed), start, clip))
        inner(ax, normed, start, clip)

    monkeypatch.setattr(metrics, "plot_grad_norms", recording)
    assert metrics.plot_run(tmp_path).stat().st_size > 0
    assert drawn == [(60, 100.0, 0.5)]
