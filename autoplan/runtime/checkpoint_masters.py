"""What a checkpoint holds of 16-bit weights with an fp32 master copy (``mixed_precision=
"params"``, Megatron-LM's --bf16): the model's true weights, the fp32 masters.

A checkpoint's ``model.<fqn>`` is then the master in fp32, as an autocast or fp32 plan's
weights are, so that any plan reads it (another mesh, autocast, fp32) and ``autoplan export``
writes it; a run resumed under "params" gets its masters back bitwise and rounds its 16-bit
weights from them, as every step does. Under ZeRO-1 a weight's master lives on its owner only,
which writes it; the other dp ranks read the value into an fp32 buffer and round it. Megatron-LM
saves its fp32 masters beside the 16-bit model (``fp32_from_fp16_params`` in the optimizer's
state dict); one fp32 copy under the model's own names is what a plan-independent checkpoint
needs (torchtitan's FSDP checkpoints hold the fp32 sharded parameters so too).
"""

from __future__ import annotations

from typing import Any

import torch

from autoplan.runtime.master_weights import MasterWeightsOptimizer
from autoplan.runtime.optim import (HostOffloadOptimizer, TensorShardedOptimizer,
                                    local_tensor as _local)


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def master_copies(opt: Any) -> dict[int, torch.Tensor]:
    """The fp32 master copy of each 16-bit weight ``opt`` steps, by the weight's id
    (``mixed_precision="params"``: ``MasterWeightsOptimizer``'s masters, or the host copies an
    offloaded optimizer steps; under ZeRO-1 those of the tensors this rank owns)."""
    if isinstance(opt, TensorShardedOptimizer):
        return master_copies(opt.inner) if opt.inner is not None else {}
    if isinstance(opt, (HostOffloadOptimizer, MasterWeightsOptimizer)):
        copies = opt.host if isinstance(opt, HostOffloadOptimizer) else opt.masters
        return {id(p): m for p, m in zip(opt.params, copies) if _local(p).dtype in SIXTEEN_BIT}
    return {}


def _holds_sixteen_bit_weights(trainer: Any) -> bool:
    cfg = trainer.plan.config
    return cfg.mixed_precision == "params" and cfg.precision != "fp32"


def weights_to_save(trainer: Any, held: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """What the checkpoint holds of each held tensor, by FQN: the tensor itself, except under
    16-bit weights with an fp32 master copy (``mixed_precision="params"``), where it holds the
    model's true weights in fp32, so that any plan (autocast, fp32, another mesh) and
    ``autoplan export`` read them: a weight's master where this rank holds it, None where
    another dp rank does (ZeRO-1: the owner writes it), other 16-bit tensors (buffers, frozen
    weights) cast to fp32."""
    if not _holds_sixteen_bit_weights(trainer):
        return {fqn: h.tensor for fqn, h in held.items()}
    masters = master_copies(trainer.optimizer)
    stepped = {id(p) for p in getattr(trainer.optimizer, "params", ())}
    out: dict[str, torch.Tensor | None] = {}
    for fqn, h in held.items():
        local = _local(h.tensor)
        if local.dtype not in SIXTEEN_BIT:
            out[fqn] = h.tensor
        elif id(h.tensor) in masters:
            out[fqn] = masters[id(h.tensor)]
        else:
            out[fqn] = None if id(h.tensor) in stepped else local.float()
    return out


def weights_to_load(trainer: Any, held: dict[str, Any]
                    ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the tensor the checkpoint's value of each held tensor is read into, the (16-bit
    weight, fp32 value) pairs to round into the weights once read). Under
    ``mixed_precision="params"`` a 16-bit weight's fp32 value goes into its master where this
    rank holds one (the master is then exactly what was saved), else into an fp32 buffer."""
    if not _holds_sixteen_bit_weights(trainer):
        return {fqn: h.tensor for fqn, h in held.items()}, []
    masters = master_copies(trainer.optimizer)
    into: dict[str, torch.Tensor] = {}
    rounded: list[tuple[torch.Tensor, torch.Tensor]] = []
    for fqn, h in held.items():
        local = _local(h.tensor)
        if local.dtype not in SIXTEEN_BIT:
            into[fqn] = h.tensor
            continue
        value = masters.get(id(h.tensor))
        if value is None:
            value = torch.empty_like(local, dtype=torch.float32)
        into[fqn] = value
        rounded.append((local, value))
    return into, rounded
