"""16-bit weights with an fp32 master copy (``mixed_precision="params"``, Megatron-LM's --bf16).

The rank program holds its weights in 16 bits and runs without autocast. What keeps training
in fp32 is around it, as Megatron-LM's ``Float16OptimizerWithFloat16Params`` and its DDP's
``main_grad`` buffers do:

- ``keep_main_grads``: each 16-bit weight gets an fp32 ``main_grad``; every micro-batch's 16-bit
  gradient is added to it as soon as autograd completes it (``register_post_accumulate_grad_hook``)
  and then freed, so the micro-batches accumulate in fp32 and the data-parallel reductions
  (``optim.DataParallelGrads``, ``TensorParallelGrads``), clipping and loss scaling read fp32
  sums (``grad_of``);
- ``MasterWeightsOptimizer``: the user's optimizer steps fp32 copies of the 16-bit weights (the
  master copy; an fp32 weight is its own master), whose gradients are the main grads; the
  16-bit weights are copied from the masters after each step. Under ZeRO-1 it is the
  optimizer each dp rank builds over the tensors it owns (``optim.TensorShardedOptimizer``),
  so the master copy is sharded over dp with the optimizer state, and the owner's updated
  16-bit weights are what the dp peers receive.

Under FSDP2 (ZeRO-2/3) no part of this is needed: its sharded fp32 parameters are the master,
``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`` gathers them in 16 bits,
accumulates and reduces the gradients in fp32 (torchtitan's mixed precision); only the weights
FSDP leaves whole take this path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

MAIN_GRAD = "main_grad"      # the attribute Megatron-LM's DDP gives each parameter


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the step reduces, clips and applies: a 16-bit weight's fp32 main grad, else
    ``p.grad``."""
    if hasattr(p, MAIN_GRAD):
        return getattr(p, MAIN_GRAD)
    return p.grad


def clear_grad(p: torch.Tensor) -> None:
    """Drop ``p``'s gradient (and its main grad) before the next step's backward."""
    p.grad = None
    if hasattr(p, MAIN_GRAD):
        setattr(p, MAIN_GRAD, None)


def _accumulate(p: torch.Tensor) -> None:
    g = p.grad
    if g is None:
        return
    with torch.no_grad():
        main = getattr(p, MAIN_GRAD)
        if main is None:
            setattr(p, MAIN_GRAD, g.to(torch.float32, copy=True))
        else:
            main.add_(g)
    p.grad = None


def keep_main_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Give every trainable 16-bit parameter of ``params`` an fp32 main grad fed by a hook
    (before any other hook on it: the data-parallel buckets read the main grad); returns them."""
    out = []
    for p in {id(p): p for p in params}.values():
        if not p.requires_grad or p.dtype not in (torch.bfloat16, torch.float16) \
                or hasattr(p, MAIN_GRAD):
            continue
        setattr(p, MAIN_GRAD, None)
        p.register_post_accumulate_grad_hook(_accumulate)
        out.append(p)
    return out


class MasterWeightsOptimizer:
    """The optimizer ``factory`` builds, run on fp32 master copies of 16-bit ``params`` (an
    fp32 parameter is its own master): gradients are the main grads, and the 16-bit weights
    are copied from the masters after the step."""

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 factory: Callable[[Any], torch.optim.Optimizer]):
        self.params = list(params)
        self.masters = [p if p.dtype == torch.float32 else
                        torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                        for p in self.params]
        self.inner = factory(self.masters)

    def step(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    m.grad = grad_of(p)
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)          # rounded to the 16-bit weight's dtype
                    m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            clear_grad(p)
        for m in self.masters:
            m.grad = None

    @property
    def param_groups(self):
        return self.inner.param_groups
