"""Model parallelism: locally connected layers and the plans that split a model over partitions.

:mod:`~distbelief.modelpar.layers` has the untied-weight layers of DistBelief's image and
speech models. A :data:`PartitionPlan` says how one replica's model is split over partitions:
:func:`plan_layerwise` (consecutive stages), :func:`plan_spatial` (blocks inside every locally
connected layer) or :func:`plan_partitions` (the one ``--partitions K --partition-by HOW``
picks). The plans are pure data; :mod:`~distbelief.modelpar.worker` runs one on Ray actors.
"""

from distbelief.modelpar.layers import LocallyConnected1d, LocallyConnected2d, locally_connected
from distbelief.modelpar.layerwise import LayerwisePlan, plan_layerwise
from distbelief.modelpar.plan import PartitionPlan, plan_partitions
from distbelief.modelpar.spatial import SpatialPlan, plan_spatial

__all__ = [
    "LayerwisePlan",
    "LocallyConnected1d",
    "LocallyConnected2d",
    "PartitionPlan",
    "SpatialPlan",
    "locally_connected",
    "plan_layerwise",
    "plan_partitions",
    "plan_spatial",
]
