"""PartitionPlan: how one replica's model is split over partitions, and choosing one.

A :data:`PartitionPlan` is a :class:`~distbelief.modelpar.layerwise.LayerwisePlan` or a
:class:`~distbelief.modelpar.spatial.SpatialPlan`; both are pure data with the same interface
(``num_partitions``, ``rounds``, ``params(k)``, ``active(round)``, the driver's messages).
Not to be confused with :class:`~distbelief.ps.plan.ShardPlan`, which places parameters on
the parameter-server shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from distbelief.errors import UserError, one_of
from distbelief.modelpar.layers import LocallyConnectedNd
from distbelief.modelpar.layerwise import LayerwisePlan, plan_layerwise
from distbelief.modelpar.spatial import SpatialPlan, plan_spatial

PartitionPlan = LayerwisePlan | SpatialPlan


def plan_partitions(model: nn.Module, partitions: int, how: str = "auto",
                    input_shape: Sequence[int] | None = None) -> PartitionPlan:
    """The plan behind ``--partitions K --partition-by HOW``.

    ``how`` is ``"space"`` (within every locally connected layer, :func:`plan_spatial`),
    ``"layers"`` (consecutive stages, :func:`plan_layerwise`, which needs one example's
    ``input_shape``) or ``"auto"``: space for a stack of locally connected layers, layers
    otherwise.
    """
    one_of("--partition-by", how, ("auto", "space", "layers"))
    if not isinstance(model, nn.Sequential):
        raise UserError(f"--partitions {partitions} splits an nn.Sequential; the model is a "
                        f"{type(model).__name__}: wrap its layers in nn.Sequential")
    if how == "auto":
        lc = any(isinstance(m, LocallyConnectedNd) for m in model)
        how = "space" if lc else "layers"
    if how == "space":
        return plan_spatial(model, partitions)
    if input_shape is None:
        raise UserError("layer-wise partitioning needs the shape of one example")
    return plan_layerwise(model, partitions, input_shape)


def gather_slices(plan: PartitionPlan, parts: Sequence[Mapping[str, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """Full-shape tensors by model parameter name from each partition's slice values
    (``parts[k]`` keyed by full name, shaped like partition ``k``'s slices)."""
    full: dict[str, torch.Tensor] = {}
    for k, got in enumerate(parts):
        for s in plan.params(k):
            value = got[s.name]
            if s.name not in full:
                full[s.name] = value.new_zeros(s.shape)
            s.put(full[s.name], value)
    return full
