"""Model parallelism: plans (pure data) and the in-process executor against the whole model."""

import itertools
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.modelpar import Executor
from torch import nn

from distbelief.errors import UserError
from distbelief.modelpar.geometry import DRIVER
from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d
from distbelief.modelpar.layerwise import _balance, plan_layerwise
from distbelief.modelpar.partitions import SpatialPartition
from distbelief.modelpar.schedule import pass_schedule
from distbelief.modelpar.spatial import LCLayer, plan_spatial


def lc1d_stack(readout=True):
    torch.manual_seed(0)
    layers = [LocallyConnected1d(2, 3, 24, 3, stride=1, padding=1), nn.Tanh(),
              LocallyConnected1d(3, 4, 24, 4, stride=2, padding=1), nn.ReLU(),
              LocallyConnected1d(4, 2, 12, 5, stride=1, padding=2)]
    if readout:
        layers += [nn.Flatten(), nn.Linear(2 * 12, 5)]
    return nn.Sequential(*layers).double(), torch.randn(6, 2, 24, dtype=torch.float64)


def lc2d_stack(readout=True):
    torch.manual_seed(0)
    layers = [LocallyConnected2d(2, 3, (10, 9), 3, stride=1, padding=1), nn.ReLU(),
              LocallyConnected2d(3, 2, (10, 9), (3, 2), stride=(2, 2)), nn.Sigmoid()]
    if readout:
        layers += [nn.Flatten(), nn.Linear(2 * 4 * 4, 3)]
    return nn.Sequential(*layers).double(), torch.randn(4, 2, 10, 9, dtype=torch.float64)


def mixed_stack():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                          LocallyConnected2d(4, 3, (8, 8), 3, stride=2), nn.Tanh(), nn.Flatten(),
                          nn.Linear(3 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 4))
    return model.double(), torch.randn(5, 2, 8, 8, dtype=torch.float64)


def loss_fn(out):
    return (out ** 2).sum() / 2 + out.sin().sum()


def reference(model, x):
    """Loss and gradients of the whole, unpartitioned model."""
    model.zero_grad()
    loss = loss_fn(model(x))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_as_whole_model(model, x, plan):
    loss, grads = reference(model, x)
    executor = Executor.from_model(model, plan)
    got = executor.step(x, loss_fn)
    torch.testing.assert_close(got, loss, rtol=0, atol=1e-10)
    partitioned = executor.gradients()
    assert set(partitioned) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(partitioned[name], grad, rtol=0, atol=1e-10, msg=name)
    return executor


# ------------------------------------------------------------------------------------------
# Within-layer (spatial) partitioning


@pytest.mark.parametrize("grid", [2, 3])
@pytest.mark.parametrize("readout", [True, False])
def test_spatial_1d_loss_and_every_gradient_match(grid, readout):
    model, x = lc1d_stack(readout)
    assert_same_as_whole_model(model, x, plan_spatial(model, grid))


@pytest.mark.parametrize("grid", [2, 3, (2, 2), (1, 3)])
@pytest.mark.parametrize("readout", [True, False])
def test_spatial_2d_loss_and_every_gradient_match(grid, readout):
    model, x = lc2d_stack(readout)
    assert_same_as_whole_model(model, x, plan_spatial(model, grid))


@pytest.mark.parametrize("stack,grid", [(lc1d_stack, 3), (lc2d_stack, (2, 2))])
def test_spatial_bytes_counted_match_plan_and_beat_naive(stack, grid):
    model, x = stack()
    plan = plan_spatial(model, grid)
    executor = Executor.from_model(model, plan)
    executor.step(x, loss_fn)
    traffic = executor.traffic
    assert traffic.total_bytes == plan.planned_bytes(x.shape[0], 8)
    assert traffic.forward_bytes == traffic.backward_bytes > 0
    assert traffic.naive_bytes == plan.naive_bytes(x.shape[0], 8)
    assert traffic.total_bytes < traffic.naive_bytes / 3


def test_spatial_float32_matches_within_tolerance():
    model, x = lc2d_stack()
    model, x = model.float(), x.float()
    model.zero_grad()
    loss = loss_fn(model(x))
    loss.backward()
    executor = Executor.from_model(model, plan_spatial(model, (2, 2)))
    torch.testing.assert_close(executor.step(x, loss_fn), loss.detach(), rtol=1e-5, atol=1e-5)
    for name, grad in executor.gradients().items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-5)
    assert executor.traffic.total_bytes == executor.plan.planned_bytes(x.shape[0], 4)


def test_halos_for_a_small_known_case():
    """kernel 3, stride 1, padding 1 on 8 positions in 2 blocks: one unit each way."""
    model = nn.Sequential(LocallyConnected1d(1, 2, 8, 3, padding=1), nn.ReLU(),
                          LocallyConnected1d(2, 1, 8, 3, padding=1))
    plan = plan_spatial(model, 2)
    left, right = plan.partitions
    assert left.owned == (((0, 4),), ((0, 4),)) and right.owned == (((4, 8),), ((4, 8),))
    assert left.reads == (((0, 5),), ((0, 5),)) and right.reads == (((3, 8),), ((3, 8),))
    (to_left,), (to_right,) = left.receive, right.receive
    assert (to_left.layer, to_left.src, to_left.dst, to_left.box) == (1, 1, 0, ((4, 5),))
    assert (to_right.src, to_right.dst, to_right.box, to_right.shape) == (0, 1, ((3, 4),), (2, 1))
    assert left.send == (to_right,) and right.send == (to_left,)


def test_middle_partition_halo_gradients_sum_from_both_neighbours():
    """Thin blocks under a wide kernel: one unit is read by both neighbours, and its owner
    must add both gradient messages to its own share."""
    torch.manual_seed(0)
    model = nn.Sequential(LocallyConnected1d(1, 2, 6, 3, padding=1), nn.Tanh(),
                          LocallyConnected1d(2, 1, 6, 5, padding=2)).double()
    plan = plan_spatial(model, 3)
    middle = plan.partitions[1]
    assert {t.dst for t in middle.send} == {0, 2}
    for t in middle.send:  # both neighbours need all of the middle block (2, 4)
        assert t.box == ((2, 4),)
    assert_same_as_whole_model(model, torch.randn(3, 1, 6, dtype=torch.float64), plan)


def test_messages_are_explicit_and_partitions_hold_only_their_slices():
    model, x = lc1d_stack()
    plan = plan_spatial(model, 3)
    parts = [SpatialPartition.from_model(plan, k, model) for k in range(3)]
    total = sum(p.numel() for p in model.parameters())
    full = dict(model.named_parameters())
    for part in parts:
        held = dict(part.named_parameters())
        assert sum(p.numel() for p in held.values()) < total / 2
        for s in part.param_slices():
            torch.testing.assert_close(held[s.name].detach(), s.take(full[s.name].detach()))
    # round 0 by hand: the data goes in, only halos for round 1 come out
    sent = [m for part, m_in in zip(parts, plan.input_messages(x))
            for m in part.forward(0, [m_in])]
    assert sent and all(m.layer == 1 and m.src != m.dst and m.dst != DRIVER for m in sent)
    for m in sent:
        (lo, hi), = m.box
        assert m.tensor.shape == (6, 3, hi - lo) and hi - lo < 24 // 3


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_spatial_random_1d_stacks_match(data):
    sizes = [data.draw(st.integers(6, 20))]
    channels = [data.draw(st.integers(1, 3))]
    modules = []
    for _ in range(data.draw(st.integers(1, 3))):
        kernel = data.draw(st.integers(1, 4))
        padding = data.draw(st.integers(0, kernel - 1))
        stride = data.draw(st.integers(1, 3))
        out = (sizes[-1] + 2 * padding - kernel) // stride + 1
        if out < 3:
            break
        c = data.draw(st.integers(1, 3))
        modules += [LocallyConnected1d(channels[-1], c, sizes[-1], kernel, stride, padding),
                    nn.Tanh()]
        sizes.append(out)
        channels.append(c)
    assume(modules)
    if data.draw(st.booleans()):
        modules += [nn.Flatten(), nn.Linear(channels[-1] * sizes[-1], 2)]
    model = nn.Sequential(*modules).double()
    k = data.draw(st.integers(1, min(3, *sizes[1:])))
    x = torch.randn(2, channels[0], sizes[0], dtype=torch.float64)
    assert_same_as_whole_model(model, x, plan_spatial(model, k))


# ------------------------------------------------------------------------------------------
# Spatial plan properties


def _read_set(layer: LCLayer, owned):
    """Brute force: every input index (tuple) that outputs ``owned`` read, padding dropped."""
    per_axis = []
    for (a, b), n, s, k, p in zip(owned, layer.input_size, layer.stride, layer.kernel_size,
                                  layer.padding):
        per_axis.append({u for o in range(a, b) for u in range(o * s - p, o * s - p + k)
                         if 0 <= u < n})
    return set(itertools.product(*per_axis))


def _box_set(box):
    return set(itertools.product(*(range(lo, hi) for lo, hi in box)))


@st.composite
def lc_stacks(draw):
    dims = draw(st.sampled_from([1, 2]))
    size = tuple(draw(st.integers(4, 14)) for _ in range(dims))
    modules = []
    for _ in range(draw(st.integers(2, 3))):
        kernel = tuple(draw(st.integers(1, 4)) for _ in range(dims))
        stride = tuple(draw(st.integers(1, 4)) for _ in range(dims))
        padding = tuple(draw(st.integers(0, k - 1)) for k in kernel)
        out = tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(size, kernel, stride, padding))
        if min(out) < 2:
            break
        cls = LocallyConnected1d if dims == 1 else LocallyConnected2d
        modules += [cls(1, 1, size, kernel, stride, padding), nn.ReLU()]
        size = out
    return nn.Sequential(*modules) if modules else None


@settings(max_examples=60, deadline=None)
@given(model=lc_stacks(), data=st.data())
def test_plan_covers_every_layer_once_and_halos_are_minimal(model, data):
    assume(model is not None)
    plan = plan_spatial(model, 1)
    smallest = [min(layer.output_size[a] for layer in plan.layers)
                for a in range(len(plan.layers[0].output_size))]
    grid = tuple(data.draw(st.integers(1, min(3, n))) for n in smallest)
    plan = plan_spatial(model, grid)
    assert plan.num_partitions == math.prod(grid)
    for i, layer in enumerate(plan.layers):
        count = np.zeros(layer.output_size, dtype=int)
        for part in plan.partitions:
            count[tuple(slice(lo, hi) for lo, hi in part.owned[i])] += 1
        assert (count == 1).all()  # every output position owned exactly once
        for q in plan.partitions:
            read = _read_set(layer, q.owned[i])
            reads = _box_set(q.reads[i])
            assert read <= reads and all(any(u[a] == lo for u in read) and
                                         any(u[a] == hi - 1 for u in read)
                                         for a, (lo, hi) in enumerate(q.reads[i]))
            if i == 0:
                continue
            halos = {t.src: t for t in q.receive if t.layer == i}
            for p in plan.partitions:
                if p.index == q.index:
                    assert p.index not in halos
                    continue
                needed = read & _box_set(p.owned[i - 1])
                if not needed:
                    assert p.index not in halos
                    continue
                box = halos[p.index].box
                assert needed <= _box_set(box)  # everything read arrives
                for a, (lo, hi) in enumerate(box):  # and the box is the tightest that holds it
                    assert min(u[a] for u in needed) == lo and max(u[a] for u in needed) == hi - 1
                assert halos[p.index] in p.send


def test_parameter_slices_cover_every_element_exactly_once():
    for model, grid in [(lc1d_stack()[0], 3), (lc2d_stack()[0], (2, 2))]:
        plan = plan_spatial(model, grid)
        owned = {n: [] for n, _ in model.named_parameters()}
        for part in plan.partitions:
            for s in part.params:
                owned[s.name].append(s.flat_index())
        for name, p in model.named_parameters():
            assert np.array_equal(np.sort(np.concatenate(owned[name])), np.arange(p.numel()))
        readout_bias = [k for k, part in enumerate(plan.partitions)
                        for s in part.params if s.name == f"{len(model) - 1}.bias"]
        assert readout_bias == [0]


def test_param_slice_take_put_and_flat_index_agree():
    model, _ = lc2d_stack()
    plan = plan_spatial(model, (2, 2))
    full = dict(model.named_parameters())
    for part in plan.partitions:
        for s in part.params:
            value = full[s.name].detach()
            part_value = s.take(value)
            assert tuple(part_value.shape) == s.part_shape
            assert torch.equal(part_value.reshape(-1), value.reshape(-1)[s.flat_index()])
            rebuilt = torch.zeros_like(value)
            s.put(rebuilt, part_value)
            assert torch.equal(rebuilt.reshape(-1)[s.flat_index()], value.reshape(-1)[
                s.flat_index()])


def test_sgd_through_slices_tracks_the_whole_model():
    """Three SGD steps where each partition loads just its slices of the new parameters (what
    a fetch from the parameter server would do) stay equal to training the whole model."""
    model, x = lc1d_stack()
    plan = plan_spatial(model, 3)
    executor = Executor.from_model(model, plan)
    for _ in range(3):
        _, grads = reference(model, x)
        executor.zero_grad()
        executor.step(x, loss_fn)
        pushed = executor.gradients()
        with torch.no_grad():
            for name, p in model.named_parameters():
                torch.testing.assert_close(pushed[name], grads[name], rtol=0, atol=1e-10)
                p -= 0.1 * pushed[name]
        full = {n: p.detach() for n, p in model.named_parameters()}
        for part in executor.partitions:
            part.load({s.name: s.take(full[s.name]) for s in part.param_slices()})
    for name, value in executor.parameters().items():
        torch.testing.assert_close(value, full[name], rtol=0, atol=0)
    torch.testing.assert_close(executor.forward(x), model(x).detach(), rtol=0, atol=1e-10)


def test_named_sequential_keys_become_parameter_names():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        low=LocallyConnected1d(1, 2, 9, 3, padding=1), act=nn.ReLU(),
        high=LocallyConnected1d(2, 2, 9, 3, stride=2), flat=nn.Flatten(), out=nn.Linear(8, 3),
    )).double()
    x = torch.randn(2, 1, 9, dtype=torch.float64)
    spatial = plan_spatial(model, 2)
    assert [layer.name for layer in spatial.layers] == ["low", "high"]
    assert spatial.readout.name == "out"
    assert_same_as_whole_model(model, x, spatial)
    assert_same_as_whole_model(model, x, plan_layerwise(model, 2, x.shape[1:]))


@pytest.mark.parametrize("build,message", [
    (lambda: nn.Sequential(nn.Conv1d(1, 1, 3)), "Conv1d"),
    (lambda: nn.Sequential(LocallyConnected1d(1, 2, 8, 3), LocallyConnected1d(1, 2, 6, 3)),
     "takes 1 x"),
    (lambda: nn.Sequential(LocallyConnected1d(1, 1, 8, 2, padding=2)), "padding"),
    (lambda: nn.Sequential(LocallyConnected1d(1, 1, 8, 3, stride=3)), "more blocks"),
    (lambda: nn.Sequential(LocallyConnected1d(1, 1, 8, 3), nn.Flatten(), nn.Linear(5, 2)),
     "readout takes 5"),
])
def test_plan_spatial_rejects_what_it_cannot_split(build, message):
    with pytest.raises(UserError, match=message):
        plan_spatial(build(), 4)


@pytest.mark.parametrize("make_plan", [
    lambda: plan_spatial(lc1d_stack()[0], 3),
    lambda: plan_spatial(lc2d_stack()[0], (2, 2)),
    lambda: plan_spatial(lc2d_stack(readout=False)[0], 2),
    lambda: plan_layerwise(mixed_stack()[0], 3, mixed_stack()[1].shape[1:]),
])
def test_pass_schedule_never_makes_a_round_wait_on_itself(make_plan):
    """Every call of a pass is fed only by calls of earlier rounds, submitted before it, so
    the calls of one round can run at the same time on different partitions (the Ray group
    submits in this order; the executor tests above prove it delivers every message)."""
    plan = make_plan()
    for rounds in (list(range(plan.rounds)), list(range(plan.rounds - 1, -1, -1))):
        schedule = pass_schedule(plan, rounds)
        position = {(r, k): i for i, (r, k, _) in enumerate(schedule)}
        assert [(r, k) for r, k, _ in schedule] == [(r, k) for r in rounds
                                                    for k in plan.active(r)]
        for r, k, senders in schedule:
            for sr, sk in senders:
                assert rounds.index(sr) < rounds.index(r) and sk != k
                assert position[sr, sk] < position[r, k]
        # each sender's output reaches each other partition's next call after it, once
        fed = [(s, k) for _, k, senders in schedule for s in senders]
        assert len(fed) == len(set(fed))


# ------------------------------------------------------------------------------------------
# Layer-wise partitioning


@pytest.mark.parametrize("partitions", [2, 3])
@pytest.mark.parametrize("stack", [mixed_stack, lc1d_stack])
def test_layerwise_loss_and_every_gradient_match(stack, partitions):
    model, x = stack()
    plan = plan_layerwise(model, partitions, x.shape[1:])
    executor = assert_same_as_whole_model(model, x, plan)
    cut_elements = sum(math.prod(c.activation_shape) for c in plan.cuts)
    assert executor.traffic.forward_bytes == executor.traffic.backward_bytes
    assert executor.traffic.forward_bytes == x.shape[0] * 8 * cut_elements
    assert executor.traffic.messages == 2 * (partitions - 1)


def test_layerwise_plan_stages_params_and_cut_shapes():
    model, x = mixed_stack()
    plan = plan_layerwise(model, 3, x.shape[1:])
    stages = plan.stages
    assert stages[0].start == 0 and stages[-1].stop == len(model)
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    names = [s.name for stage in stages for s in stage.params]
    assert names == [n for n, _ in model.named_parameters()]  # each parameter once, in order
    for stage in stages:
        assert stage.cost == sum(p.numel() for p in model[stage.start:stage.stop].parameters())
    h = x
    for i, layer in enumerate(model):
        for cut in plan.cuts:
            if cut.layer == i:
                assert cut.activation_shape == cut.gradient_shape == tuple(h.shape[1:])
        h = layer(h)
    assert [c.layer for c in plan.cuts] == [s.start for s in stages[1:]]


def test_layerwise_cost_estimate_moves_the_cuts():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    assert [s.start for s in plan_layerwise(model, 2, (4,)).stages] == [0, 3]
    flops = [10, 1, 1, 1, 1, 1]
    assert [s.start for s in plan_layerwise(model, 2, (4,), cost=flops).stages] == [0, 1]
    with pytest.raises(UserError, match="between 1 and 6"):
        plan_layerwise(model, 7, (4,))


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(0, 20), min_size=1, max_size=8), data=st.data())
def test_balance_minimises_the_largest_stage(costs, data):
    parts = data.draw(st.integers(1, len(costs)))
    bounds = _balance(costs, parts)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == parts + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))

    def largest(b):
        return max(sum(costs[lo:hi]) for lo, hi in zip(b, b[1:]))

    best = min(largest([0, *cut, len(costs)])
               for cut in itertools.combinations(range(1, len(costs)), parts - 1))
    assert largest(bounds) == best
