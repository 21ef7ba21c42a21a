"""One contiguous float32 buffer for a model's parameters and one for their gradients.

Parameters and ``.grad`` become views into the two buffers, so fetching is one copy per
shard into the buffer, autograd accumulates straight into the gradient buffer, and a push
sends slices of it with no gather step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from distbelief.errors import UserError
from distbelief.ps.plan import ShardPlan


def parameter_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each trainable parameter, checking they are float32."""
    shapes = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dtype != torch.float32:
            raise UserError(f"parameter {name!r} is {p.dtype}: distbelief shards float32 "
                            "parameters, call model.float() first")
        shapes.append((name, tuple(p.shape)))
    if not shapes:
        raise UserError("the model has no trainable parameters: nothing to train")
    return shapes


class FlatModel:
    """A model whose trainable parameters and gradients live in two flat buffers."""

    def __init__(self, model: nn.Module, plan: ShardPlan,
                 device: torch.device | str = "cpu") -> None:
        """``device``: where the buffers (and the model, moved there) live; ``flat_np`` and
        ``grad_np`` (NumPy views) exist on CPU only."""
        on_cpu = torch.device(device).type == "cpu"
        self.model = model if on_cpu else model.to(device)
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if names != [t.name for t in plan.tensors]:
            raise UserError("the model's parameters differ from the shard plan's: build the "
                            "plan from the same model class and arguments")
        self.flat = torch.empty(plan.numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros(plan.numel, dtype=torch.float32, device=device)
        self._bind()

    def _bind(self) -> None:
        """Make every parameter (and its ``.grad``) a view of ``flat`` (``grad``), holding
        its current values, and ``flat_np``/``grad_np`` NumPy views of them on CPU."""
        on_cpu = self.flat.device.type == "cpu"
        self.flat_np = self.flat.numpy() if on_cpu else None
        self.grad_np = self.grad.numpy() if on_cpu else None
        self._grad_views = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                self.flat[offset: offset + k].copy_(p.reshape(-1))
                p.data = self.flat[offset: offset + k].view_as(p)
                view = self.grad[offset: offset + k].view_as(p)
                p.grad = view
                self._grad_views.append(view)
                offset += k

    def __getstate__(self) -> dict:
        # Pickling (Ray shipping an evaluator to its actor) copies each tensor and array
        # apart, so the views are rebuilt on unpickling; NumPy views would otherwise come
        # back as separate (through Ray, read-only) arrays.
        return {k: v for k, v in self.__dict__.items()
                if k not in ("flat_np", "grad_np", "_grad_views")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind()

    def zero_grad(self) -> None:
        self.grad.zero_()

    def sync_grads(self) -> None:
        """Make sure every ``.grad`` is still the buffer view (autograd may replace it)."""
        for p, view in zip(self.params, self._grad_views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def named_arrays(self, plan: ShardPlan) -> dict[str, np.ndarray]:
        """Copies of the current parameters by name (NumPy float32)."""
        return plan.unflatten(self.flat_np)
