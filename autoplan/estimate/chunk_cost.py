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

from collections.abc import Sequence
from typing import Any

from autoplan.cost.dtypes import own_sizes
from autoplan.cost.float8 import backward_buffer_bytes
from autoplan.cost.memory import (GRAD_BYTES, PRECISION_BYTES, activation_parts, held_meta_bytes,
                                  shared_inputs, working_set_bytes)
from autoplan.estimate.activation_offload import chunk_offload
from autoplan.estimate.cost_inputs import CostInputs, RangeCost, op_work, work_scale
from autoplan.estimate.held_params import experts_of, held_elements, repeated_params
from autoplan.estimate.overlap import overlap_exposed_s, overlap_interference
from autoplan.estimate.partition import Chunk
from autoplan.estimate.range_comm import ep_comm_s, tp_comm_s
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.oprules import OPS_POLICY_SAVES
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.placement import REPLICATE
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategy import divided_split


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
        scale = load * work_scale(a, graph, sh, i, ci.batch_scale, ci.context, ci.documents)
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
