"""distbelief: DistBelief's sharded parameter server, Downpour SGD and Sandblaster L-BFGS on Ray
and PyTorch."""

from distbelief.config import TrainConfig
from distbelief.downpour import DownpourSGD
from distbelief.errors import UserError
from distbelief.ps.plan import ShardPlan
from distbelief.sandblaster.trainer import SandblasterLBFGS
from distbelief.sparse.module import SparseEmbedding
from distbelief.sparse.trainer import SparseDownpourSGD
from distbelief.trainer import TrainResult

__all__ = [
    "DownpourSGD",
    "SandblasterLBFGS",
    "ShardPlan",
    "SparseDownpourSGD",
    "SparseEmbedding",
    "TrainConfig",
    "TrainResult",
    "UserError",
]
__version__ = "0.1.0"
