"""Push ids and a shard's ledger of them: every push applied at most once, and counted.

A push id is ``(replica, incarnation, seq)``: ``incarnation`` is new each time the driver
starts a replica (a restart or a resumed run gets one no earlier incarnation used) and
``seq`` counts that incarnation's pushes from 1. One client's pushes reach a shard in the
order it sent them, so a shard keeps, per ``(replica, incarnation)``, only the highest
``seq`` it has taken: a push at or below it is a resend of one already taken (after a
failover) and is acknowledged, not applied again (with the outcome it had if it is the
highest, which is what a client resends; an older one answers "applied"). A push above
``high + 1`` means the ones between never reached this shard's state (dropped by their
client, or taken by a shard copy that was lost): they are counted as ``gaps``.

:func:`account` turns two ledgers (a run's start and end) and what each client reports it
sent into the exact split ``sent == applied + rejected + dropped + lost_with_shard``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["FIELDS", "PushId", "PushLedger", "account", "key_of", "next_incarnation",
           "parse_key"]

PushId = tuple[int, int, int]  # (replica, incarnation, seq)
FIELDS = ("high", "applied", "rejected", "duplicates", "gaps")


def key_of(replica: int, incarnation: int) -> str:
    """The JSON key of one replica incarnation: ``"replica:incarnation"``."""
    return f"{int(replica)}:{int(incarnation)}"


def parse_key(key: str) -> tuple[int, int]:
    replica, incarnation = key.split(":")
    return int(replica), int(incarnation)


def next_incarnation(stats: Iterable[Mapping]) -> int:
    """The first incarnation no shard's ledger (``stats[i]["ledger"]``) has seen: 1 for a new
    run, past every earlier one for a resumed run."""
    seen = [parse_key(k)[1] for s in stats for k in s.get("ledger", {})]
    return max(seen, default=0) + 1


class PushLedger:
    """Per replica incarnation: the highest seq taken, and applied / rejected / duplicate
    pushes and seq gaps. ``entries`` maps :func:`key_of` keys to ``FIELDS`` counts; the
    outcome of each key's highest seq answers a resend of it."""

    def __init__(self, entries: Mapping[str, Iterable[int]] | None = None) -> None:
        self.entries: dict[str, list[int]] = {}
        self.last: dict[str, bool] = {}  # outcome of each key's highest seq
        for key, values in (entries or {}).items():
            self.entries[key] = [int(v) for v in values]
            self.last[key] = True

    def _entry(self, key: str) -> list[int]:
        if key not in self.entries:
            self.entries[key] = [0] * len(FIELDS)
        return self.entries[key]

    def taken(self, pid: PushId) -> bool | None:
        """The outcome (applied or not) of push ``pid`` if this ledger has taken it already
        (the resend is counted as a duplicate), else None: apply it, then :meth:`record`."""
        replica, incarnation, seq = pid
        key = key_of(replica, incarnation)
        entry = self.entries.get(key)
        if entry is None or seq > entry[0]:
            return None
        entry[3] += 1
        return self.last.get(key, True) if seq == entry[0] else True

    def record(self, pid: PushId, applied: bool) -> None:
        """Push ``pid`` (not :meth:`taken`) was applied or rejected."""
        replica, incarnation, seq = pid
        key = key_of(replica, incarnation)
        entry = self._entry(key)
        if seq <= entry[0]:
            raise ValueError(f"push {pid} is not newer than {entry[0]}: ask taken() first")
        entry[4] += seq - entry[0] - 1
        entry[0] = seq
        entry[1 if applied else 2] += 1
        self.last[key] = applied

    def to_json(self) -> dict[str, list[int]]:
        """The entries, JSON-ready (checkpoint counters, shard stats)."""
        return {k: list(v) for k, v in sorted(self.entries.items())}


def _delta(first: Mapping[str, list[int]], last: Mapping[str, list[int]], key: str) -> dict:
    a = first.get(key, [0] * len(FIELDS))
    b = last.get(key, [0] * len(FIELDS))
    out = {f: y - x for f, x, y in zip(FIELDS, a, b)}
    out["high"] = b[0]
    return out


def account(first: Mapping[str, list[int]], last: Mapping[str, list[int]],
            clients: Mapping[str, dict], shard: int) -> dict:
    """Where every push sent to shard ``shard`` during a run went.

    ``first``/``last``: the shard's ledger entries at the run's start and end; ``clients``:
    for each incarnation that finished (its :func:`key_of` key), its client counters
    (``pushes`` sent, ``dropped_by_shard`` per shard). An incarnation that died has no
    counters: its pushes count as sent up to the last one this shard took (``high``).
    ``dropped``: pushes a client gave up on (its shard died, no standby); ``lost_with_shard``:
    the rest, pushes acknowledged and then rolled back with a shard restored from a
    checkpoint. ``exact``: every term is measured and none is negative.
    """
    keys = sorted(set(last) - set(first) | set(clients)
                  | {k for k in last if last[k] != first.get(k)})
    sent = applied = rejected = dropped = duplicates = 0
    exact = True
    for key in keys:
        d = _delta(first, last, key)
        applied += d["applied"]
        rejected += d["rejected"]
        duplicates += d["duplicates"]
        client = clients.get(key)
        if client is None:  # died: its pushes up to the last this shard took
            sent += d["high"]
            exact &= key not in first  # earlier pushes of a resumed incarnation: unknown
        else:
            sent += int(client["pushes"])
            dropped += int(client["dropped_by_shard"][shard])
    lost = sent - applied - rejected - dropped
    return {"shard": shard, "sent": sent, "applied": applied, "rejected": rejected,
            "dropped": dropped, "lost_with_shard": lost, "duplicates": duplicates,
            "exact": exact and lost >= 0}
