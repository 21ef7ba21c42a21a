"""Sandblaster L-BFGS over a LocalVectorSpace: optimum, Wolfe steps, scalars only, resume."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import scipy.optimize
from sklearn.datasets import load_digits
from support.vectors import LocalVectorSpace

from distbelief.sandblaster.lbfgs import LBFGS
from distbelief.sandblaster.linesearch import LineSearchError
from distbelief.sandblaster.vectors import VectorSpace

Objective = Callable[[np.ndarray], tuple[float, np.ndarray]]
L2 = 1e-3


def digits_objective() -> tuple[Objective, int]:
    """Multinomial logistic regression on sklearn's digits (1797 x 64, 10 classes) with an L2
    term, so the optimum is unique; parameters are a flat (65 * 10,) weight-and-bias vector."""
    data = load_digits()
    features = np.hstack([data.data / 16.0, np.ones((len(data.data), 1))])
    onehot = np.eye(10)[data.target]
    n, k = features.shape[0], 10

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        weights = w.astype(np.float64).reshape(features.shape[1], k)
        logits = features @ weights
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        loss = -(onehot * log_probs).sum() / n + 0.5 * L2 * (weights**2).sum()
        grad = features.T @ (np.exp(log_probs) - onehot) / n + L2 * weights
        return float(loss), grad.ravel()

    return objective, features.shape[1] * k


def quadratic_objective(n: int, condition: float, seed: int) -> tuple[Objective, np.ndarray]:
    """0.5 x'Ax - b'x with SPD A of the given condition number; also returns the minimiser."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = (q * np.geomspace(1.0, condition, n)) @ q.T
    b = rng.standard_normal(n)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        x = x.astype(np.float64)
        ax = a @ x
        return float(0.5 * x @ ax - b @ x), ax - b

    return objective, np.linalg.solve(a, b)


def evaluator(space: LocalVectorSpace, objective: Objective) -> Callable[[str, str], float]:
    """The replicas' side: loss at vector x, gradient written into vector g."""

    def evaluate(x: str, g: str) -> float:
        loss, grad = objective(space[x])
        space[g] = grad
        return loss

    return evaluate


def make(objective: Objective, x0: np.ndarray, **kwargs) -> tuple[LocalVectorSpace, LBFGS]:
    space = LocalVectorSpace({"x": x0})
    return space, LBFGS(space, evaluator(space, objective), **kwargs)


def test_digits_reaches_scipy_optimum():
    objective, dim = digits_objective()
    reference = scipy.optimize.minimize(
        objective,
        np.zeros(dim),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-10},
    )
    _, lbfgs = make(objective, np.zeros(dim))
    result = lbfgs.minimize(max_iter=2000, tol=1e-7)
    assert result.converged, result.message
    assert abs(result.loss - reference.fun) <= 1e-4 * abs(reference.fun)


def test_quadratic_converges_to_minimiser():
    objective, x_star = quadratic_objective(n=40, condition=1e2, seed=0)
    space, lbfgs = make(objective, np.zeros(40))
    result = lbfgs.minimize(max_iter=500, tol=1e-6, ftol=0.0)
    assert result.converged and result.grad_norm <= 1e-6, result.message
    # The smallest eigenvalue of A is 1, so |x - x*| <= |A (x - x*)| = |g|.
    assert np.linalg.norm(space["x"] - x_star) <= 1e-6


def test_float32_vectors_converge():
    objective, x_star = quadratic_objective(n=40, condition=1e2, seed=1)
    space = LocalVectorSpace({"x": np.zeros(40)}, dtype=np.float32)
    lbfgs = LBFGS(space, evaluator(space, objective))
    lbfgs.minimize(max_iter=300, tol=1e-4)
    assert space["x"].dtype == np.float32 and space["g"].dtype == np.float32
    assert np.linalg.norm(space["x"] - x_star) <= 1e-3 * np.linalg.norm(x_star)


def test_accepted_steps_satisfy_strong_wolfe():
    objective, dim = digits_objective()
    space, lbfgs = make(objective, np.zeros(dim), history=5)
    lbfgs.start()
    for _ in range(30):
        x0, g0, f0 = space["x"].copy(), space["g"].copy(), lbfgs.loss
        info = lbfgs.step()
        d = space["d"]
        assert info.wolfe
        np.testing.assert_allclose(space["x"], x0 + info.step_size * d, rtol=0, atol=1e-12)
        assert info.loss == pytest.approx(objective(space["x"])[0], rel=1e-12)
        slope0 = g0 @ d
        assert slope0 < 0
        assert info.loss <= f0 + lbfgs.c1 * info.step_size * slope0
        assert abs(space["g"] @ d) <= lbfgs.c2 * abs(slope0)


def test_out_of_evaluations_falls_back_to_armijo_point():
    # f = sum(x^4) from x = 2: the first trial (alpha = 1/|g|) lands on x = 1, a decrease whose
    # slope is far from flat enough for c2 = 0.01, and the single evaluation is spent.
    space, lbfgs = make(
        lambda x: (float(x @ x) ** 2, 4.0 * x**3), np.array([2.0]), c2=0.01, max_evaluations=1
    )
    info = lbfgs.step()
    assert not info.wolfe
    assert info.step_size == pytest.approx(1.0 / 32.0)
    assert info.loss == pytest.approx(1.0) and space["x"][0] == pytest.approx(1.0)
    assert info.evaluations == 1


def test_ascent_gradient_raises_and_minimize_reports_it():
    # The "gradient" points uphill, so no step along d (or along -g) decreases the loss.
    def wrong(x: np.ndarray) -> tuple[float, np.ndarray]:
        return float(x @ x), -2.0 * x

    _, lbfgs = make(wrong, np.ones(3), max_evaluations=5)
    with pytest.raises(LineSearchError):
        lbfgs.step()
    _, lbfgs = make(wrong, np.ones(3), max_evaluations=5)
    result = lbfgs.minimize()
    assert not result.converged and "line search" in result.message
    assert result.loss == pytest.approx(3.0)


class BoundarySpace:
    """Exposes only the VectorSpace operations and checks every value that comes back."""

    def __init__(self, inner: LocalVectorSpace) -> None:
        self._inner = inner
        self.returned: list[object] = []

    def _call(self, op: str, *args):
        value = getattr(self._inner, op)(*args)
        self.returned.append(value)
        return value

    def dots(self, pairs):
        return self._call("dots", pairs)

    def axpy(self, alpha, x, y):
        return self._call("axpy", alpha, x, y)

    def scale(self, alpha, x):
        return self._call("scale", alpha, x)

    def copy(self, src, dst):
        return self._call("copy", src, dst)

    def lincomb(self, dst, terms):
        for c, name in terms:
            assert type(c) is float and isinstance(name, str)
        return self._call("lincomb", dst, terms)


def test_only_scalars_cross_the_boundary():
    objective, dim = digits_objective()
    inner = LocalVectorSpace({"x": np.zeros(dim)})
    boundary: VectorSpace = BoundarySpace(inner)
    lbfgs = LBFGS(boundary, evaluator(inner, objective), history=10)
    result = lbfgs.minimize(max_iter=50, tol=0.0)
    assert result.iterations == 50
    for value in boundary.returned:
        assert value is None or (isinstance(value, list) and all(type(v) is float for v in value))
    scalars = sum(len(v) for v in boundary.returned if v is not None)
    assert (
        scalars
        == inner.scalars_returned
        == sum(len(v) for v in boundary.returned if isinstance(v, list))
    )
    assert set(inner.calls) <= {"dots", "axpy", "scale", "copy", "lincomb"}
    # Per step: one Gram update (3 * (2m + 1) + 3 dots at most) and one dot per trial point.
    m = lbfgs.history
    assert inner.scalars_returned <= 50 * (3 * (2 * m + 1) + 3) + result.evaluations + 1


@pytest.mark.parametrize("history", [1, 10])
def test_state_is_scalars_independent_of_vector_size(history):
    for dim in (3, 3000):
        _, lbfgs = make(
            lambda x: (float(x @ x), 2.0 * x), np.linspace(1.0, 2.0, dim), history=history
        )
        lbfgs.minimize(max_iter=3, tol=0.0)
        state = json.loads(json.dumps(lbfgs.state_dict()))
        gram = state.pop("gram")
        assert np.shape(gram) == (2 * history + 3, 2 * history + 3)
        assert all(isinstance(v, int | float) for v in state.values())


def run(lbfgs: LBFGS, space: LocalVectorSpace, steps: int) -> list[np.ndarray]:
    iterates = []
    for _ in range(steps):
        lbfgs.step()
        iterates.append(space["x"].copy())
    return iterates


def test_state_dict_round_trip_gives_identical_iterates():
    objective, dim = digits_objective()
    space, lbfgs = make(objective, np.zeros(dim), history=4)
    uninterrupted = run(lbfgs, space, 20)

    space, lbfgs = make(objective, np.zeros(dim), history=4)
    first = run(lbfgs, space, 8)  # 8 > history + 1: the ring has wrapped
    state = json.loads(json.dumps(lbfgs.state_dict()))
    vectors = {
        name: space[name].copy()
        for name in ["x", "g"] + [f"{kind}{i}" for kind in "sy" for i in range(5)]
    }
    space2 = LocalVectorSpace(vectors)
    resumed = LBFGS(space2, evaluator(space2, objective), history=4)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == lbfgs.state_dict()
    rest = run(resumed, space2, 12)
    for expected, got in zip(uninterrupted, first + rest, strict=True):
        np.testing.assert_array_equal(expected, got)
    assert resumed.iteration == 20


class CrashingSpace(LocalVectorSpace):
    """Raises on the n-th copy: the coordinator dies half-way through committing a step."""

    def __init__(self, vectors, crash_at_copy: int) -> None:
        super().__init__(vectors)
        self.crash_at_copy = crash_at_copy

    def copy(self, src: str, dst: str) -> None:
        super().copy(src, dst)
        if self.calls["copy"] == self.crash_at_copy:
            raise ConnectionError("coordinator lost")


def test_resume_after_crash_inside_a_step():
    objective, x_star = quadratic_objective(n=30, condition=1e2, seed=3)
    # With history 3, after 6 steps all 4 slots have been used; die after copying x_trial -> x
    # (x is ahead of the saved state, g is not yet).
    space = CrashingSpace({"x": np.zeros(30)}, crash_at_copy=2 * 6 + 1)
    lbfgs = LBFGS(space, evaluator(space, objective), history=3)
    run(lbfgs, space, 6)
    saved = lbfgs.state_dict()
    with pytest.raises(ConnectionError):
        lbfgs.step()
    space.crash_at_copy = -1
    resumed = LBFGS(space, evaluator(space, objective), history=3)
    resumed.load_state_dict(saved)
    resumed.start()  # x moved on: re-evaluate there; the saved pairs were not overwritten
    assert resumed.loss < saved["loss"]
    result = resumed.minimize(max_iter=200, tol=1e-6, ftol=0.0)
    assert result.converged, result.message
    assert np.linalg.norm(space["x"] - x_star) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"history": 0}, "history"), ({"c1": 0.9, "c2": 0.1}, "c1"), ({"max_evaluations": 0}, "max")],
)
def test_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LBFGS(LocalVectorSpace({"x": [0.0]}), lambda x, g: 0.0, **kwargs)


def test_local_space_operations():
    space = LocalVectorSpace({"a": [1.0, 2.0], "b": [3.0, -1.0]})
    space.axpy(2.0, "a", "b")
    space.scale(0.5, "b")
    space.copy("b", "c")
    space.lincomb("a", [(1.0, "a"), (-1.0, "c")])  # dst appears among its own terms
    np.testing.assert_array_equal(space["b"], [2.5, 1.5])
    np.testing.assert_array_equal(space["a"], [-1.5, 0.5])
    assert space.dots([("a", "b"), ("c", "c")]) == [-3.0, 8.5]
    assert space.scalars_returned == 2
    assert dict(space.calls) == {"axpy": 1, "scale": 1, "copy": 1, "lincomb": 1, "dots": 1}
    space.lincomb("c", [])  # no terms: zero an existing vector
    np.testing.assert_array_equal(space["c"], [0.0, 0.0])
    with pytest.raises(KeyError):
        space.lincomb("missing", [])


def test_history_is_dropped_when_it_gives_no_descent():
    objective, _ = quadratic_objective(n=20, condition=10.0, seed=4)
    space, lbfgs = make(objective, np.zeros(20), history=3)
    run(lbfgs, space, 3)
    state = lbfgs.state_dict()
    gram, slots = np.array(state["gram"]), lbfgs.history + 1
    for i in range(slots):  # negative curvature s.y: an indefinite inverse Hessian
        gram[i, slots + i] = gram[slots + i, i] = -abs(gram[i, slots + i])
    lbfgs.load_state_dict({**state, "gram": gram.tolist()})
    info = lbfgs.step()
    assert info.loss < state["loss"] and info.wolfe
    assert lbfgs.length == 1  # the bad history went; only this step's pair is in use
