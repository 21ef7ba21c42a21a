"""The named vectors Sandblaster's L-BFGS works on, and the five operations a space offers.

In Sandblaster the parameters, the gradient and the L-BFGS history live on the
parameter-server shards, each shard holding the same slice of every named vector. The
coordinator sends small commands and gets back only scalars. Shards implement exactly the
five operations of `VectorSpace`:

    dots(pairs)          -> [float]   batched dot products u . v, one round trip
    axpy(alpha, x, y)                 y += alpha * x
    scale(alpha, x)                   x *= alpha
    copy(src, dst)                    dst = src (creates dst)
    lincomb(dst, terms)               dst = sum(c * v for c, v in terms) (creates dst; dst may
                                      itself appear in terms; no terms zeroes an existing dst)

Vector names: ``x`` parameters, ``g`` gradient at ``x``, ``d`` search direction,
``x_trial`` / ``g_trial`` the line-search point (``s{i}`` / ``y{i}``, the L-BFGS history, are
named by :mod:`~distbelief.sandblaster.lbfgs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

X, G, D = "x", "g", "d"
X_TRIAL, G_TRIAL = "x_trial", "g_trial"

Evaluate = Callable[[str, str], float]
"""``evaluate(x, g)``: the loss at vector ``x``; writes the gradient there into vector ``g``."""


class VectorSpace(Protocol):
    """Named vectors that live elsewhere (on the shards); every call returns at most scalars."""

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Dot products ``u . v`` for each ``(u, v)`` in ``pairs``, in order, in one round trip."""
        ...

    def axpy(self, alpha: float, x: str, y: str) -> None:
        """``y += alpha * x``."""
        ...

    def scale(self, alpha: float, x: str) -> None:
        """``x *= alpha``."""
        ...

    def copy(self, src: str, dst: str) -> None:
        """``dst = src``, creating ``dst`` if missing."""
        ...

    def lincomb(self, dst: str, terms: list[tuple[float, str]]) -> None:
        """``dst = sum(c * v for c, v in terms)``, creating ``dst``; ``dst`` may be a term.

        With no terms, zeroes ``dst``, which must then exist (its length is not known otherwise).
        """
        ...
