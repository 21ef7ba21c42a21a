"""The sharded parameter server: plan (pure), update rules (pure), shard actor, client."""

from distbelief.ps.client import PSClient
from distbelief.ps.optim import SGD, Adagrad, Momentum, make_rule
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ParameterShard

__all__ = ["SGD", "Adagrad", "Momentum", "PSClient", "ParameterShard", "ShardPlan", "make_rule"]
