"""Sandblaster L-BFGS: a coordinator over sharded vectors (pure core) and its portion scheduler."""
