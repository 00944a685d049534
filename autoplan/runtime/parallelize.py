"""Apply a plan to the model's own modules with PyTorch's parallel APIs.

Order, and why (the order torchtitan uses):
1. tensor parallelism first (``parallelize_module``): it turns the weights into DTensors on the
   tp mesh, which every later step must see;
2. activation recomputation next (``checkpoint_wrapper`` per layer): it wraps modules whose
   weights are already sharded, and must sit inside FSDP's units so that FSDP's all-gathers
   bracket the recomputation too;
3. data parallelism last: FSDP2 ``fully_shard`` per layer then the root (ZeRO-2/3, also on top
   of TP), or DDP (ZeRO-0/1 without TP); with TP and ZeRO-0/1 the trainer all-reduces the
   local gradient shards over the dp group itself;
4. a model given on the meta device is materialized only now, shard by shard (``to_empty``
   then the modules' own initializers), so each rank allocates only its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autoplan.errors import PlanError
from autoplan.sharding.placement import Placement
from autoplan.runtime.layouts import ModuleLayout, to_dtensor


def _style(layout: ModuleLayout, local_output: bool):
    """The PyTorch ParallelStyle of one module (its layouts come from the plan)."""
    arrives, leaves = to_dtensor(layout.arrives), to_dtensor(layout.leaves)
    s = layout.style
    if s in ("colwise", "colwise_sp", "embed_dim"):
        return ColwiseParallel(input_layouts=arrives, output_layouts=leaves,
                               use_local_output=local_output)
    if s in ("rowwise", "rowwise_sp", "vocab", "vocab_sp"):
        return RowwiseParallel(input_layouts=arrives, output_layouts=leaves,
                               use_local_output=local_output)
    if s in ("seq", "batch"):
        return SequenceParallel(sequence_dim=layout.wants.dim, use_local_output=local_output)
    raise PlanError(f"module {layout.fqn!r}: no runtime style for {s!r}")


def _reshard_input(mesh, src: Placement, dst: Placement) -> Callable:
    """A forward pre-hook: the local input of placement ``src`` becomes one of ``dst``
    (a slice, a gather or an all-to-all; its backward is the reverse)."""
    s, d = [to_dtensor(src)], [to_dtensor(dst)]

    def hook(module, args):
        x = args[0]
        if isinstance(x, DTensor):
            return (x.redistribute(mesh, d),) + tuple(args[1:])
        y = DTensor.from_local(x, mesh, s, run_check=False).redistribute(mesh, d).to_local()
        return (y,) + tuple(args[1:])
    return hook


def apply_tensor_parallel(model: nn.Module, layouts: dict[str, ModuleLayout], tp_mesh,
                          dtensor_outputs: set[str]) -> None:
    """Parallelize each module by its layout; ``dtensor_outputs`` keep DTensor outputs (the
    logits feeding a loss-parallel cross entropy)."""
    plan = {}
    for fqn, layout in sorted(layouts.items()):
        module = model.get_submodule(fqn)
        if layout.style == "replicate":
            if layout.arrives != layout.wants:
                module.register_forward_pre_hook(_reshard_input(tp_mesh, layout.arrives,
                                                                layout.wants))
            continue
        if layout.style in ("seq", "batch") and layout.arrives != layout.wants:
            module.register_forward_pre_hook(_reshard_input(tp_mesh, layout.arrives,
                                                            layout.wants))
        plan[fqn] = _style(layout, local_output=fqn not in dtensor_outputs)
    if plan:
        groups = tied_groups(model)
        parallelize_module(model, tp_mesh, plan)
        retie(model, groups)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter FQNs that share one tensor (e.g. an LM head tied to the embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Tensor parallelism distributes each module's weights on its own, which unties shared
    weights; tie them again to the first one (their placements must agree)."""
    for names in groups:
        first_mod, _, first_attr = names[0].rpartition(".")
        keep = getattr(model.get_submodule(first_mod), first_attr)
        for name in names[1:]:
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            other = getattr(mod, attr)
            if other is keep:
                continue
            if getattr(other, "placements", None) != getattr(keep, "placements", None):
                raise PlanError(f"tied weights {names} are sharded differently "
                                f"({getattr(keep, 'placements', 'replicated')} vs "
                                f"{getattr(other, 'placements', 'replicated')}); re-plan")
            setattr(mod, attr, keep)


def recompute_policy(policy: str) -> dict[str, Any]:
    """checkpoint_wrapper keyword arguments for a recompute policy."""
    if policy == "full":
        return {}
    if policy == "selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
        aten = torch.ops.aten
        recompute = {aten.bmm.default, aten._softmax.default, aten.softmax.int,
                     aten.native_dropout.default, aten.masked_fill.Scalar,
                     aten.masked_fill.Tensor}

        def policy_fn(ctx, op, *args, **kwargs):
            return (CheckpointPolicy.PREFER_RECOMPUTE if op in recompute
                    else CheckpointPolicy.MUST_SAVE)
        return {"context_fn": partial(create_selective_checkpoint_contexts, policy_fn)}
    raise PlanError(f"unknown recompute policy {policy!r}")


def apply_recompute(model: nn.Module, recompute: dict[str, str]) -> None:
    """Wrap each layer whose policy is not 'none' in a checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for path, policy in sorted(recompute.items()):
        if policy == "none":
            continue
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = parent.get_submodule(attr)
        wrapped = checkpoint_wrapper(child, preserve_rng_state=True, **recompute_policy(policy))
        parent.register_module(attr, wrapped)


def layer_modules(model: nn.Module, layer_paths: list[str]) -> list[nn.Module]:
    return [model.get_submodule(p) for p in layer_paths]


def apply_fsdp(model: nn.Module, layer_paths: list[str], dp_mesh, *, reshard: bool,
               mp_policy: Any = None, offload: bool = False) -> None:
    """FSDP2: one unit per layer, then the root (ZeRO-3 reshards after forward, ZeRO-2 not)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for module in layer_modules(model, layer_paths):
        fully_shard(module, **kw)
    fully_shard(model, **kw)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``module`` as full tensors (gathered over dp and tp), on the
    CPU, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in sd.items()}


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model's (local) parameters and initialize them."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    torch.manual_seed(seed)            # the same replicated weights on every rank
    with torch.no_grad():
        if hasattr(model, "init_weights"):
            model.init_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
