"""Row-sparse embedding tables larger than any replica: row shards, a module, a trainer.

- ``table.py``: :class:`RowTable`, rows created on first push from a seeded hash (pure).
- ``shard.py`` / ``client.py``: the :class:`EmbeddingShard` actor (rows ``r % S``) and the
  replica-side :class:`SparseClient` (one call per shard, all tables together).
- ``module.py``: :class:`SparseEmbedding`, an ``nn.Module`` whose rows live on the shards.
- ``replica.py`` / ``trainer.py``: :class:`SparseDownpourSGD` and its replicas.
- ``ctr.py`` / ``models.py``: the synthetic click data set and a wide-and-deep model.
"""

from distbelief.sparse.models import WideAndDeep
from distbelief.sparse.module import LocalTables, SparseEmbedding, prefetch_rows, push_rows
from distbelief.sparse.table import RowTable, TableSpec
from distbelief.sparse.trainer import SparseDownpourSGD

__all__ = ["LocalTables", "RowTable", "SparseDownpourSGD", "SparseEmbedding", "TableSpec",
           "WideAndDeep", "prefetch_rows", "push_rows"]
