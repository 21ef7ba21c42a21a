"""ShardCore without Ray: applies good pushes, rejects bad ones, measures staleness."""

import numpy as np
import pytest
import torch

from distbelief.checkpoint import load_arrays
from distbelief.ps.optim import SGD, make_rule
from distbelief.ps.schedules import parse_schedule
from distbelief.ps.shard import ShardCore


@pytest.fixture
def core():
    return ShardCore(0, np.zeros(4, np.float32), SGD(1.0))


def test_push_applies_and_bumps_version(core):
    assert core.push(np.ones(4, np.float32), fetched_version=0, replica=2)
    version, params = core.fetch()
    assert version == 1 and np.allclose(params, -1.0)
    assert not params.flags.writeable
    assert core.stats()["pushes_by_replica"] == {"2": 1}


def test_timings_cover_every_whole_slice_push_applied_or_not(core):
    assert core.timings() == {"push_s": 0.0, "pushes": 0}
    core.push(np.ones(4, np.float32), 0)
    core.push_fetch(np.ones(4, np.float32), 1)
    core.push(np.ones(5, np.float32), 2)  # rejected: still the shard's time
    core.push_part(np.ones(8, np.float32), 4, 2)
    timings = core.timings()
    assert timings["pushes"] == 4 and timings["push_s"] >= 0.0
    assert core.version == 3 and "push_s" not in core.stats()


@pytest.mark.parametrize("grad,reason", [
    (np.array([1.0, np.nan, 0.0, 0.0], np.float32), "nonfinite"),
    (np.array([1.0, np.inf, 0.0, 0.0], np.float32), "nonfinite"),
    (np.ones(5, np.float32), "shape"),
    (np.ones((2, 2), np.float32), "shape"),
    (np.ones(4, np.float64), "dtype"),
    ([1.0, 1.0, 1.0, 1.0], "type"),
])
def test_bad_push_is_rejected_counted_and_not_applied(core, grad, reason):
    assert not core.push(grad, fetched_version=0)
    version, params = core.fetch()
    assert version == 0 and np.all(params == 0.0)
    stats = core.stats()
    assert stats["rejected"] == {reason: 1} and stats["rejected_total"] == 1
    assert stats["updates"] == 0


def test_staleness_is_version_at_apply_minus_fetched_version(core):
    g = np.ones(4, np.float32)
    core.push(g, 0)  # fresh
    core.push(g, 0)  # one update behind
    core.push(g, 0)  # two behind
    core.push(g, 3)  # fresh again
    assert core.stats()["staleness"] == {"0": 2, "1": 1, "2": 1}


def test_ranged_adagrad_equals_dense_adagrad_on_the_touched_elements():
    from distbelief.ps.optim import Adagrad

    rng = np.random.default_rng(0)
    init = rng.standard_normal(10).astype(np.float32)
    dense, ranged = ShardCore(0, init, Adagrad(0.1)), ShardCore(0, init, Adagrad(0.1))
    ranges = [(1, 3), (6, 9)]
    touched = np.r_[1:3, 6:9]
    for _ in range(3):
        g = rng.standard_normal(5).astype(np.float32)
        full = np.zeros(10, np.float32)
        full[touched] = g
        dense.push(full, dense.version)
        assert ranged.push_ranges(ranges, g, ranged.version)
    _, values = ranged.fetch_ranges(ranges)
    np.testing.assert_allclose(values, dense.params[touched], rtol=1e-6)
    untouched = np.setdiff1d(np.arange(10), touched)
    np.testing.assert_array_equal(ranged.params[untouched], init[untouched])
    np.testing.assert_allclose(ranged.state["accumulator"], dense.state["accumulator"])


def test_ranged_push_out_of_range_or_misshaped_is_rejected(core):
    assert not core.push_ranges([(2, 9)], np.ones(7, np.float32), 0)
    assert not core.push_ranges([(0, 2)], np.ones(3, np.float32), 0)
    assert core.stats()["rejected"] == {"range": 1, "shape": 1}
    assert core.version == 0 and np.all(core.params == 0)


@pytest.mark.parametrize("grad_dtype", ["float16", "bfloat16"])
def test_16_bit_push_is_widened_and_applied_in_float32(grad_dtype):
    from distbelief.ps.codec import encode

    core = ShardCore(0, np.zeros(4, np.float32), SGD(1.0))
    assert core.push(encode(np.array([0.5, -2.0, 1.0, 0.25], np.float32), grad_dtype), 0)
    _, params = core.fetch()
    assert params.dtype == np.float32
    np.testing.assert_array_equal(params, [-0.5, 2.0, -1.0, -0.25])
    bad = encode(np.array([0.5, np.nan, 1.0, 0.0], np.float32), grad_dtype)
    assert not core.push(bad, 1)
    assert core.stats()["rejected"] == {"nonfinite": 1} and core.version == 1
    assert not core.push(encode(np.ones(5, np.float32), grad_dtype), 1)
    assert core.stats()["rejected"] == {"nonfinite": 1, "shape": 1}


def test_staged_ranges_add_up_under_one_tag_and_bad_parts_are_refused(core):
    assert core.stage_ranges("t", [(0, 1), (3, 4)], np.array([1.0, 2.0], np.float32))
    assert core.stage_ranges("t", [(1, 3)], np.array([3.0, 4.0], np.float32))
    assert core.stage_ranges("t", [(0, 1)], np.array([0.5], np.float32))
    assert not core.stage_ranges("t", [(2, 9)], np.ones(7, np.float32))
    assert not core.stage_ranges("t", [(0, 2)], np.array([1.0, np.nan], np.float32))
    core.vectors["g"] = np.zeros(4, np.float32)
    assert core.commit("t", "g")
    np.testing.assert_array_equal(core.vector("g"), [1.5, 3.0, 4.0, 2.0])
    assert core.stats()["rejected"] == {"range": 1, "nonfinite": 1}
    np.testing.assert_array_equal(core.fetch_vector_ranges("g", [(1, 2), (3, 4)]), [3.0, 2.0])


def test_torch_rule_with_schedule_equals_torch_and_survives_save_restore(tmp_path):
    """A shard's Adam (amsgrad) with a warm-up/cosine schedule keyed on its version equals
    torch's Adam + LambdaLR, and a shard restored from its file mid-way continues bit for
    bit; a ranged push, which a torch rule cannot serve, is rejected as ``rule``."""
    def rule():
        return make_rule("adam", 0.01, args=["amsgrad=true"], schedule="warmup:3,cosine:10")

    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(8)]
    core = ShardCore(0, np.zeros(6, np.float32), rule())
    for g in grads[:4]:
        assert core.push(g, core.version)
    core.save(str(tmp_path / "s.safetensors"))
    again = ShardCore(0, np.ones(6, np.float32), rule())
    again.restore(load_arrays(tmp_path / "s.safetensors"), core.version)
    assert again.state["step"].shape == (1,)
    for g in grads[4:]:
        assert core.push(g, core.version) and again.push(g.copy(), again.version)
    np.testing.assert_array_equal(again.params, core.params)
    for name in core.state:
        np.testing.assert_array_equal(again.state[name], core.state[name], err_msg=name)
    param = torch.zeros(6, requires_grad=True)
    opt = torch.optim.Adam([param], lr=0.01, amsgrad=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, parse_schedule("warmup:3,cosine:10").factor)
    for g in grads:
        param.grad = torch.from_numpy(g)
        opt.step()
        sched.step()
    np.testing.assert_allclose(core.params, param.detach().numpy(), rtol=0, atol=1e-7)
    assert core.state["step"].tolist() == [8.0]
    assert not core.push_ranges([(0, 2)], np.ones(2, np.float32), core.version)
    assert core.rejected == {"rule": 1} and core.version == 8
