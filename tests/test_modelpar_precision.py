"""--precision bfloat16 in model-parallel replicas: each partition's forward under autocast,
tensors between partitions in bfloat16, what reaches the driver and the shards float32.

The partition cores run in this process (support.modelpar.CoreGroup, the same calls a
PartitionGroup makes of its actors); tests/test_modelpar_ray.py trains with them on Ray."""

import pytest
import torch
from support.modelpar import CoreGroup
from torch import nn

from distbelief.modelpar.layers import LocallyConnected2d
from distbelief.modelpar.layerwise import plan_layerwise
from distbelief.modelpar.spatial import plan_spatial


def lc2d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (2, 9, 8)),
                          LocallyConnected2d(2, 3, (9, 8), 3, padding=1), nn.ReLU(),
                          LocallyConnected2d(3, 2, (9, 8), (3, 2), stride=(2, 1)), nn.Tanh(),
                          nn.Flatten(), nn.Linear(2 * 4 * 7, 5))
    return model, torch.randn(16, 2 * 9 * 8)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    return model, torch.randn(16, 12)


CASES = {"spatial": (lc2d, lambda m, x, k: plan_spatial(m, k)),
         "layerwise": (mlp, lambda m, x, k: plan_layerwise(m, k, x.shape[1:]))}


def loss_fn(out):
    return torch.nn.functional.cross_entropy(out, torch.arange(len(out)) % out.shape[1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [2, 3])
def test_bfloat16_partitions_send_half_the_bytes_and_give_float32_close_gradients(case, k):
    build, planner = CASES[case]
    model, x = build()
    plan = planner(model, x, k)
    runs = {}
    for precision in ("float32", "bfloat16"):
        group = CoreGroup(model, plan, precision)
        out, loss = group.step(x, loss_fn)
        runs[precision] = out, loss, group.gradients(), group.bytes_sent()
    (out32, loss32, g32, b32), (out16, loss16, g16, b16) = runs["float32"], runs["bfloat16"]
    assert out16.dtype == torch.float32 and b32 > 0
    assert (out16 - out32).abs().max() < 0.02 * out32.abs().max()  # logits
    assert b16 * 2 == b32  # every boundary tensor, activations up and gradients down
    assert loss16 == pytest.approx(loss32, rel=0.02)
    flat32 = torch.cat([g32[n].reshape(-1) for n in sorted(g32)])
    flat16 = torch.cat([g16[n].reshape(-1) for n in sorted(g16)])
    assert all(g16[n].dtype == torch.float32 for n in g16)  # what the shards get
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) > 0.99
    with torch.no_grad():
        whole_loss = float(loss_fn(model(x)))
    assert loss32 == pytest.approx(whole_loss, rel=1e-5)  # float32 is exact as before


def test_bfloat16_partitions_compute_their_products_in_bfloat16():
    model, x = mlp()
    group = CoreGroup(model, plan_layerwise(model, 2, x.shape[1:]), "bfloat16")
    seen = []
    for core in group.cores:
        for layer in core.part.layers:
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    group.step(x, loss_fn)
    assert seen and set(seen) == {torch.bfloat16}


def test_bfloat16_spatial_partitions_compute_their_windows_in_bfloat16(monkeypatch):
    import distbelief.modelpar.partitions as partitions

    seen, inner = [], partitions.locally_connected

    def recording(x, weight, bias, stride):  # the product's dtype (a float32 bias widens it)
        seen.append(inner(x, weight, None, stride).dtype)
        return inner(x, weight, bias, stride)

    monkeypatch.setattr(partitions, "locally_connected", recording)
    model, x = lc2d()
    CoreGroup(model, plan_spatial(model, 2), "bfloat16").step(x, loss_fn)
    assert len(seen) == 4 and set(seen) == {torch.bfloat16}  # 2 layers x 2 partitions
