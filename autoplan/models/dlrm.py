"""DLRM-style recommendation model (Naumov et al. 2019, "Deep Learning Recommendation Model for
Personalization and Recommendation Systems"): a bottom MLP on dense features, one embedding
table per categorical feature, pairwise dot-product interaction, a top MLP to one logit.

Layout (module paths the planner and the runtime address):

    bottom_mlp.<j>        nn.Linear / nn.ReLU   num_dense -> ... -> embedding_dim
    embeddings.<t>        nn.Embedding          rows_per_table -> embedding_dim
    top_mlp.<j>           nn.Linear / nn.ReLU   interaction -> ... -> 1

Inputs: ``dense`` (b, num_dense) float and ``sparse`` (b, num_tables, bag_size) int64, a
fixed-size bag of row indices per table per sample, sum-pooled. Plain ``nn.Embedding`` plus a
sum (rather than ``nn.EmbeddingBag`` with offsets) keeps every shape static for export and lets
``RowwiseParallel``/``ColwiseParallel`` shard the tables. Output: (b,) logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """Shape of a :class:`DLRM`. ``bottom_mlp`` lists hidden widths before the final width
    ``embedding_dim``; ``top_mlp`` lists hidden widths before the final logit."""

    num_dense: int
    num_tables: int
    rows_per_table: int
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    bag_size: int = 1

    def __post_init__(self) -> None:
        for field in ("num_dense", "num_tables", "rows_per_table", "embedding_dim", "bag_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DLRMConfig.{field} must be a positive int, got {value!r}")
        for field in ("bottom_mlp", "top_mlp"):
            widths = getattr(self, field)
            if not isinstance(widths, tuple) or any(
                not isinstance(w, int) or w < 1 for w in widths
            ):
                raise ValueError(
                    f"DLRMConfig.{field} must be a tuple of positive ints, got {widths!r}"
                )

    @property
    def interaction_size(self) -> int:
        """Top-MLP input: the bottom output plus one dot product per pair of features."""
        n = self.num_tables + 1
        return self.embedding_dim + n * (n - 1) // 2

    def param_count(self) -> int:
        def linears(widths: list[int]) -> int:
            return sum(a * b + b for a, b in zip(widths, widths[1:]))

        bottom = linears([self.num_dense, *self.bottom_mlp, self.embedding_dim])
        top = linears([self.interaction_size, *self.top_mlp, 1])
        return bottom + top + self.num_tables * self.rows_per_table * self.embedding_dim


def _mlp(widths: list[int], *, final_relu: bool) -> nn.Sequential:
    modules: list[nn.Module] = []
    for i in range(len(widths) - 1):
        modules.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2 or final_relu:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


class DLRM(nn.Module):
    """``forward(dense: (b, num_dense), sparse: (b, num_tables, bag_size)) -> (b,) logits``."""

    def __init__(self, config: DLRMConfig):
        super().__init__()
        self.config = config
        self.bottom_mlp = _mlp([config.num_dense, *config.bottom_mlp, config.embedding_dim],
                               final_relu=True)
        self.embeddings = nn.ModuleList(
            nn.Embedding(config.rows_per_table, config.embedding_dim)
            for _ in range(config.num_tables)
        )
        self.top_mlp = _mlp([config.interaction_size, *config.top_mlp, 1], final_relu=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Embedding rows uniform in +-1/sqrt(rows) (as the DLRM reference does); default
        Linear init."""
        bound = self.config.rows_per_table ** -0.5
        for table in self.embeddings:
            nn.init.uniform_(table.weight, -bound, bound)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom_mlp(dense)                                   # (b, d)
        pooled = [table(sparse[:, t]).sum(dim=1) for t, table in enumerate(self.embeddings)]
        features = torch.stack([bottom, *pooled], dim=1)                  # (b, n, d)
        products = torch.bmm(features, features.transpose(1, 2))          # (b, n, n)
        n = features.shape[1]
        rows, cols = torch.tril_indices(n, n, offset=-1, device=features.device)
        pairs = products[:, rows, cols]                                   # (b, n(n-1)/2)
        logits = self.top_mlp(torch.cat([bottom, pairs], dim=1))          # (b, 1)
        return logits.squeeze(1)


# Named configurations (project examples). Dense width 13 and the layer pattern follow the
# Criteo Terabyte setup of the MLPerf Training DLRM benchmark (bottom 512-256-128, top
# 1024-1024-512-256-1); the table count and sizes are our own, chosen to be small ("tiny") or
# far beyond one device ("dlrm": 8 x 10M x 128 = 10.2B parameters, 41 GB in fp32; meta only).
DLRM_CONFIGS: dict[str, DLRMConfig] = {
    "dlrm-tiny": DLRMConfig(num_dense=13, num_tables=4, rows_per_table=1000, embedding_dim=16,
                            bottom_mlp=(64,), top_mlp=(64,)),
    "dlrm": DLRMConfig(num_dense=13, num_tables=8, rows_per_table=10_000_000, embedding_dim=128,
                       bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256)),
}
