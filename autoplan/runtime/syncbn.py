"""Batch norm whose statistics span the data-parallel group, on any backend (gloo included).

Splitting a batch over data-parallel ranks changes batch norm: each rank would normalize with
the statistics of its own slice. ``torch.nn.SyncBatchNorm`` fixes that on GPUs only; this
module does the same with differentiable all-reduces of the per-channel sum, sum of squares and
count, so every rank normalizes with the statistics of the whole (micro-)batch, as one device
would, and the running statistics stay identical across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.nn.functional as dist_fn
from torch import nn


class GroupBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm{1,2,3}d with statistics all-reduced over ``group`` in training."""

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, group: Any):
        super().__init__(source.num_features, eps=source.eps, momentum=source.momentum,
                         affine=source.affine, track_running_stats=source.track_running_stats,
                         device="meta")
        self.group = group
        self.weight, self.bias = source.weight, source.bias
        self.running_mean, self.running_var = source.running_mean, source.running_var
        self.num_batches_tracked = source.num_batches_tracked

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = dist_fn.all_reduce(stats, group=self.group)
        c = self.num_features
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach() * m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)) * m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y


def convert_batch_norms(model: nn.Module, group: Any) -> int:
    """Replace every batch norm by a GroupBatchNorm over ``group``; returns how many."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and \
                not isinstance(child, GroupBatchNorm):
            setattr(model, name, GroupBatchNorm(child, group))
            count += 1
        else:
            count += convert_batch_norms(child, group)
    return count
