"""The elastic work pool (segments.WorkPool), pure: whatever replicas come and go, every
slot's steps run exactly once, and the request files of `distbelief scale` (elastic.py)."""

import json
import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distbelief.elastic import REQUEST, RUNNING, ScaleRequests, request_scale
from distbelief.errors import UserError
from distbelief.limits import Resources
from distbelief.segments import WorkPool


def run_out(pool, workers, done):
    """Run every worker's segments until none has work; record each step run."""
    while True:
        segs = [(w, pool.next(w)) for w in sorted(workers) if pool.idle(w)]
        segs = [(w, s) for w, s in segs if s is not None]
        if not segs and not pool.running:
            return
        for w, (slot, a, b) in segs:
            pool.done(w)
            done.extend((slot, k) for k in range(a, b))


def test_added_workers_take_half_of_the_longest_queue_and_removed_ones_give_theirs_back():
    pool = WorkPool.from_done(2, 100, {}, segment_steps=10)
    pool.assign([0, 1])
    assert pool.next(0) == (0, 0, 10) and pool.next(1) == (1, 0, 10)
    pool.balance = True
    assert pool.next(2) == (0, 55, 65)  # the back half of worker 0's 90 queued steps
    assert pool.next(3) == (1, 55, 65)
    pool.done(0)
    pool.remove(3)  # worker 3 left mid-segment
    assert pool.free == [(1, 55, 65), (1, 65, 100)]  # its segment and queue, to run again
    pool.done(1)
    assert pool.next(1) == (1, 10, 20)
    assert pool.left() == 200 - 10 - 10


def test_an_unscaled_pool_hands_each_worker_its_own_slot_only():
    pool = WorkPool.from_done(2, 30, {0: 14, 1: 30}, segment_steps=10, warmstart_steps=10)
    pool.assign([0, 1])
    assert pool.next(1) is None and pool.next(0) == (0, 14, 24)


def test_a_failed_segment_runs_again_and_the_remaining_ranges_merge():
    pool = WorkPool.from_done(1, 30, {}, segment_steps=10)
    pool.assign([0])
    assert pool.next(0) == (0, 0, 10)
    pool.failed(0)
    assert pool.next(0) == (0, 0, 10)
    pool.done(0)
    assert pool.remaining() == {"0": [[10, 30]]} and pool.replica_steps() == {"0": 10}
    restored = WorkPool(1, 30, {0: [[10, 30]]}, segment_steps=10)
    restored.assign([0])
    assert restored.next(0) == (0, 10, 20)
    longer = WorkPool.resumed(1, 50, {"0": [[10, 20], [25, 30]]}, 30, segment_steps=10)
    assert longer.remaining() == {"0": [[10, 20], [25, 50]]}
    shorter = WorkPool.resumed(1, 22, {"0": [[10, 20], [25, 30]]}, 30, segment_steps=10)
    assert shorter.remaining() == {"0": [[10, 20]]} and shorter.replica_steps() == {"0": 12}


ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "step", "fail"]),
                         st.integers(0, 7)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 4), steps=st.integers(1, 40), seg=st.integers(1, 12),
       warm=st.integers(0, 15), script=ops)
@example(slots=1, steps=3, seg=1, warm=2,  # a warm-start range left behind a later one
         script=[("add", 0), ("step", 0), ("remove", 0), ("step", 0)])
def test_every_step_runs_exactly_once_whatever_workers_come_and_go(slots, steps, seg, warm,
                                                                   script):
    warm = min(warm, steps)
    pool = WorkPool.from_done(slots, steps, {}, segment_steps=seg, warmstart_steps=warm)
    workers, done, nxt = set(range(slots)), [], slots
    pool.assign(workers)
    for op, k in script:
        w = sorted(workers)[k % len(workers)] if workers else None
        if op == "add":
            pool.balance = True
            workers.add(nxt)
            nxt += 1
        elif op == "remove" and len(workers) > 1:
            workers.discard(w)
            pool.remove(w)
        elif op == "fail" and w is not None:
            pool.failed(w)
        elif op == "step" and w is not None:
            if pool.idle(w):
                pool.next(w)
            elif pool.running[w]:
                slot, a, b = pool.done(w)
                assert not (slot == 0 and a < warm) or b <= warm  # warm-start cut
                done.extend((slot, i) for i in range(a, b))
    for w in list(pool.running):
        pool.failed(w)  # what was running when the script ended runs again
    run_out(pool, workers, done)
    assert sorted(done) == [(s, i) for s in range(slots) for i in range(steps)]
    assert pool.left() == 0 and pool.replica_steps() == {str(s): steps for s in range(slots)}


def test_scale_requests_go_through_a_file_that_only_a_running_run_takes(tmp_path):
    res = Resources(2**30, 2.0)
    with pytest.raises(UserError, match="not a running run"):
        request_scale(tmp_path, 2)
    requests = ScaleRequests(tmp_path, 1, 1, res)
    assert json.loads((tmp_path / RUNNING).read_text())["pid"] == os.getpid()
    assert requests.take() is None
    with pytest.raises(UserError, match="at least one replica"):
        request_scale(tmp_path, 0)
    with pytest.raises(UserError, match="over 8 a core"):
        request_scale(tmp_path, 17)
    assert not (tmp_path / REQUEST).exists()  # nothing written for a refused request
    request_scale(tmp_path, 3)
    assert requests.take() == (3, REQUEST) and requests.take() is None
    requests.ask(1)
    assert requests.take() == (1, "api")
    with pytest.raises(UserError, match="at least one replica"):
        requests.ask(0)
    requests.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_run_whose_driver_is_gone_is_not_running(tmp_path):
    ScaleRequests(tmp_path, 1, 1, Resources(2**30, 2.0))
    record = json.loads((tmp_path / RUNNING).read_text())
    (tmp_path / RUNNING).write_text(json.dumps(record | {"pid": 2**22 + 12345}))
    with pytest.raises(UserError, match="is gone"):
        request_scale(tmp_path, 2)
