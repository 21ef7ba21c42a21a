"""Row-sparse embedding tables larger than any replica: row shards, a module, a trainer.

- ``table.py``: :class:`RowTable`, rows created on first push from a seeded hash (pure).
- ``shard.py`` / ``client.py``: the :class:`EmbeddingShard` actor (rows ``r % S``) and the
  replica-side :class:`SparseClient` (one call per shard, all tables together).
- ``module.py``: :class:`SparseEmbedding`, an ``nn.Module`` whose rows live on the shards.
- ``replica.py`` / ``trainer.py``: :class:`SparseDownpourSGD` and its replicas.
- ``ctr.py`` / ``models.py``: the synthetic click data set and a wide-and-deep model.

Names are imported on first use, so ``distbelief.sparse.ctr`` (NumPy only) stays light for
the command line.
"""

from __future__ import annotations

import importlib

_WHERE = {"LocalTables": "module", "SparseEmbedding": "module", "prefetch_rows": "module",
          "push_rows": "module", "RowTable": "table", "TableSpec": "table",
          "SparseDownpourSGD": "trainer", "WideAndDeep": "models"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'distbelief.sparse' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distbelief.sparse.{_WHERE[name]}"), name)
