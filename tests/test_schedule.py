"""Portion scheduler: dynamic assignment, backup tasks, failures, against a simulated clock."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.sandblaster.schedule import (
    PORTIONS_PER_REPLICA,
    PortionScheduler,
    portion_bounds,
    static_plan,
)


@dataclass
class Simulation:
    """Outcome of one simulated batch: when it finished and what the scheduler saw."""

    batch_time: float
    scheduler: PortionScheduler
    used: Counter = field(default_factory=Counter)  # portion -> complete() calls returning True
    max_copies_seen: int = 0


def simulate(
    seconds_per_portion: list[float],
    n_portions: int,
    max_copies: int = 2,
    failures: dict[int, float] | None = None,
    late_results: bool = False,
) -> Simulation:
    """Event loop: replica r takes ``seconds_per_portion[r]`` per portion and asks for work
    whenever idle; replica r in ``failures`` dies at that time (its result in flight is lost,
    or still arrives when ``late_results``, as when a slow replica is wrongly declared dead)."""
    failures = failures or {}
    replicas = range(len(seconds_per_portion))
    scheduler = PortionScheduler(len(seconds_per_portion), n_portions, max_copies)
    sim = Simulation(float("inf"), scheduler)
    events = [(t, 0, r, -1) for r, t in failures.items()]  # (time, order, replica, portion)
    busy: dict[int, int | None] = dict.fromkeys(replicas)
    running: Counter = Counter()  # portion -> copies computing right now
    dead: set[int] = set()
    order = 1
    now = 0.0
    while True:
        for r in replicas:
            if r not in dead and busy[r] is None:
                portion = scheduler.assign(r)
                if portion is not None:
                    busy[r] = portion
                    running[portion] += 1
                    sim.max_copies_seen = max(sim.max_copies_seen, running[portion])
                    heapq.heappush(events, (now + seconds_per_portion[r], order, r, portion))
                    order += 1
        if not events:
            return sim  # stuck: batch_time stays inf
        now, _, r, portion = heapq.heappop(events)
        if portion < 0:
            dead.add(r)
            scheduler.fail(r)
            if busy[r] is not None:
                running[busy[r]] -= 1  # no longer a copy the scheduler counts
            busy[r] = None
            continue
        if r in dead:
            if not late_results:
                continue
        else:
            running[portion] -= 1
            busy[r] = None
        if scheduler.complete(r, portion):
            sim.used[portion] += 1
        if scheduler.done:
            sim.batch_time = now
            return sim


def test_portion_bounds_are_contiguous_and_even():
    bounds = portion_bounds(103, 10)
    assert bounds[0][0] == 0 and bounds[-1][1] == 103
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert sorted({stop - start for start, stop in bounds}) == [10, 11]
    assert [stop - start for start, stop in bounds[:3]] == [11, 11, 11]
    assert portion_bounds(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    for n_portions in (0, 6):
        with pytest.raises(ValueError):
            portion_bounds(5, n_portions)


@given(st.integers(1, 10_000), st.data())
def test_portion_bounds_property(n_samples, data):
    n_portions = data.draw(st.integers(1, n_samples))
    sizes = [stop - start for start, stop in portion_bounds(n_samples, n_portions)]
    assert sum(sizes) == n_samples and max(sizes) - min(sizes) <= 1


def test_static_plan_splits_portions_evenly():
    plan = static_plan(22, 4)
    assert [len(p) for p in plan] == [6, 6, 5, 5]
    assert sum(plan, []) == list(range(22))


def test_default_portions_per_replica():
    assert PortionScheduler(3).n_portions == 3 * PORTIONS_PER_REPLICA


def test_fresh_portions_in_order_then_backups():
    scheduler = PortionScheduler(3, n_portions=3)
    assert scheduler.has_fresh
    assert [scheduler.assign(r) for r in range(3)] == [0, 1, 2]
    assert scheduler.backups_issued == 0 and not scheduler.has_fresh
    assert scheduler.assign(0) is None  # busy with 0: no backup, and never a copy of its own
    assert scheduler.complete(0, 0)
    assert scheduler.assign(0) == 1  # idle: a backup of the portion running longest
    assert scheduler.complete(2, 2)
    assert scheduler.assign(2) is None  # portion 1 already has max_copies = 2 copies
    assert scheduler.complete(0, 1) and not scheduler.complete(1, 1)
    assert scheduler.done
    assert scheduler.backups_issued == 1 and scheduler.duplicates_discarded == 1
    assert scheduler.portions_done == {0: 2, 1: 0, 2: 1}


def test_backup_prefers_fewest_copies():
    scheduler = PortionScheduler(4, n_portions=2, max_copies=3)
    assert [scheduler.assign(r) for r in range(2)] == [0, 1]
    assert scheduler.assign(2) == 0  # both have 1 copy: the earliest assigned
    assert scheduler.assign(3) == 1  # portion 0 has 2 copies now, portion 1 only 1


def test_max_copies_one_disables_backups():
    scheduler = PortionScheduler(2, n_portions=1, max_copies=1)
    assert scheduler.assign(0) == 0
    assert scheduler.assign(1) is None
    assert scheduler.backups_issued == 0


def test_fail_requeues_only_portions_nobody_else_has():
    scheduler = PortionScheduler(3, n_portions=3)
    assert [scheduler.assign(r) for r in range(3)] == [0, 1, 2]
    assert scheduler.complete(2, 2)
    assert scheduler.assign(2) == 0  # backup of portion 0
    assert scheduler.fail(0) == []  # replica 2 still runs portion 0
    assert scheduler.fail(1) == [1]
    assert scheduler.fail(1) == []  # already dead: nothing more
    with pytest.raises(ValueError, match="failed"):
        scheduler.assign(1)
    assert scheduler.complete(2, 0)
    assert scheduler.assign(2) == 1  # the requeued portion
    assert scheduler.complete(2, 1) and scheduler.done


def test_late_result_of_failed_replica_is_used_once():
    scheduler = PortionScheduler(2, n_portions=2)
    assert [scheduler.assign(r) for r in range(2)] == [0, 1]
    assert scheduler.fail(0) == [0]
    assert scheduler.complete(1, 1)
    assert scheduler.has_fresh  # portion 0 is back in the queue
    assert scheduler.complete(0, 0)  # the "dead" replica's result arrives first: use it
    assert not scheduler.has_fresh
    assert scheduler.assign(1) is None  # portion 0 was requeued but is done: skipped
    assert scheduler.done and scheduler.portions_done == {0: 1, 1: 1}


def test_revive_lets_a_restarted_replica_work_again():
    scheduler = PortionScheduler(2, n_portions=3)
    scheduler.fail(1)
    scheduler.revive(1)
    assert scheduler.assign(1) == 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        PortionScheduler(0)
    with pytest.raises(ValueError):
        PortionScheduler(2, max_copies=0)
    scheduler = PortionScheduler(2, n_portions=4)
    with pytest.raises(ValueError, match="unknown"):
        scheduler.assign(7)
    with pytest.raises(ValueError, match="range"):
        scheduler.complete(0, 4)


def test_fast_replicas_do_more_portions():
    sim = simulate([1.0, 1.0, 1.0, 4.0], n_portions=130)
    assert sim.batch_time < float("inf")
    assert sim.used == Counter(range(130))
    done = sim.scheduler.portions_done
    assert sum(done.values()) == 130
    for fast in range(3):
        assert 3 * done[3] <= done[fast] <= 5 * done[3] + 4


def test_straggler_dynamic_with_backups_beats_static_split():
    seconds = [1.0] * 7 + [4.0]  # one replica 4x slower
    speedups = []
    for per_replica in (8, PORTIONS_PER_REPLICA, 11):
        n_portions = per_replica * len(seconds)
        plan = static_plan(n_portions, len(seconds))
        static = max(len(portions) * seconds[r] for r, portions in enumerate(plan))
        ideal = n_portions / sum(1.0 / s for s in seconds)  # perfectly divisible work
        with_backups = simulate(seconds, n_portions)
        without_backups = simulate(seconds, n_portions, max_copies=1)
        assert static == 4.0 * per_replica
        assert with_backups.batch_time <= 0.35 * static
        assert with_backups.batch_time <= ideal + 1.0  # at most one fast portion past ideal
        assert with_backups.batch_time <= without_backups.batch_time
        assert with_backups.used == Counter(range(n_portions))
        speedups.append(without_backups.batch_time / with_backups.batch_time)
    assert max(speedups) >= 1.2  # a backup saves the straggler's tail when it holds the last one


def test_failed_replica_portions_still_complete_once():
    sim = simulate([1.0, 1.5, 2.0], n_portions=30, failures={1: 3.2})
    assert sim.scheduler.done and sim.used == Counter(range(30))
    assert sim.scheduler.portions_done[1] == 2  # finished at 1.5 and 3.0, then died


@settings(max_examples=150, deadline=None)
@given(
    seconds=st.lists(st.floats(0.5, 8.0), min_size=1, max_size=6),
    n_portions=st.integers(1, 40),
    max_copies=st.integers(1, 3),
    failure_times=st.lists(st.floats(0.0, 30.0), max_size=6),
    late_results=st.booleans(),
)
def test_exactly_once_under_random_speeds_and_failures(
    seconds, n_portions, max_copies, failure_times, late_results
):
    failures = dict(enumerate(failure_times[: len(seconds) - 1]))  # the last replica survives
    sim = simulate(seconds, n_portions, max_copies, failures, late_results)
    assert sim.batch_time < float("inf"), "batch must finish while a replica is alive"
    assert sim.used == Counter(range(n_portions))
    assert sim.max_copies_seen <= max_copies
    scheduler = sim.scheduler
    assert sum(scheduler.portions_done.values()) == n_portions
    if max_copies == 1 and not failures:
        assert scheduler.backups_issued == 0 and scheduler.duplicates_discarded == 0
