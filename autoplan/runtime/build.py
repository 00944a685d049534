"""One rank's training program, built by one ordered path for every plan.

    mesh -> rank program -> stages -> recomputation -> compilation -> data parallelism
         -> pipeline schedule -> optimizer

A plan without pipelines is one stage of the same path: its stage is the whole program, run by
a micro-batch loop instead of a schedule. The order, and why (torchtitan's ``parallelize_llama``
composes tensor parallelism, activation checkpointing, compilation and FSDP in this order, for
the same reasons):

1. **mesh**: every later step takes its process groups from it, and creating groups is a
   collective (every rank, in the same order);
2. **rank program**: the traced graph running the plan's tensor / context / expert-parallel
   strategies on local tensors (``emit.py``); it shards the weights, which every later step
   must see;
3. **stages**: the program cut into the pipeline chunks this rank runs (without pipelines, one
   chunk: all of it), each chunk into one module per layer, the unit of every step below (and,
   compiled, one per part between layers: embedding, final norm, head and loss);
4. **recomputation** per layer: inside FSDP's units, so that FSDP's all-gathers bracket the
   recomputation too; then activation offload's hooks around the layers the plan names
   (``activation_offload.py``), outside the checkpoint wrapper (a checkpointed layer offloads
   its input) and inside FSDP's units (FSDP's hooks gather before them);
5. **compilation** per layer and per part between layers (regional, ``parallelize.
   apply_compile``): after recomputation, so that the
   compiled region is the checkpointed layer, and before data parallelism, so that FSDP's
   hooks and DDP's buckets stay outside the compiled graphs;
6. **data parallelism** per stage: FSDP2 per layer then the stage (ZeRO-2/3), or DDP / a
   bucketed all-reduce (ZeRO-0/1); expert weights averaged over the ranks that hold them;
7. **pipeline schedule** over the stages (``torch.distributed.pipelining``), pp > 1 only;
8. **optimizer**, over the parameters as data parallelism left them (FSDP's shards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import PlanError
from autoplan.graph.analysis import reads_tables
from autoplan.graph.loss import token_mean_loss
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.oprules import uses_batch_statistics
from autoplan.runtime import parallelize as par
from autoplan.runtime.emit import (Exported, autocast_dtype, compute_dtype, connect,
                                   export_for_plan, lower, weights_dtype)
from autoplan.runtime.master_weights import MasterWeightsOptimizer, keep_main_grads
from autoplan.runtime.activation_offload import apply_activation_offload
from autoplan.runtime.autocast_weights import read_as_autocast
from autoplan.runtime.experts import expert_parameters
from autoplan.runtime.float8 import Float8Scales, fsdp_float8_weights, fsdp_gathered_fqns
from autoplan.runtime.rank_failure import for_job
from autoplan.runtime.lowbit_optim import state_factory
from autoplan.runtime.optim import (DataParallelGrads, HostOffloadOptimizer,
                                    TensorParallelGrads, TensorShardedOptimizer)
from autoplan.runtime.pipeline import (LossPassesThrough, build_schedule, chunk_cuts,
                                       chunk_specs, metas, shared_elsewhere, tie_across_ranks)
from autoplan.runtime.program import COMM_SLOTS, OP, Program
from autoplan.runtime.program_modules import (layer_ranges, split_chunks, split_layers,
                                              split_outside)
from autoplan.runtime.state import (keep_out_of_state_dict, non_persistent_buffers,
                                    register_aliases, tied_names)
from autoplan.runtime.steps import LocalSteps, PipelineSteps, Trainer
from autoplan.sharding.mesh_axes import STAGE_AXES, MeshAxis as A
from autoplan.sharding.parallel_config import SPLIT_BACKWARD
from autoplan.runtime.program_calls import call_scatter


@dataclass(frozen=True)
class BuildInputs:
    """What ``build_rank`` needs besides the plan: the user's model, its example (micro-)batch
    and loss, the optimizer factory, and where this rank runs."""

    model: nn.Module
    graph: OpGraph                      # the planning graph the plan's strategies name
    plan: Any
    example_inputs: Sequence[Any]
    example_targets: Any
    loss_fn: Callable[..., torch.Tensor] | None
    optimizer: Callable[[Any], Any]     # params -> torch optimizer
    device: torch.device
    rank: int
    seed: int


@dataclass(frozen=True)
class Place:
    """This rank and its index on every axis of the plan's mesh."""

    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int

    @staticmethod
    def of(cfg: Any, rank: int) -> Place:
        at = cfg.dims.coords(rank)
        return Place(rank=rank, pp=at[A.PP], dp=at[A.DP], cp=at[A.CP], tp=at[A.TP],
                     ep=at[A.EP])


@dataclass(frozen=True)
class Groups:
    """The process groups the plan's axes run on (None where an axis has one rank and no
    group was made)."""

    mesh: Any = None
    dp: Any = None          # the ranks that average gradients: dp (x cp), flattened
    fsdp_mesh: Any = None   # what FSDP2 shards over (2-D under HSDP)
    tp: Any = None
    ep: Any = None
    edp: Any = None         # the ranks holding the same experts
    cp: Any = None
    pp: Any = None
    stage: Any = None       # the dp x cp x tp ranks of this rank's pipeline stage


@dataclass
class Stage:
    """One pipeline chunk this rank runs (the whole program without pipelines)."""

    index: int
    module: nn.Module
    layers: list[str]
    held: list[str]                     # FQNs of the weights it reads
    inputs: list[Any]                   # program nodes it takes (pipeline stages)
    outputs: list[Any]
    # compiled plans: the parts between its layers (``program_modules.split_outside``)
    outside: list[str] = field(default_factory=list)


# ---- 1. mesh ---------------------------------------------------------------------------------

def make_groups(device: torch.device, cfg: Any, place: Place, world: int) -> Groups:
    """The plan's device mesh and the groups cut from it. A one-process plan makes none unless
    FSDP2 needs a mesh (parameter offload over a dp axis of one rank)."""
    if world == 1 and not cfg.offload_params:
        return Groups()
    mesh, dp_mesh, fsdp_mesh = par.plan_mesh(device.type, cfg)
    stage = None
    if cfg.pp > 1:
        # every rank creates every stage's group, in the same order (new_group is collective)
        stage = [dist.new_group(ranks=list(g)) for g in cfg.dims.groups(STAGE_AXES)][place.pp]
    named = cfg.dims.mesh_axes()

    def group(axis: A) -> Any:
        return mesh[axis.value].get_group() if axis in named else None
    return Groups(mesh=mesh, dp=dp_mesh.get_group(), fsdp_mesh=fsdp_mesh, tp=group(A.TP),
                  ep=group(A.EP), edp=group(A.EDP), cp=group(A.CP), pp=group(A.PP),
                  stage=stage)


# ---- 2. rank program -------------------------------------------------------------------------

def rank_program(b: BuildInputs, place: Place, groups: Groups
                 ) -> tuple[Exported, Program, list[int]]:
    """The traced graph with the plan's per-op strategies on local tensors, connected to this
    rank's groups, and the op indices where its pipeline chunks start (``[0, ops]``: one)."""
    cfg = b.plan.config
    ex = export_for_plan(b.model, b.plan, b.graph, example_inputs=b.example_inputs,
                         example_targets=b.example_targets, loss_fn=b.loss_fn, t=cfg.tp,
                         device=b.device)
    if cfg.dp_shares is not None and cfg.dp > 1 and ex.graph.meta.get("train", True) \
            is not False and any(uses_batch_statistics(op) for op in ex.graph.ops):
        # its statistics are all-reduced over dp in every micro-batch: uneven counts would
        # leave a rank waiting for a peer's micro-batch that never comes
        raise PlanError(f"dp_shares={list(cfg.dp_shares)} (uneven data parallelism) cannot run "
                        f"a model with batch statistics (a batch norm in training mode): its "
                        f"statistics are shared over the dp ranks in every micro-batch; "
                        f"re-plan with even shares (no dp_shares) or train in eval mode")
    keep = None
    cuts = [0, len(ex.graph.ops)]
    if cfg.pp > 1:
        if not ex.with_loss:
            raise PlanError("a pipelined plan needs the loss in the traced program: pass "
                            "loss_fn and example_targets")
        cuts = chunk_cuts(ex.graph, chunk_specs(b.plan))
        used: set[str] = set()
        for c in cfg.rank_chunks(place.pp):
            for op in ex.graph.ops[cuts[c]:cuts[c + 1]]:
                used.update(op.params)
        keep = used.__contains__          # other ranks' weights stay unallocated
    program = lower(b.model, ex, t=cfg.tp, tp_rank=place.tp, device=b.device, seed=b.seed,
                    keep=keep, ep=(cfg.ep, place.ep), cp=cfg.cp, cp_layout=cfg.cp_layout)
    if cfg.uses_fsdp and ex.autocast_dtype is not None:    # (16-bit gathers under autocast)
        read_as_autocast(program.graph_module, ex.graph, b.device)
    dims = cfg.dims
    connect(program.comm_slot, tp=(groups.tp, cfg.tp, place.tp),
            dp=(groups.dp, cfg.grad_degree, dims.index(place.rank, dims.data_axes())),
            dp_tp=((groups.stage, dims.degree(STAGE_AXES), dims.index(place.rank, STAGE_AXES))
                   if groups.stage is not None else None),
            ep=(groups.ep, cfg.ep, place.ep), cp_slot=program.cp_slot,
            cp=(groups.cp, cfg.cp, place.cp))
    same_program_everywhere(ex, program)
    return ex, program, cuts


def program_digest(ex: Exported, program: Program) -> str:
    """The order this rank's program runs the calls that may communicate in (those reading a
    process-group slot: collectives, kernels that gather or exchange, per-rank random masks),
    as their ops' canonical keys (``OpGraph.op_keys``): equal on every rank of a plan."""
    import hashlib

    keys = ex.graph.op_keys()
    names = [op.name for op in ex.graph.ops]
    h = hashlib.sha256()
    for n in program.graph_module.graph.nodes:
        i = n.meta.get(OP)
        if i is None or n.target is call_scatter or not any(    # (a scatter slices locally)
                getattr(a, "op", None) == "get_attr" and a.target in COMM_SLOTS for a in n.args):
            continue
        h.update(f"{keys[names[i]]}:{getattr(n.target, '__name__', n.target)};".encode())
    return h.hexdigest()


def same_program_everywhere(ex: Exported, program: Program) -> None:
    """Every rank traced the model in its own process: where independent ops came out in
    another order (a model iterating a ``set``, whose order follows ``PYTHONHASHSEED``), ranks
    would pair one op's collective with another's and train wrong, silently. One small
    collective compares the orders and refuses on every rank alike. (Not on the ``fake``
    backend, whose collectives carry nothing.)"""
    if not dist.is_initialized() or dist.get_world_size() == 1 \
            or dist.get_backend() == "fake":
        return
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, program_digest(ex, program))
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanError(f"ranks {odd} traced the model with its collectives in another order "
                        "than rank 0 (its forward iterates something whose order changes "
                        "between processes, such as a set under Python's hash seed): set "
                        "PYTHONHASHSEED=0 in every rank's environment (autoplan run does), or "
                        "make the forward's order deterministic")


# ---- 3. stages -------------------------------------------------------------------------------

def cut_stages(b: BuildInputs, ex: Exported, program: Program, cuts: list[int],
               place: Place) -> tuple[list[Stage], list[list[str]]]:
    """This rank's chunks of the program, each cut into one module per layer (installed at the
    layer's path, weights under the user's names), and per chunk of the whole program (every
    rank's) the FQNs of the weights it reads: a weight two ranks read (a tied LM head) has its
    gradients summed between them."""
    cfg = b.plan.config
    ranges = layer_ranges(ex.graph)
    aliases, transient = tied_names(b.model), non_persistent_buffers(b.model)
    if cfg.pp == 1:
        pieces = [(0, program.graph_module, [], [])]
        held = [sorted({n for n, _ in program.graph_module.named_parameters()})]
    else:
        chunks = split_chunks(program.graph_module, cuts)
        pieces = [(c, chunks[c].module, chunks[c].inputs, chunks[c].outputs)
                  for c in cfg.rank_chunks(place.pp)]
        held = [c.held for c in chunks]
    stages = []
    for c, gm, inputs, outputs in pieces:
        inside = [r for r in ranges if cuts[c] <= r[1] < cuts[c + 1]]
        module = split_layers(gm, inside)
        outside: list[str] = []
        if cfg.compiled and inside:     # what runs between the layers, compiled too (5)
            module, outside = split_outside(module)
        register_aliases(module, aliases)
        keep_out_of_state_dict(module, transient)
        stages.append(Stage(index=c, module=module, layers=[p for p, _, _ in inside],
                            held=held[c], inputs=inputs, outputs=outputs, outside=outside))
    return stages, held


# ---- 6. data parallelism ---------------------------------------------------------------------

@dataclass
class GradSyncs:
    """The gradient reductions no wrapper does, in the order the step runs them."""

    tensor_parallel: list[Any]          # weights whose tp gradients are partial
    whole: list[Any]                    # weights left whole on every dp rank (scalars, dp_whole)
    tied: list[Any]                     # weights read by chunks on two pipeline ranks
    split_backward: list[Any]           # ZeRO-0/1 under zero-bubble schedules
    experts: list[Any]                  # expert slabs, over the ranks that hold them
    main_grads: list[Any] = field(default_factory=list)   # 16-bit weights' fp32 sums (no DDP)

    def in_order(self) -> list[Any]:
        return (self.tensor_parallel + self.whole + self.tied + self.split_backward
                + self.experts + self.main_grads)


def data_parallel(b: BuildInputs, stages: list[Stage], ex: Exported, groups: Groups,
                  ) -> tuple[list[nn.Module], GradSyncs, dict[str, nn.Parameter]]:
    """FSDP2 (ZeRO-2/3, parameter offload) per layer then per stage, else DDP (ZeRO-0/1, one
    all-reduce per step, as the simulator prices it: during the stage's last backward, or
    after the schedule where zero-bubble splits backward in two, which DDP's hooks cannot
    follow). Returns the stages' modules as the step calls them, the syncs left to the step,
    and the expert weights (by FQN) after wrapping."""
    cfg = b.plan.config
    syncs = GradSyncs([], [], [], [], [])
    before = expert_parameters([s.module for s in stages], ex.graph, cfg.ep)
    sixteen = weights_dtype(b.plan)
    if cfg.uses_fsdp:
        mp = None
        precision = compute_dtype(b.plan)
        if sixteen is not None:       # FSDP's sharded fp32 parameters are the master copy
            _cast_params([s.module for s in stages], torch.float32)
        root_mp = None
        if precision is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            # under autocast (``autocast_weights.py``): the layers' inputs as they come
            # (autocast casts what it runs in 16 bits; the residual stream stays fp32), and
            # the weights outside the layers gathered in fp32 where an embedding table is
            # among them (its rows are the residual stream's start)
            autocast = ex.autocast_dtype is not None
            mp = MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=torch.float32,
                                      cast_forward_inputs=not autocast)
            if autocast:
                root_mp = MixedPrecisionPolicy(
                    param_dtype=None if reads_tables(ex.graph) else precision,
                    reduce_dtype=torch.float32, cast_forward_inputs=False)
        for st in stages:
            # ZeRO-3 gathers the weights again for every micro-batch, as the estimate prices;
            # the weights the plan keeps whole (dp_whole) stay out of FSDP like scalars
            mine = {k: p for k, p in before.items()
                    if any(p is q for q in st.module.parameters())}
            whole = par.apply_fsdp(st.module, st.layers, groups.fsdp_mesh,
                                   reshard=cfg.zero_stage == 3, mp_policy=mp,
                                   root_mp_policy=root_mp,
                                   offload=cfg.offload_params, experts=mine.values(),
                                   expert_mesh=groups.mesh[A.EDP.value] if mine else None,
                                   whole=par.whole_parameters(st.module, cfg.keeps_whole))
            if whole and cfg.grad_degree > 1:
                syncs.whole.append(DataParallelGrads(whole, groups.dp, cfg.grad_degree))
    experts = expert_parameters([s.module for s in stages], ex.graph, cfg.ep)
    expert_ids = {id(p) for p in experts.values()}
    modules = [s.module for s in stages]
    if sixteen is not None:
        # the weights FSDP left whole run in 16 bits too; every 16-bit weight sums its
        # micro-batches' gradients in fp32 (before any other hook reads them)
        _cast_params(modules, sixteen)
        held16 = keep_main_grads(p for m in modules for p in m.parameters())
        if cfg.grad_degree > 1 and not cfg.uses_fsdp:
            # DDP would reduce the 16-bit gradients: the fp32 sums are reduced instead, each
            # bucket behind the last backward (Megatron-LM's DDP with fp32 grad buffers)
            syncs.main_grads.append(DataParallelGrads([p for p in held16
                                                       if id(p) not in expert_ids],
                                                      groups.dp, cfg.grad_degree))
    elif cfg.grad_degree > 1 and not cfg.uses_fsdp:
        if cfg.pp > 1 and cfg.schedule in SPLIT_BACKWARD:
            params = [p for s in stages for p in s.module.parameters()
                      if p.requires_grad and id(p) not in expert_ids]
            syncs.split_backward.append(DataParallelGrads(list({id(p): p for p in params}
                                                               .values()),
                                                          groups.dp, cfg.grad_degree))
        else:
            modules = [par.ddp(m, groups.dp, expert_ids) for m in modules]
            if cfg.grad_compression == "powersgd":     # lossy: the plan says so (inspect)
                for m in modules:
                    par.powersgd(m, groups.dp, rank=cfg.powersgd_rank, seed=b.seed)
    if experts and not (cfg.uses_fsdp and par.shards_experts(groups.mesh[A.EDP.value])):
        # the experts' gradients hold every ep peer's tokens: averaged over the ranks that
        # hold the same experts, not by DDP over all of dp (FSDP does it in its units)
        syncs.experts.append(DataParallelGrads(list(experts.values()), groups.edp, cfg.dp))
    return modules, syncs, experts


def _cast_params(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """The floating, plain-tensor parameters of ``modules`` (not FSDP's sharded DTensors) cast to
    ``dtype`` in place (16-bit -> fp32 -> 16-bit is exact)."""
    from torch.distributed.tensor import DTensor
    for p in {id(p): p for m in modules for p in m.parameters()}.values():
        if p.is_floating_point() and p.dtype != dtype and not isinstance(p, DTensor):
            p.data = p.data.to(dtype)


def tensor_parallel_grads(program: Program, stages: list[Stage], groups: Groups, cfg: Any
                          ) -> list[Any]:
    """The all-reduce over tp of the weights whose gradients are partial there (this rank's
    stages' only)."""
    if cfg.tp == 1 or not program.step_params:
        return []
    mine = {f for s in stages for f in s.held} if cfg.pp > 1 else None
    step = [f for f in program.step_params if mine is None or f in mine]
    if not step:
        return []
    return [TensorParallelGrads([s.module for s in stages], step, groups.tp)]


# ---- 8. optimizer ----------------------------------------------------------------------------

def make_optimizer(b: BuildInputs, stages: list[Stage], modules: list[nn.Module],
                   groups: Groups, experts: dict[str, nn.Parameter]) -> Any:
    """The user's optimizer over this rank's trainable parameters: on the host when the plan
    offloads its state, sharded over dp under ZeRO-1 (the updated weights gathered back
    behind the next forward, layer by layer, as priced)."""
    cfg = b.plan.config
    params = list({id(p): p for m in modules for p in m.parameters()
                   if p.requires_grad}.values())
    # Adam's moments as the plan holds them (torchao's 8-bit or bf16 states; lowbit_optim.py)
    user = state_factory(b.optimizer, cfg.optimizer_state)
    factory = user
    if weights_dtype(b.plan) is not None:       # the optimizer steps fp32 masters
        factory = partial(MasterWeightsOptimizer, factory=user)
    if cfg.offload_optimizer and not cfg.offload_params:   # FSDP's offload carries the state
        # (its fp32 host copies are 16-bit weights' masters: ZeRO-Offload's master weights)
        factory = partial(HostOffloadOptimizer, factory=user)
    if cfg.grad_degree > 1 and cfg.zero_stage == 1:
        opt = TensorShardedOptimizer(params, factory, groups.dp,
                                     groups={id(p): groups.edp for p in experts.values()})
        opt.overlap_with_forward([s.module for s in stages],
                                 [s.module.get_submodule(p) for s in stages for p in s.layers])
        return opt
    return factory(params)


# ---- the path --------------------------------------------------------------------------------

def build_rank(b: BuildInputs) -> Trainer:
    """This rank's trainer for ``b.plan``, built in the order the module docstring gives."""
    cfg = b.plan.config
    world = dist.get_world_size() if dist.is_initialized() else 1
    place = Place.of(cfg, b.rank)
    groups = make_groups(b.device, cfg, place, world)                          # 1
    ex, program, cuts = rank_program(b, place, groups)                         # 2
    stages, held = cut_stages(b, ex, program, cuts, place)                     # 3
    offloader = None
    for st in stages:                                                          # 4
        par.apply_recompute(st.module, {p: pol for p, pol in b.plan.recompute.items()
                                        if p in set(st.layers)})
        # around each recompute wrapper, so that a checkpointed layer offloads its input
        offloader = apply_activation_offload(
            st.module, [p for p in b.plan.offload.get("activations", ()) if p in st.layers],
            b.device, offloader)
    # FSDP's fp8 all-gather: the fp8 linears' weights wrapped before compilation and FSDP
    # (``float8.py``), their scales computed after each optimizer step
    gathered = fsdp_gathered_fqns(b.graph, cfg)
    fp8_weights = [w for st in stages for w in fsdp_float8_weights(st.module, gathered)]
    if cfg.compiled:                                                           # 5
        for st in stages:
            par.apply_compile(st.module, st.layers, b.plan.recompute, outside=st.outside)
    modules, syncs, experts = data_parallel(b, stages, ex, groups)            # 6
    syncs.tensor_parallel = tensor_parallel_grads(program, stages, groups, cfg)
    token = token_mean_loss(b.graph)
    if cfg.pp > 1:                                                             # 7
        syncs.tied = [tie_across_ranks(held, {s.index: s.module for s in stages}, cfg,
                                       place.rank, _canonical(ex))]
        runner = _pipeline_steps(b, stages, modules, program, cuts, place, groups, token)
    else:
        # the scalar and expert gradients go out behind the last backward, as DDP's buckets
        overlapped = syncs.whole + syncs.experts + syncs.main_grads
        for sync in overlapped:
            sync.overlap_with_backward()
        runner = LocalSteps(module=modules[0], loss_in_program=ex.with_loss,
                            loss_fn=b.loss_fn, overlapped=tuple(overlapped),
                            token_loss=token, weights_dtype=weights_dtype(b.plan))
    opt = make_optimizer(b, stages, modules, groups, experts)                  # 8
    return Trainer(runner=runner, optimizer=opt, plan=b.plan, rank=b.rank,
                   after_weights_update=(Float8Scales([s.module for s in stages]),)
                   if fp8_weights else (),
                   activation_offload=offloader.counter if offloader is not None else None,
                   dp_index=place.dp, cp_index=place.cp,
                   dp_group=groups.dp if cfg.grad_degree > 1 else None,
                   grad_syncs=syncs.in_order(), device=b.device,
                   # under FSDP too: its mixed precision casts the weights, but a traced graph
                   # keeps casts the model made, and only autocast reconciles those with the
                   # 16-bit weights
                   autocast_dtype=autocast_dtype(b.plan),
                   tp_comm=program.comm_slot.comm, placements=program.state,
                   aliases=tied_names(b.model), health=for_job(b.rank, world),
                   experts=frozenset(experts), ep_comm=program.comm_slot.ep,
                   shared_elsewhere=(shared_elsewhere(held, cfg, place.pp, _canonical(ex),
                                                      tied_names(b.model))
                                     if cfg.pp > 1 else frozenset()))


def _canonical(ex: Exported) -> dict[str, str]:
    return {v.fqn: ex.graph.value(v.base).fqn for v in ex.graph.param_values}


def _pipeline_steps(b: BuildInputs, stages: list[Stage], modules: list[nn.Module],
                    program: Program, cuts: list[int], place: Place, groups: Groups,
                    token: Any) -> PipelineSteps:
    """The stages on torch pipelining's stages and the plan's schedule."""
    from torch.distributed.pipelining import PipelineStage
    cfg = b.plan.config
    n = cfg.pp * cfg.virtual_stages
    # declared shapes: no shape-inference forward on uninitialized buffers (a loss would read
    # garbage targets)
    pipe_stages = [PipelineStage(m, st.index, n, b.device, input_args=metas(st.inputs),
                                 output_args=metas(st.outputs), group=groups.pp)
                   for st, m in zip(stages, modules)]
    # this pipeline's micro-batches (its replica's share under dp_shares)
    _, per_replica = cfg.replica_rows(b.plan.training.global_batch_size, place.dp)
    loss_out = LossPassesThrough(token if token is not None
                                 and token.target_input == len(b.graph.inputs) - 1 else None)
    in_two = sum(1 for st in stages for _ in st.module.parameters()) > len(
        {id(p) for st in stages for p in st.module.parameters()})
    # 16-bit weights: torch scales p.grad, which is empty (the sums are the fp32 main grads)
    sixteen = weights_dtype(b.plan)
    schedule = build_schedule(pipe_stages, cfg, per_replica // cfg.micro_batch_size, loss_out,
                              # uneven dp shares: the loss carries 1 / micro-batches, as
                              # torch would divide after the replicas' reduction
                              scale_grads=not in_two and sixteen is None
                              and cfg.dp_shares is None)
    params = list({id(p): p for st in stages for p in st.module.parameters()
                   if p.requires_grad}.values())
    last = cfg.dims.group(A.PP, place.rank)[cfg.chunk_rank(n - 1)]
    return PipelineSteps(chunks={st.index: st.module for st in stages}, schedule=schedule,
                         loss_out=loss_out, pp_group=groups.pp, last_stage_rank=last,
                         average_here=params if in_two or sixteen is not None else [],
                         weights_dtype=sixteen)
