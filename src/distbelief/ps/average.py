"""Averages of a shard's parameters over its updates (``--average``), pure NumPy.

``ema:DECAY`` keeps ``a <- DECAY a + (1 - DECAY) p`` after every applied update, starting
from the initial parameters (so after ``k`` updates ``a_k = DECAY^k p_0 + (1 - DECAY)
sum_j DECAY^(k-j) p_j``). ``polyak`` (or ``polyak:K``) keeps the uniform mean of the
parameters after every update from update ``K`` on (Polyak-Ruppert averaging); before that
it follows the parameters. Both update in place in chunks (:func:`~distbelief.ps.optim.
chunks`), so an update of a large slice allocates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distbelief.errors import UserError
from distbelief.ps.optim import chunks

USAGE = "pass ema:DECAY with 0 < DECAY < 1 (e.g. ema:0.999), polyak, or polyak:K with K >= 0"


@dataclass(frozen=True)
class AverageSpec:
    """``kind`` ``"ema"`` (with ``decay``) or ``"polyak"`` (from update ``start``)."""

    kind: str
    decay: float = 0.0
    start: int = 0

    def __str__(self) -> str:
        return f"ema:{self.decay:g}" if self.kind == "ema" else f"polyak:{self.start}"


def parse_average(text: str) -> AverageSpec:
    """``--average`` as an :class:`AverageSpec`; a one-line :class:`UserError` if malformed."""
    kind, _, arg = str(text).strip().partition(":")
    try:
        if kind == "ema" and arg:
            decay = float(arg)
            if math.isfinite(decay) and 0.0 < decay < 1.0:
                return AverageSpec("ema", decay=decay)
        elif kind == "polyak":
            start = int(arg) if arg else 0
            if start >= 0:
                return AverageSpec("polyak", start=start)
    except ValueError:
        pass
    raise UserError(f"--average {text!r} is not understood: {USAGE}")


class ParamAverage:
    """The running average of one slice's parameters (float32 ``(n,)``), updated by
    :meth:`update` after each applied update; ``count`` is how many updates it has seen."""

    def __init__(self, spec: AverageSpec, params: np.ndarray) -> None:
        self.spec = spec
        self.values = np.array(params, dtype=np.float32, copy=True).reshape(-1)
        self.count = 0

    def update(self, params: np.ndarray) -> None:
        """Fold in ``params`` (the slice after one more update), in place, chunk by chunk."""
        self.count += 1
        if self.spec.kind == "ema":
            decay = np.float32(self.spec.decay)
            for a, p, _ in chunks(self.values, params):
                a -= p  # a <- decay (a - p) + p = decay a + (1 - decay) p
                a *= decay
                a += p
            return
        n = self.count - self.spec.start  # parameters after updates start..count averaged
        if n <= 0:
            np.copyto(self.values, params)
            return
        weight = np.float32(1.0 / (n + 1))  # the parameters at update ``start`` count too
        for a, p, t in chunks(self.values, params):
            np.subtract(p, a, out=t)
            t *= weight
            a += t

    def arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint holds: the average and its update count."""
        return {"average": self.values, "average_count": np.array([self.count], np.int64)}

    def restore(self, arrays: dict[str, np.ndarray], params: np.ndarray) -> None:
        """Load :meth:`arrays`; a checkpoint without an average starts one at ``params``."""
        if "average" in arrays and arrays["average"].shape == self.values.shape:
            np.copyto(self.values, arrays["average"])
            self.count = int(np.asarray(arrays.get("average_count", [0])).reshape(-1)[0])
        else:
            np.copyto(self.values, params)
            self.count = 0


def check_average(spec: str, trainer: str) -> None:
    """``--average`` parses and the run is Downpour on dense shards (``trainer``: the
    algorithm, or ``"click data"``); one-line :class:`UserError` if not."""
    parse_average(spec)
    if trainer != "downpour":
        raise UserError(f"--average averages Downpour's dense shards only, not {trainer}: "
                        "drop it")
