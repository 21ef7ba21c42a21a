"""Learning-rate schedules keyed on a shard's update count (pure, no state of their own).

A shard's ``version`` counts the updates it has applied and is already checkpointed, so a
schedule needs no state: the rate of update ``k`` (``k`` = the version *before* it is
applied, 0 for the first update) is ``lr * schedule.factor(k)``, and a resumed shard picks
up exactly where it stopped.

``--lr-schedule`` strings are comma-separated phases, an optional warm-up first, then at
most one decay, counted from the end of the warm-up:

- ``warmup:N``: linear warm-up, factor ``(k + 1) / N`` for the first ``N`` updates.
- ``cosine:T[:FLOOR]``: cosine from 1 down to ``FLOOR`` (a fraction of ``--lr``, default 0)
  over ``T`` updates, then ``FLOOR``.
- ``step:N:GAMMA``: multiply by ``GAMMA`` every ``N`` updates.
- ``constant`` (or an empty string): factor 1.

e.g. ``warmup:100,cosine:5000``, ``step:1000:0.5``, ``warmup:50,cosine:2000:0.1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distbelief.errors import UserError

EXAMPLE = "write e.g. warmup:100,cosine:5000 or step:1000:0.5"
DECAYS = ("none", "cosine", "step")


@dataclass(frozen=True)
class Schedule:
    """The factor applied to ``--lr`` at each update; the default is constant 1.

    ``warmup``: updates of linear warm-up; ``decay``: ``none``, ``cosine`` or ``step``;
    ``period``: the cosine's length or the step decay's interval, in updates; ``floor``:
    the cosine's final factor; ``gamma``: the step decay's factor per period.
    """

    warmup: int = 0
    decay: str = "none"
    period: int = 0
    floor: float = 0.0
    gamma: float = 1.0

    @property
    def constant(self) -> bool:
        """Whether every update gets factor 1 (no update count needed)."""
        return self.warmup == 0 and self.decay == "none"

    def factor(self, update: int) -> float:
        """The factor of update ``update`` (0-based: the shard's version before it)."""
        if update < 0:
            raise ValueError(f"update count must be >= 0 (got {update})")
        if update < self.warmup:
            return (update + 1) / self.warmup
        done = update - self.warmup  # updates since the warm-up ended
        if self.decay == "cosine":
            progress = min(done, self.period) / self.period
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.gamma ** (done // self.period)
        return 1.0

    def __str__(self) -> str:
        parts = [f"warmup:{self.warmup}"] if self.warmup else []
        if self.decay == "cosine":
            parts.append(f"cosine:{self.period}" + (f":{self.floor:g}" if self.floor else ""))
        elif self.decay == "step":
            parts.append(f"step:{self.period}:{self.gamma:g}")
        return ",".join(parts) or "constant"


CONSTANT = Schedule()


def parse_schedule(text: str) -> Schedule:
    """The :class:`Schedule` an ``--lr-schedule`` string names; a one-line
    :class:`~distbelief.errors.UserError` (naming the flag and the fix) if it is malformed."""
    text = text.strip()
    if text in ("", "constant", "none"):
        return CONSTANT
    warmup, decay = 0, None
    for i, phase in enumerate(p.strip() for p in text.split(",")):
        kind, *args = phase.split(":")
        where = f"--lr-schedule {text!r}: phase {phase!r}"
        if kind == "warmup":
            if i != 0:
                raise UserError(f"{where}: the warm-up must come first; {EXAMPLE}")
            _arity(where, args, 1, "warmup:N")
            warmup = _count(where, args[0])
        elif kind in ("cosine", "step"):
            if decay is not None:
                raise UserError(f"{where}: only one decay (cosine or step) is allowed; {EXAMPLE}")
            decay = _decay(where, kind, args)
        else:
            raise UserError(f"{where}: unknown phase {kind!r}, use warmup, cosine or step; "
                            f"{EXAMPLE}")
    return Schedule(warmup=warmup, **(decay or {}))


def _decay(where: str, kind: str, args: list[str]) -> dict:
    if kind == "cosine":
        if len(args) not in (1, 2):
            raise UserError(f"{where}: write cosine:T or cosine:T:FLOOR (FLOOR a fraction "
                            "of --lr in [0, 1])")
        floor = finite_number(where, args[1]) if len(args) == 2 else 0.0
        if not 0.0 <= floor <= 1.0:
            raise UserError(f"{where}: FLOOR is a fraction of --lr and must be in [0, 1] "
                            f"(got {floor:g})")
        return {"decay": "cosine", "period": _count(where, args[0]), "floor": floor}
    _arity(where, args, 2, "step:N:GAMMA (GAMMA in (0, 1])")
    gamma = finite_number(where, args[1])
    if not 0.0 < gamma <= 1.0:
        raise UserError(f"{where}: GAMMA must be in (0, 1] (got {gamma:g})")
    return {"decay": "step", "period": _count(where, args[0]), "gamma": gamma}


def _arity(where: str, args: list[str], n: int, form: str) -> None:
    if len(args) != n:
        raise UserError(f"{where}: write {form}")


def _count(where: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{where}: {text!r} must be a whole number of updates >= 1")
    return value


def finite_number(where: str, text: str) -> float:
    """``text`` as a finite float; a one-line :class:`UserError` naming ``where`` if not."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UserError(f"{where}: {text!r} is not a finite number")
    return value


def scheduled_lr(lr: float, schedule: Schedule, update: int | None) -> float:
    """``lr`` scaled by ``schedule`` at ``update``; a non-constant schedule needs the count."""
    if schedule.constant:
        return lr
    if update is None:
        raise TypeError("a scheduled rule needs the update count: apply(..., update=version)")
    return lr * schedule.factor(update)
