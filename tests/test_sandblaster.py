"""Sandblaster L-BFGS on real Ray: scalars-only coordinator, exactly-once portions, accuracy."""

import copy
import threading
import time
from functools import partial

import numpy as np
import pytest
import ray
import scipy.optimize
import torch

from distbelief import data, models
from distbelief.cli import main
from distbelief.ps.host import FlatHost
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard
from distbelief.sandblaster.coordinator import PortionRunner, ShardVectorSpace
from distbelief.sandblaster.replica import SandblasterReplica
from distbelief.sandblaster.trainer import SandblasterLBFGS

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def full_batch_reference(model, x, y):
    """Summed cross-entropy and its gradient over the whole set, in one process."""
    model = copy.deepcopy(model)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y),
                                             reduction="sum")
    loss.backward()
    grad = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    return float(loss.detach()), grad


class Rig:
    """Shards + replicas + runner for one batch, torn down afterwards."""

    def __init__(self, model, x, y, replicas=4, shards=2, slow=None, portions=40, k=3,
                 backups=True):
        self.plan = ShardPlan.build([(n, tuple(p.shape)) for n, p in model.named_parameters()],
                                    shards)
        flat = self.plan.flatten({n: p.detach().numpy() for n, p in model.named_parameters()})
        self.shards = [ParameterShard.remote(i, part, "sgd", 1.0)
                       for i, part in enumerate(self.plan.split_flat(flat))]
        x_ref, y_ref = ray.put(x), ray.put(y)
        slow = slow or {}
        self.actors = []

        def start(i):
            host = partial(FlatHost, copy.deepcopy(model), self.plan, self.shards)
            actor = SandblasterReplica.remote(i, host, torch.nn.CrossEntropyLoss(), x_ref, y_ref,
                                              slow.get(i, 1.0))
            self.actors.append(actor)
            return actor

        self.space = ShardVectorSpace(self.shards)
        self.runner = PortionRunner(self.space, start, replicas, len(x), portions, k,
                                    backups=backups)

    def gradient(self, name="g"):
        parts = ray.get([s.fetch_vector.remote(name) for s in self.shards])
        return np.concatenate(parts)

    def close(self):
        for a in [*self.actors, *self.shards]:
            ray.kill(a)


def test_backup_copies_count_every_portion_exactly_once(digits):
    model = models.mlp(digits.features, 16, 10, seed=1)
    want_loss, want_grad = full_batch_reference(model, digits.x_train, digits.y_train)
    rig = Rig(model, digits.x_train, digits.y_train, slow={0: 300.0})
    try:
        ray.get([a.where.remote() for a in rig.actors])  # every replica up before batch 1
        for _ in range(3):
            loss = rig.runner.run("x", "g")
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
            np.testing.assert_allclose(rig.gradient(), want_grad, rtol=1e-4, atol=1e-4)
        stats = rig.runner.history
        assert sum(b.backups for b in stats) > 0  # the straggler's portions got backup copies
        for b in stats:
            assert sum(b.portions_by_replica.values()) == 40 + b.recomputed
        done = {r: sum(b.portions_by_replica.get(r, 0) for b in stats) for r in range(4)}
        assert done[0] < min(done[r] for r in (1, 2, 3))  # fast replicas do more
    finally:
        rig.close()


def test_killed_replica_mid_batch_gives_the_same_gradient(digits):
    model = models.mlp(digits.features, 16, 10, seed=2)
    want_loss, want_grad = full_batch_reference(model, digits.x_train, digits.y_train)
    rig = Rig(model, digits.x_train, digits.y_train, slow={1: 40.0, 2: 40.0}, k=4)
    try:
        ray.get([a.where.remote() for a in rig.actors])  # every replica up before the batch
        out = {}
        thread = threading.Thread(target=lambda: out.update(loss=rig.runner.run("x", "g")))
        thread.start()

        def computing_on_1():
            return any(kind == "compute" and r == 1
                       for kind, r, *_ in list(rig.runner.inflight.values()))

        while not computing_on_1() and thread.is_alive():
            time.sleep(0.002)
        ray.kill(rig.runner.replicas[1])  # mid-portion: it is slowed 40x
        thread.join(timeout=120)
        np.testing.assert_allclose(out["loss"], want_loss, rtol=1e-5)
        np.testing.assert_allclose(rig.gradient(), want_grad, rtol=1e-4, atol=1e-4)
        assert rig.runner.history[-1].failures == [1]
    finally:
        rig.close()


def test_static_split_without_backups_is_also_exact(digits):
    model = models.mlp(digits.features, 16, 10, seed=3)
    want_loss, want_grad = full_batch_reference(model, digits.x_train, digits.y_train)
    rig = Rig(model, digits.x_train, digits.y_train, replicas=2, portions=4, backups=False)
    try:
        np.testing.assert_allclose(rig.runner.run("x", "g"), want_loss, rtol=1e-5)
        np.testing.assert_allclose(rig.gradient(), want_grad, rtol=1e-4, atol=1e-4)
        assert rig.runner.history[-1].backups == 0
    finally:
        rig.close()


def scipy_softmax_accuracy(ds, l2, seed):
    """Single-process full-batch scipy L-BFGS on the same softmax-regression objective."""
    model = models.mlp(ds.features, 0, ds.classes, seed)
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)

    def set_flat(theta):
        for p, chunk, shape in zip(params, np.split(theta, np.cumsum(sizes)[:-1]), shapes):
            p.data = torch.from_numpy(chunk.astype(np.float32)).reshape(shape)

    def fun(theta):
        set_flat(theta)
        for p in params:
            p.grad = None
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grad = np.concatenate([p.grad.numpy().ravel() for p in params]).astype(np.float64)
        return loss.item() + 0.5 * l2 * theta @ theta, grad + l2 * theta

    theta0 = np.concatenate([p.detach().numpy().ravel() for p in params]).astype(np.float64)
    res = scipy.optimize.minimize(fun, theta0, jac=True, method="L-BFGS-B",
                                  options={"maxiter": 500})
    set_flat(res.x)
    with torch.no_grad():
        pred = model(torch.from_numpy(ds.x_test)).argmax(1).numpy()
    return float((pred == ds.y_test).mean()), res.fun


def test_cli_sandblaster_matches_scipy_lbfgs_accuracy(digits, tmp_path, capsys):
    code = main(["train", "--algorithm", "sandblaster", "--replicas", "2", "--shards", "2",
                 "--hidden", "0", "--iterations", "60", "--run-dir", str(tmp_path / "sb"),
                 "--no-progress"])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    accuracy = float(last.split()[1].split("=")[1])
    reference, _ = scipy_softmax_accuracy(digits, l2=1e-4, seed=0)
    assert abs(accuracy - reference) <= 0.01, (accuracy, reference)


def test_coordinator_receives_only_scalars(digits):
    model = models.mlp(digits.features, 0, 10, seed=0)
    result = SandblasterLBFGS(model, replicas=2, shards=3, iterations=5).fit(
        digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    done = next(e for e in result.events if e["event"] == "lbfgs_done")
    assert done["received_types"] == ["float"]
    assert done["scalars_received"] > 0
    losses = [e["loss"] for e in result.events if e["event"] == "step"]
    assert len(losses) == 5 and losses[-1] < losses[0]
