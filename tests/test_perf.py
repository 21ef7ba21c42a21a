"""Issue 16 without Ray: the evaluation budget and sample, and the step-time breakdown
(on a fake clock that the host advances, so nothing depends on real timings)."""

import pickle
import types

import numpy as np
import pytest
import torch
from torch import nn

from distbelief import replica as replica_module
from distbelief.config import TrainConfig
from distbelief.errors import UserError
from distbelief.evaluation import EvalBudget, job_cores, probe_cost, sample_rows
from distbelief.flat import FlatModel, parameter_shapes
from distbelief.ps.plan import ShardPlan
from distbelief.replica import ReplicaLoop

BREAKDOWN = ("compute_s", "fetch_wait_s", "push_wait_s", "idle_s")


def test_budget_spaces_evaluations_by_their_cost_and_the_least_period():
    budget = EvalBudget(0.05, 0.5, now=100.0)
    assert budget.due(100.0)
    budget.done(started=100.0, duration_s=0.2)  # 0.2 s is 5% of 4 s: next at 104
    assert budget.at == pytest.approx(104.0)
    assert not budget.due(103.9) and budget.due(104.0)
    budget.done(started=104.0, duration_s=0.001)  # cheap: the least period wins
    assert budget.at == pytest.approx(104.5)


def test_budget_counts_cpu_time_and_never_starts_before_the_last_one_finished():
    budget = EvalBudget(0.1, 0.5, now=200.0)  # e.g. --eval-budget 0.05 on 2 cores
    budget.done(started=200.0, duration_s=0.9, cpu_s=0.3)  # it waited for busy cores
    assert budget.at == pytest.approx(203.0)  # 0.3 CPU s is 10% of one core over 3 s
    budget.done(started=203.0, duration_s=0.9, cpu_s=0.01)
    assert budget.at == pytest.approx(203.9)  # not before it finished


@pytest.mark.parametrize(("actors", "cluster", "local", "cores"), [
    (4, 4.0, 2, 2.0),     # embedded Ray told of 4 CPUs on a 2-core machine
    (3, 16.0, 16, 3.0),   # fewer actors than cores
    (6, 4.0, None, 4.0),  # a cluster (--address): its CPUs
    (2, 0.0, 8, 1.0),     # never below one core
])
def test_the_job_has_the_cores_its_actors_can_use_and_no_more_than_exist(
        actors, cluster, local, cores):
    assert job_cores(actors, cluster, local) == cores


def test_the_sample_is_fixed_by_the_seed_sorted_and_never_larger_than_the_set():
    a, b = sample_rows(5000, 1000, seed=3), sample_rows(5000, 1000, seed=3)
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) == 1000 and np.all(np.diff(a) > 0) and a.max() < 5000
    assert not np.array_equal(a, sample_rows(5000, 1000, seed=4))
    np.testing.assert_array_equal(sample_rows(300, 1000, seed=3), np.arange(300))


@pytest.mark.parametrize("field, value", [("eval_budget", 0.0), ("eval_budget", 1.5),
                                          ("eval_rows", 0)])
def test_bad_evaluation_settings_are_refused_naming_the_flag(field, value):
    with pytest.raises(UserError, match=field.replace("_", "-")):
        TrainConfig(**{field: value}).validate()


class ClockHost:
    """A ParamHost that advances a fake clock: a fetch 1 s, a compute 2 s, a push 0.5 s."""

    event_fields: dict = {}

    def __init__(self, clock: list[float], replica: int) -> None:
        self.clock, self.calls = clock, []

    def fetch(self, upcoming):
        self.calls.append("fetch")
        self.clock[0] += 1.0
        return {}

    def forward_backward(self, x, loss_of):
        self.calls.append("compute")
        self.clock[0] += 2.0
        return float(loss_of(torch.zeros(len(x), 2)))

    def end_step(self, push, local_lr, fetch_next):
        self.calls.append("push" if push else "end")
        self.clock[0] += 0.5 if push else 0.0

    def versions(self):
        return [0]

    def after_run(self, events):
        return {}


def test_every_step_event_breaks_its_time_down_and_idle_goes_to_a_segments_first_step(
        monkeypatch):
    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: clock[0],
                                 sleep=lambda s: None)
    monkeypatch.setattr(replica_module, "time", fake)
    cfg = TrainConfig(replicas=1, batch_size=2, n_fetch=2, n_push=1, lr=0.1)
    x, y = np.zeros((8, 2), np.float32), np.zeros(8, np.int64)
    loop = ReplicaLoop(0, lambda replica: ClockHost(clock, replica),
                       torch.nn.CrossEntropyLoss(), x, y, cfg)
    first = loop.run(3)["events"]
    clock[0] += 7.0  # the replica waits this long for the driver's next segment
    second = loop.run(1)["events"]
    events = first + second
    for e in events:
        assert all(isinstance(e[k], float) and e[k] >= 0 for k in BREAKDOWN)
        assert e["compute_s"] == 2.0 and e["push_wait_s"] == 0.5
    assert [e["fetch_wait_s"] for e in events] == [1.0, 0.0, 1.0, 0.0]
    assert [e["fetched"] for e in events] == [True, False, True, False]
    assert [e["idle_s"] for e in events] == [0.0, 0.0, 0.0, 7.0]


def test_time_shares_sum_to_one_per_replica_and_skip_steps_without_a_breakdown():
    from distbelief.metrics import time_shares

    steps = [{"replica": 1, "compute_s": 3.0, "fetch_wait_s": 1.0, "push_wait_s": 0.0,
              "idle_s": 0.0},
             {"replica": 0, "compute_s": 1.0, "fetch_wait_s": 0.0, "push_wait_s": 1.0,
              "idle_s": 2.0},
             {"replica": 0, "loss": 1.0}]
    shares = time_shares(steps)
    assert list(shares) == [0, 1]
    assert shares[0] == {"compute_s": 0.25, "fetch_wait_s": 0.0, "push_wait_s": 0.25,
                         "idle_s": 0.5}
    assert shares[1]["compute_s"] == 0.75 and sum(shares[1].values()) == 1.0


class PrefetchHost:
    """A ParamHost that can send a fetch early; records the loop's calls by step."""

    event_fields: dict = {}

    def __init__(self, replica: int) -> None:
        self.calls: list[tuple] = []

    def fetch(self, upcoming):
        self.calls.append(("fetch",))
        return {}

    def prefetch(self, upcoming):
        self.calls.append(("prefetch",))

    def forward_backward(self, x, loss_of):
        self.calls.append(("compute",))
        return float(loss_of(torch.zeros(len(x), 2)))

    def end_step(self, push, local_lr, fetch_next):
        self.calls.append(("push", fetch_next) if push else ("end",))

    def versions(self):
        return [0]

    def after_run(self, events):
        return {}


def run_calls(n_fetch: int, n_push: int, steps: int) -> list[tuple]:
    cfg = TrainConfig(replicas=1, batch_size=2, n_fetch=n_fetch, n_push=n_push, lr=0.1)
    x, y = np.zeros((8, 2), np.float32), np.zeros(8, np.int64)
    loop = ReplicaLoop(0, PrefetchHost, torch.nn.CrossEntropyLoss(), x, y, cfg)
    loop.run(steps)
    return loop.host.calls


def test_the_next_fetch_is_sent_right_after_the_last_push_before_it():
    calls = run_calls(n_fetch=4, n_push=3, steps=12)
    # pushes end steps 2, 5, 8, 11; fetches start steps 0, 4, 8. After step 2's push no
    # other push comes before step 4's fetch: that fetch is sent then, and waited for at
    # step 4; likewise after step 5's for step 8. Step 8's push is followed by step 11's,
    # which is fused with step 12's fetch, so nothing is sent early then.
    assert [c for c in calls if c[0] != "compute" and c != ("end",)] == [
        ("fetch",), ("push", False), ("prefetch",), ("fetch",), ("push", False),
        ("prefetch",), ("fetch",), ("push", False), ("push", True)]
    computes = [i for i, c in enumerate(calls) if c == ("compute",)]
    prefetches = [i for i, c in enumerate(calls) if c == ("prefetch",)]
    fetches = [i for i, c in enumerate(calls) if c == ("fetch",)]
    # each early fetch is sent before the computes of the steps before its fetching step
    assert computes[3] > prefetches[0] > computes[2] and fetches[1] < computes[4]
    assert computes[6] > prefetches[1] > computes[5] and fetches[2] < computes[8]


class WindowHost(PrefetchHost):
    """A PrefetchHost that asks, like RowSparseHost, for the inputs of the batches until the
    next fetch: at each fetch and at each early fetch; records them and each step's inputs."""

    def fetch(self, upcoming):
        self.calls.append(("fetch", upcoming()))
        return {}

    def prefetch(self, upcoming):
        self.calls.append(("prefetch", upcoming()))

    def forward_backward(self, x, loss_of):
        self.calls.append(("compute", x.numpy()))
        return float(loss_of(torch.zeros(len(x), 2)))


def test_an_early_fetch_is_given_the_batches_its_fetching_step_and_the_steps_after_use():
    cfg = TrainConfig(replicas=1, batch_size=2, n_fetch=4, n_push=3, lr=0.1)
    x = np.arange(64, dtype=np.float32).reshape(32, 2)  # every row tells which it is
    loop = ReplicaLoop(0, WindowHost, torch.nn.CrossEntropyLoss(), x, np.zeros(32, np.int64),
                       cfg)
    loop.run(12)
    calls = loop.host.calls
    computed = [c[1] for c in calls if c[0] == "compute"]
    windows = {"fetch": [], "prefetch": []}
    for c in calls:
        if c[0] in windows:
            windows[c[0]].append(c[1])
    assert len(windows["fetch"]) == 3 and len(windows["prefetch"]) == 2  # as above
    for k, window in enumerate(windows["fetch"]):  # steps 4k .. 4k + 3
        np.testing.assert_array_equal(window, np.concatenate(computed[4 * k: 4 * k + 4]))
    for early, fetched in zip(windows["prefetch"], windows["fetch"][1:]):
        np.testing.assert_array_equal(early, fetched)


@pytest.mark.parametrize("n_fetch, n_push", [(1, 1), (3, 1), (2, 2), (3, 3), (1, 4)])
def test_no_fetch_is_sent_early_where_the_push_before_it_is_fused_or_the_next_step_fetches(
        n_fetch, n_push):
    assert ("prefetch",) not in run_calls(n_fetch, n_push, steps=12)


def test_a_pickled_flat_model_keeps_its_numpy_view_on_the_parameters():
    """Through pickling (as Ray ships an evaluator to its actor) ``flat_np`` must still be the
    parameters' memory: a fetch writes there."""
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    flat = pickle.loads(pickle.dumps(FlatModel(model, ShardPlan.build(parameter_shapes(model),
                                                                         2))))
    assert flat.flat_np.flags.writeable
    flat.flat_np[:] = 7.0
    assert all(bool((p == 7.0).all()) for p in flat.model.parameters())


def test_probe_cost_times_one_thread_and_restores_the_thread_count():
    """The probe scores 32 rows three times with torch on one thread (more spin on busy
    cores and inflate the driver thread's CPU time); the thread count is restored."""
    seen = []

    class Probed:
        def score(self, shards, limit):
            seen.append((shards, limit, torch.get_num_threads()))
            return {}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probe_cost(Probed(), 320)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [(None, 32, 1)] * 3


@pytest.mark.parametrize("source", ["arrays", "rows"])
def test_scoring_in_passes_counts_every_row_once_and_averages_the_loss_over_rows(source):
    """The evaluator puts ``rows_per_pass()`` rows through the model at a time (64 for this
    small model): accuracy is the exact share of rows right and the loss the mean over rows,
    as one pass over all of them gives; 300 rows (not a multiple of the pass) and a ``limit``
    inside the last pass."""
    from distbelief.sources import ArrayRows
    from distbelief.trainer import Evaluator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(300, 5)
    y = torch.randint(0, 3, (300,))
    test = (x.numpy(), y.numpy()) if source == "arrays" else ArrayRows(x.numpy(), y.numpy())
    evaluator = Evaluator(model, nn.CrossEntropyLoss(),
                          ShardPlan.build(parameter_shapes(model), 1), test)
    assert evaluator.rows_per_pass() == 64
    for limit in (None, 290):
        n = 300 if limit is None else limit
        with torch.no_grad():
            out = model(x[:n])
        scores = evaluator.score(None, limit)
        assert scores["test_accuracy"] == int((out.argmax(1) == y[:n]).sum()) / n
        assert scores["test_loss"] == pytest.approx(float(nn.CrossEntropyLoss()(out, y[:n])),
                                                    rel=1e-5)


def test_a_pass_holds_as_many_rows_as_make_its_activations_match_the_weights():
    """Activations counted per row over every leaf module's output: a wide MLP (many
    weights, few activations a row) gets long passes, a convolution (few weights, large
    activations) the least."""
    from distbelief.evaluation import MIN_ROWS_PER_PASS, activation_bytes_per_row, rows_per_pass

    wide = nn.Sequential(nn.Linear(1000, 5000), nn.ReLU(), nn.Linear(5000, 10))
    # Linear 5000 + ReLU 5000 + Linear 10 floats a row
    assert activation_bytes_per_row(wide, torch.randn(4, 1000)) == 4 * 10010
    weights = 4 * sum(p.numel() for p in wide.parameters())
    assert rows_per_pass(weights, 4 * 10010) == weights // (4 * 10010) > MIN_ROWS_PER_PASS
    conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 16 * 16, 2))
    conv.train()
    per_row = activation_bytes_per_row(conv, torch.randn(2, 1, 16, 16))
    assert per_row == 4 * (3 * 8 * 16 * 16 + 2)  # conv, relu, flatten (a view, counted), linear
    assert conv.training  # the mode is restored
    assert rows_per_pass(4 * sum(p.numel() for p in conv.parameters()), per_row) == \
        MIN_ROWS_PER_PASS


def test_a_regression_model_is_scored_by_its_loss_alone():
    from distbelief.trainer import Evaluator

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(200, 4), torch.randn(200, 1)
    evaluator = Evaluator(model, nn.MSELoss(), ShardPlan.build(parameter_shapes(model), 1),
                          (x.numpy(), y.numpy()))
    scores = evaluator.score(None)
    with torch.no_grad():
        assert scores == {"test_loss": pytest.approx(float(nn.MSELoss()(model(x), y)),
                                                     rel=1e-5)}
