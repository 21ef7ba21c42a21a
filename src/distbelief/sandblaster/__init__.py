"""Sandblaster L-BFGS: a coordinator over sharded vectors (pure core) and its portion scheduler.

:class:`SandblasterLBFGS` is the trainer; :class:`LBFGS` the coordinator's recursion over any
:class:`VectorSpace` (named vectors that live elsewhere), with its strong Wolfe line search.
"""

from distbelief.sandblaster.lbfgs import LBFGS
from distbelief.sandblaster.linesearch import LineSearchError
from distbelief.sandblaster.trainer import SandblasterLBFGS
from distbelief.sandblaster.vectors import VectorSpace

__all__ = ["LBFGS", "LineSearchError", "SandblasterLBFGS", "VectorSpace"]
