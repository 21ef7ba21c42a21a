"""The push ledger (ps/ledger.py) and push accounting from it, without Ray."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.ps.ledger import PushLedger, account, key_of
from distbelief.ps.optim import make_rule
from distbelief.ps.shard import ShardCore

# One client's pushes, each: delivered once, delivered and resent, or dropped by its client.
FATES = st.lists(st.sampled_from(["once", "resent", "dropped"]), max_size=30)


def deliveries(plan: dict[tuple[int, int], list[str]], order: list[int]):
    """Each client's pushes in its own order, clients interleaved as ``order`` says."""
    queues = {k: [(seq, fate) for seq, fate in enumerate(fates, 1)]
              for k, fates in plan.items()}
    keys = sorted(queues)
    for pick in order:
        live = [k for k in keys if queues[k]]
        if not live:
            return
        k = live[pick % len(live)]
        yield k, *queues[k].pop(0)
    for k in keys:
        for seq, fate in queues[k]:
            yield k, seq, fate


@settings(max_examples=200, deadline=None)
@given(plan=st.dictionaries(st.tuples(st.integers(0, 3), st.integers(0, 2)), FATES,
                            max_size=5),
       order=st.lists(st.integers(0, 10), max_size=200),
       rejected_every=st.integers(2, 7))
def test_every_push_is_taken_once_and_the_accounting_is_exact(plan, order, rejected_every):
    ledger = PushLedger()
    taken: dict[tuple[int, int], int] = {}
    for (replica, inc), seq, fate in deliveries(plan, order):
        if fate == "dropped":
            continue
        applied = seq % rejected_every != 0
        assert ledger.taken((replica, inc, seq)) is None
        ledger.record((replica, inc, seq), applied)
        taken[(replica, inc)] = taken.get((replica, inc), 0) + 1
        if fate == "resent":  # a resend right after: answered as before, not taken again
            assert ledger.taken((replica, inc, seq)) == applied
    entries = ledger.to_json()
    clients = {}
    for (replica, inc), fates in plan.items():
        key = key_of(replica, inc)
        high = max([s for s, f in enumerate(fates, 1) if f != "dropped"], default=0)
        if key in entries:
            got = entries[key]
            assert got[0] == high
            assert got[1] + got[2] == taken[(replica, inc)]
            assert got[3] == fates.count("resent")
            assert got[4] == sum(f == "dropped" for f in fates[:high])
        clients[key] = {"pushes": len(fates), "dropped_by_shard": [fates.count("dropped")]}
    out = account({}, entries, clients, 0)
    assert out["exact"] and out["lost_with_shard"] == 0
    assert out["sent"] == out["applied"] + out["rejected"] + out["dropped"]
    assert out["sent"] == sum(len(f) for f in plan.values())


def test_a_dead_incarnation_counts_as_sent_what_the_shard_took_and_runs_are_deltas():
    first = {key_of(0, 1): [5, 5, 0, 0, 0]}  # a resumed run's earlier incarnation
    last = {key_of(0, 1): [5, 5, 0, 0, 0], key_of(0, 2): [7, 6, 1, 0, 0],
            key_of(1, 2): [4, 4, 0, 1, 0]}
    clients = {key_of(1, 2): {"pushes": 4, "dropped_by_shard": [0, 0]}}  # replica 0 died
    out = account(first, last, clients, 1)
    assert out == {"shard": 1, "sent": 11, "applied": 10, "rejected": 1, "dropped": 0,
                   "lost_with_shard": 0, "duplicates": 1, "exact": True}


def test_pushes_rolled_back_with_a_restored_shard_are_lost_with_it():
    clients = {key_of(0, 1): {"pushes": 10, "dropped_by_shard": [1]}}
    last = {key_of(0, 1): [10, 6, 0, 0, 3]}  # restored at seq 6, seq 7 dropped, 8-10 taken
    out = account({}, last, clients, 0)
    assert out["lost_with_shard"] == 3 and out["exact"]


def test_a_record_out_of_order_is_refused():
    ledger = PushLedger()
    ledger.record((0, 1, 3), True)
    with pytest.raises(ValueError, match="taken"):
        ledger.record((0, 1, 2), True)


def test_a_resent_push_changes_nothing_on_a_shard_and_survives_a_snapshot():
    shard = ShardCore(0, np.zeros(6, np.float32), make_rule("adagrad", 0.1, 0.9))
    grad = np.arange(6, dtype=np.float32)
    assert shard.push(grad, 0, 0, pid=(0, 1, 1))
    before = shard.params.copy()
    assert shard.push(grad, 0, 0, pid=(0, 1, 1))  # the resend: acknowledged, not applied
    assert np.array_equal(shard.params, before) and shard.version == 1
    assert not shard.push(np.full(6, np.nan, np.float32), 1, 0, pid=(0, 1, 2))
    assert shard.push(grad, 1, 0, pid=(0, 1, 2)) is False  # its outcome, again
    copy = ShardCore(0, np.zeros(6, np.float32), make_rule("adagrad", 0.1, 0.9))
    snap = shard.snapshot()
    copy.restore(snap["arrays"], snap["version"], snap["counters"])
    for s in (shard, copy):
        assert s.push(grad, 1, 0, pid=(0, 1, 3))
    assert np.array_equal(shard.params, copy.params) and shard.stats() == copy.stats()
    assert shard.stats()["ledger"] == {key_of(0, 1): [3, 2, 1, 2, 0]}
