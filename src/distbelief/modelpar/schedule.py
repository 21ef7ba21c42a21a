"""The pass schedule: which partition calls a pass makes, in which order, fed by whom."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from distbelief.modelpar.plan import PartitionPlan


def pass_schedule(plan: PartitionPlan, rounds: Sequence[int]
                  ) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """The calls of one pass, in submission order: ``(round, partition, senders)``, where
    ``senders`` are the earlier calls ``(round, partition)`` whose messages to this partition
    are handed to this call (it keeps those meant for later rounds).

    Each call gets what other partitions' calls sent since its own previous call, and only
    from earlier rounds: what a round sends is always for a later round, and handing it to
    another partition's call in the same round would make the two wait for each other.
    """
    schedule, pending = [], defaultdict(list)
    for r in rounds:
        active = plan.active(r)
        for k in active:
            schedule.append((r, k, tuple(pending.pop(k, []))))
        for k in active:
            for dst in range(plan.num_partitions):
                if dst != k:
                    pending[dst].append((r, k))
    return schedule
