"""Per-micro-batch costs of op ranges, layers and pipeline chunks under one sharding.

A range's cost: compute time of every op (profile or roofline, scaled to the micro-batch and
the op's tensor-parallel shard), the recomputation its policy adds to the backward, the
tensor-parallel collectives it issues (exposed: each one blocks the op after it), the
activations it keeps for backward, and the parameters it reads. Layers of one block cost the
same, so a unit's cost is that of the range standing for it (``Unit.like``), computed once per
(sharding, micro-batch, policy) and kept on the graph.
"""

from __future__ import annotations

import bisect

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.graph.analysis import GraphAnalysis
from autoplan.cost.compute import ComputeModel
from autoplan.cost.dtypes import HeldBytes, held_bytes, own_sizes
from autoplan.cost.float8 import backward_buffer_bytes
from autoplan.cost.memory import (GRAD_BYTES, PRECISION_BYTES, activation_parts, held_meta_bytes,
                                  meta_bytes, shared_inputs, working_set_bytes)
from autoplan.estimate.activation_offload import ChunkOffload, chunk_offload
from autoplan.estimate.held_params import experts_of, held_elements, repeated_params
from autoplan.estimate.overlap import overlap_exposed_s, overlap_interference
from autoplan.estimate.partition import Chunk
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.oprules import OPS_POLICY_SAVES
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.placement import REPLICATE
from autoplan.sharding.ring_work import tp_work_share
from autoplan.sharding.context_axis import ContextAxis, share_at
from autoplan.sharding.doc_work import PackedWork, attention_share
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategy import OpStrategy, divided_split


@dataclass(frozen=True)
class CostInputs:
    """What every range cost reads: one model, sharding, device model and configuration."""

    graph: OpGraph
    analysis: GraphAnalysis
    sharding: Sharding
    compute: ComputeModel
    cluster: Any
    config: ParallelConfig
    # expert parallelism: the busiest rank's routed rows over the balanced share (a router
    # with capacity factor c sends an expert at most c times its share, Fedus et al. 2021)
    expert_load: float = 1.0
    # context parallelism on an axis of its own (config.cp > 1): the sequence split over it
    context: ContextAxis | None = None
    # packed documents behind a document mask (``--seq-lengths``): attention's work is theirs
    documents: PackedWork | None = None

    @property
    def batch_scale(self) -> float:
        return self.config.micro_batch_size / self.graph.batch_size

    @property
    def held(self) -> HeldBytes | None:
        """The dtypes the runtime holds activations in (autocast), None for ``precision``."""
        return held_bytes(self.graph, self.config.precision, self.config.mixed_precision,
                          self.cluster.device.kind)


@dataclass(frozen=True)
class RangeCost:
    """Costs of one contiguous op range for one micro-batch (a layer, a chunk, ...)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_step_s: float              # once per step: tp-axis gradient all-reduces (replicated weights)
    activation_bytes: float
    working_set_bytes: float
    params: float                 # parameters per device (after TP sharding)
    param_tensors: int            # parameter tensors (an optimizer's per-tensor costs)
    num_layers: int = 0
    boundary_bytes: float = 0.0   # chunks: activation sent to the next chunk per micro-batch
    layer_params: float = 0.0     # chunks: of ``params``, those inside its layers
    ep_fwd_s: float = 0.0         # expert parallelism: the routed rows' all-to-all exchanges
    ep_bwd_s: float = 0.0
    expert_params: float = 0.0    # of ``params``, expert weights' slabs (their grads: over edp)
    cp_s: float = 0.0             # of ``tp_fwd_s + tp_bwd_s``, ring attention's exposed passes
    # of ``activation_bytes``, tensors made outside the layers and kept by several (a mask):
    # a chunk holds each once (``_chunk_cost``)
    shared_acts: tuple[tuple[str, float], ...] = ()
    # of ``activation_bytes``, the range's inputs it keeps (made before it; shared ones aside):
    # a chunk's received input, which the pipeline schedule holds anyway (``activation_offload``)
    input_acts: tuple[tuple[str, float], ...] = ()
    # of ``params``: (FQN, elements held) per parameter storage (``ParallelConfig.dp_whole``
    # picks some by name)
    param_elements: tuple[tuple[str, float], ...] = ()
    # chunks: the layers whose saved activations go to host memory (``activation_offload``):
    # ``activation_bytes`` is net of them, ``*_total_s`` include their exposed copies
    offload: ChunkOffload = ChunkOffload()

    def elements_of(self, keep: Any) -> float:
        """Of ``params``, the elements of the parameters whose FQN ``keep`` accepts."""
        return sum(n for fqn, n in self.param_elements if keep(fqn))

    @property
    def fwd_total_s(self) -> float:
        return self.fwd_s + self.tp_fwd_s + self.ep_fwd_s + self.offload.fwd_exposed_s

    @property
    def bwd_total_s(self) -> float:
        return (self.bwd_s + self.tp_bwd_s + self.recompute_s + self.ep_bwd_s
                + self.offload.bwd_exposed_s)

    @property
    def time_s(self) -> float:
        return self.fwd_total_s + self.bwd_total_s


def _work_scale(a: GraphAnalysis, graph: OpGraph, sh: Sharding, i: int,
                batch_scale: float, context: ContextAxis | None = None,
                documents: PackedWork | None = None) -> float:
    """Work of op ``i`` relative to its traced work: the micro-batch, then its tp shard (and
    its cp shard), attention under packed ``documents`` at its slowest rank's masked share."""
    batch_dep = any(o in a.batch_dependent for o in graph.ops[i].outputs)
    return (batch_scale if batch_dep else 1.0) * shard_share(graph, sh.op_strategy[i], i,
                                                             context, documents)


def shard_share(graph: OpGraph, s: OpStrategy, i: int, context: ContextAxis | None,
                documents: PackedWork | None) -> float:
    """The share of op ``i``'s traced work (one micro-batch) its slowest rank does under tp
    strategy ``s`` and the cp axis ``context``: attention under packed ``documents`` at its
    ring's expected slowest share (``doc_work``), divided by the heads tp splits."""
    ring = s.work_divisor if s.kernel == "ring_attention" else 1
    docs = attention_share(graph, i, documents, context.c if context is not None else 1,
                           context.layout if context is not None else "", ring)
    if docs is not None:
        return docs / (s.work_divisor // ring)
    cp = context.op_scale(i) if context is not None else 1.0
    return cp * tp_work_share(graph, i, s.kernel, s.work_divisor)


def op_work(ci: CostInputs, i: int) -> tuple[float, tuple[str, int]]:
    """Op ``i``'s work on one rank relative to its traced work, and the product side its tp
    strategy divides (``ComputeModel.op_cost``'s arguments; expert load left out)."""
    return (_work_scale(ci.analysis, ci.graph, ci.sharding, i, ci.batch_scale, ci.context,
                        ci.documents),
            divided_split(ci.graph, ci.graph.ops[i], ci.sharding.op_strategy[i]))


def comm_bytes(graph: OpGraph, a: GraphAnalysis, precision: str, value: str, scale: float,
               t: int, batch_scale: float, phase: str = "fwd", grad_shard: int = 1,
               kind: str = "", held: float = 1.0, sizes: Mapping[str, int] | None = None
               ) -> float:
    """Bytes of one tp-axis collective ``kind`` on ``value`` (``scale`` < 0: one tp shard of
    it), as the estimate, the sharding ILP and the runtime's collective count all take them: an
    activation at its micro-batch share, in the dtype autocast computes it in (``sizes``: bytes
    per element by value, ``HeldBytes.own``; its gradient has its dtype), else the precision's;
    a weight's gradient in fp32, as the runtime reduces gradients, and once per step (``phase``
    "step") of ZeRO-2/3's ``grad_shard``-way shard; a weight gathered again in backward
    (``all_gather``) in the training precision. ``held``: the share of the value the other axis
    leaves this rank (a cp axis's sequence piece)."""
    v = graph.value(value)
    nbytes = (meta_bytes(v.meta, precision) if v.kind == "param"
              else held_meta_bytes(value, v.meta, precision, sizes)) * held
    if value in a.batch_dependent:
        nbytes *= batch_scale
    nbytes *= 1.0 / t if scale < 0 else scale
    if phase == "step" or phase == "bwd" and v.kind == "param" and kind != "all_gather":
        nbytes *= GRAD_BYTES / PRECISION_BYTES[precision]
    if phase == "step":
        nbytes /= grad_shard
    return nbytes


def tp_comm_s(ci: CostInputs, start: int, stop: int) -> tuple[float, float, float, float]:
    """(forward, backward, per-step, ring) seconds of tp-axis collectives issued by
    ops[start:stop]: the strategies' own collectives and the reshards between producers and
    consumers, and those of a cp axis (``ci.context``); ``ring``: of forward + backward, what
    ring attention's passes leave exposed, and the cp axis's other traffic."""
    sh, graph, a, config, cx = ci.sharding, ci.graph, ci.analysis, ci.config, ci.context
    if sh.t == 1 and cx is None:
        return 0.0, 0.0, 0.0, 0.0
    t = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
    # ZeRO-2/3: the gradient is already sharded over dp when the tp step all-reduces it
    shard = config.shard_degree if config.zero_stage >= 2 else 1
    ring: dict[int, dict[str, float]] = {}
    own = own_sizes(ci.held)      # activations' autocast dtypes

    def held(i: int, name: str) -> float:
        return cx.held_scale(i, name) if cx is not None else 1.0
    # (axis, its sharding, group, the share of each value the other axis leaves a rank)
    axes = []
    if sh.t > 1:
        axes.append((sh, config.tp_group(), held))
    if cx is not None:
        # the cp axis: its ring passes and any reshard, at the tp piece of each value;
        # weights' gradients go with the dp x cp average (``dp_terms``), not here
        axes.append((cx.sharding, config.cp_group(),
                     lambda i, name: share_at(graph.ops[i], sh.op_strategy[i], name, sh.t)
                     or 1.0))
    ring_s = 0.0                  # ring passes and the rest of the cp axis's traffic
    for ax, group, share in axes:
        on_cp = ax is not sh
        for i, c in ax.comms(start, stop):
            if on_cp and c.phase == "step":
                continue
            nbytes = comm_bytes(graph, a, config.precision, c.value, c.scale, ax.t,
                                ci.batch_scale, c.phase, shard, c.kind, share(i, c.value), own)
            s = ci.cluster.collective_time_s(c.kind, nbytes, group)
            if ax.op_strategy[i].kernel == "ring_attention":
                ring.setdefault(i, {"fwd": 0.0, "bwd": 0.0})[c.phase] += s
            else:
                t[c.phase] += s
                ring_s += s if on_cp and c.phase != "step" else 0.0
        for r in ax.reshards_in(start, stop):
            nbytes = comm_bytes(graph, a, config.precision, r.value, r.scale, ax.t,
                                ci.batch_scale, r.phase, held=share(r.op_index, r.value),
                                sizes=own)
            s = ci.cluster.collective_time_s(r.kind, nbytes, group)
            t[r.phase] += s
            ring_s += s if on_cp else 0.0
    for i, parts in ring.items():
        # ring attention passes each block on while the previous one computes: only what
        # the attention's own compute does not cover is exposed
        c = ci.compute.op_cost(i, _work_scale(a, graph, sh, i, ci.batch_scale, cx,
                                              ci.documents),
                               divided_split(graph, graph.ops[i], sh.op_strategy[i]))
        x = overlap_interference(ci.cluster)
        exposed = (overlap_exposed_s(parts["fwd"], c.fwd_s, 0.0, x),
                   overlap_exposed_s(parts["bwd"], c.bwd_s, 0.0, x))
        t["fwd"] += exposed[0]
        t["bwd"] += exposed[1]
        ring_s += sum(exposed)
    return t["fwd"], t["bwd"], t["step"], ring_s


def ep_comm_s(ci: CostInputs, start: int, stop: int) -> tuple[float, float]:
    """(forward, backward) seconds of the expert-parallel exchanges of ops[start:stop], where
    ``sharding/expert_regions.py`` puts them (as the runtime runs them): each dispatch sends a
    value's rows all-to-all to their experts' ranks (after an all-gather of the per-expert row
    counts), each combine brings a dispatched value's rows home; the backward sends the rows'
    gradients the same ways. Rows move at their tp-local size, and the busiest rank's at
    ``expert_load`` times the balanced share (1: every rank receives as many rows as it
    sends)."""
    config = ci.config
    regions = expert_regions(ci.graph, ci.sharding) if config.ep > 1 else None
    if regions is None:
        return 0.0, 0.0
    graph, sh, a = ci.graph, ci.sharding, ci.analysis
    group = config.ep_group()
    experts = find_experts(graph).num_experts
    own = own_sizes(ci.held)      # rows in autocast's dtype

    def a2a(value: str, p: Any) -> float:
        b = held_meta_bytes(value, graph.value(value).meta, config.precision, own)
        if value in a.batch_dependent:
            b *= ci.batch_scale
        return ci.cluster.collective_time_s(
            "all_to_all", ci.expert_load * b / (sh.t if p.kind == "S" else 1), group)
    fwd = bwd = 0.0
    seen = set()
    for i, x in regions.dispatch:
        p = sh.op_strategy[i].inputs[0]
        if start <= i < stop and (x, str(p)) not in seen:
            seen.add((x, str(p)))
            t = a2a(x, p)
            fwd += t + ci.cluster.collective_time_s("all_gather", 8.0 * experts * config.ep,
                                                    group)
            bwd += t
    for v in regions.combine:
        if start <= a.producer[v] < stop:
            t = a2a(v, sh.placement_of(graph, v))
            fwd += t
            bwd += t
    return fwd, bwd


def cached_on_graph(ci: CostInputs, what: str, where: tuple, make: Any) -> Any:
    """``make()``, kept on the graph under ``where`` and every input a range's cost reads: the
    sharding, device model, cluster and packed-documents objects, and the config fields used
    (ZeRO-2/3 shard the tp step's gradient over dp; autocast's dtypes set what is kept)."""
    cache = ci.graph.__dict__.setdefault(what, {})
    key = (_inputs_key(ci), where)
    hit = cache.get(key)
    if (hit is not None and hit[0] is ci.sharding and hit[1] is ci.compute
            and hit[2] is ci.cluster and hit[3] is ci.documents):
        return hit[4]
    cost = make()
    if len(cache) > 16384:
        cache.clear()
    cache[key] = (ci.sharding, ci.compute, ci.cluster, ci.documents, cost)
    return cost


def _inputs_key(ci: CostInputs) -> tuple:
    """The part of ``cached_on_graph``'s key that ``ci`` sets, worked out once per ``ci``
    (kept on it beside its fields: a range's cost is looked up for every layer)."""
    key = ci.__dict__.get("_autoplan_inputs_key")
    if key is None:
        cfg = ci.config
        key = (id(ci.sharding), id(ci.compute), id(ci.cluster), cfg.micro_batch_size,
               cfg.precision, cfg.mixed_precision, cfg.tp, cfg.tp_comm_overlap,
               cfg.shard_degree if cfg.zero_stage >= 2 else 1, cfg.ep, ci.expert_load, cfg.cp,
               cfg.cp_layout, cfg.offload_activations, cfg.layer_offload, id(ci.documents))
        object.__setattr__(ci, "_autoplan_inputs_key", key)
    return key


def range_cost(ci: CostInputs, start: int, stop: int, policy: str) -> RangeCost:
    """Costs of ops[start:stop] under recompute ``policy`` (cached on the graph)."""
    return cached_on_graph(ci, "_autoplan_range_costs", (start, stop, policy),
                           lambda: _range_cost(ci, start, stop, policy))


def replays(policy: str, kind: str, in_scores: bool) -> bool:
    """Whether recompute ``policy`` runs an op of ``kind`` (``in_scores``: inside an attention
    score region, ``analysis.score_ops``) forward again in backward: every op under ``full``,
    the score region under ``selective``, all but the products under ``ops``
    (``oprules.OPS_POLICY_SAVES``)."""
    return (policy == "full" or policy == "selective" and in_scores
            or policy == "ops" and kind not in OPS_POLICY_SAVES)


def _loaded(ci: CostInputs) -> Any:
    """Under expert parallelism with unbalanced routing (``expert_load`` > 1), the regions whose
    work and activations grow with the busiest rank's rows; None otherwise."""
    if ci.config.ep == 1 or ci.expert_load == 1.0:
        return None
    return expert_regions(ci.graph, ci.sharding)


def _range_cost(ci: CostInputs, start: int, stop: int, policy: str) -> RangeCost:
    graph, a, sh, config = ci.graph, ci.analysis, ci.sharding, ci.config
    mbs = config.micro_batch_size
    fwd = bwd = recompute = gemm_fwd = gemm_bwd = 0.0
    loaded = _loaded(ci)
    for i in range(start, stop):
        load = ci.expert_load if loaded is not None and i in loaded.members else 1.0
        scale = load * _work_scale(a, graph, sh, i, ci.batch_scale, ci.context, ci.documents)
        split = divided_split(graph, graph.ops[i], sh.op_strategy[i])
        c = ci.compute.op_cost(i, scale, split)
        op_fwd, op_bwd = c.fwd_s, c.bwd_s
        if config.tp_comm_overlap and graph.ops[i].kind == "matmul":
            fwd_chunks, dgrad_chunks = overlap_chunks(sh.op_strategy[i].name, sh.t)
            slow_fwd, slow_bwd = ci.compute.chunked_slowdown(i, scale, split, fwd_chunks,
                                                             dgrad_chunks)
            op_fwd, op_bwd = op_fwd * slow_fwd, op_bwd * slow_bwd
        fwd += op_fwd
        bwd += op_bwd
        if graph.ops[i].kind == "matmul":
            gemm_fwd += op_fwd
            gemm_bwd += op_bwd
        if replays(policy, graph.ops[i].kind, i in a.score_ops):
            recompute += op_fwd
    tp_fwd, tp_bwd, tp_step, ring_s = tp_comm_s(ci, start, stop)
    ring_share = ring_s / (tp_fwd + tp_bwd) if ring_s > 0 else 0.0
    if config.tp_comm_overlap:
        # each collective in t ring steps, every step but the first beside a GEMM chunk
        # (Megatron-LM's --tp-comm-overlap; Wang et al. 2023, "Overlap Communication with
        # Dependent Computation via Decomposition")
        x = overlap_interference(ci.cluster)
        tp_fwd = overlap_exposed_s(tp_fwd, gemm_fwd, tp_fwd / sh.t, x)
        tp_bwd = overlap_exposed_s(tp_bwd, gemm_bwd, tp_bwd / sh.t, x)
    cp_s = ring_share * (tp_fwd + tp_bwd)
    if policy in ("full", "ops"):     # the forward's collectives run again too
        recompute += tp_fwd
    kept = activation_parts(graph, start, stop, micro_batch_size=mbs, sharding=sh,
                            recompute=policy, precision=config.precision, context=ci.context,
                            held=ci.held)
    if loaded is not None:           # the busiest rank keeps its extra rows' activations
        kept = {n: b * (ci.expert_load if n in loaded.inside else 1.0) for n, b in kept.items()}
    acts = sum(kept.values())
    shared = shared_inputs(graph)
    shared_acts = tuple((n, b) for n, b in sorted(kept.items()) if n in shared)
    input_acts = tuple((n, b) for n, b in sorted(kept.items())
                       if n not in shared and a.producer.get(n, -1) < start)
    working = (working_set_bytes(graph, start, stop, micro_batch_size=mbs, sharding=sh,
                                 precision=config.precision, context=ci.context,
                                 held=ci.held)
               if policy in ("full", "ops") else 0.0)
    # a weight stored split and gathered for its product is whole while the product runs, and
    # again in backward with its whole gradient before the reduce-scatter: the largest one
    working += max((_gathered_bytes(graph, sh, i, config.precision)
                    for i in range(start, stop)), default=0.0)
    # an fp8 linear's backward holds its fp8 operand copies (``cost/float8.py``): the largest
    working += max((backward_buffer_bytes(ci.compute.product_sides(i, *op_work(ci, i)),
                                          compiled=config.compiled)
                    for i in range(start, stop) if i in ci.compute.fp8_ops), default=0.0)
    # parameters the range reads, each storage once (a tied weight on two stages is held by
    # both, as Megatron-LM does with the embedding and the LM head)
    params = expert = 0.0
    seen: set[str] = set()
    found = experts_of(ci)
    elements = []
    for i in range(start, stop):
        for n in graph.ops[i].inputs:
            v = graph.value(n)
            if v.kind == "param" and v.base not in seen:
                seen.add(v.base)
                held, is_expert = held_elements(ci, i, n, found)
                expert += held if is_expert else 0.0
                params += held
                elements.append((graph.value(v.base).fqn, held))
    ep_fwd, ep_bwd = ep_comm_s(ci, start, stop)
    return RangeCost(fwd, bwd, recompute, tp_fwd, tp_bwd, tp_step, acts, working, params,
                     len(seen), ep_fwd_s=ep_fwd, ep_bwd_s=ep_bwd, expert_params=expert,
                     cp_s=cp_s, shared_acts=shared_acts, param_elements=tuple(elements),
                     input_acts=input_acts)


# Transformer Engine's default pipelining of the sequence-parallel collectives with their GEMMs
# (Megatron-LM's --tp-comm-overlap; transformer_engine/pytorch/module/base.py, initialize_ub):
# an all-gather's GEMM (column-parallel forward, row-parallel input gradient) runs in t row
# chunks, one per ring step ("ring_exchange"); a reduce-scatter's GEMM (row-parallel forward)
# in 4 ("pipeline", num_splits=4); the column-parallel input gradient and the weight gradients
# overlap whole ("bulk").
_PIPELINE_SPLITS = 4


def overlap_chunks(strategy: str, t: int) -> tuple[int, int]:
    """(forward, input-gradient) row chunks a product of ``strategy`` runs in under
    tensor-parallel comm overlap on ``t`` ranks (Transformer Engine's defaults, above)."""
    if strategy.startswith("colwise_sp"):
        return t, 1
    if strategy == "rowwise_sp":
        return _PIPELINE_SPLITS, t
    return 1, 1


def chunk_parts(chunk: Chunk) -> list[tuple[int, int, bool]]:
    """The chunk's op ranges in order: (start, stop, is_layer); the ops between and around its
    layers keep their activations (no recomputation)."""
    parts: list[tuple[int, int, bool]] = []
    pos = chunk.start
    for (s, e) in chunk.layer_ranges:
        if pos < s:
            parts.append((pos, s, False))
        parts.append((s, e, True))
        pos = e
    if pos < chunk.stop:
        parts.append((pos, chunk.stop, False))
    return parts


def _gathered_bytes(graph: OpGraph, sh: Sharding, i: int, precision: str) -> float:
    """Bytes of the whole weight op ``i`` gathers for its product (``gathered_weight``
    strategies: the runtime's ``kernels.gathered_weight``) and of its whole gradient."""
    s = sh.op_strategy[i]
    if s.kernel != "gathered_weight":
        return 0.0
    op = graph.ops[i]
    whole = [graph.value(op.inputs[k]).meta.numel for k in s.gathered_inputs()]
    return max(whole, default=0) * (PRECISION_BYTES[precision] + GRAD_BYTES)


def chunk_cost(ci: CostInputs, chunk: Chunk, policy: str | tuple[str, ...],
               offload: tuple[bool, ...] | None = None) -> RangeCost:
    """Sum of the chunk's layers (under ``policy``, or one policy per layer of the chunk) and
    the ops around them (cached on the graph: configs that differ in ZeRO stage or schedule
    share their chunks). ``offload``: per layer of the chunk, whether it offloads its saved
    activations (``ParallelConfig.layer_offload``); None: the first
    ``offload_activations``."""
    return cached_on_graph(ci, "_autoplan_chunk_costs",
                           (chunk.start, chunk.stop, chunk.layer_ranges, policy, offload),
                           lambda: _chunk_cost(ci, chunk, policy, offload))


def _chunk_cost(ci: CostInputs, chunk: Chunk, policy: str | tuple[str, ...],
                offload: tuple[bool, ...] | None) -> RangeCost:
    like = {(u.start, u.stop): u.like for u in chunk.units}
    spans = chunk_parts(chunk)
    count = len(chunk.layer_ranges)
    layer_policies = (policy,) * count if isinstance(policy, str) else tuple(policy)
    policies = iter(layer_policies)
    parts = [range_cost(ci, *like.get((s, e), (s, e)), next(policies)) if is_layer
             else range_cost(ci, s, e, "none")
             for s, e, is_layer in spans]
    # a tensor several layers keep (a mask made once) is held once: as its first keeper has it
    shared: dict[str, list[float]] = {}
    for p in parts:
        for n, b in p.shared_acts:
            shared.setdefault(n, []).append(b)
    twice = sum(sum(bs) - bs[0] for bs in shared.values())
    if offload is None:
        offload = tuple(k < ci.config.offload_activations for k in range(count))
    off = chunk_offload(ci.cluster, offload, chunk.layers, parts,
                        [is_layer for _, _, is_layer in spans], policies=layer_policies,
                        received=chunk.start > 0)
    # a weight two parts read (a tied embedding and LM head) is held once
    again = repeated_params(ci, [(s, e) for s, e, _ in spans])
    return RangeCost(
        fwd_s=sum(p.fwd_s for p in parts), bwd_s=sum(p.bwd_s for p in parts),
        recompute_s=sum(p.recompute_s for p in parts), tp_fwd_s=sum(p.tp_fwd_s for p in parts),
        tp_bwd_s=sum(p.tp_bwd_s for p in parts), tp_step_s=sum(p.tp_step_s for p in parts),
        activation_bytes=sum(p.activation_bytes for p in parts) - twice - off.moved_bytes,
        working_set_bytes=max((p.working_set_bytes for p in parts), default=0.0)
        + off.in_flight_bytes + tied_grad_buffer_bytes(ci.config, again.elements),
        params=sum(p.params for p in parts) - again.elements,
        param_tensors=sum(p.param_tensors for p in parts) - again.tensors,
        num_layers=len(chunk.layers), boundary_bytes=boundary_bytes(ci, chunk.stop),
        layer_params=sum(p.params for p, (_, _, is_layer) in zip(parts, spans) if is_layer),
        ep_fwd_s=sum(p.ep_fwd_s for p in parts), ep_bwd_s=sum(p.ep_bwd_s for p in parts),
        expert_params=sum(p.expert_params for p in parts) - again.experts,
        cp_s=sum(p.cp_s for p in parts), param_elements=_once(parts, again.fqns), offload=off)


def tied_grad_buffer_bytes(config: Any, elements: float) -> float:
    """The gradient a tied weight's later use (the LM head, first in backward) hands autograd,
    held until its earlier use's (the embedding, last in backward) is added to it: one more
    gradient of the weight through the whole backward, in the weight's dtype (fp32 under
    autocast). Measured on one H100 (gpt3-1.3b, ``test_autocast_memory``): counting the tied
    weight once without this buffer under-predicted the peak by 2.3 %."""
    if config.mixed_precision == "autocast" or config.precision == "fp32":
        return elements * GRAD_BYTES
    return elements * PRECISION_BYTES[config.precision]


def _once(parts: Sequence[RangeCost], fqns: frozenset[str]) -> tuple[tuple[str, float], ...]:
    """The parts' (FQN, elements held) per parameter storage, those of ``fqns`` (read by two
    parts) once."""
    seen: set[str] = set()
    out = []
    for p in parts:
        for fqn, held in p.param_elements:
            if fqn in fqns and fqn in seen:
                continue
            seen.add(fqn)
            out.append((fqn, held))
    return tuple(out)


def boundary_bytes(ci: CostInputs, cut: int) -> float:
    """Bytes of the activations produced before op ``cut`` and read at or after it (what a stage
    sends to the next per micro-batch)."""
    total = 0.0
    own = own_sizes(ci.held)
    for n in boundary_values(ci.graph, cut):
        v = ci.graph.value(n)
        b = held_meta_bytes(n, v.meta, ci.config.precision, own) * (
            ci.batch_scale if n in ci.analysis.batch_dependent else 1)
        if ci.context is not None:
            b *= ci.context.value_scale(n)
        if ci.sharding.value_placement.get(n, REPLICATE).kind == "S":
            b /= ci.sharding.t
        total += b
    return total


def boundary_values(graph: OpGraph, cut: int) -> list[str]:
    """Values crossing op ``cut``, computed once per cut and kept on the graph."""
    cache = graph.__dict__.setdefault("_autoplan_boundaries", {})
    if cut not in cache:
        cache[cut] = _crossing(graph, cut)
    return cache[cut]


def _crossing(graph: OpGraph, cut: int) -> list[str]:
    """The bases of the float values an op before ``cut`` makes and one at or after it reads,
    in the order those reads come (op, then input slot), each base once."""
    if cut >= len(graph.ops):
        return []
    found = []
    for made, reads, n in _lifetimes(graph):
        if made < cut <= reads[-1][0]:
            found.append((reads[bisect.bisect_left(reads, (cut, -1))], n))
    crossing = []
    seen = set()
    for _, n in sorted(found):
        base = graph.value(n).base
        if base not in seen:
            seen.add(base)
            crossing.append(base)
    return crossing


def _lifetimes(graph: OpGraph) -> list[tuple[int, list[tuple[int, int]], str]]:
    """Per float value an op makes and another reads: the op that makes it, the (op, input
    slot) of every read, ascending, and its name; kept on the graph (every cut asks)."""
    found = graph.__dict__.get("_autoplan_lifetimes")
    if found is None:
        made: dict[str, int] = {}
        reads: dict[str, list[tuple[int, int]]] = {}
        for i, op in enumerate(graph.ops):
            for k, n in enumerate(op.inputs):
                if n in made:
                    reads.setdefault(n, []).append((i, k))
            for n in op.outputs:
                made.setdefault(n, i)
        found = graph.__dict__["_autoplan_lifetimes"] = [
            (made[n], r, n) for n, r in reads.items() if graph.value(n).meta.is_float]
    return found


def unit_costs(ci: CostInputs, units: Sequence[Any], policy: str) -> list[RangeCost]:
    """Per unit (``partition.Unit``), its cost under ``policy`` (the list kept on the graph
    as ``range_cost`` keeps each, for the same ``units`` object: every pipelined config the
    search lays out asks for all of them)."""
    def make() -> tuple[Sequence[Any], list[RangeCost]]:
        return units, [range_cost(ci, *u.like, policy) for u in units]
    kept, costs = cached_on_graph(ci, "_autoplan_unit_costs", (policy, id(units)), make)
    return costs if kept is units else make()[1]
