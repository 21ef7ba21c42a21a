"""A wide-and-deep click model over one id table: sparse tables on the shards, a dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from distbelief.sparse.module import SparseEmbedding

DEEP_DIM = 8  # embedding width of each field for the deep part


class WideAndDeep(nn.Module):
    """Logit of a click from ``fields`` categorical ids per example.

    ``wide``: one scalar weight per table row, summed over the example's ids (a logistic
    regression on one-hot ids). ``deep``: a ``dim``-wide embedding per id, concatenated over
    fields ``(B, fields * dim)`` into a ReLU MLP with ``hidden`` units (no hidden layer if
    ``hidden == 0``). Input int64 ``(B, fields)`` of table rows, output logits ``(B,)``.
    """

    def __init__(self, rows: int, fields: int, dim: int = DEEP_DIM, hidden: int = 64,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wide = SparseEmbedding(rows, 1, "wide", mode="sum", init_scale=0.0, seed=seed)
        self.deep = SparseEmbedding(rows, dim, "deep", mode="concat", init_scale=0.05,
                                    seed=seed)
        if hidden:
            self.mlp = nn.Sequential(nn.Linear(fields * dim, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 1))
        else:
            self.mlp = nn.Sequential(nn.Linear(fields * dim, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wide(ids)[:, 0] + self.mlp(self.deep(ids))[:, 0]
