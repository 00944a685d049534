"""Pipelined plans on ``torch.distributed.pipelining``, with chunks cut from the rank program.

The rank program (the traced graph running the plan's tensor-parallel strategies on local
tensors, ``program.py``) is cut into the plan's ``pp * v`` chunks by op ranges
(``program_modules.split_chunks``): a chunk's ops are its layers, with what runs before the first
layer (embeddings) on the first chunk and what runs after the last one (final norm, head, loss)
on the last. A chunk takes every value later chunks still need and returns the next such set,
passing through what it does not produce (masks, rotary tables, the targets), so any model the
tracer reads pipelines, whatever its forward looks like. Parameter names stay the user's.

Chunk ``c`` runs on pipeline rank ``cfg.chunk_rank(c)``: ``c % pp`` (looped placement, Megatron-LM's
interleaving), or in a V for ``zbv`` and ``dualpipev`` (rank r holds chunks r and 2pp - 1 - r), each
on a ``PipelineStage`` whose group is the pp axis of the device mesh. The last chunk
computes the loss itself (the schedule's ``loss_fn`` passes it on). Weights read by chunks on
different ranks (an LM head tied to the embedding) have their gradients summed between those
ranks. The schedule averages the micro-batch gradients (``scale_grads``); the loss of the last
chunk is broadcast to every rank. What each chunk gets on the way (recomputation, compilation,
data parallelism) is the one build path's (``build.py``); running it is ``steps.PipelineSteps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import PlanError
from autoplan.graph.loss import TokenMeanLoss
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.plan_vs_model import chunks_in_model_order
from autoplan.runtime.optim import local_tensor
from autoplan.runtime.master_weights import MAIN_GRAD, grad_of
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.runtime.program_modules import layer_ranges
from autoplan.runtime.checkpoint_held import canonical_name
from autoplan.runtime.program import VAL

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
            if grad_of(p) is None:          # (a 16-bit weight's sum is its fp32 main grad)
                if hasattr(p, MAIN_GRAD):
                    setattr(p, MAIN_GRAD, torch.zeros_like(p, dtype=torch.float32))
                else:
                    p.grad = torch.zeros_like(p)
            dist.all_reduce(local_tensor(grad_of(p)), group=group)


def tie_across_ranks(held: list[list[str]], mine: dict[int, nn.Module], cfg: Any,
                     rank: int, canonical: dict[str, str]) -> TiedGrads:
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
        for pipe in cfg.dims.groups(MeshAxis.PP):       # one pipeline per dp x cp x tp index
            members = [pipe[s] for s in ranks_pp]
            group = dist.new_group(ranks=members)
            if rank in members:
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


class LossPassesThrough:
    """The last chunk computes the loss itself; the schedule's loss function hands it on,
    multiplied by fp16's loss scale (1 otherwise) and, where the loss is a mean over counted
    targets (``graph/loss.py``), by the micro-batch's share of the global batch's count
    (``counted * dp * micro_batches / total``: its micro-batch is the one ``target`` holds, in
    whatever order the schedule runs them). Under uneven dp shares without a token mean, by
    ``dp * micro_batches / sum(shares)`` (the replica's share of the global batch); and under
    uneven shares, divided by the replica's micro-batches (``per_loss``): torch's schedule
    would divide the gradients by them after DDP or FSDP averaged them over replicas of other
    counts, so the schedule scales nothing there and the loss carries the division."""

    def __init__(self, token_loss: TokenMeanLoss | None = None) -> None:
        self.scale = 1.0
        self.token_loss = token_loss
        self.shares = 0                  # dp * micro-batches
        self.total = 0                   # the global batch's count (0: no weighting)
        self.replica = 1.0               # uneven dp shares: dp * micro-batches / sum(shares)
        self.per_loss = 1                # uneven dp shares: the replica's micro-batches

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        f = self.scale
        if self.total:                   # integers first: exactly 1 for equal counts
            f *= self.token_loss.counted(target) * self.shares / self.total
        else:
            f *= self.replica
        f /= self.per_loss
        return output * f if f != 1.0 else output

    def weigh(self, global_targets: torch.Tensor, dp: int, micro_batches: int,
              dp_shares: tuple[int, ...] | None = None) -> None:
        """Set the step's count (before the schedule runs it). ``micro_batches``: this
        replica's; ``dp_shares``: every replica's, where they differ."""
        self.shares = dp * micro_batches
        self.total = self.token_loss.counted(global_targets) if self.token_loss else 0
        self.replica = 1.0 if dp_shares is None else dp * micro_batches / sum(dp_shares)
        self.per_loss = 1 if dp_shares is None else micro_batches


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


def shared_elsewhere(held: list[list[str]], cfg: Any, pp_index: int,
                      canonical: dict[str, str], aliases: dict[str, tuple[str, ...]]
                      ) -> frozenset[str]:
    """Checkpoint names of the weights this rank holds that a lower pipeline rank holds too
    (counted once in the global gradient norm: there)."""
    first: dict[str, int] = {}
    mine: set[str] = set()
    for c, names in enumerate(held):
        for f in names:
            key = canonical.get(f, f)
            first[key] = min(first.get(key, cfg.pp), cfg.chunk_rank(c))
            if cfg.chunk_rank(c) == pp_index:
                mine.add(key)
    return frozenset(canonical_name(k, aliases) for k in mine if first[k] < pp_index)



def metas(nodes: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """Meta tensors standing for what program nodes carry (recorded by the shape check)."""
    out = []
    for n in nodes:
        shape, dtype, grad = n.meta[VAL]
        t = torch.empty(shape, dtype=dtype, device="meta")
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return tuple(out)
