"""What a rank holds for a checkpoint, and where it stands: its parameters and persistent
buffers under their checkpoint names (``held_state``; tied weights once), the torch optimizers
inside a wrapped one with the parameter each stepped tensor stands for (``optimizer_slots``),
its tensor- and expert-parallel place, and the few collectives saving and loading share
(``checkpoint.py`` saves, ``checkpoint_load.py`` loads; gradient clipping reads ``held_state``
too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import CheckpointError
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.runtime.optim import HostOffloadOptimizer, TensorShardedOptimizer
from autoplan.runtime.master_weights import MasterWeightsOptimizer


@dataclass
class Held:
    """One state tensor this rank holds, under its checkpoint name."""

    fqn: str
    tensor: torch.Tensor          # the live tensor (a Parameter, buffer, or FSDP2 DTensor)
    placement: Any                # its tensor-parallel placement (None: replicated)


def program_modules(trainer: Any) -> list[nn.Module]:
    """The modules holding this rank's parameters (DDP unwrapped; pipeline chunks)."""
    return list(trainer.stage_modules)


def canonical_name(name: str, aliases: dict[str, tuple[str, ...]]) -> str:
    return min(aliases.get(name, (name,)))


def held_state(trainer: Any) -> dict[str, Held]:
    """Parameters and persistent buffers of this rank by checkpoint name (tied weights once)."""
    out: dict[str, Held] = {}
    for module in program_modules(trainer):
        for name, t in module.state_dict(keep_vars=True).items():
            name = name.replace("_checkpoint_wrapped_module.", "")
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            fqn = canonical_name(name, trainer.aliases)
            p = trainer.placements.get(name)
            if p is None:
                p = next((trainer.placements[a] for a in trainer.aliases.get(name, ())
                          if a in trainer.placements), None)
            out.setdefault(fqn, Held(fqn, t, p))
    return out


def optimizer_slots(opt: Any) -> list[tuple[torch.optim.Optimizer, dict[int, torch.Tensor]]]:
    """Each torch optimizer inside ``opt`` with, per tensor it steps (by id), the model
    parameter that tensor stands for (itself, or the one a host-offloaded copy mirrors)."""
    if isinstance(opt, TensorShardedOptimizer):
        return optimizer_slots(opt.inner) if opt.inner is not None else []
    if isinstance(opt, (HostOffloadOptimizer, MasterWeightsOptimizer)):
        inner = optimizer_slots(opt.inner)
        copies = opt.host if isinstance(opt, HostOffloadOptimizer) else opt.masters
        mirror = {id(h): p for h, p in zip(copies, opt.params)}
        return [(o, {k: mirror.get(id(v), v) for k, v in m.items()}) for o, m in inner]
    if isinstance(opt, torch.optim.Optimizer):
        return [(opt, {id(p): p for g in opt.param_groups for p in g["params"]})]
    raise CheckpointError(f"cannot checkpoint an optimizer of type {type(opt).__name__}: "
                          "compile() takes a factory returning a torch.optim.Optimizer")


def tp_place(trainer: Any) -> tuple[int, int]:
    t = trainer.config.tp
    return t, trainer.config.dims.index(trainer.rank, MeshAxis.TP)


def expert_place(trainer: Any, fqn: str) -> tuple[int, int] | None:
    """(ep, this rank's index in its expert-parallel group) for an expert weight, else None."""
    ep = trainer.config.ep
    if ep == 1 or fqn not in trainer.experts:
        return None
    return ep, trainer.dp_index % ep


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: Any) -> list[Any]:
    _, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()
