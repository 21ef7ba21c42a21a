"""The Downpour replica loop without Ray, over a host that records what it is asked."""

import numpy as np
import torch

from distbelief.config import TrainConfig
from distbelief.data import ReplicaSampler
from distbelief.replica import ReplicaLoop


class RecordingHost:
    """A ParamHost that computes nothing and records the loop's calls."""

    event_fields = {"note": "idle"}

    def __init__(self, replica: int) -> None:
        self.replica, self.calls, self.upcoming = replica, [], []

    def fetch(self, upcoming):
        self.calls.append("fetch")
        self.upcoming.append(upcoming())
        return {"note": "fetched"}

    def forward_backward(self, x, loss_of):
        self.calls.append(("compute", len(x)))
        return float(loss_of(torch.zeros(len(x), 2)))

    def end_step(self, push, local_lr, fetch_next):
        self.calls.append(("end", push, local_lr, fetch_next))

    def versions(self):
        return [7]

    def after_run(self, events):
        return {"pushes": sum(e["pushed"] for e in events)}

    def finish(self, push, fetch_next):
        return {"final_push": push, "fetch_next": fetch_next}


def loop(**overrides) -> ReplicaLoop:
    cfg = TrainConfig(replicas=2, batch_size=4, n_fetch=3, n_push=2, lr=0.5, **overrides)
    x, y = np.arange(40, dtype=np.float32).reshape(20, 2), np.zeros(20, np.int64)
    return ReplicaLoop(1, RecordingHost, torch.nn.CrossEntropyLoss(), x, y, cfg)


def test_loop_fetches_pushes_and_updates_locally_on_schedule():
    replica = loop()
    reply = replica.run(6)
    host = replica.host
    assert host.replica == 1
    ends = [c[1:] for c in host.calls if c[0] == "end"]
    # push every 2nd step; local SGD except before a fetch; fetch_next before steps 3 and 6
    assert ends == [(False, 0.5, False), (True, 0.5, False), (False, None, True),
                    (True, 0.5, False), (False, 0.5, False), (True, None, True)]
    assert [c for c in host.calls if c == "fetch"] == ["fetch", "fetch"]
    assert all(c == ("compute", 4) for c in host.calls if c[0] == "compute")
    events = reply["events"]
    assert [e["fetched"] for e in events] == [True, False, False, True, False, False]
    assert [e["note"] for e in events] == ["fetched", "idle", "idle", "fetched", "idle", "idle"]
    assert all(e["versions"] == [7] and e["replica"] == 1 for e in events)
    assert reply["step"] == 6 and reply["pushes"] == 3


def test_loop_hands_a_fetch_the_inputs_until_the_next_fetch():
    replica = loop()
    replica.run(3)
    [upcoming] = replica.host.upcoming
    x = np.arange(40, dtype=np.float32).reshape(20, 2)  # loop()'s data; replica 1 of 2
    sampler = ReplicaSampler(20, 1, 2, batch_size=4, seed=0)
    want = np.concatenate([x[sampler.batch(k)] for k in range(3)])
    np.testing.assert_array_equal(upcoming, want)


def test_finish_pushes_only_what_accrued_since_the_last_push():
    replica = loop(local_update=False)
    replica.run(3)
    assert replica.finish() == {"final_push": True, "fetch_next": False}
    assert replica.finish() == {"final_push": False, "fetch_next": False}
    ends = [c[1:] for c in replica.host.calls if c[0] == "end"]
    assert [lr for _, lr, _ in ends] == [None, None, None]


class StagingHost:
    """A ParamHost's Sandblaster half that records loads, holds, verdicts and stages."""

    def __init__(self, replica: int) -> None:
        self.log, self.kept = [], []

    def load_vector(self, name):
        self.log.append(("load", name))

    def forward_backward(self, x, loss_of):
        return float(loss_of(torch.zeros(len(x), 2)))

    def hold(self, portion):
        self.log.append(("hold", portion))

    def settle(self, verdicts):
        self.kept += [p for p, keep in verdicts if keep]

    def stage(self, tag):
        self.log.append(("stage", tag, sorted(self.kept)))
        self.kept = []
        return True

    def discard(self):
        self.kept = []


def test_sandblaster_replica_stages_only_kept_portions_of_its_batch():
    from distbelief.sandblaster.replica import PortionReplica

    x, y = np.zeros((12, 2), np.float32), np.zeros(12, np.int64)
    replica = PortionReplica(0, StagingHost, torch.nn.CrossEntropyLoss(), x, y)
    for portion in range(3):
        out = replica.compute(0, "x", portion, 4 * portion, 4 * portion + 4, [])
        assert out["portion"] == portion and out["rows"] == 4
    assert replica.push(0, "t0", [(0, True), (1, False), (2, True), (9, True)]) == [0, 2]
    assert replica.push(0, "t1", []) == []  # nothing kept since
    replica.compute(1, "x1", 5, 0, 4, [])
    assert replica.push(0, "t2", [(5, True)]) == []  # a verdict for a batch gone by
    assert replica.host.log == [("load", "x"), ("hold", 0), ("hold", 1), ("hold", 2),
                                ("stage", "t0", [0, 2]), ("load", "x1"), ("hold", 5)]


def test_a_slowed_replica_sleeps_after_every_step_but_its_first(monkeypatch):
    """--slow-replica stretches each step; an actor's first step is start-up (partition
    actors coming up, the first fetch) and is not stretched, also for a restarted one."""
    import time

    for start_step in (0, 5):
        slept = []
        monkeypatch.setattr(time, "sleep", slept.append)
        cfg = TrainConfig(replicas=2, batch_size=4, slow_replicas={1: 3.0})
        x, y = np.arange(40, dtype=np.float32).reshape(20, 2), np.zeros(20, np.int64)
        replica = ReplicaLoop(1, RecordingHost, torch.nn.CrossEntropyLoss(), x, y, cfg,
                              start_step=start_step)
        events = replica.run(4)["events"]
        assert [e["step"] for e in events] == list(range(start_step, start_step + 4))
        assert len(slept) == 3 and all(s >= 0 for s in slept)
        monkeypatch.undo()
