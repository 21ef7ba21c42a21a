"""distbelief: DistBelief's sharded parameter server and Downpour SGD on Ray and PyTorch."""

from distbelief.config import TrainConfig
from distbelief.downpour import DownpourSGD
from distbelief.errors import UserError
from distbelief.ps.plan import ShardPlan
from distbelief.trainer import TrainResult

__all__ = ["DownpourSGD", "ShardPlan", "TrainConfig", "TrainResult", "UserError"]
__version__ = "0.1.0"
