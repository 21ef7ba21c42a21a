"""Sandblaster L-BFGS: a coordinator that never holds a vector (pure).

`LBFGS` works on the named vectors of a :class:`~distbelief.sandblaster.vectors.VectorSpace`
(the parameter-server shards) and uses dots, lincomb and copy (axpy and scale are the in-place
forms other drivers use). It runs the two-loop recursion on coefficients rather than on
vectors ("vector-free L-BFGS", Chen et al., NIPS 2014): the coordinator keeps the Gram matrix
of dot products among the history vectors ``s{i}``, ``y{i}`` and the gradient ``g``, a few
hundred float64 scalars, so the search direction costs one ``lincomb`` instead of 2m
dependent round trips. ``s{i}`` / ``y{i}`` are the ring of m + 1 history slots (one spare, so
a step being committed never overwrites a pair the last saved state still refers to); the
step along the direction is found by :class:`~distbelief.sandblaster.linesearch.StrongWolfe`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.sandblaster.linesearch import LineSearchError, StrongWolfe
from distbelief.sandblaster.vectors import G_TRIAL, X_TRIAL, D, Evaluate, G, VectorSpace, X

CURVATURE_EPS = 1e-10  # a pair with s.y <= CURVATURE_EPS * y.y would make H indefinite: skipped


@dataclass(frozen=True)
class StepInfo:
    """One completed iteration: ``loss`` and ``grad_norm`` (2-norm of g) at the new x.

    ``step_size`` is the accepted alpha in ``x_new = x + alpha * d``; ``evaluations`` counts
    calls to the evaluate callback in this step; ``wolfe`` is False when the line search ran out
    of evaluations and fell back to a point satisfying only sufficient decrease (Armijo).
    """

    iteration: int
    loss: float
    step_size: float
    evaluations: int
    grad_norm: float
    wolfe: bool


@dataclass(frozen=True)
class MinimizeResult:
    """How `LBFGS.minimize` ended; ``iterations`` and ``evaluations`` count this call only."""

    loss: float
    grad_norm: float
    iterations: int
    evaluations: int
    converged: bool
    message: str



class LBFGS:
    """L-BFGS over a `VectorSpace`, one resumable iteration at a time.

    Minimises the loss that ``evaluate`` computes, starting from vector ``x`` (which must
    exist in ``space``); the iterate is always ``x`` and its gradient ``g``. ``history`` is m,
    the number of (s, y) pairs kept. The line search finds a step satisfying the strong Wolfe
    conditions with constants ``c1`` < ``c2`` (Nocedal & Wright, Algorithms 3.5 and 3.6, cubic
    interpolation) using at most ``max_evaluations`` evaluations per step. All coordinator
    state is float64 scalars: see `state_dict`.
    """

    def __init__(
        self,
        space: VectorSpace,
        evaluate: Evaluate,
        history: int = 10,
        c1: float = 1e-4,
        c2: float = 0.9,
        max_evaluations: int = 20,
    ) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        if not 0.0 < c1 < c2 < 1.0:
            raise ValueError(f"need 0 < c1 < c2 < 1, got c1={c1}, c2={c2}")
        if max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1, got {max_evaluations}")
        self.space, self.evaluate = space, evaluate
        self.history, self.c1, self.c2 = history, c1, c2
        self.max_evaluations = max_evaluations
        self._slots = history + 1
        self.iteration = 0  # completed steps
        self.evaluations = 0  # calls to evaluate, all steps together
        self.position = 0  # ring slot the next (s, y) pair goes to
        self.length = 0  # pairs in use: the `length` slots before `position`
        self.loss: float | None = None  # loss at x, None until evaluated
        # Gram matrix over the basis s0..s{m}, y0..y{m}, g (only referenced entries are valid).
        self._gram = np.zeros((2 * self._slots + 1, 2 * self._slots + 1))

    @property
    def grad_norm(self) -> float:
        """2-norm of the gradient ``g`` at ``x``."""
        return math.sqrt(max(self._gram[self._g, self._g], 0.0))

    def start(self) -> float:
        """Evaluate the loss at ``x`` (writing ``g``) and refresh g's dot products; the loss.

        `step` calls this on its first use. Call it yourself after `load_state_dict` when the
        previous coordinator died inside a step: ``x`` and ``g`` may then be ahead of the saved
        state, whose history pairs are intact because a step writes only to the spare slot.
        """
        loss = float(self.evaluate(X, G))
        self.evaluations += 1
        if not math.isfinite(loss):
            raise ValueError(f"loss at the starting point is {loss}")
        self.loss = loss
        self._update_gram([self._g], self._recent())
        return loss

    def step(self) -> StepInfo:
        """Take one L-BFGS iteration: direction into ``d``, line search, commit to ``x``/``g``.

        If the line search finds no decrease, the history is dropped and it retries along
        -g; if that fails too, raises `LineSearchError` with ``x`` and ``g`` unchanged (and
        the history dropped).
        """
        if self.loss is None:
            self.start()
        evaluations = self.evaluations
        try:
            alpha, loss, wolfe = self._search()
        except LineSearchError:
            if self.length == 0:
                raise
            self.length = 0
            alpha, loss, wolfe = self._search()
        self._commit(loss)
        self.iteration += 1
        return StepInfo(
            self.iteration, loss, alpha, self.evaluations - evaluations, self.grad_norm, wolfe
        )

    def minimize(
        self, max_iter: int = 100, tol: float = 1e-5, ftol: float = 1e-12
    ) -> MinimizeResult:
        """Step until ``grad_norm <= tol``, the relative loss decrease of a step falls to
        ``ftol`` or below (relative to ``max(|f|, 1)``), the line search fails, or ``max_iter``
        steps have been taken in this call. Line searches compare losses, so a ``tol`` below
        what the loss's rounding resolves ends in a line-search failure (``converged`` False)."""
        if self.loss is None:
            self.start()
        iteration, evaluations = self.iteration, self.evaluations

        def result(converged: bool, message: str) -> MinimizeResult:
            assert self.loss is not None
            return MinimizeResult(
                self.loss,
                self.grad_norm,
                self.iteration - iteration,
                self.evaluations - evaluations,
                converged,
                message,
            )

        for _ in range(max_iter):
            if self.grad_norm <= tol:
                return result(True, f"gradient norm <= {tol}")
            previous = self.loss
            try:
                info = self.step()
            except LineSearchError as error:
                return result(False, f"line search failed: {error}")
            if previous - info.loss <= ftol * max(abs(previous), abs(info.loss), 1.0):
                return result(True, f"relative loss decrease <= {ftol}")
        if self.grad_norm <= tol:
            return result(True, f"gradient norm <= {tol}")
        return result(False, f"reached max_iter={max_iter}")

    def state_dict(self) -> dict[str, Any]:
        """All coordinator state as JSON-ready scalars; with the named vectors it resumes a run.

        Keys: ``history`` (m), ``iteration``, ``evaluations``, ``position`` (next ring slot),
        ``length`` (pairs in use), ``loss`` (at x, or None) and ``gram`` (square list of
        lists, side 2m + 3, dot products over s0..s{m}, y0..y{m}, g; rho_i = 1 / gram[i][m+1+i]).
        """
        return {
            "history": self.history,
            "iteration": self.iteration,
            "evaluations": self.evaluations,
            "position": self.position,
            "length": self.length,
            "loss": self.loss,
            "gram": self._gram.tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned; the space must hold that state's vectors."""
        if state["history"] != self.history:
            raise ValueError(f"state has history {state['history']}, this LBFGS {self.history}")
        gram = np.array(state["gram"], dtype=np.float64)
        if gram.shape != self._gram.shape:
            raise ValueError(f"gram has shape {gram.shape}, expected {self._gram.shape}")
        self.iteration, self.evaluations = int(state["iteration"]), int(state["evaluations"])
        self.position, self.length = int(state["position"]), int(state["length"])
        self.loss = None if state["loss"] is None else float(state["loss"])
        self._gram = gram

    # Basis indices into the Gram matrix: s{i} -> i, y{i} -> slots + i, g -> 2 * slots.
    def _s(self, slot: int) -> int:
        return slot

    def _y(self, slot: int) -> int:
        return self._slots + slot

    @property
    def _g(self) -> int:
        return 2 * self._slots

    def _name(self, index: int) -> str:
        if index == self._g:
            return G
        return f"s{index}" if index < self._slots else f"y{index - self._slots}"

    def _recent(self) -> list[int]:
        """Ring slots in use, newest first."""
        return [(self.position - 1 - age) % self._slots for age in range(self.length)]

    def _update_gram(self, fresh: list[int], slots: list[int]) -> None:
        """Recompute the dot products of the ``fresh`` basis vectors with those of ``slots``,
        g and each other, in one round trip."""
        basis = [self._s(i) for i in slots] + [self._y(i) for i in slots] + [self._g]
        pairs = list(dict.fromkeys((min(i, j), max(i, j)) for i in fresh for j in basis + fresh))
        values = self.space.dots([(self._name(i), self._name(j)) for i, j in pairs])
        for (i, j), value in zip(pairs, values, strict=True):
            self._gram[i, j] = self._gram[j, i] = value

    def _direction(self) -> np.ndarray:
        """Coefficients c over the basis with ``sum(c_k b_k) = -H g``: the two-loop recursion
        run on the Gram matrix instead of on vectors."""
        gram = self._gram
        coef = np.zeros(len(gram))
        coef[self._g] = 1.0
        recent = self._recent()
        alphas = []
        for i in recent:
            s, y = self._s(i), self._y(i)
            alphas.append(coef @ gram[s] / gram[s, y])
            coef[y] -= alphas[-1]
        if recent:
            s, y = self._s(recent[0]), self._y(recent[0])
            coef *= gram[s, y] / gram[y, y]
        for i, alpha in zip(reversed(recent), reversed(alphas), strict=True):
            s, y = self._s(i), self._y(i)
            coef[s] += alpha - coef @ gram[y] / gram[s, y]
        return -coef

    def _search(self) -> tuple[float, float, bool]:
        """Write d and line-search along it; (alpha, loss, strong Wolfe held)."""
        coef = self._direction()
        terms = [(float(c), self._name(k)) for k, c in enumerate(coef) if c != 0.0]
        self.space.lincomb(D, terms)
        slope = float(coef @ self._gram[self._g])  # g . d
        if not slope < 0.0:
            raise LineSearchError(f"d is not a descent direction (g.d = {slope})")
        alpha = 1.0 if self.length else min(1.0, 1.0 / self.grad_norm)
        assert self.loss is not None
        search = StrongWolfe(self._trial, self.c1, self.c2, self.max_evaluations)
        return search.search(self.loss, slope, alpha)

    def _trial(self, alpha: float) -> tuple[float, float]:
        """Evaluate at ``x + alpha * d`` into x_trial, g_trial; (phi(alpha), phi'(alpha))."""
        self.space.lincomb(X_TRIAL, [(1.0, X), (alpha, D)])
        loss = float(self.evaluate(X_TRIAL, G_TRIAL))
        self.evaluations += 1
        (slope,) = self.space.dots([(G_TRIAL, D)])
        return loss, slope

    def _commit(self, loss: float) -> None:
        """Move to the trial point: new pair (s, y) into the spare slot, then x, g; update Gram."""
        slot, space = self.position, self.space
        space.lincomb(f"s{slot}", [(1.0, X_TRIAL), (-1.0, X)])
        space.lincomb(f"y{slot}", [(1.0, G_TRIAL), (-1.0, G)])
        space.copy(X_TRIAL, X)
        space.copy(G_TRIAL, G)
        s, y = self._s(slot), self._y(slot)
        self._update_gram([s, y, self._g], self._recent())
        self.loss = loss
        if self._gram[s, y] > CURVATURE_EPS * self._gram[y, y]:
            self.position = (slot + 1) % self._slots
            self.length = min(self.length + 1, self.history)
