"""A strong Wolfe line search over scalars only (Nocedal & Wright, Algorithms 3.5 and 3.6).

The search never sees a vector: it asks a ``trial`` callback for the loss and the slope at a
step size along the search direction (the callback evaluates the point into ``x_trial`` and
``g_trial`` on the shards) and decides from the returned scalars alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Point = tuple[float, float, float]  # (alpha, phi(alpha), phi'(alpha)) along d

Trial = Callable[[float], tuple[float, float]]
"""``trial(alpha)``: evaluate at ``x + alpha * d``; ``(phi(alpha), phi'(alpha))``."""


class LineSearchError(RuntimeError):
    """No step along the search direction, nor along -g, decreased the loss."""


@dataclass
class StrongWolfe:
    """One line search: a step satisfying the strong Wolfe conditions with constants ``c1`` <
    ``c2`` (cubic interpolation), using at most ``max_evaluations`` calls of ``trial``."""

    trial: Trial
    c1: float
    c2: float
    max_evaluations: int
    _last_alpha: float | None = None  # the alpha of the latest trial: what x_trial holds

    def search(self, f0: float, slope0: float, alpha: float) -> tuple[float, float, bool]:
        """Search from ``(0, f0, slope0)`` starting at step ``alpha``; ``(alpha, loss, strong
        Wolfe held)``. Bracketing phase (N&W Algorithm 3.5), doubling alpha until a bracket
        is found."""
        self._last_alpha = None
        previous: Point = (0.0, f0, slope0)
        for i in range(self.max_evaluations):
            loss, slope = self._trial(alpha)
            current = (alpha, loss, slope)
            budget = self.max_evaluations - i - 1
            if not self._armijo(f0, slope0, alpha, loss) or (i > 0 and loss >= previous[1]):
                return self._zoom(f0, slope0, previous, current, budget)
            if abs(slope) <= -self.c2 * slope0:
                return alpha, loss, True
            if slope >= 0.0:
                return self._zoom(f0, slope0, current, previous, budget)
            previous, alpha = current, 2.0 * alpha
        return self._fallback(previous)

    def _trial(self, alpha: float) -> tuple[float, float]:
        loss, slope = self.trial(alpha)
        self._last_alpha = alpha
        return loss, slope

    def _armijo(self, f0: float, slope0: float, alpha: float, loss: float) -> bool:
        return loss <= f0 + self.c1 * alpha * slope0  # False for NaN as well

    def _zoom(
        self, f0: float, slope0: float, lo: Point, hi: Point, budget: int
    ) -> tuple[float, float, bool]:
        """Zoom phase (N&W Algorithm 3.6): ``lo`` is the best point satisfying sufficient
        decrease, and the interval between ``lo`` and ``hi`` holds a strong Wolfe point."""
        for _ in range(budget):
            alpha = _cubic_minimizer(lo, hi)
            loss, slope = self._trial(alpha)
            if not self._armijo(f0, slope0, alpha, loss) or loss >= lo[1]:
                hi = (alpha, loss, slope)
                continue
            if abs(slope) <= -self.c2 * slope0:
                return alpha, loss, True
            if slope * (hi[0] - lo[0]) >= 0.0:
                hi = lo
            lo = (alpha, loss, slope)
        return self._fallback(lo)

    def _fallback(self, lo: Point) -> tuple[float, float, bool]:
        """Out of evaluations: accept ``lo`` if it is a real decrease, re-evaluating if needed."""
        alpha, loss, _ = lo
        if alpha == 0.0:
            raise LineSearchError(f"no decrease within {self.max_evaluations} evaluations")
        if self._last_alpha != alpha:
            loss, _ = self._trial(alpha)
        return alpha, loss, False


def _cubic_minimizer(lo: Point, hi: Point) -> float:
    """Minimiser of the cubic through two points with slopes (N&W eq. 3.59), kept inside the
    middle 80% of the interval; bisection when the cubic is unusable."""
    (a, fa, da), (b, fb, db) = lo, hi
    left, right = min(a, b), max(a, b)
    margin = 0.1 * (right - left)
    d1 = da + db - 3.0 * (fa - fb) / (a - b)
    discriminant = d1 * d1 - da * db
    if discriminant >= 0.0:
        d2 = math.copysign(math.sqrt(discriminant), b - a)
        denominator = db - da + 2.0 * d2
        if denominator != 0.0:
            t = b - (b - a) * (db + d2 - d1) / denominator
            if left + margin <= t <= right - margin:
                return t
    return 0.5 * (a + b)
