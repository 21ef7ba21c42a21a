"""Staleness control on a shard, pure NumPy: what a push's staleness changes in its update.

A push's staleness is the shard's version when it is applied minus the version the pushing
replica last fetched (:class:`~distbelief.ps.slice.ShardSlice`). Two remedies, each off by
default:

- ``--staleness-lr`` (Zhang et al., IJCAI 2016): the push is applied with the learning rate
  divided by ``max(1, staleness)`` (:func:`lr_scale`).
- ``--delay-compensation LAMBDA`` (DC-ASGD, Zheng et al., ICML 2017): the gradient becomes
  ``g + LAMBDA * g * g * (w_now - w_fetched)`` (:func:`compensate`), a first-order Taylor
  correction of ``g`` towards the parameters it is applied to, with ``g * g`` standing in
  for the Hessian's diagonal. The shard keeps the parameters each replica last fetched
  (:class:`FetchedCopies`): one extra copy of its slice per replica, i.e. ``replicas x
  slice`` float32 per shard, ``replicas x model`` over all shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distbelief.errors import UserError
from distbelief.ps.optim import chunks

__all__ = ["FetchedCopies", "StalenessControl", "check_staleness_flags", "compensate",
           "lr_scale"]


def lr_scale(staleness: int) -> float:
    """The factor on a push's learning rate under ``--staleness-lr``: ``1 / max(1, s)``."""
    return 1.0 / max(1, int(staleness))


def compensate(grad: np.ndarray, now: np.ndarray, fetched: np.ndarray, lam: float,
               out: np.ndarray) -> np.ndarray:
    """DC-ASGD's gradient ``grad + lam * grad * grad * (now - fetched)`` into ``out`` (float32,
    chunked: a large slice allocates nothing); returns ``out``. ``out`` may be ``grad``."""
    lam32 = np.float32(lam)
    for g, w, f, o, t in chunks(grad, now, fetched, out):
        np.subtract(w, f, out=t)
        t *= g
        t *= g
        t *= lam32
        np.add(g, t, out=o)
    return out


class FetchedCopies:
    """The slice as each replica last fetched it (DC-ASGD's ``w_fetched``), one float32 copy
    of ``size`` elements per replica, made on its first fetch."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.copies: dict[int, np.ndarray] = {}

    def remember(self, replica: int, params: np.ndarray) -> None:
        copy = self.copies.get(replica)
        if copy is None:
            self.copies[replica] = np.array(params, dtype=np.float32, copy=True)
        else:
            np.copyto(copy, params)

    def get(self, replica: int) -> np.ndarray | None:
        return self.copies.get(replica)

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies.values())


@dataclass(frozen=True)
class StalenessControl:
    """A shard's staleness remedies: ``lr`` (``--staleness-lr``) and ``dc_lambda``
    (``--delay-compensation``; 0 is off)."""

    lr: bool = False
    dc_lambda: float = 0.0

    @property
    def active(self) -> bool:
        return self.lr or self.dc_lambda > 0

    def scale(self, staleness: int) -> float:
        """The factor on this push's learning rate."""
        return lr_scale(staleness) if self.lr else 1.0


def check_staleness_flags(max_staleness: int | None, staleness_lr: bool,
                          delay_compensation: float, algorithm: str, ranged: bool) -> None:
    """One-line :class:`UserError` for a bad ``--max-staleness``, ``--delay-compensation``,
    or one given where it does nothing (Sandblaster; ranged updates for the shard remedies)."""
    if max_staleness is not None and (isinstance(max_staleness, bool)
                                      or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise UserError(f"--max-staleness must be an integer >= 0 (got {max_staleness!r}): "
                        "0 runs replicas in lockstep, K lets one run K steps ahead")
    if not (isinstance(delay_compensation, (int, float)) and math.isfinite(delay_compensation)
            and delay_compensation >= 0):
        raise UserError(f"--delay-compensation must be a finite number >= 0 (got "
                        f"{delay_compensation!r}): 0 is off, DC-ASGD uses e.g. 0.04 to 2")
    used = [f for f, on in (("--max-staleness", max_staleness is not None),
                            ("--staleness-lr", staleness_lr),
                            ("--delay-compensation", delay_compensation > 0)) if on]
    if used and algorithm != "downpour":
        raise UserError(f"{used[0]} applies to --algorithm downpour only, not {algorithm}: "
                        "drop it")
    shard_side = [f for f in used if f != "--max-staleness"]
    if shard_side and ranged:
        raise UserError(f"{shard_side[0]} works on dense pushes only, not on click data or "
                        "model-parallel partitions: drop it")
