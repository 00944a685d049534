"""What one strategy of one ILP node costs: seconds per step, bytes per device, and the
forward and backward seconds and kept activation bytes per micro-batch, for all the block
instances the node stands for (``problem.reduce_graph`` tabulates them).

Each op of the node adds, in this order (the estimate's: float sums depend on it):
its compute (and the forward again where the recompute policy replays it), its collectives
(ring attention's passed on behind the attention it rides), the experts' exchanges, its
parameters' state, and the activations it keeps; then the gathers the node makes inside
itself where a follower cannot carry the leader's sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autoplan.cost.compute import OpCost
from autoplan.cost.dtypes import own_sizes
from autoplan.cost.memory import internal_anchor, meta_bytes
from autoplan.estimate.chunk_cost import replays
from autoplan.estimate.cost_inputs import shard_share
from autoplan.estimate.range_comm import comm_bytes
from autoplan.estimate.overlap import overlap_exposed_s
from autoplan.estimate.partition import priced_ops
from autoplan.graph.analysis import GraphAnalysis, analyze
from autoplan.planner.axis_costs import cp_comms_s, cp_held, exchange_s, value_bytes
from autoplan.planner.cost_context import CostContext
from autoplan.planner.folding import Node
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import mutates_input, reshard_kind
from autoplan.sharding.strategies import OpStrategy
from autoplan.sharding.strategy import divided_split

# Choices that cannot run cost this much: an in-place op whose input would be resharded first
# (the write would land on a copy), a tied weight laid out two ways.
INFEASIBLE_S = 1.0e6

# per (part, value): the op that counts the kept value (part -1: held once for the chunk),
# and per op its part (``kept_activations.activation_owners``)
Savers = dict[tuple[int, str], int]


@dataclass(frozen=True)
class NodeCost:
    """One strategy of one node, for all the instances it stands for."""

    time_s: float           # seconds per step
    memory_bytes: float     # bytes per device: parameters' state and kept activations
    fwd_s: float            # forward seconds per micro-batch
    bwd_s: float            # backward seconds per micro-batch (recomputation included)
    act_bytes: float        # activation bytes kept per micro-batch
    # per instance, the (forward, backward) seconds per micro-batch it costs beyond an even
    # share of fwd_s and bwd_s (empty: its instances cost alike; ``_add_compute``)
    instance_extra: tuple[tuple[float, float], ...] = ()


@dataclass
class _Tally:
    """Running sums of one strategy's terms over the node's ops (mutable: each step adds)."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_comm_s: float = 0.0     # forward collectives: replayed in backward under full remat
    step_s: float = 0.0
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    once_bytes: float = 0.0     # tensors several layers keep, held once
    # per instance, its (forward, backward) seconds beyond the mean (``_add_compute``)
    extra: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class _Choice:
    """Strategy ``j`` of ``node`` being costed, and what its steps read besides."""

    ctx: CostContext
    analysis: GraphAnalysis
    node: Node
    j: int
    savers: Savers
    part_of: list[int]

    @property
    def placement(self) -> dict[str, Placement]:
        return self.node.placement[self.j]


def collective_bytes(ctx: CostContext, name: str, scale: float, phase: str, kind: str = "",
                     held: float = 1.0) -> float:
    """Bytes of one collective, as the estimate takes them (``range_comm.comm_bytes``)."""
    return comm_bytes(ctx.graph, analyze(ctx.graph), ctx.precision, name, scale, ctx.t,
                      ctx.batch_scale, phase, ctx.step_shard if phase == "step" else 1, kind,
                      held, own_sizes(ctx.held))


def reshard_s(ctx: CostContext, name: str, src: Placement, dst: Placement, consumer: int = -1
              ) -> tuple[float, float]:
    """(forward, backward): the forward reshard, and the backward one for tensors that carry
    gradients (into op ``consumer``: the piece of ``name`` the cp axis leaves it)."""
    held = cp_held(ctx, consumer, name) if consumer >= 0 else 1.0
    out = [0.0, 0.0]
    for p, (a, b, needed) in enumerate(((src, dst, True),
                                        (dst, src, ctx.graph.value(name).requires_grad))):
        if not needed:
            continue
        k = reshard_kind(a, b)
        if k is not None:
            kind, scale = k
            out[p] = ctx.collective_s(kind, collective_bytes(ctx, name, scale, "fwd", held=held))
    return out[0], out[1]


def recomputes_comms(ctx: CostContext, node: Node) -> bool:
    """Full recomputation replays a layer's forward collectives too (``chunk_cost``)."""
    return ctx.recompute in ("full", "ops") and node.mult > 1


def _recomputed(ctx: CostContext, a: GraphAnalysis, node: Node, i: int) -> bool:
    """Whether the policy replays op ``i``'s forward in backward (and so keeps nothing of it):
    every op of a layer under full recomputation, the attention scores under selective, all
    but the products of a layer under ops (``chunk_cost.replays``)."""
    if node.mult == 1 and ctx.recompute in ("full", "ops"):
        return False
    return replays(ctx.recompute, ctx.graph.ops[i].kind, i in a.score_ops)


def node_cost(ctx: CostContext, node: Node, j: int, savers: Savers, part_of: list[int]
              ) -> NodeCost:
    """What strategy ``j`` of ``node`` costs, for all the instances it stands for."""
    a = analyze(ctx.graph)
    choice = _Choice(ctx, a, node, j, savers, part_of)
    tally = _Tally()
    seen_params: set[str] = set()
    for i, s, copies in zip(node.ops, node.choices[j], node.copies):
        compute = _add_compute(choice, tally, i, s, copies)
        _add_collectives(ctx, tally, i, s, compute)
        if ctx.experts is not None:
            ef, eb = exchange_s(ctx, i, s, choice.placement)
            tally.fwd_s, tally.bwd_s = tally.fwd_s + ef, tally.bwd_s + eb
        _add_params(ctx, tally, i, s, seen_params)
        if not _recomputed(ctx, a, node, i):
            _add_saved_values(choice, tally, i, s)
            _add_saved_internal(choice, tally, i, s)
    _add_internal_gathers(choice, tally)
    if recomputes_comms(ctx, node):
        tally.bwd_s += tally.fwd_comm_s
    fwd = tally.fwd_s + tally.fwd_comm_s
    bwd = tally.bwd_s
    time_s = node.mult * (ctx.microbatches * (fwd + bwd) + tally.step_s)
    mem = node.mult * (tally.param_bytes + tally.act_bytes * ctx.activation_multiplier) \
        + tally.once_bytes
    return NodeCost(time_s, mem, node.mult * fwd, node.mult * bwd,
                    node.mult * tally.act_bytes + tally.once_bytes, tuple(tally.extra))


def _add_compute(choice: _Choice, tally: _Tally, i: int, s: OpStrategy,
                 copies: tuple[int, ...]) -> OpCost:
    """Op ``i``'s kernel seconds under ``s`` (its batch, expert load and cp share), the forward
    again in backward where the policy replays it; returns the op's cost. Its instances
    (``copies``) are priced as the estimate prices them (``partition.priced_ops``): where
    they cost differently, at their mean, each instance's difference from it kept in
    ``tally.extra`` (what a pipeline rank's share of the node adds, ``problem``; a compiled
    program's first layer no longer differs: its fused chains end at every layer's edge,
    ``cost.fused.compiled_regions``). The cost
    returned is the mean: ring attention hides its passes behind it, exact while attention,
    no fused op, costs alike in every instance."""
    ctx = choice.ctx
    c = _op_seconds(choice, i, i, s)
    priced = priced_ops(ctx.graph)
    if any(priced[o] != i for o in copies):
        per = {p: _op_seconds(choice, i, p, s) for p in sorted({priced[o] for o in copies})}
        if any(x != c for x in per.values()):
            n = len(copies)
            each = [per[priced[o]] for o in copies]
            c = OpCost(fwd_s=sum(x.fwd_s for x in each) / n,
                       bwd_s=sum(x.bwd_s for x in each) / n)
            again = 1.0 if _recomputed(ctx, choice.analysis, choice.node, i) else 0.0
            if not tally.extra:
                tally.extra = [(0.0, 0.0)] * n
            tally.extra = [(f + x.fwd_s - c.fwd_s,
                            b + x.bwd_s - c.bwd_s + again * (x.fwd_s - c.fwd_s))
                           for (f, b), x in zip(tally.extra, each)]
    tally.fwd_s += c.fwd_s
    tally.bwd_s += c.bwd_s
    if _recomputed(ctx, choice.analysis, choice.node, i):
        tally.bwd_s += c.fwd_s
    return c


def _op_seconds(choice: _Choice, i: int, p: int, s: OpStrategy) -> OpCost:
    """The kernel seconds of op ``p``, an instance of node op ``i`` (or ``i`` itself), run
    under ``i``'s strategy ``s``: at its batch, expert load and cp share."""
    ctx, a = choice.ctx, choice.analysis
    graph = ctx.graph
    op = graph.ops[p]
    batch_dep = any(o in a.batch_dependent for o in op.outputs)
    load = (ctx.experts.load if ctx.experts is not None and i in ctx.experts.members
            else 1.0)
    return ctx.compute.op_cost(p, load * (ctx.batch_scale if batch_dep else 1.0)
                               * shard_share(graph, s, p, ctx.context, ctx.documents),
                               divided_split(graph, op, s))


def _add_collectives(ctx: CostContext, tally: _Tally, i: int, s: OpStrategy,
                     compute: OpCost) -> None:
    """The collectives ``s`` makes (per step, forward, backward), the cp axis's, and ring
    attention's passes, exposed only where they outlast the attention they hide behind."""
    ring = {"fwd": 0.0, "bwd": 0.0}
    for cm in s.comms:
        held = cp_held(ctx, i, cm.value) if cm.phase != "step" else 1.0
        t = ctx.collective_s(cm.kind, collective_bytes(ctx, cm.value, cm.scale, cm.phase,
                                                       cm.kind, held))
        if cm.phase == "step":
            tally.step_s += t
        elif s.kernel == "ring_attention":
            ring[cm.phase] += t
        elif cm.phase == "fwd":
            tally.fwd_comm_s += t
        else:
            tally.bwd_s += t
    cf, cb, rf, rb = cp_comms_s(ctx, i, s)
    tally.fwd_comm_s, tally.bwd_s = tally.fwd_comm_s + cf, tally.bwd_s + cb
    ring["fwd"], ring["bwd"] = ring["fwd"] + rf, ring["bwd"] + rb
    if s.kernel == "ring_attention" or rf + rb > 0:
        # passed on behind the blocks' attention, as priced
        tally.fwd_comm_s += overlap_exposed_s(ring["fwd"], compute.fwd_s, 0.0,
                                              ctx.interference)
        tally.bwd_s += overlap_exposed_s(ring["bwd"], compute.bwd_s, 0.0, ctx.interference)


def _add_params(ctx: CostContext, tally: _Tally, i: int, s: OpStrategy,
                seen: set[str]) -> None:
    """The state of the parameters op ``i`` reads first in the node, split where ``s``
    shards them."""
    graph = ctx.graph
    for k, n in enumerate(graph.ops[i].inputs):
        v = graph.value(n)
        if v.kind == "param" and v.base not in seen:
            seen.add(v.base)
            split = k < len(s.inputs) and s.inputs[k].kind == "S"
            tally.param_bytes += v.meta.numel * ctx.state_bytes_per_param / (ctx.t if split
                                                                             else 1)


def tied_state_bytes(ctx: CostContext, nodes: Sequence[Node]) -> list[list[float]]:
    """Per node and strategy, the state bytes ``node_cost`` counts for weights an earlier node
    reads too (a tied embedding and LM head): one tensor, which the problem's memory row (one
    rank's whole model) holds once, as ``chunk_cost`` does (``estimate/held_params``)."""
    graph = ctx.graph
    claimed: set[str] = set()
    out = []
    for node in nodes:
        first: dict[str, tuple[int, int, float]] = {}
        for pos, i in enumerate(node.ops):
            for k, n in enumerate(graph.ops[i].inputs):
                v = graph.value(n)
                if v.kind == "param" and v.base not in first:
                    first[v.base] = (pos, k, v.meta.numel)
        row = []
        for chosen in node.choices:
            b = 0.0
            for base, (pos, k, numel) in first.items():
                if base in claimed:
                    split = k < len(chosen[pos].inputs) and chosen[pos].inputs[k].kind == "S"
                    b += numel * ctx.state_bytes_per_param / (ctx.t if split else 1)
            row.append(node.mult * b)
        claimed.update(first)
        out.append(row)
    return out


def _add_saved_values(choice: _Choice, tally: _Tally, i: int, s: OpStrategy) -> None:
    """The values op ``i`` keeps for backward and counts (``savers``: each counted once, as
    the estimate does), split over tp and cp where they are placed so."""
    ctx, savers, part_of = choice.ctx, choice.savers, choice.part_of
    graph = ctx.graph
    op = graph.ops[i]
    counted: set[str] = set()
    copied = ctx.held.copies.get(i, frozenset()) if ctx.held is not None else frozenset()
    for n in op.saved:
        base = graph.value(graph.value(n).base)
        if base.kind == "activation" and base.name in copied:
            if ctx.recompute == "selective" and (i in choice.analysis.score_ops
                                                 or base.name in choice.analysis.score_values):
                continue           # selective recomputation drops it
            held = "copy"          # autocast's 16-bit copy, this op's own (cost.dtypes)
        elif i not in (savers.get((part_of[i], base.name)), savers.get((-1, base.name))) \
                or base.name in counted:
            continue           # dropped by the policy, or counted already
        else:
            held = "kept"
            counted.add(base.name)
        k = op.inputs.index(n) if n in op.inputs else -1
        where = s.inputs[k] if 0 <= k < len(s.inputs) else choice.placement.get(n, REPLICATE)
        b = (value_bytes(ctx, base.name, held)
             * (1.0 / ctx.t if where.kind == "S" else 1.0)
             * (cp_held(ctx, i, n) if n == base.name else
                ctx.context.value_scale(base.name) if ctx.context is not None else 1.0))
        if held == "kept" and (-1, base.name) in savers:
            tally.once_bytes += b
        else:
            tally.act_bytes += b


def _add_saved_internal(choice: _Choice, tally: _Tally, i: int, s: OpStrategy) -> None:
    """What a kernel keeps beside its outputs (softmax statistics), placed as its anchor."""
    ctx, a = choice.ctx, choice.analysis
    graph = ctx.graph
    op = graph.ops[i]
    if not op.saved_internal:
        return
    anchor, on_input = internal_anchor(graph, op)
    where = (s.inputs[op.inputs.index(anchor)] if on_input
             else choice.placement.get(anchor, REPLICATE))
    scale = ((ctx.batch_scale if anchor in a.batch_dependent else 1.0)
             * (1.0 / ctx.t if where.kind == "S" else 1.0) * cp_held(ctx, i, anchor))
    # under autocast a kernel keeps its statistics in their own dtype (as cost.memory counts)
    tally.act_bytes += sum(m.numel * m.itemsize if ctx.held is not None and m.is_float
                           else meta_bytes(m, ctx.precision) for m in op.saved_internal) * scale


def _add_internal_gathers(choice: _Choice, tally: _Tally) -> None:
    """The gathers inside the node where a follower cannot carry the leader's sharding
    (an in-place follower cannot run so: its write would land on a copy)."""
    ctx = choice.ctx
    for i, name, src, dst in choice.node.internal[choice.j]:
        if mutates_input(ctx.graph.ops[i].target):
            tally.bwd_s += INFEASIBLE_S
        else:
            rf, rb = reshard_s(ctx, name, src, dst, i)
            tally.fwd_comm_s, tally.bwd_s = tally.fwd_comm_s + rf, tally.bwd_s + rb
