"""What the axes beside tp add to the sharding ILP's price of a strategy, on the estimate's
terms: expert parallelism's all-to-all exchanges (``range_comm.ep_comm_s``) and the traffic of
a context-parallel axis of its own (``range_comm.tp_comm_s``: ring attention's passes at the tp
piece a strategy leaves, the cp axis's other collectives and reshards). ``problem.py`` builds
the ILP with them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from autoplan.cost.dtypes import own_sizes
from autoplan.cost.memory import held_meta_bytes
from autoplan.estimate.range_comm import comm_bytes
from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.cost_context import CostContext, ExpertExchanges
from autoplan.planner.folding import Node
from autoplan.sharding.context_axis import share_at
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import replicated
from autoplan.sharding.strategy import OpStrategy


def expert_exchanges(graph: OpGraph, a2a_s: Callable[[float], float], counts_s: float,
                     load: float = 1.0) -> ExpertExchanges | None:
    regions = expert_regions(graph, replicated(graph))
    if regions is None:
        return None
    dispatch: dict[int, tuple[str, ...]] = {}
    first: dict[str, int] = {}
    again: list[tuple[int, int, str]] = []
    for i, x in regions.dispatch:
        if x in first:
            again.append((first[x], i, x))
        else:
            first[x] = i
            dispatch[i] = dispatch.get(i, ()) + (x,)
    return ExpertExchanges(dispatch=dispatch, again=tuple(again), combine=regions.combine,
                           a2a_s=a2a_s,
                           counts_s=counts_s, load=load, members=regions.members)


def exchange_s(ctx: CostContext, i: int, s: OpStrategy, placement: Mapping[str, Placement]
                ) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the expert exchanges op ``i`` issues
    under strategy ``s``: each forward exchange sends the gradients back in backward, and each
    dispatch first gathers the row counts."""
    ex, op = ctx.experts, ctx.graph.ops[i]
    fwd = bwd = 0.0
    for x in ex.dispatch.get(i, ()):
        t = one_exchange_s(ctx, x, read_as(ctx, i, s, x))
        fwd, bwd = fwd + t + ex.counts_s, bwd + t
    for v in op.outputs:
        if v in ex.combine:
            t = one_exchange_s(ctx, v, placement.get(v, REPLICATE))
            fwd, bwd = fwd + t, bwd + t
    return fwd, bwd


def one_exchange_s(ctx: CostContext, name: str, where: Placement) -> float:
    """One exchange of ``name``'s rows placed ``where`` (one way), in the dtype autocast
    computes them in."""
    ex = ctx.experts
    b = value_bytes(ctx, name, "own") * ex.load / (ctx.t if where.kind == "S" else 1)
    return ex.a2a_s(b)


def read_as(ctx: CostContext, i: int, s: OpStrategy, x: str) -> Placement:
    k = ctx.graph.ops[i].inputs.index(x)
    return s.inputs[k] if k < len(s.inputs) else REPLICATE


def sent_again(ctx: CostContext, nodes: list[Node], node_of: dict[int, int],
                edge_mats: dict[tuple[int, int], list[list[float]]],
                costs: list[list[float]]) -> None:
    """A value two grouped products read is sent a second time when they read it placed
    differently: a term on the pair of strategies (inside a node: on its own choices)."""
    for first, other, x in ctx.experts.again:
        u, v = node_of.get(first), node_of.get(other)
        if u is None or v is None:
            continue
        pu, pv = nodes[u].ops.index(first), nodes[v].ops.index(other)
        weight = nodes[v].mult * ctx.microbatches

        def price(a: int, b: int) -> float:
            src = read_as(ctx, first, nodes[u].choices[a][pu], x)
            dst = read_as(ctx, other, nodes[v].choices[b][pv], x)
            if src == dst:
                return 0.0
            return weight * (2 * one_exchange_s(ctx, x, dst) + ctx.experts.counts_s)
        if u == v:
            for j in range(len(nodes[v].choices)):
                costs[v][j] += price(j, j)
            continue
        flip = (u, v) not in edge_mats and (v, u) in edge_mats     # one edge per pair
        key = (v, u) if flip else (u, v)
        ka, kb = len(nodes[key[0]].choices), len(nodes[key[1]].choices)
        acc = edge_mats.setdefault(key, [[0.0] * kb for _ in range(ka)])
        for a in range(ka):
            for b in range(kb):
                acc[a][b] += price(b, a) if flip else price(a, b)


def value_bytes(ctx: CostContext, name: str, held: str | None = None) -> float:
    """Bytes of ``name`` at the micro-batch: in ``ctx.precision``, or with ``held`` ("kept":
    as backward keeps it, "own": as the value itself) in the dtype autocast holds it in
    (``ctx.held``; ``cost.dtypes``)."""
    a = analyze(ctx.graph)
    meta = ctx.graph.value(name).meta
    sizes = (None if held is None or ctx.held is None
             else {name: ctx.held.lower_bytes} if held == "copy"    # a product's 16-bit copy
             else ctx.held.kept if held == "kept" else ctx.held.own)
    b = held_meta_bytes(name, meta, ctx.precision, sizes)
    return b * ctx.batch_scale if name in a.batch_dependent else b


def cp_held(ctx: CostContext, i: int, name: str) -> float:
    """The share of ``name`` the cp axis leaves a rank where op ``i`` holds it (1 without)."""
    return ctx.context.held_scale(i, name) if ctx.context is not None else 1.0


def cp_comms_s(ctx: CostContext, i: int, s: OpStrategy) -> tuple[float, float, float, float]:
    """(forward, backward, ring forward, ring backward) seconds of the cp axis's traffic at op
    ``i`` under tp strategy ``s`` (``range_comm.tp_comm_s`` prices the same): its collectives
    but the weights' gradients (they go with the dp x cp average) and the reshards into it, at
    the tp piece ``s`` leaves of each value."""
    cx = ctx.context
    out = {"fwd": 0.0, "bwd": 0.0, "rfwd": 0.0, "rbwd": 0.0}
    if cx is None:
        return 0.0, 0.0, 0.0, 0.0
    op, a = ctx.graph.ops[i], analyze(ctx.graph)
    ring = cx.strategy(i).kernel == "ring_attention"

    def nbytes(value: str, scale: float, phase: str, kind: str) -> float:
        return comm_bytes(ctx.graph, a, ctx.precision, value, scale, cx.c, ctx.batch_scale,
                          phase, 1, kind, share_at(op, s, value, ctx.t) or 1.0,
                          own_sizes(ctx.held))
    for c in cx.strategy(i).comms:
        if c.phase != "step":
            out[("r" if ring else "") + c.phase] += ctx.cp_collective_s(
                c.kind, nbytes(c.value, c.scale, c.phase, c.kind))
    for r in cx.sharding.reshards_in(i, i + 1):
        out[r.phase] += ctx.cp_collective_s(r.kind, nbytes(r.value, r.scale, r.phase, ""))
    return out["fwd"], out["bwd"], out["rfwd"], out["rbwd"]
