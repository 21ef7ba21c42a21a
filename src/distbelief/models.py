"""The models the CLI trains (any ``nn.Module`` works through the Python API)."""

from __future__ import annotations

from torch import nn


def mlp(features: int, hidden: int, classes: int, seed: int = 0) -> nn.Module:
    """A one-hidden-layer ReLU network (softmax regression if ``hidden == 0``), seeded."""
    import torch

    torch.manual_seed(seed)
    if hidden == 0:
        return nn.Sequential(nn.Linear(features, classes))
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def lc(features: int, channels: int, classes: int, seed: int = 0) -> nn.Module:
    """Two locally connected layers (3-wide windows, untied weights) and a linear readout.

    A perfect-square ``features`` (digits: 64) is read as a one-channel image
    ``(1, s, s)``, anything else as a one-channel sequence ``(1, features)``. The model takes
    flat rows ``(N, features)`` and starts with an ``nn.Unflatten``, so it runs as it is and
    splits spatially (``--partitions K``) into blocks of rows (or of sequence positions).
    """
    import math

    import torch

    from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d

    torch.manual_seed(seed)
    side = math.isqrt(features)
    if side * side == features:
        size, layer = (side, side), LocallyConnected2d
    else:
        size, layer = (features,), LocallyConnected1d
    return nn.Sequential(
        nn.Unflatten(1, (1, *size)),
        layer(1, channels, size, 3, padding=1), nn.ReLU(),
        layer(channels, channels, size, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * math.prod(size), classes))


class ImageRows(nn.Unflatten):
    """An ``nn.Unflatten`` of flat rows to images ``(C, H, W)``, laid out channels-last.

    The values and the parameters are the same as with a plain ``nn.Unflatten``; only the
    activations' memory order changes. With a channels-last input, PyTorch's convolutions
    keep their outputs channels-last, and ``max_pool2d`` on CPU is then a vectorised kernel:
    8x faster than on NCHW activations, where it took a fifth of the CNN's step (measured in
    BENCHMARKS.md, "the CNN's activations channels-last, pool before ReLU"). A one-channel
    tensor counts as contiguous either way, so ``contiguous(memory_format=...)`` would leave
    it as it is; the copy into an explicitly channels-last tensor is what makes the
    convolution pick the layout. The parameters stay contiguous, as the flat buffers and
    checkpoints expect.
    """

    def forward(self, x):
        import torch

        x = super().forward(x)
        return torch.empty_like(x, memory_format=torch.channels_last).copy_(x)


def cnn(features: int, classes: int, seed: int = 0, channels: int = 32,
        hidden: int = 128) -> nn.Module:
    """A small image CNN: two 5x5 convolutions (``channels`` then ``2 * channels``, 'same'
    padding, each followed by a 2x2 max-pool and ReLU) and two linear layers (``hidden``
    ReLU units, then ``classes`` logits). Seeded like :func:`mlp`. Max-pool and ReLU
    commute (the same values and gradients in either order), so the ReLU runs on the pooled
    quarter of the activations.

    ``features`` must be a perfect square ``s * s`` (MNIST: 784, digits: 64); the model takes
    flat rows ``(N, features)`` and starts with an :class:`ImageRows` (an ``nn.Unflatten`` to
    ``(N, 1, s, s)``, channels-last in memory). On 28x28 MNIST with the defaults it has
    454,922 parameters.
    """
    import math

    import torch

    from distbelief.errors import UserError

    side = math.isqrt(features)
    if side * side != features or side < 4:
        raise UserError(f"--model cnn needs square images, but the data has {features} "
                        "features: use --model mlp or lc, or data of s*s pixels (s >= 4)")
    torch.manual_seed(seed)
    pooled = side // 2 // 2
    model = nn.Sequential(
        ImageRows(1, (1, side, side)),
        nn.Conv2d(1, channels, 5, padding=2), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 5, padding=2), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * channels * pooled * pooled, hidden), nn.ReLU(),
        nn.Linear(hidden, classes))
    # The first convolution's gradient comes back with channels-last strides (25, 1, 5, 1);
    # its one-input-channel weight is contiguous with those strides too, so it takes them,
    # and PyTorch's DDP finds the gradient laid out as its parameter (no stride warning).
    first = model[1].weight
    first.data = first.data.to(memory_format=torch.channels_last)
    return model
