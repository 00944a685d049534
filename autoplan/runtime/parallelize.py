"""Per-layer wrappers the plan asks for, on the rank program's layer modules: activation
recomputation (``checkpoint_wrapper``), FSDP2 units, and full state dicts. The order they are
applied in, and why, is in ``trainer.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial
from typing import Any

import torch
from torch import nn

from autoplan.errors import PlanError
from autoplan.graph.oprules import ops_policy_names


def recompute_policy(policy: str) -> dict[str, Any]:
    """checkpoint_wrapper keyword arguments for a recompute policy."""
    if policy == "full":
        return {}
    if policy == "selective":
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )
        aten = torch.ops.aten
        recompute = {aten.bmm.default, aten._softmax.default, aten.softmax.int,
                     aten.native_dropout.default, aten.masked_fill.Scalar,
                     aten.masked_fill.Tensor}

        def policy_fn(ctx, op, *args, **kwargs):
            return (CheckpointPolicy.PREFER_RECOMPUTE if op in recompute
                    else CheckpointPolicy.MUST_SAVE)
        return {"context_fn": partial(create_selective_checkpoint_contexts, policy_fn)}
    if policy == "ops":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return {"context_fn": partial(create_selective_checkpoint_contexts, _ops_policy)}
    raise PlanError(f"unknown recompute policy {policy!r}")


def ops_policy_saves(op: Any) -> bool:
    """Whether the op-level policy ("ops") keeps the outputs of aten op ``op`` (an
    OpOverload): the ops of the kinds ``graph.oprules.OPS_POLICY_SAVES`` names (products,
    attention), which the cost model prices as kept; every other op is recomputed."""
    return op.overloadpacket in _ops_policy_packets()


@lru_cache(maxsize=1)
def _ops_policy_packets() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in ops_policy_names() if hasattr(aten, n))


def _ops_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing's policy for "ops": save the products, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy
    return (CheckpointPolicy.MUST_SAVE if ops_policy_saves(op)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def apply_recompute(model: nn.Module, recompute: dict[str, str]) -> None:
    """Wrap each layer whose policy is not 'none' in a checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    for path, policy in sorted(recompute.items()):
        if policy == "none":
            continue
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = parent.get_submodule(attr)
        wrapped = checkpoint_wrapper(child, preserve_rng_state=True, **recompute_policy(policy))
        parent.register_module(attr, wrapped)


def apply_compile(model: nn.Module, layer_paths: list[str],
                  recompute: dict[str, str] | None = None, outside: Sequence[str] = ()) -> None:
    """``torch.compile`` one layer at a time (regional compilation, as torchtitan's
    ``apply_compile``): compile time stays one layer's, whatever the depth (``segments.
    share_code`` gives layers of one kind one compiled graph), and each part between them
    (``outside``, below) as a region of its own. In place (``nn.Module.compile``), so every parameter keeps its name. A model
    without layers is compiled whole.

    Under recomputation (``recompute``: layer path -> policy), a fully recomputed layer is
    compiled inside its checkpoint, which then reruns the compiled forward: torch.compile
    would trace a checkpoint as one region that must hold no graph break, and a tensor-parallel
    layer's collectives are graph breaks (the whole layer would run eagerly, silently). A
    selectively recomputed layer is compiled with its checkpoint, whole (``fullgraph``: a
    graph break is an error, never a silent eager layer);
    ``planner/search_space.selective_compiles`` keeps it to layers without collectives.

    ``outside``: the parts between the layers (``program_modules.split_outside``: embedding,
    final norm, LM head, loss), compiled each as a region of its own, at static shapes (every
    micro-batch has one shape), so what runs between the layers is not left eager. A part's
    collectives (a vocabulary-parallel embedding or loss under tp) are graph breaks, run
    eagerly between the compiled pieces, as in a tensor-parallel layer."""
    recompute = recompute or {}
    paths = list(layer_paths) or [""]
    for path in paths:
        module = model.get_submodule(path) if path else model
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is None:
            module.compile()
        elif recompute.get(path) in ("selective", "ops"):
            _quiet_selective_under_compile()
            module.compile(fullgraph=True)
        else:
            inner.compile()
    for name in outside:
        model.get_submodule(name).compile(dynamic=False)


def _quiet_selective_under_compile() -> None:
    """torch logs, on every rank, that a checkpoint's context_fn under torch.compile needs a
    region without in-place ops: a note to whoever writes the region (autoplan), nothing a user
    can act on; the compiled selective layers are checked against eager ones in
    tests/test_compiled.py. That one record is dropped."""
    import logging
    log = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _DropContextFnNote) for f in log.filters):
        log.addFilter(_DropContextFnNote())


class _DropContextFnNote:
    def filter(self, record) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in str(record.msg)


def layer_modules(model: nn.Module, layer_paths: list[str]) -> list[nn.Module]:
    return [model.get_submodule(p) for p in layer_paths]


def plan_mesh(device_type: str, cfg: Any) -> tuple[Any, Any, Any]:
    """The plan's DeviceMesh (``cfg.mesh_axes()``, the plan file's axes) and, from it, the flat
    dp mesh (batches, DDP, ZeRO-1) and the mesh FSDP2 shards over: the dp axis, or under HSDP
    the 2-D (dp_replicate, dp_shard) mesh, on which ``fully_shard`` shards inside a group and
    replicates across groups. Under expert parallelism dp is the flattened (edp, ep) pair: the
    ``ep`` axis exchanges routed tokens, the ``edp`` axis averages the expert weights'
    gradients. With context parallelism the dp mesh is the flattened (dp, cp) pair (the
    ranks that average gradients, as torchtitan's dp_shard_cp), and HSDP shards over
    (dp_shard, cp). Collective: every rank calls it in the same order."""
    from torch.distributed.device_mesh import init_device_mesh
    dims = cfg.dims
    mesh = init_device_mesh(device_type, dims.mesh_shape(), mesh_dim_names=dims.mesh_names())
    # FSDP's (flattened) axes first, then the data axes where they differ: every rank flattens
    # in the same order (each flattening makes a process group)
    fsdp = [axis_mesh(mesh, dims, axes) for axes in dims.fsdp_axes()]
    fsdp_mesh = fsdp[0] if len(fsdp) == 1 else mesh[tuple(dims.flat_name(axes)
                                                          for axes in dims.fsdp_axes())]
    data = dims.data_axes()
    dp_mesh = fsdp[0] if dims.fsdp_axes() == (data,) else axis_mesh(mesh, dims, data)
    return mesh, dp_mesh, fsdp_mesh


def axis_mesh(mesh: Any, dims: Any, axes: tuple[Any, ...]) -> Any:
    """The 1-D DeviceMesh of ``axes`` (mesh axes of ``dims``): the axis itself, or the axes
    flattened under ``dims.flat_name(axes)``."""
    if len(axes) == 1:
        return mesh[axes[0].value]
    return mesh[tuple(a.value for a in axes)]._flatten(dims.flat_name(axes))


def apply_fsdp(model: nn.Module, layer_paths: list[str], dp_mesh, *, reshard: bool,
               mp_policy: Any = None, offload: bool = False, experts: Any = (),
               expert_mesh: Any = None, whole: Any = (), root_mp_policy: Any = None
               ) -> list[nn.Parameter]:
    """FSDP2: one unit per layer, then the root (ZeRO-3 reshards after forward, ZeRO-2 not);
    on a 2-D ``dp_mesh`` (replicate, shard) that is HSDP. ``experts``: the expert weights (this
    rank's slabs, already split over ep), sharded over ``expert_mesh`` (the ranks holding the
    same experts) in the same units, as torchtitan shards its experts over dp_shard / ep (left
    out where that mesh is one rank: see ``shards_experts``). Their gradients hold every ep
    peer's tokens: every unit divides its reduced gradients by all of dp (for the other
    weights that is FSDP's own average).

    Returns the parameters left whole on every rank, outside FSDP, whose gradients the caller
    averages over dp: the scalar ones (a learned residual scale, a logit temperature), which
    ``fully_shard`` refuses, and the ``whole`` ones (the plan's ``dp_whole``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    scalars = list({id(p): p for p in [*model.parameters(), *whole]
                    if p.dim() == 0 or any(p is w for w in whole)}.values())
    ignored = set(scalars)
    if experts and not shards_experts(expert_mesh):
        ignored, experts = ignored | set(experts), ()
    if ignored:
        kw["ignored_params"] = ignored
    if experts:
        kw["shard_placement_fn"] = _on_expert_mesh(experts, expert_mesh)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    units = layer_modules(model, layer_paths) + [model]
    for module in units:
        if module is model and root_mp_policy is not None:     # the root unit's own policy
            fully_shard(module, **{**kw, "mp_policy": root_mp_policy})
        else:
            fully_shard(module, **kw)
        if experts:
            module.set_gradient_divide_factor(float(dp_mesh.size()))
            if torch.distributed.get_backend() != "nccl":     # gloo has no pre-scaled sum
                module.set_force_sum_reduction_for_comms(True)
    return [p for p in scalars if p.requires_grad]


def keep_gathered(module: nn.Module, *, last: bool) -> None:
    """ZeRO-2 over several micro-batches (no pipeline, even shares): FSDP2 keeps the weights it
    gathered in the first forward whole until the last micro-batch's backward (no reshard after
    the earlier ones), so a step gathers them once, as the estimate prices; each backward still
    reduce-scatters its gradients into their shards (ZeRO-2's sharded gradients, as DeepSpeed's
    stage 2 reduces every micro-step; ``estimate/dp_terms.reduce_scatters_per_step``). ZeRO-2
    holds the whole weights from each forward to its backward anyway, so keeping them between
    micro-batches raises no peak. Nothing for a module FSDP does not shard."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(module, FSDPModule):
        module.set_reshard_after_backward(last)


def whole_parameters(module: nn.Module, keep: Any) -> list[nn.Parameter]:
    """The parameters of ``module`` whose FQN (checkpoint wrappers dropped) ``keep`` accepts."""
    out: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if keep(name.replace("_checkpoint_wrapped_module.", "")):
            out.setdefault(id(p), p)
    return list(out.values())


def shards_experts(expert_mesh: Any) -> bool:
    """Whether FSDP shards the expert weights: not where one rank holds each slab (ep = dp),
    whose weights it leaves out; the caller averages their gradients (torch 2.13's FSDP2
    divides twice on a one-rank mesh under sum-only reductions)."""
    return expert_mesh is not None and expert_mesh.size() > 1


def _on_expert_mesh(experts: Any, mesh: Any) -> Any:
    """FSDP2's ``shard_placement_fn`` putting the ``experts`` on ``mesh`` (dim 0: the expert
    dim of the slab), every other weight on the unit's own mesh."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
    except ImportError as e:
        raise PlanError(
            "this plan shards expert weights under FSDP (zero_stage 2/3 with ep > 1), which "
            "needs per-parameter meshes in fully_shard (ShardPlacementResult, torch 2.13 has "
            f"it; this is torch {torch.__version__}): upgrade torch, or plan with "
            "zero_stage=1 (autoplan plan --force zero_stage=1)") from e
    from torch.distributed.tensor import Shard
    info = FSDPMeshInfo(mesh=mesh, shard_mesh_dim=0)
    ids = {id(p) for p in experts}

    def placement(param: nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(0), info) if id(param) in ids else None
    return placement


# PowerSGD's first step with compression: the hook's minimum with error feedback and warm start
# (the step before all-reduces the gradients whole); Vogels et al. 2019 compress from the start
POWERSGD_START_ITER = 2


def powersgd(module: nn.Module, group: Any, *, rank: int, seed: int) -> None:
    """Register torch's PowerSGD communication hook (rank ``rank``, error feedback and warm
    start, the hook's defaults) on DDP ``module``: its gradient all-reduce sends low-rank
    factors (lossy; ``cost/powersgd.py`` prices it). ``seed`` draws the first Q factors alike
    on every rank."""
    # lazily: PowerSGD plans only
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    state = hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                               start_powerSGD_iter=POWERSGD_START_ITER, random_seed=seed)
    module.register_comm_hook(state, hook.powerSGD_hook)


def ddp(module: nn.Module, group: Any, ignore: Any = frozenset()) -> nn.Module:
    """DDP over the dp ``group``, leaving out the parameters whose ids are in ``ignore``
    (expert weights: averaged over the ranks holding the same experts instead). The gradients
    are views of DDP's all-reduce buckets (``gradient_as_bucket_view``), as the estimate prices
    them: one fp32 copy of the gradients, not a second in the buckets (4 bytes a parameter)."""
    from torch.nn.parallel import DistributedDataParallel
    names = [k for k, p in module.named_parameters() if id(p) in ignore]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return DistributedDataParallel(module, process_group=group, gradient_as_bucket_view=True)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``module`` as full tensors (gathered over dp and tp), on the
    CPU, on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in sd.items()}
