"""Pipelined plans on ``torch.distributed.pipelining``.

Stage modules are cut from the user's model by hand, the way torchtitan does (the tracer
frontend of ``torch.distributed.pipelining`` flattens modules into graphs, and tensor
parallelism needs the modules): each model chunk of the plan is a deep copy of the model
keeping only its own repeated layers, with what runs before the layers (embeddings) on the first
chunk and what runs after them (final norm, head) on the last; the others are set to ``None``.
FQNs are unchanged (``layers.5.attn...`` stays ``layers.5.attn...``), so the plan's per-module
layouts apply as they are. The model's forward must pass activations through a missing (None)
module and iterate its layer container, as autoplan's GPT and Llama examples do.

Chunk ``c`` of ``pp * v`` runs on pipeline rank ``c % pp`` (looped placement, Megatron-LM's
interleaving), each on a ``PipelineStage`` whose group is the pp axis of the device mesh. Per
chunk, in order: tensor parallelism, recomputation, then FSDP2 (ZeRO-2/3) or a data-parallel
all-reduce after the schedule (ZeRO-0/1). Weights tied across chunks (an LM head tied to the
embedding) have their gradients summed between the ranks holding them. The schedule averages
the micro-batch gradients (``scale_grads``); the loss of the last chunk is broadcast to every
rank.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError
from autoplan.estimate.partition import pipeline_units
from autoplan.graph.opgraph import OpGraph
from autoplan.runtime.optim import _local

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    layers: tuple[str, ...]
    first: bool
    last: bool


def chunk_specs(plan: Any) -> list[ChunkSpec]:
    """All ``pp * v`` chunks of the plan in pipeline order (chunk c on rank c % pp)."""
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
    return [ChunkSpec(index=c, layers=tuple(per_rank[c % p][c // p]), first=c == 0,
                      last=c == n - 1) for c in range(n)]


def _outer_modules(graph: OpGraph) -> tuple[set[str], set[str], str]:
    """Module paths used before the layers, after them, and the layers' container."""
    units = pipeline_units(graph)
    if not units:
        raise PlanError("pipeline stages need a model with a repeated layer block (e.g. "
                        "transformer layers); re-plan with max_pp=1")
    first, last = units[0], units[-1]
    container = first.path.rpartition(".")[0]
    before = {op.module_path for op in graph.ops[:first.start] if op.module_path}
    after = {op.module_path for op in graph.ops[last.stop:] if op.module_path}
    return before, after, container


def _drop(model: nn.Module, path: str) -> None:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(parent, attr, None) is not None:
        setattr(parent, attr, None)


def cut_chunk(model: nn.Module, graph: OpGraph, spec: ChunkSpec) -> nn.Module:
    """A copy of ``model`` holding only chunk ``spec`` (see the module docstring)."""
    before, after, container = _outer_modules(graph)
    chunk = copy.deepcopy(model)
    layers = chunk.get_submodule(container) if container else chunk
    keep = {p.rpartition(".")[2] for p in spec.layers}
    for key in list(layers._modules):
        if key not in keep:
            del layers._modules[key]          # FQNs of the kept layers stay as they are
    for path in sorted(before - after) if not spec.first else ():
        _drop(chunk, path)
    for path in sorted(after - before) if not spec.last else ():
        _drop(chunk, path)
    return chunk


class TiedGrads:
    """Sums the gradients of one weight held by several chunks on different pipeline ranks."""

    def __init__(self, pairs: list[tuple[nn.Parameter, Any]]):
        self.pairs = pairs                     # (this rank's copy, group of the holders)

    def all_reduce(self) -> None:
        for p, group in self.pairs:
            if p.grad is None:
                continue
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                # e.g. an embedding's gradient comes out replicated: lay it out as the weight
                g = p.grad = g.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(_local(g), group=group)


def tie_across_chunks(chunks: dict[int, nn.Module], groups: list[list[str]], cfg: Any,
                      rank: int) -> TiedGrads:
    """Weights shared in the full model (``groups`` of FQNs) that chunks hold separately: one
    Parameter within a rank, a gradient all-reduce between pipeline ranks. Every rank learns
    the holders (an all-gather) and creates the same process groups in the same order."""
    pairs = []
    me = (_dp_index(cfg, rank), rank % cfg.tp)
    for names in groups:
        mine = [(c, f) for c in sorted(chunks) for f in names if _has_param(chunks[c], f)]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [c % cfg.pp for c, _ in mine])
        holders = sorted({s for got in everyone for s in got})
        if len(mine) > 1:                      # one rank holds several copies: one Parameter
            c0, f0 = mine[0]
            keep = chunks[c0].get_parameter(f0)
            for c, f in mine[1:]:
                mod_name, _, attr = f.rpartition(".")
                setattr(chunks[c].get_submodule(mod_name), attr, keep)
        if len(holders) < 2:
            continue
        for d in range(cfg.dp):
            for t in range(cfg.tp):
                ranks = [cfg.rank(pp_index=s, dp_index=d, tp_index=t) for s in holders]
                group = dist.new_group(ranks=ranks)
                if (d, t) == me and mine:
                    c0, f0 = mine[0]
                    pairs.append((chunks[c0].get_parameter(f0), group))
    return TiedGrads(pairs)


def _dp_index(cfg: Any, rank: int) -> int:
    return (rank % (cfg.dp * cfg.tp)) // cfg.tp


def _has_param(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_parameter(fqn)
        return True
    except AttributeError:
        return False


@dataclass
class PipelineTrainer:
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
    loss_context: Callable[[], Any]
    device: torch.device
    steps_done: int = 0

    @property
    def config(self):
        return self.plan.config

    @property
    def model(self) -> nn.ModuleList:
        return nn.ModuleList(self.chunks[c] for c in sorted(self.chunks))

    def step(self, batch: Sequence[torch.Tensor] | torch.Tensor) -> float:
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
        inputs, target = mine[:-1], mine[-1]
        n_chunks = self.config.pp * self.config.virtual_stages
        args = inputs if 0 in self.chunks else []
        losses: list[torch.Tensor] = []
        kw: dict[str, Any] = {"return_outputs": False}
        if n_chunks - 1 in self.chunks:
            kw.update(target=target, losses=losses)
        with self.loss_context():
            try:
                self.schedule.step(*args, **kw)
            except (TypeError, AttributeError) as e:
                if self.steps_done:
                    raise
                raise PlanError(
                    f"the model does not run as pipeline stages ({type(e).__name__}: {e}). A "
                    "stage is the model with the other stages' layers removed and, off the "
                    "first/last stage, the modules before/after the layers set to None; its "
                    "forward must pass activations through those (see autoplan/models/gpt.py). "
                    "Re-plan with max_pp=1 (`autoplan plan --max-pp 1`)") from e
        self.steps_done += 1
        for sync in self.grad_syncs:
            sync.all_reduce()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean = torch.zeros(1, dtype=torch.float64)
        if losses:
            mean[0] = sum(float(_local(x).detach()) for x in losses) / len(losses)
        if self.pp_group is not None:
            dist.broadcast(mean, src=self.last_stage_rank, group=self.pp_group)
        if self.dp_group is not None and self.config.dp > 1:
            dist.all_reduce(mean, group=self.dp_group)
            mean /= self.config.dp
        return float(mean[0])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, full tensors (gathered over dp and tp)."""
        from autoplan.runtime.parallelize import full_state_dict
        out: dict[str, torch.Tensor] = {}
        for c in sorted(self.chunks):
            out.update(full_state_dict(self.chunks[c]))
        return out


def build_schedule(stages: list[Any], cfg: Any, n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor]) -> Any:
    from torch.distributed.pipelining import schedules
    cls = getattr(schedules, SCHEDULES[cfg.schedule])
    if cfg.schedule in ("gpipe", "1f1b"):
        if len(stages) != 1:
            raise PlanError(f"schedule {cfg.schedule!r} runs one chunk per rank, the plan has "
                            f"{len(stages)}; re-plan")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def _present(module: nn.Module, fqn: str) -> bool:
    try:
        return module.get_submodule(fqn) is not None
    except AttributeError:
        return False


def compile_pipelined(model: nn.Module, graph: OpGraph, plan: Any, *, device: torch.device,
                      optimizer: Callable[[Any], Any], loss_fn: Callable[..., torch.Tensor],
                      seed: int, rank: int, sharding: Any, logits_module: str | None,
                      loss_parallel: bool, precision_dtype: torch.dtype | None
                      ) -> PipelineTrainer:
    """This rank's chunks of a pipelined plan, parallelized, on a torch pipelining schedule."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from autoplan.runtime import parallelize as par
    from autoplan.runtime.layouts import module_layouts
    from autoplan.runtime.optim import (DataParallelGrads, HostOffloadOptimizer,
                                        TensorShardedOptimizer)

    cfg = plan.config
    if loss_fn is None:
        raise PlanError("a pipelined plan needs loss_fn (and example_targets): the last stage "
                        "computes the loss")
    mesh = init_device_mesh(device.type, (cfg.pp, cfg.dp, cfg.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    pp_mesh, dp_mesh, tp_mesh = mesh["pp"], mesh["dp"], mesh["tp"]
    pp_index = rank // (cfg.dp * cfg.tp)
    specs = chunk_specs(plan)
    n = len(specs)
    tied = par.tied_groups(model)
    chunks = {s.index: cut_chunk(model, graph, s) for s in specs if s.index % cfg.pp == pp_index}
    layouts = module_layouts(graph, sharding)
    use_fsdp = cfg.dp > 1 and cfg.zero_stage >= 2
    grad_syncs: list[Any] = []
    for c, chunk in chunks.items():
        if cfg.tp > 1:
            mine = {f: lay for f, lay in layouts.items() if _present(chunk, f)}
            keep = {logits_module} if logits_module and _present(chunk, logits_module) else set()
            par.apply_tensor_parallel(chunk, mine, tp_mesh, keep)
        layers = [p for p in specs[c].layers]
        par.apply_recompute(chunk, {p: pol for p, pol in plan.recompute.items() if p in layers})
        if cfg.dp > 1:
            from autoplan.runtime.syncbn import convert_batch_norms
            convert_batch_norms(chunk, dp_mesh.get_group())
        if use_fsdp:
            mp = None
            if precision_dtype is not None:
                from torch.distributed.fsdp import MixedPrecisionPolicy
                mp = MixedPrecisionPolicy(param_dtype=precision_dtype,
                                          reduce_dtype=torch.float32)
            # ZeRO-3 gathers the weights again for every micro-batch, as the estimate prices
            par.apply_fsdp(chunk, layers, dp_mesh, reshard=cfg.zero_stage == 3, mp_policy=mp,
                           offload=cfg.offload_params)
        par.materialize(chunk, device, seed)
        if cfg.dp > 1 and not use_fsdp:
            grad_syncs.append(DataParallelGrads(chunk, dp_mesh.get_group(), cfg.dp))
    grad_syncs.insert(0, tie_across_chunks(chunks, tied, cfg, rank))
    pp_group = pp_mesh.get_group()
    stages = [PipelineStage(chunks[c], c, n, device, group=pp_group) for c in sorted(chunks)]
    per_replica = plan.training.global_batch_size // cfg.dp
    schedule = build_schedule(stages, cfg, per_replica // cfg.micro_batch_size, loss_fn)
    params = [p for c in sorted(chunks) for p in chunks[c].parameters() if p.requires_grad]
    params = list({id(p): p for p in params}.values())
    factory = optimizer
    if cfg.offload_optimizer and not cfg.offload_params:
        from functools import partial
        factory = partial(HostOffloadOptimizer, factory=optimizer)
    if cfg.dp > 1 and cfg.zero_stage == 1:
        opt = TensorShardedOptimizer(params, factory, dp_mesh.get_group())
    else:
        opt = factory(params)

    autocast = precision_dtype if precision_dtype is not None and not use_fsdp else None

    @contextlib.contextmanager
    def loss_context():
        with contextlib.ExitStack() as stack:
            if loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel as lp
                stack.enter_context(lp())
            if autocast is not None:
                stack.enter_context(torch.autocast(device.type, dtype=autocast))
            yield

    dp_index = _dp_index(cfg, rank)
    last_rank = cfg.rank(pp_index=(n - 1) % cfg.pp, dp_index=dp_index, tp_index=rank % cfg.tp)
    return PipelineTrainer(chunks=chunks, schedule=schedule, optimizer=opt, plan=plan, rank=rank,
                           pp_index=pp_index, dp_index=dp_index,
                           dp_group=dp_mesh.get_group() if cfg.dp > 1 else None,
                           pp_group=pp_group, last_stage_rank=last_rank, grad_syncs=grad_syncs,
                           loss_context=loss_context, device=device)
