"""GPU replicas: the device options, the host-buffer staging (covered on CPU), and a CUDA run
where CUDA exists (skipped elsewhere)."""

import numpy as np
import pytest
import ray
import torch

from distbelief import DownpourSGD, data, models
from distbelief.cli import main
from distbelief.config import TrainConfig
from distbelief.devices import CPU, DeviceBuffers, gpu_options, on_device, replica_device
from distbelief.errors import UserError
from distbelief.flat import parameter_shapes
from distbelief.ps.client import PSClient
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard
from distbelief.sparse import SparseDownpourSGD, WideAndDeep

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


BAD = [
    (["--device", "tpu"], "--device 'tpu' is unknown: choose one of cpu, cuda, auto"),
    (["--device", "cuda", "--gpus-per-replica", "-1"], "--gpus-per-replica must be a number >= 0"),
    (["--device", "cuda"], "--device cuda needs GPUs from Ray: pass --gpus-per-replica"),
    (["--gpus-per-replica", "1"], "reserves GPUs that --device cpu does not use"),
    (["--device", "cuda", "--gpus-per-replica", "1", "--partitions", "2"],
     "model partitions and click data (ctr) run on CPU"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_device_options_are_one_line_exit_2(argv, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = run_cli(["train", "--run-dir", str(run_dir), "--no-progress", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not ray.is_initialized() and not run_dir.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gpus_without_cuda_or_cluster_are_refused_naming_the_fix(device, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = run_cli(["train", "--run-dir", str(tmp_path / "run"), "--no-progress",
                    "--device", device, "--gpus-per-replica", "0.5"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "torch has no CUDA" in lines[0] and "install a CUDA build of torch" in lines[0]
    with pytest.raises(UserError, match="torch has no CUDA"):
        TrainConfig(device=device, gpus_per_replica=1).validate()


def test_auto_without_gpus_resolves_to_cpu_and_a_cluster_may_hold_the_gpus():
    assert TrainConfig(device="auto").validate().device == "cpu"
    on_cluster = TrainConfig(device="cuda", gpus_per_replica=0.5, address="10.0.0.1:6379")
    assert on_cluster.validate().device == "cuda"  # the cluster's replicas have CUDA, maybe
    assert TrainConfig().validate().device == "cpu" and TrainConfig().gpus_per_replica == 0


def test_sparse_tables_refuse_gpu_replicas_through_the_api():
    model = WideAndDeep(rows=50, fields=2, hidden=0)
    with pytest.raises(UserError, match="sparse embedding tables train on CPU"):
        SparseDownpourSGD(model, device="cuda", gpus_per_replica=1, address="10.0.0.1:6379")


def test_device_helpers_leave_cpu_alone():
    assert replica_device("cpu") == CPU
    assert replica_device("auto") == (torch.device("cuda") if torch.cuda.is_available() else CPU)
    assert gpu_options(0) == {} and gpu_options(0.5) == {"num_gpus": 0.5}
    x, y = torch.ones(3), torch.zeros(3)
    moved = on_device(CPU, x, y)
    assert moved[0] is x and moved[1] is y  # no copy on CPU


def test_device_buffers_round_trip_values_through_the_same_buffers():
    flat = torch.zeros(5)  # stands in for the device's flat parameters
    buffers = DeviceBuffers(flat, pin=False)
    host_params, params_np, grad_np = buffers.host_params, buffers.params_np, buffers.grad_np
    for step in range(3):
        params_np[:] = np.arange(5, dtype=np.float32) + step  # what a fetch writes
        buffers.params_to_device()
        assert torch.equal(flat, torch.arange(5, dtype=torch.float32) + step)
        grad = flat * 2  # a gradient on the device
        out = buffers.grad_to_host(grad)
        assert out is grad_np and np.array_equal(out, (np.arange(5) + step) * 2.0)
        assert buffers.host_params is host_params and buffers.params_np is params_np
    assert not buffers.host_params.is_pinned()


def shard_set(plan: ShardPlan, initial: np.ndarray) -> list:
    return [ParameterShard.remote(i, part, "sgd", 0.1)
            for i, part in enumerate(plan.split_flat(initial))]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("fuse", [True, False])
def test_staged_host_trains_exactly_like_the_plain_cpu_host(fuse):
    """The staging path (as on a GPU, here on CPU) pushes the same gradients and ends at the
    same parameters as today's CPU path, reusing its buffers every step."""
    model = models.mlp(8, 6, 3, seed=1)
    plan = ShardPlan.build(parameter_shapes(model), 2)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy(rng.normal(size=(4, 8)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 3, 4))) for _ in range(4)]
    finals = []
    for staged in (False, True):
        shards = shard_set(plan, initial)
        host = FlatHost(models.mlp(8, 6, 3, seed=1), plan, shards, fuse=fuse, staged=staged)
        flat_ptr = host.flat.flat.data_ptr()
        buffers = host.staging
        for x, y in batches:
            host.fetch()
            host.forward_backward(x, lambda out, y=y: torch.nn.functional.cross_entropy(out, y))
            host.end_step(True, None, True)
        counters = host.finish(False)
        assert host.flat.flat.data_ptr() == flat_ptr and host.staging is buffers
        if staged:
            assert counters["device"] == "cpu"
            assert host._params_np is buffers.params_np  # fetches land in the host buffer
        else:
            assert "device" not in counters and buffers is None
        final = np.empty(plan.numel, np.float32)
        PSClient(shards, plan).fetch_into(final)
        finals.append(final)
        for s in shards:
            ray.kill(s)
    assert not np.array_equal(finals[0], initial)
    np.testing.assert_array_equal(finals[0], finals[1])


@needs_cuda
@pytest.mark.usefixtures("ray_local")  # embedded Ray finds the machine's GPUs itself
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_two_cuda_replicas_share_a_gpu_and_learn(device):
    ds = data.digits()
    model = models.mlp(ds.features, 32, ds.classes, seed=0)
    result = DownpourSGD(model, replicas=2, shards=2, device=device, gpus_per_replica=0.5,
                         optimizer="adagrad", lr=0.05, steps=300).fit(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    assert result.test_accuracy >= 0.95
    assert {torch.device(c["device"]).type for c in result.replica_counters.values()} == {"cuda"}
