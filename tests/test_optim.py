"""Each server-side rule against a reference written out here, step by step."""

import numpy as np
import torch

from distbelief.ps.optim import SGD, Adagrad, Momentum, make_rule


def grads(n_steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n_steps)]


def run(rule, p0, gs):
    p, state = p0.copy(), rule.init_state(p0.size)
    for g in gs:
        rule.apply(p, g, state)
    return p, state


def test_sgd_matches_reference():
    p0, gs = np.ones(5, np.float32), grads(4, 5)
    p, _ = run(SGD(0.1), p0, gs)
    ref = p0.astype(np.float64)
    for g in gs:
        ref = ref - 0.1 * g
    np.testing.assert_allclose(p, ref, rtol=1e-6)


def test_momentum_matches_reference_and_torch():
    p0, gs = np.linspace(-1, 1, 6, dtype=np.float32), grads(5, 6, seed=1)
    p, state = run(Momentum(0.05, momentum=0.9), p0, gs)
    ref, v = p0.astype(np.float64), np.zeros(6)
    for g in gs:
        v = 0.9 * v + g
        ref = ref - 0.05 * v
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["velocity"], v, rtol=1e-5, atol=1e-7)
    t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.SGD([t], lr=0.05, momentum=0.9)
    for g in gs:
        t.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_adagrad_matches_paper_formula():
    # DistBelief: eta_i,K = gamma / sqrt(sum_j g_i,j^2), here with eps inside the root.
    p0, gs = np.zeros(4, np.float32), grads(6, 4, seed=2)
    lr, eps = 0.5, 1e-8
    p, state = run(Adagrad(lr, eps=eps), p0, gs)
    ref, acc = np.zeros(4), np.zeros(4)
    for g in gs:
        acc = acc + g.astype(np.float64) ** 2
        ref = ref - lr / np.sqrt(eps + acc) * g
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["accumulator"], acc, rtol=1e-5)


def test_adagrad_first_step_is_lr_times_sign():
    p, _ = run(Adagrad(0.1), np.zeros(3, np.float32), [np.array([4.0, -0.5, 2.0], np.float32)])
    np.testing.assert_allclose(p, [-0.1, 0.1, -0.1], rtol=1e-6)


def test_rules_work_on_gathered_rows():
    rule = make_rule("adagrad", 0.1)
    params = np.ones((5, 3), np.float32)
    state = {"accumulator": np.zeros((5, 3), np.float32)}
    rows = np.array([1, 3])
    p, s = params[rows], {"accumulator": state["accumulator"][rows]}
    rule.apply(p, np.ones((2, 3), np.float32), s)
    params[rows], state["accumulator"][rows] = p, s["accumulator"]
    assert np.allclose(params[[0, 2, 4]], 1.0) and np.allclose(params[rows], 0.9)


def test_chunked_rules_equal_whole_array_numpy_bit_for_bit():
    # Sizes around and across chunk boundaries, plus a non-contiguous view (unchunked path).
    from distbelief.ps.optim import CHUNK

    rng = np.random.default_rng(5)
    for n in (1, CHUNK - 1, CHUNK, 2 * CHUNK + 7):
        p0 = rng.standard_normal(n).astype(np.float32)
        gs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
        lr, mu, eps = np.float32(0.05), np.float32(0.9), np.float32(1e-8)
        sgd, v, acc = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        mom, ada = p0.copy(), p0.copy()
        for g in gs:
            sgd -= lr * g
            v *= mu
            v += g
            mom -= lr * v
            acc += g * g
            ada -= lr * (g / np.sqrt(acc + eps))
        for rule, ref in ((SGD(0.05), sgd), (Momentum(0.05, momentum=0.9), mom),
                          (Adagrad(0.05, eps=1e-8), ada)):
            p, _ = run(rule, p0, gs)
            np.testing.assert_array_equal(p, ref)
    strided = np.zeros(10, np.float32)[::2]
    Adagrad(0.1).apply(strided, np.ones(5, np.float32), {"accumulator": np.zeros(5, np.float32)})
    np.testing.assert_allclose(strided, -0.1, rtol=1e-6)
