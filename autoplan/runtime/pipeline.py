"""Pipelined plans on ``torch.distributed.pipelining``, with chunks cut from the rank program.

The rank program (the traced graph running the plan's tensor-parallel strategies on local
tensors, ``program.py``) is cut into the plan's ``pp * v`` chunks by op ranges
(``segments.split_chunks``): a chunk's ops are its layers, with what runs before the first
layer (embeddings) on the first chunk and what runs after the last one (final norm, head, loss)
on the last. A chunk takes every value later chunks still need and returns the next such set,
passing through what it does not produce (masks, rotary tables, the targets), so any model the
tracer reads pipelines, whatever its forward looks like. Parameter names stay the user's.

Chunk ``c`` runs on pipeline rank ``cfg.chunk_rank(c)``: ``c % pp`` (looped placement, Megatron-LM's
interleaving), or in a V for ``zbv`` and ``dualpipev`` (rank r holds chunks r and 2pp - 1 - r), each
on a ``PipelineStage`` whose group is the pp axis of the device mesh. The last chunk
computes the loss itself (the schedule's ``loss_fn`` passes it on). Per chunk, in order:
recomputation per layer, then FSDP2 (ZeRO-2/3) or a data-parallel all-reduce after the schedule
(ZeRO-0/1). Weights read by chunks on different ranks (an LM head tied to the embedding) have
their gradients summed between those ranks. The schedule averages the micro-batch gradients
(``scale_grads``); the loss of the last chunk is broadcast to every rank.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import PlanError
from autoplan.estimate.config import SPLIT_BACKWARD
from autoplan.graph.loss import TokenMeanLoss, token_mean_loss
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.plan_check import chunks_in_model_order
from autoplan.runtime.checkpoint import Checkpointing
from autoplan.runtime.grads import GradientStep, LossScaler, finish_step
from autoplan.runtime.optim import _local, wait_gathers

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    layers: tuple[str, ...]
    first: bool
    last: bool


def chunk_specs(plan: Any) -> list[ChunkSpec]:
    """All ``pp * v`` chunks of the plan in pipeline order (chunk c on rank cfg.chunk_rank(c),
    the plan's stage of that rank listing its chunks in model order)."""
    cfg = plan.config
    p, v = cfg.pp, cfg.virtual_stages
    per_rank = []
    for st in plan.stages:
        chunks = st.get("chunks") or [st["layers"]]
        if len(chunks) != v:
            raise PlanError(f"stage {st['index']} lists {len(chunks)} chunks, the plan's config "
                            f"has virtual_stages={v}; re-plan")
        per_rank.append(chunks)
    if len(per_rank) != p:
        raise PlanError(f"the plan lists {len(per_rank)} pipeline stages for pp={p}; re-plan")
    n = p * v
    return [ChunkSpec(index=c, layers=tuple(layers), first=c == 0, last=c == n - 1)
            for c, layers in enumerate(chunks_in_model_order(plan))]


def chunk_cuts(graph: OpGraph, specs: Sequence[ChunkSpec]) -> list[int]:
    """Op indices where the chunks start (and the op count at the end)."""
    from autoplan.runtime.segments import layer_ranges
    start = {path: s for path, s, _ in layer_ranges(graph)}
    cuts = [0]
    for spec in specs[1:]:
        if not spec.layers or spec.layers[0] not in start:
            raise PlanError(f"pipeline chunk {spec.index} starts at layer "
                            f"{spec.layers[:1]}, which the model does not have; re-plan")
        cuts.append(start[spec.layers[0]])
    cuts.append(len(graph.ops))
    if cuts != sorted(cuts):
        raise PlanError(f"the plan's pipeline chunks are not in layer order ({cuts}); re-plan")
    return cuts


class TiedGrads:
    """Sums the gradients of one weight held by chunks on several pipeline ranks."""

    def __init__(self, pairs: list[tuple[nn.Parameter, Any]]):
        self.pairs = pairs                     # (this rank's copy, group of the holders)

    def all_reduce(self) -> None:
        # every holder joins every all-reduce (a copy without a gradient adds zeros and takes
        # the sum): a collective one rank skipped would leave its peers waiting forever
        for p, group in self.pairs:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=group)


def tie_across_ranks(held: list[list[str]], mine: dict[int, nn.Module], cfg: Any,
                     pp_index: int, dp_index: int, tp_index: int,
                     canonical: dict[str, str], cp_index: int = 0) -> TiedGrads:
    """A gradient all-reduce between the pipeline ranks whose chunks read the same weight
    (under any of its names: ``canonical`` maps each name to its storage owner's). Every rank
    knows every chunk's weights, so all create the same groups in the same order."""
    holders: dict[str, set[int]] = {}
    names_of: dict[str, set[str]] = {}
    for c, names in enumerate(held):
        for f in names:
            key = canonical.get(f, f)
            holders.setdefault(key, set()).add(cfg.chunk_rank(c))
            names_of.setdefault(key, set()).add(f)
    pairs = []
    for fqn in sorted(holders):
        ranks_pp = sorted(holders[fqn])
        if len(ranks_pp) < 2:
            continue
        for d, c, t in itertools.product(range(cfg.dp), range(cfg.cp), range(cfg.tp)):
            group = dist.new_group(ranks=[cfg.rank(pp_index=s, dp_index=d, cp_index=c,
                                                   tp_index=t) for s in ranks_pp])
            if (d, c, t) == (dp_index, cp_index, tp_index) and pp_index in ranks_pp:
                param = next((p for f in sorted(names_of[fqn])
                              if (p := _param(mine, f)) is not None), None)
                if param is not None:
                    pairs.append((param, group))
    return TiedGrads(pairs)


def _param(chunks: dict[int, nn.Module], fqn: str) -> nn.Parameter | None:
    for c in sorted(chunks):
        for name, p in chunks[c].named_parameters(remove_duplicate=False):
            if name.replace("_checkpoint_wrapped_module.", "") == fqn:
                return p
    return None


@dataclass
class PipelineTrainer(Checkpointing, GradientStep):
    """``Trainer`` for pipelined plans: ``step(batch)`` runs the plan's schedule."""

    chunks: dict[int, nn.Module]         # chunk index -> this rank's module
    schedule: Any
    optimizer: Any
    plan: Any
    rank: int
    pp_index: int
    dp_index: int
    dp_group: Any
    pp_group: Any
    last_stage_rank: int                 # global rank holding the last chunk in this pp group
    grad_syncs: list[Any]
    autocast_dtype: torch.dtype | None
    device: torch.device
    tp_comm: Any = None
    placements: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    health: Any = None
    steps_done: int = 0
    lr_schedulers: list[Any] = field(default_factory=list)
    checkpointer: Any = None
    max_grad_norm: float | None = None
    loss_scaler: LossScaler | None = None
    last_grad_norm: float | None = None
    shared_elsewhere: frozenset[str] = frozenset()   # tied weights a lower pp rank holds
    loss_out: Any = None                             # the schedule's loss function
    # when one weight sits in two of this rank's chunks (V schedules: the LM head tied to the
    # embedding), torch's per-stage scaling would divide its gradient twice: these are then
    # averaged over the micro-batches here, once each, and the schedule scales nothing
    average_here: list[nn.Parameter] = field(default_factory=list)
    experts: frozenset[str] = frozenset()     # expert weights split over the ep group
    ep_comm: Any = None
    cp_index: int = 0                          # this rank's piece of the sequence (cp > 1)
    batch_spec: Any = None                     # what step() takes (runtime/batch_check.py)

    @property
    def config(self):
        return self.plan.config

    @property
    def model(self) -> nn.ModuleList:
        return nn.ModuleList(self.chunks[c] for c in sorted(self.chunks))

    def step(self, batch: Sequence[torch.Tensor] | torch.Tensor) -> float:
        from autoplan.runtime.batch_check import check_batch
        from autoplan.runtime.trainer import guarded
        return guarded(self, self._step, check_batch(self.batch_spec, batch))

    def _step(self, batch: Sequence[torch.Tensor] | torch.Tensor) -> float:
        if isinstance(batch, torch.Tensor):
            raise PlanError("a pipelined plan needs (inputs..., targets): the last stage "
                            "computes the loss")
        batch = list(batch)
        rows = batch[0].shape[0]
        gbs = self.plan.training.global_batch_size
        if rows != gbs:
            raise PlanError(f"step() got a batch of {rows} samples; the plan is for a global "
                            f"batch of {gbs}")
        per = rows // self.config.dp
        lo = self.dp_index * per
        mine = [t[lo:lo + per].to(self.device) for t in batch]
        n_chunks = self.config.pp * self.config.virtual_stages
        args = mine if 0 in self.chunks else []     # the targets ride to the loss
        losses: list[torch.Tensor] = []
        kw: dict[str, Any] = {"return_outputs": False}
        if n_chunks - 1 in self.chunks:
            kw.update(target=mine[-1], losses=losses)
        amp = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        # context parallelism: each cp rank's gradient is its tokens' part, and the dp x cp
        # average divides by cp as well (``sharding/context_axis.py``)
        scale = self.loss_scale * self.config.cp
        self.loss_out.scale = scale
        self.loss_out.weigh(batch[-1], self.config.dp, per // self.config.micro_batch_size)
        with amp:
            self.schedule.step(*args, **kw)
        for p in self.average_here:
            if p.grad is not None:
                _local(p.grad).div_(per // self.config.micro_batch_size)
        for sync in self.grad_syncs:
            sync.all_reduce()
        finish_step(self)
        mean = torch.zeros(1, dtype=torch.float64)
        if losses:
            mean[0] = sum(float(_local(x).detach()) for x in losses) / len(losses) / scale
        if self.pp_group is not None:
            dist.broadcast(mean, src=self.last_stage_rank, group=self.pp_group)
        if self.dp_group is not None and self.config.grad_degree > 1:
            dist.all_reduce(mean, group=self.dp_group)     # cp ranks hold the same loss
            mean /= self.config.grad_degree
        return float(mean[0])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, full tensors (gathered over dp and tp)."""
        from autoplan.runtime.parallelize import full_state_dict
        from autoplan.runtime.state import gather_tensor_parallel
        wait_gathers(self.optimizer)
        out: dict[str, torch.Tensor] = {}
        for c in sorted(self.chunks):
            out.update(full_state_dict(self.chunks[c]))
        from autoplan.runtime.experts import gather_slabs
        out = gather_slabs(out, self.experts, self.ep_comm)
        return gather_tensor_parallel(out, self.placements, self.aliases, self.tp_comm)


class LossPassesThrough:
    """The last chunk computes the loss itself; the schedule's loss function hands it on,
    multiplied by fp16's loss scale (1 otherwise) and, where the loss is a mean over counted
    targets (``graph/loss.py``), by the micro-batch's share of the global batch's count
    (``counted * dp * micro_batches / total``: its micro-batch is the one ``target`` holds, in
    whatever order the schedule runs them)."""

    def __init__(self, token_loss: TokenMeanLoss | None = None) -> None:
        self.scale = 1.0
        self.token_loss = token_loss
        self.shares = 0                  # dp * micro-batches
        self.total = 0                   # the global batch's count (0: no weighting)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        f = self.scale
        if self.total:                   # integers first: exactly 1 for equal counts
            f *= self.token_loss.counted(target) * self.shares / self.total
        return output * f if f != 1.0 else output

    def weigh(self, global_targets: torch.Tensor, dp: int, micro_batches: int) -> None:
        """Set the step's count (before the schedule runs it)."""
        self.shares = dp * micro_batches
        self.total = self.token_loss.counted(global_targets) if self.token_loss else 0


def build_schedule(stages: list[Any], cfg: Any, n_microbatches: int,
                   loss_fn: LossPassesThrough, scale_grads: bool = True) -> Any:
    from torch.distributed.pipelining import schedules
    cls = getattr(schedules, SCHEDULES[cfg.schedule])
    if cfg.schedule in ("gpipe", "1f1b"):
        if len(stages) != 1:
            raise PlanError(f"schedule {cfg.schedule!r} runs one chunk per rank, the plan has "
                            f"{len(stages)}; re-plan")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                   scale_grads=scale_grads)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def compile_pipelined(model: nn.Module, graph: OpGraph, plan: Any, *, device: torch.device,
                      optimizer: Callable[[Any], Any], loss_fn: Callable[..., torch.Tensor],
                      seed: int, rank: int, example_inputs: Sequence[Any],
                      example_targets: Any, precision_dtype: torch.dtype | None
                      ) -> PipelineTrainer:
    """This rank's chunks of a pipelined plan, parallelized, on a torch pipelining schedule."""
    from torch.distributed.pipelining import PipelineStage

    from autoplan.runtime import parallelize as par
    from autoplan.runtime.emit import connect, export_for_plan, lower
    from autoplan.runtime.health import for_job
    from autoplan.runtime.optim import (
        DataParallelGrads,
        HostOffloadOptimizer,
        TensorParallelGrads,
        TensorShardedOptimizer,
    )
    from autoplan.runtime.segments import layer_ranges, split_chunks, split_layers
    from autoplan.runtime.state import (
        keep_out_of_state_dict,
        non_persistent_buffers,
        register_aliases,
        tied_names,
    )

    cfg = plan.config
    if loss_fn is None or example_targets is None:
        raise PlanError("a pipelined plan needs loss_fn and example_targets: the last stage "
                        "computes the loss")
    if cfg.split_backward_on_fsdp_unsupported:
        raise PlanError(f"this plan runs the {cfg.schedule} schedule on FSDP2-sharded stages "
                        f"(zero_stage {cfg.zero_stage}" + (", offload_params" if
                                                           cfg.offload_params else "")
                        + "), which this runtime cannot: with each backward split in two, "
                        "torch's weight-gradient pass misses weights FSDP2 resharded after "
                        "forward, or shared by two chunks of a rank (torch 2.13). Re-plan "
                        "with zero_stage <= 1, ZeRO-2 with zero_bubble, or another schedule "
                        "(force schedule=1f1b or interleaved_1f1b)")
    mesh, dp_mesh, fsdp_mesh = par.plan_mesh(device.type, cfg)
    tp_mesh = mesh["tp"]
    where = cfg.indices(rank)
    pp_index, dp_index, cp_index, tp_index = where["pp"], where["dp"], where["cp"], where["tp"]
    ep_index = dp_index % cfg.ep
    specs = chunk_specs(plan)
    n = len(specs)
    mine_idx = list(cfg.rank_chunks(pp_index))
    ex = export_for_plan(model, plan, graph, example_inputs=example_inputs,
                         example_targets=example_targets, loss_fn=loss_fn, t=cfg.tp)
    if not ex.with_loss:
        raise PlanError("a pipelined plan needs the loss in the traced program: pass loss_fn "
                        "and example_targets")
    cuts = chunk_cuts(ex.graph, specs)
    used: set[str] = set()
    for c in mine_idx:
        for op in ex.graph.ops[cuts[c]:cuts[c + 1]]:
            used.update(op.params)
    aliases = tied_names(model)
    transient = non_persistent_buffers(model)
    program = lower(model, ex, t=cfg.tp, tp_rank=tp_index, device=device, seed=seed,
                    keep=lambda fqn: fqn in used, ep=(cfg.ep, ep_index), cp=cfg.cp)
    # every rank creates every stage's group, in the same order (new_group is collective)
    stage_groups = [dist.new_group(ranks=[cfg.rank(pp_index=s, dp_index=d, cp_index=c,
                                                   tp_index=t)
                                          for d in range(cfg.dp) for c in range(cfg.cp)
                                          for t in range(cfg.tp)])
                    for s in range(cfg.pp)][pp_index]
    grad_index = dp_index * cfg.cp + cp_index        # in the dp x cp group
    connect(program.comm_slot, tp=(tp_mesh.get_group(), cfg.tp, tp_index),
            dp=(dp_mesh.get_group(), cfg.grad_degree, grad_index),
            dp_tp=(stage_groups, cfg.grad_degree * cfg.tp, grad_index * cfg.tp + tp_index),
            ep=(mesh["ep"].get_group() if cfg.ep > 1 else None, cfg.ep, ep_index),
            cp_slot=program.cp_slot,
            cp=(mesh["cp"].get_group() if cfg.cp > 1 else None, cfg.cp, cp_index))
    pieces = split_chunks(program.graph_module, cuts)
    held = [p.held for p in pieces]
    ranges = layer_ranges(ex.graph)
    use_fsdp = cfg.uses_fsdp                       # FSDP2 offload too
    chunks: dict[int, nn.Module] = {}
    layer_modules: list[nn.Module] = []
    grad_syncs: list[Any] = []
    for c in mine_idx:
        inside = [r for r in ranges if cuts[c] <= r[1] < cuts[c + 1]]
        chunk = split_layers(pieces[c].module, inside)
        register_aliases(chunk, aliases)
        keep_out_of_state_dict(chunk, transient)
        layers = [p for p, _, _ in inside]
        layer_modules += [chunk.get_submodule(p) for p in layers]
        par.apply_recompute(chunk, {p: pol for p, pol in plan.recompute.items()
                                    if p in set(layers)})
        if use_fsdp:
            mp = None
            if precision_dtype is not None:
                from torch.distributed.fsdp import MixedPrecisionPolicy
                mp = MixedPrecisionPolicy(param_dtype=precision_dtype,
                                          reduce_dtype=torch.float32)
            # ZeRO-3 gathers the weights again for every micro-batch, as the estimate prices;
            # expert slabs sharded over the ranks holding the same experts
            from autoplan.runtime.experts import expert_parameters
            scalars = par.apply_fsdp(
                chunk, layers, fsdp_mesh, reshard=cfg.zero_stage == 3, mp_policy=mp,
                offload=cfg.offload_params,
                experts=expert_parameters([chunk], ex.graph, cfg.ep).values(),
                expert_mesh=mesh["edp"] if cfg.ep > 1 else None)
            if scalars and cfg.grad_degree > 1:   # whole on every rank: averaged here
                grad_syncs.append(DataParallelGrads(scalars, dp_mesh.get_group(),
                                                    cfg.grad_degree))
        chunks[c] = chunk
    canonical = {v.fqn: ex.graph.value(v.base).fqn for v in ex.graph.param_values}
    grad_syncs.append(tie_across_ranks(held, chunks, cfg, pp_index, dp_index, tp_index,
                                       canonical, cp_index))
    params = list({id(p): p for c in sorted(chunks) for p in chunks[c].parameters()
                   if p.requires_grad}.values())
    # expert weights: their gradients averaged over the ranks holding the same experts
    from autoplan.runtime.experts import expert_parameters
    experts = expert_parameters([chunks[c] for c in sorted(chunks)], ex.graph, cfg.ep)
    expert_ids = {id(p) for p in experts.values()}
    edp_group = mesh["edp"].get_group() if cfg.ep > 1 else None
    in_two_chunks = sum(1 for c in chunks for p in chunks[c].parameters()) > len(
        {id(p) for c in chunks for p in chunks[c].parameters()})
    if cfg.tp > 1:
        mine_names = {f for c in mine_idx for f in held[c]}
        step = [f for f in program.step_params if f in mine_names]
        if step:
            grad_syncs.insert(0, TensorParallelGrads([chunks[c] for c in sorted(chunks)], step,
                                                     tp_mesh.get_group()))
    # ZeRO-0/1 over dp: each chunk in DDP, whose bucketed all-reduce runs during the chunk's
    # last backward (torch pipelining syncs a DDP stage on its last micro-batch only), as the
    # simulator prices it. Zero bubble splits backward into input and weight halves, which
    # DDP's hooks cannot follow: there the buckets are all-reduced after the schedule, and the
    # simulator puts that sync after the rank's last weight gradient.
    ddp = cfg.grad_degree > 1 and not use_fsdp and cfg.schedule not in SPLIT_BACKWARD
    if cfg.grad_degree > 1 and not use_fsdp and not ddp:
        grad_syncs.append(DataParallelGrads([p for p in params if id(p) not in expert_ids],
                                            dp_mesh.get_group(), cfg.grad_degree))
    if experts and not (use_fsdp and par.shards_experts(mesh["edp"])):
        grad_syncs.append(DataParallelGrads(list(experts.values()), edp_group, cfg.dp))
    pp_group = mesh["pp"].get_group()
    # declared shapes: no shape-inference forward on uninitialized buffers (a loss would read
    # garbage targets)
    stages = [PipelineStage(par.ddp(chunks[c], dp_mesh.get_group(), expert_ids) if ddp
                            else chunks[c], c, n,
                            device, input_args=_metas(pieces[c].inputs),
                            output_args=_metas(pieces[c].outputs), group=pp_group)
              for c in sorted(chunks)]
    per_replica = plan.training.global_batch_size // cfg.dp
    token = token_mean_loss(graph)           # the targets ride last, to the loss
    loss_out = LossPassesThrough(token if token is not None
                                 and token.target_input == len(graph.inputs) - 1 else None)
    schedule = build_schedule(stages, cfg, per_replica // cfg.micro_batch_size, loss_out,
                              scale_grads=not in_two_chunks)
    factory = optimizer
    if cfg.offload_optimizer and not cfg.offload_params:
        from functools import partial
        factory = partial(HostOffloadOptimizer, factory=optimizer)
    if cfg.grad_degree > 1 and cfg.zero_stage == 1:
        opt = TensorShardedOptimizer(params, factory, dp_mesh.get_group(),
                                     groups={i: edp_group for i in expert_ids})
        opt.overlap_with_forward([chunks[c] for c in sorted(chunks)], layer_modules)
    else:
        opt = factory(params)
    last_rank = cfg.rank(pp_index=cfg.chunk_rank(n - 1), dp_index=dp_index, cp_index=cp_index,
                         tp_index=tp_index)
    return PipelineTrainer(chunks=chunks, schedule=schedule, optimizer=opt, plan=plan, rank=rank,
                           pp_index=pp_index, dp_index=dp_index,
                           dp_group=dp_mesh.get_group() if cfg.grad_degree > 1 else None,
                           pp_group=pp_group, last_stage_rank=last_rank, grad_syncs=grad_syncs,
                           autocast_dtype=precision_dtype,     # as trainer.py: FSDP too
                           device=device, tp_comm=program.comm_slot.comm,
                           placements=program.state, aliases=aliases,
                           health=for_job(rank, dist.get_world_size()), loss_out=loss_out,
                           shared_elsewhere=_shared_elsewhere(held, cfg, pp_index,
                                                              canonical, aliases),
                           average_here=params if in_two_chunks else [],
                           experts=frozenset(experts), ep_comm=program.comm_slot.ep,
                           cp_index=cp_index)


def _shared_elsewhere(held: list[list[str]], cfg: Any, pp_index: int,
                      canonical: dict[str, str], aliases: dict[str, tuple[str, ...]]
                      ) -> frozenset[str]:
    """Checkpoint names of the weights this rank holds that a lower pipeline rank holds too
    (counted once in the global gradient norm: there)."""
    from autoplan.runtime.checkpoint import canonical_name
    first: dict[str, int] = {}
    mine: set[str] = set()
    for c, names in enumerate(held):
        for f in names:
            key = canonical.get(f, f)
            first[key] = min(first.get(key, cfg.pp), cfg.chunk_rank(c))
            if cfg.chunk_rank(c) == pp_index:
                mine.add(key)
    return frozenset(canonical_name(k, aliases) for k in mine if first[k] < pp_index)



def _metas(nodes: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """Meta tensors standing for what program nodes carry (recorded by the shape check)."""
    from autoplan.runtime.program import VAL
    out = []
    for n in nodes:
        shape, dtype, grad = n.meta[VAL]
        t = torch.empty(shape, dtype=dtype, device="meta")
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return tuple(out)
