"""Model parallelism: locally connected layers and the plans that split a model over partitions.

:mod:`~distbelief.modelpar.layers` has the untied-weight layers of DistBelief's image and
speech models; :mod:`~distbelief.modelpar.partition` plans layer-wise and within-layer
(spatial) splits as pure data and runs them in process with explicit boundary messages.
"""

from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d, locally_connected
from distbelief.modelpar.partition import (
    DRIVER,
    Executor,
    LayerwisePartition,
    LayerwisePlan,
    Message,
    ParamSlice,
    SpatialPartition,
    SpatialPlan,
    Traffic,
    plan_layerwise,
    plan_partitions,
    plan_spatial,
)

__all__ = [
    "DRIVER",
    "Executor",
    "LayerwisePartition",
    "LayerwisePlan",
    "LocallyConnected1d",
    "LocallyConnected2d",
    "Message",
    "ParamSlice",
    "SpatialPartition",
    "SpatialPlan",
    "Traffic",
    "locally_connected",
    "plan_layerwise",
    "plan_partitions",
    "plan_spatial",
]
