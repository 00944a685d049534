"""Adam and AdamW with bf16 moments (``ParallelConfig.optimizer_state="bf16"``): torchao's
low-bit Adam (``torchao.optim.adam._AdamBase``, its compiled fp32 step) with every moment
buffer of 4,096 elements or more made in bf16, as Megatron-Core's precision-aware optimizer
holds ``exp_avg`` and ``exp_avg_sq`` (``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``). The
step reads each moment as fp32 (``.float()``), updates the fp32 weight, and writes the moment
back rounded to bf16 (``copy_``). Smaller tensors keep fp32 moments, torchao's rule for its
quantised states. Imported only when a plan asks for it: torchao is optional.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchao.optim.adam import _AdamBase

# torchao's low-bit Adam makes its subclass buffers for tensors of at least this many elements
# that are a multiple of the block; one element a block makes every such tensor bf16
_ONE = 1


class BF16StateAdamW(_AdamBase):
    """AdamW (decoupled weight decay) with bf16 moments; torch.optim.AdamW's defaults."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, block_size=_ONE,
                         bf16_stochastic_round=False, is_adamw=True)

    @staticmethod
    def _subclass_zeros(p: Tensor, signed: bool, block_size: int) -> Tensor:
        return torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)


class BF16StateAdam(BF16StateAdamW):
    """Adam (L2 weight decay in the gradient) with bf16 moments; torch.optim.Adam's defaults."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)
        self.is_adamw = False
