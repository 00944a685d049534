"""From an OpGraph to the sharding ILP, and from the ILP's answer back to a ``Sharding``.

Graph reduction, so that a 96-layer model is one layer's problem:
1. Repeated blocks fold onto their first instance (``folding.py``): every op of instance k
   stands for the op at the same position in instance 0 (``rep``); costs and memory count once
   per instance, and the edge from one instance's output to the next instance's input is
   priced with its multiplicity.
2. Ops that simply follow their producer (views, element-wise ops with one activation input,
   dropout, copies, reductions) join the producer's node: their placement is a function of the
   producer's strategy (when they cannot carry it, the node gathers the tensor first and pays).
What is left is a few nodes per layer (linears, norms, attention products, residual adds, the
loss), with the strategies of ``strategies.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoplan.graph.analysis import analyze
from autoplan.cost.dtypes import own_sizes
from autoplan.cost.memory import internal_anchor, meta_bytes
from autoplan.estimate.chunk_cost import comm_bytes
from autoplan.estimate.overlap import overlap_exposed_s
from autoplan.graph.opgraph import OpGraph
from autoplan.errors import ConfigError
from autoplan.planner.axis_costs import cp_comms_s, cp_held, exchange_s, sent_again, value_bytes
from autoplan.planner.cost_context import CostContext
from autoplan.planner.folding import Node, group, representatives
from autoplan.planner.kept_activations import activation_owners, layer_inputs
from autoplan.planner.ilp import ILPProblem, Linear
from autoplan.sharding.context_axis import ContextAxis, tp_allowed
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import Sharding, built_once, mutates_input, reshard_kind
from autoplan.sharding.strategies import OpStrategy, strategies, strategies_by_name
from autoplan.sharding.strategy import divided_split, replicate

# Choices that cannot run cost this much: an in-place op whose input would be resharded first
# (the write would land on a copy), a tied weight laid out two ways.
INFEASIBLE_S = 1.0e6


@dataclass(frozen=True)
class Reduction:
    rep: tuple[int, ...]             # op -> representative op
    node_of: dict[int, int]          # rep op -> node
    nodes: tuple[Node, ...]
    problem: ILPProblem
    # per micro-batch, the seconds of forward and of backward (recomputation included) each
    # choice puts on the compute stream: the estimate's ``fwd_total_s`` and ``bwd_total_s``,
    # the windows data parallelism's traffic hides behind (``dp_problem``)
    fwd: Linear | None = None
    bwd: Linear | None = None
    # with ``stages`` (op ranges per pipeline rank): per rank, its share of ``fwd`` and ``bwd``
    # and the seconds of its per-step tp gradient all-reduces (each node's instances and each
    # edge's consumers counted where they run)
    stage_fwd: tuple[Linear, ...] = ()
    stage_bwd: tuple[Linear, ...] = ()
    stage_step: tuple[Linear, ...] = ()
    stage_share: tuple[tuple[int, ...], ...] = ()    # per node, its instances on each rank
    # per rank, the activation bytes each choice keeps there per micro-batch (node terms)
    stage_acts: tuple[Linear, ...] = ()


def _comm_bytes(ctx: CostContext, name: str, scale: float, phase: str, kind: str = "",
                held: float = 1.0) -> float:
    """Bytes of one collective, as the estimate takes them (``chunk_cost.comm_bytes``)."""
    return comm_bytes(ctx.graph, analyze(ctx.graph), ctx.precision, name, scale, ctx.t,
                      ctx.batch_scale, phase, ctx.step_shard if phase == "step" else 1, kind,
                      held, own_sizes(ctx.held))


def _reshard_s(ctx: CostContext, name: str, src: Placement, dst: Placement, consumer: int = -1
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
            out[p] = ctx.collective_s(kind, _comm_bytes(ctx, name, scale, "fwd", held=held))
    return out[0], out[1]


def _expand(graph: OpGraph, node: Node, t: int, cache: dict[int, list[OpStrategy]],
            micro_batch: int | None = None, pinned: Mapping[int, str] | None = None,
            context: ContextAxis | None = None) -> None:
    """Per leader strategy: the followers' strategies and the node's value placements (only
    the strategies that run under a cp axis, ``context``)."""
    def opts(i):
        if i not in cache:
            cache[i] = tp_allowed(context, i, strategies(graph, graph.ops[i], t,
                                                         micro_batch=micro_batch), t)
            if pinned and i in pinned:
                cache[i] = [s for s in cache[i] if s.name == pinned[i]]
                if not cache[i]:
                    raise ConfigError(f"op {graph.ops[i].name}: its pinned strategy "
                                      f"{pinned[i]!r} does not split micro-batches of "
                                      f"{micro_batch} evenly at tp={t}")
        return cache[i]
    node.choices, node.placement, node.internal = [], [], []
    for s in opts(node.ops[0]):
        chosen = [s]
        place: dict[str, Placement] = {}
        internal: list[tuple[str, Placement, Placement]] = []
        lead = graph.ops[node.ops[0]]
        for k, n in enumerate(lead.outputs):
            place[n] = s.outputs[k] if k < len(s.outputs) else REPLICATE
        for i in node.ops[1:]:
            op = graph.ops[i]
            x_slot = next(k for k, n in enumerate(op.inputs)
                          if graph.value(n).kind == "activation")
            want = place.get(op.inputs[x_slot], REPLICATE)
            pick = next((f for f in opts(i) if f.inputs[x_slot] == want), None)
            if pick is None:            # cannot carry the sharding: gather, run replicated
                pick = opts(i)[0]
                internal.append((i, op.inputs[x_slot], want, REPLICATE))
            chosen.append(pick)
            for k, n in enumerate(op.outputs):
                place[n] = pick.outputs[k] if k < len(pick.outputs) else REPLICATE
        node.choices.append(chosen)
        node.placement.append(place)
        node.internal.append(internal)


def _recomputes_comms(ctx: CostContext, node: Node) -> bool:
    """Full recomputation replays a layer's forward collectives too (``chunk_cost``)."""
    return ctx.recompute == "full" and node.mult > 1


def _node_cost(ctx: CostContext, node: Node, j: int, savers: dict[tuple[int, str], int],
               part_of: list[int]) -> tuple[float, float, float, float, float]:
    """(seconds per step, bytes per device, forward and backward seconds per micro-batch,
    activation bytes kept per micro-batch) of strategy j, for all instances it stands for."""
    graph = ctx.graph
    a = analyze(graph)
    fwd = bwd = fwd_comm = step = 0.0
    params = acts = once = 0.0           # once: tensors several layers keep, held once
    seen_params: set[str] = set()
    in_block = node.mult > 1
    for i, s in zip(node.ops, node.choices[j]):
        op = graph.ops[i]
        batch_dep = any(o in a.batch_dependent for o in op.outputs)
        load = (ctx.experts.load if ctx.experts is not None and i in ctx.experts.members
                else 1.0)
        cp_share = ctx.context.op_scale(i) if ctx.context is not None else 1.0
        c = ctx.compute.op_cost(i, load * (ctx.batch_scale if batch_dep else 1.0) * cp_share
                                / s.work_divisor, divided_split(graph, op, s))
        fwd += c.fwd_s
        bwd += c.bwd_s
        if ctx.recompute == "full" and in_block or ctx.recompute == "selective" and i in a.score_ops:
            bwd += c.fwd_s
        ring = {"fwd": 0.0, "bwd": 0.0}
        for cm in s.comms:
            held = cp_held(ctx, i, cm.value) if cm.phase != "step" else 1.0
            t = ctx.collective_s(cm.kind, _comm_bytes(ctx, cm.value, cm.scale, cm.phase,
                                                      cm.kind, held))
            if cm.phase == "step":
                step += t
            elif s.kernel == "ring_attention":
                ring[cm.phase] += t
            elif cm.phase == "fwd":
                fwd_comm += t
            else:
                bwd += t
        cf, cb, rf, rb = cp_comms_s(ctx, i, s)
        fwd_comm, bwd = fwd_comm + cf, bwd + cb
        ring["fwd"], ring["bwd"] = ring["fwd"] + rf, ring["bwd"] + rb
        if s.kernel == "ring_attention" or rf + rb > 0:
            # passed on behind the blocks' attention, as priced
            fwd_comm += overlap_exposed_s(ring["fwd"], c.fwd_s, 0.0, ctx.interference)
            bwd += overlap_exposed_s(ring["bwd"], c.bwd_s, 0.0, ctx.interference)
        if ctx.experts is not None:
            ef, eb = exchange_s(ctx, i, s, node.placement[j])
            fwd, bwd = fwd + ef, bwd + eb
        for k, n in enumerate(op.inputs):
            v = graph.value(n)
            if v.kind == "param" and v.base not in seen_params:
                seen_params.add(v.base)
                split = k < len(s.inputs) and s.inputs[k].kind == "S"
                params += v.meta.numel * ctx.state_bytes_per_param / (ctx.t if split else 1)
        if ctx.recompute == "full" and in_block:
            continue
        if ctx.recompute == "selective" and i in a.score_ops:
            continue
        counted: set[str] = set()
        for n in op.saved:
            base = graph.value(graph.value(n).base)
            if i not in (savers.get((part_of[i], base.name)), savers.get((-1, base.name))) \
                    or base.name in counted:
                continue           # dropped by the policy, or counted already
            counted.add(base.name)
            k = op.inputs.index(n) if n in op.inputs else -1
            where = s.inputs[k] if 0 <= k < len(s.inputs) else node.placement[j].get(n, REPLICATE)
            b = (value_bytes(ctx, base.name, "kept")
                 * (1.0 / ctx.t if where.kind == "S" else 1.0)
                 * (cp_held(ctx, i, n) if n == base.name else
                    ctx.context.value_scale(base.name) if ctx.context is not None else 1.0))
            if (-1, base.name) in savers:
                once += b
            else:
                acts += b
        if op.saved_internal:      # what a kernel keeps beside its outputs (softmax statistics)
            anchor, on_input = internal_anchor(graph, op)
            where = (s.inputs[op.inputs.index(anchor)] if on_input
                     else node.placement[j].get(anchor, REPLICATE))
            scale = ((ctx.batch_scale if anchor in a.batch_dependent else 1.0)
                     * (1.0 / ctx.t if where.kind == "S" else 1.0) * cp_held(ctx, i, anchor))
            acts += sum(meta_bytes(m, ctx.precision) for m in op.saved_internal) * scale
    for i, name, src, dst in node.internal[j]:
        if mutates_input(graph.ops[i].target):
            bwd += INFEASIBLE_S
        else:
            rf, rb = _reshard_s(ctx, name, src, dst, i)
            fwd_comm, bwd = fwd_comm + rf, bwd + rb
    if _recomputes_comms(ctx, node):
        bwd += fwd_comm
    fwd += fwd_comm
    time_s = node.mult * (ctx.microbatches * (fwd + bwd) + step)
    mem = node.mult * (params + acts * ctx.activation_multiplier) + once
    return time_s, mem, node.mult * fwd, node.mult * bwd, node.mult * acts + once


def reduce_graph(ctx: CostContext,
                 stages: Sequence[Sequence[tuple[int, int]]] | None = None) -> Reduction:
    """The sharding problem of ``ctx``; ``stages`` (per pipeline rank, the op ranges of its
    chunks): also each rank's share of the per-micro-batch and per-step seconds."""
    graph = ctx.graph
    a = analyze(graph)
    rep, mult, inst = representatives(graph)
    nodes, node_of = group(graph, rep, mult, inst)
    stage_of = [0] * len(graph.ops)
    chunk_of = [0] * len(graph.ops)
    for r, ranges in enumerate(stages or ()):
        for start, stop in ranges:
            stage_of[start:stop] = [r] * (stop - start)
            chunk_of[start:stop] = [start] * (stop - start)
    n_stages = len(stages or ())
    # per node: how many of its instances each rank runs (by the instance's leading op)
    share = [[0] * n_stages for _ in nodes]
    if n_stages:
        for i in range(len(graph.ops)):
            v = node_of.get(rep[i])
            if v is not None and nodes[v].ops[0] == rep[i]:
                share[v][stage_of[i]] += 1
    cache: dict[int, list[OpStrategy]] = {}
    for node in nodes:
        _expand(graph, node, ctx.t, cache, ctx.micro_batch, ctx.pinned, ctx.context)
    costs = [[0.0] * len(n.choices) for n in nodes]
    mems = [[0.0] * len(n.choices) for n in nodes]
    fwds = [[0.0] * len(n.choices) for n in nodes]
    bwds = [[0.0] * len(n.choices) for n in nodes]
    acts = [[0.0] * len(n.choices) for n in nodes]
    savers, part_of = activation_owners(graph, ctx.recompute)
    for v, node in enumerate(nodes):
        for j in range(len(node.choices)):
            costs[v][j], mems[v][j], fwds[v][j], bwds[v][j], acts[v][j] = _node_cost(
                ctx, node, j, savers, part_of)
    # per rank: its instances' share of each node's seconds (instances cost alike)
    s_fwd = [[[f * share[v][r] / nodes[v].mult for f in fwds[v]] for v in range(len(nodes))]
             for r in range(n_stages)]
    s_bwd = [[[b * share[v][r] / nodes[v].mult for b in bwds[v]] for v in range(len(nodes))]
             for r in range(n_stages)]
    s_acts = [[[x * share[v][r] / nodes[v].mult for x in acts[v]] for v in range(len(nodes))]
              for r in range(n_stages)]
    if ctx.recompute == "full":     # the layers keep only their inputs, on their layer's rank
        for start, u, j, b in layer_inputs(graph, nodes, rep, node_of, ctx, chunk_of):
            mems[u][j] += b * ctx.activation_multiplier
            if n_stages:
                s_acts[stage_of[start]][u][j] += b
    s_step = [[[(c - ctx.microbatches * (f + b)) * share[v][r] / nodes[v].mult
                for c, f, b in zip(costs[v], fwds[v], bwds[v])] for v in range(len(nodes))]
              for r in range(n_stages)]

    # edges: every (producer, consumer) pair of the full graph, folded onto representatives
    counts: dict[tuple[int, int, str, int, int], int] = {}
    stage_counts: dict[tuple[int, int, str, int, int], list[int]] = {}
    for c, op in enumerate(graph.ops):
        if not op.outputs:
            continue
        rc = rep[c]
        for k, n in enumerate(op.inputs):
            if graph.value(n).kind != "activation":
                continue
            p = a.producer[n]
            rp = rep[p]
            u, v = node_of.get(rp), node_of.get(rc)
            if u is None or v is None:
                continue
            if u == v and inst[p] == inst[c]:
                continue                      # inside one node: priced by the node
            x_rep = graph.ops[rp].outputs[graph.ops[p].outputs.index(n)]
            key = (u, v, x_rep, rc, k)
            counts[key] = counts.get(key, 0) + 1
            if n_stages:
                stage_counts.setdefault(key, [0] * n_stages)[stage_of[c]] += 1
    edge_mats: dict[tuple[int, int], list[list[float]]] = {}
    edge_fwd: dict[tuple[int, int], list[list[float]]] = {}
    edge_bwd: dict[tuple[int, int], list[list[float]]] = {}
    st_edge_fwd: list[dict[tuple[int, int], list[list[float]]]] = [{} for _ in range(n_stages)]
    st_edge_bwd: list[dict[tuple[int, int], list[list[float]]]] = [{} for _ in range(n_stages)]
    for (u, v, x_rep, rc, k), count in sorted(counts.items()):
        pos = nodes[v].ops.index(rc)
        ku, kv = len(nodes[u].choices), len(nodes[v].choices)
        per_mb = [[(0.0, 0.0)] * kv for _ in range(ku)]     # (forward, backward)
        again = _recomputes_comms(ctx, nodes[v])   # a reshard into a layer: the consumer's
        for i in range(ku):
            src = nodes[u].placement[i].get(x_rep, REPLICATE)
            for j in range(kv):
                s = nodes[v].choices[j][pos]
                dst = s.inputs[k] if k < len(s.inputs) else REPLICATE
                if src != dst:
                    f, b = ((0.0, INFEASIBLE_S) if k == 0 and mutates_input(graph.ops[rc].target)
                            else _reshard_s(ctx, x_rep, src, dst, rc))
                    per_mb[i][j] = (count * f, count * (b + f * again))
        for r, n_r in enumerate(stage_counts.get((u, v, x_rep, rc, k), ())):
            if not n_r:
                continue
            if u == v:
                for j in range(kv):
                    s_fwd[r][v][j] += per_mb[j][j][0] * n_r / count
                    s_bwd[r][v][j] += per_mb[j][j][1] * n_r / count
                continue
            for acc, pick in ((st_edge_fwd[r], 0), (st_edge_bwd[r], 1)):
                mat = acc.setdefault((u, v), [[0.0] * kv for _ in range(ku)])
                for i in range(ku):
                    for j in range(kv):
                        mat[i][j] += per_mb[i][j][pick] * n_r / count
        if u == v:
            for j in range(kv):
                f, b = per_mb[j][j]
                costs[v][j] += ctx.microbatches * (f + b)
                fwds[v][j] += f
                bwds[v][j] += b
            continue
        for acc, pick in ((edge_mats, lambda fb: ctx.microbatches * (fb[0] + fb[1])),
                          (edge_fwd, lambda fb: fb[0]), (edge_bwd, lambda fb: fb[1])):
            mat = acc.setdefault((u, v), [[0.0] * kv for _ in range(ku)])
            for i in range(ku):
                for j in range(kv):
                    mat[i][j] += pick(per_mb[i][j])
    if ctx.experts is not None:
        sent_again(ctx, nodes, node_of, edge_mats, costs)
    st_edge_step: list[dict[tuple[int, int], list[list[float]]]] = [{} for _ in range(n_stages)]
    _tie_shared_weights(ctx, nodes, edge_mats, costs,
                        _StageSinks(stage_of, s_bwd, s_step, st_edge_bwd, st_edge_step)
                        if n_stages else None)
    # ops no node holds (no outputs: a metadata assert) cost what the estimate prices them,
    # whatever the choice
    fixed_fwd = fixed_bwd = 0.0
    s_fixed = [[0.0, 0.0] for _ in range(n_stages)]
    for i, op in enumerate(graph.ops):
        if rep[i] not in node_of:
            c = ctx.compute.op_cost(i)
            again = c.fwd_s if ctx.recompute == "full" and mult[rep[i]] > 1 else 0.0
            fixed_fwd, fixed_bwd = fixed_fwd + c.fwd_s, fixed_bwd + c.bwd_s + again
            if n_stages:
                s_fixed[stage_of[i]][0] += c.fwd_s
                s_fixed[stage_of[i]][1] += c.bwd_s + again
    problem = ILPProblem(
        node_costs=tuple(tuple(c) for c in costs), node_memory=tuple(tuple(m) for m in mems),
        edges=tuple((u, v, tuple(tuple(r) for r in mat)) for (u, v), mat in sorted(edge_mats.items())),
        memory_budget=ctx.memory_budget,
        constant_s=ctx.microbatches * (fixed_fwd + fixed_bwd))

    def aligned(fixed: float, nodes_s: list[list[float]],
                edges_s: dict[tuple[int, int], list[list[float]]]) -> Linear:
        return Linear(fixed, tuple(tuple(c) for c in nodes_s),
                      tuple(tuple(tuple(r) for r in edges_s.get((u, v), [[0.0] * len(mat[0])]
                                                                * len(mat)))
                            for u, v, mat in problem.edges))
    return Reduction(rep=tuple(rep), node_of=node_of, nodes=tuple(nodes), problem=problem,
                     fwd=aligned(fixed_fwd, fwds, edge_fwd),
                     bwd=aligned(fixed_bwd, bwds, edge_bwd),
                     stage_fwd=tuple(aligned(s_fixed[r][0], s_fwd[r], st_edge_fwd[r])
                                     for r in range(n_stages)),
                     stage_bwd=tuple(aligned(s_fixed[r][1], s_bwd[r], st_edge_bwd[r])
                                     for r in range(n_stages)),
                     stage_step=tuple(aligned(0.0, s_step[r], st_edge_step[r])
                                      for r in range(n_stages)),
                     stage_share=tuple(tuple(row) for row in share),
                     stage_acts=tuple(Linear(0.0, tuple(tuple(c) for c in s_acts[r]))
                                      for r in range(n_stages)))


@dataclass(frozen=True)
class _StageSinks:
    """Where ``_tie_shared_weights`` also writes each pipeline rank's share: the partial
    reader's rank gets its per-micro-batch all-reduce (backward) and loses its per-step one."""

    stage_of: list[int]
    bwd: list[list[list[float]]]
    step: list[list[list[float]]]
    edge_bwd: list[dict[tuple[int, int], list[list[float]]]]
    edge_step: list[dict[tuple[int, int], list[list[float]]]]


def _tie_shared_weights(ctx: CostContext, nodes: list[Node],
                        edge_mats: dict[tuple[int, int], list[list[float]]],
                        costs: list[list[float]], sinks: _StageSinks | None = None) -> None:
    """A weight read by several ops (an LM head tied to the embedding) is one tensor with one
    placement: strategy pairs that would lay it out differently cannot run. And where one
    reader's gradient is partial (all-reduced once per step) and another's whole, the partial
    one is all-reduced every micro-batch instead (``sharding._mixed_weight_grads``): the pair
    pays the difference (``sinks``: on the partial reader's pipeline rank)."""
    graph = ctx.graph
    readers: dict[str, list[tuple[int, int, int]]] = {}      # weight -> [(node, pos, slot)]
    for v, node in enumerate(nodes):
        for pos, i in enumerate(node.ops):
            for k, n in enumerate(graph.ops[i].inputs):
                val = graph.value(n)
                if val.kind == "param":
                    readers.setdefault(val.base or n, []).append((v, pos, k))

    def where(v: int, j: int, pos: int, k: int) -> Placement:
        s = nodes[v].choices[j][pos]
        return s.inputs[k] if k < len(s.inputs) else REPLICATE

    def parts(v: int, j: int, pos: int, weight: str) -> tuple[float, float] | None:
        """Reader (v, pos)'s gradient all-reduce of ``weight`` under strategy j: (per
        micro-batch when it runs in backward, once per step) seconds (None: its gradient is
        whole)."""
        comms = [c for c in nodes[v].choices[j][pos].comms
                 if c.phase == "step" and graph.value(c.value).base == weight]
        if not comms:
            return None
        return (sum(ctx.collective_s(c.kind, _comm_bytes(ctx, c.value, c.scale, "bwd"))
                    for c in comms),
                sum(ctx.collective_s(c.kind, _comm_bytes(ctx, c.value, c.scale, "step"))
                    for c in comms))

    def step_s(v: int, j: int, pos: int, weight: str) -> float | None:
        """What that all-reduce adds when it runs every micro-batch instead of once per step."""
        x = parts(v, j, pos, weight)
        return None if x is None else ctx.microbatches * x[0] - x[1]

    def to_stage(u: int, i: int, pu: int, ku: int, v: int, j: int, pv: int, kv: int,
                 weight: str, a: int, b: int, flip: bool) -> None:
        """The pair's per-rank share (``sinks``), on edge (a, b) (or node a where a == b)."""
        if sinks is None or where(u, i, pu, ku) != where(v, j, pv, kv):
            return
        x, y = parts(u, i, pu, weight), parts(v, j, pv, weight)
        if (x is None) == (y is None):
            return
        (mb, once), op = (x, nodes[u].ops[pu]) if x is not None else (y, nodes[v].ops[pv])
        r = sinks.stage_of[op]
        if a == b:
            sinks.bwd[r][a][i] += mb
            sinks.step[r][a][i] -= once
            return
        for acc, amount in ((sinks.edge_bwd[r], mb), (sinks.edge_step[r], -once)):
            mat = acc.setdefault((a, b), [[0.0] * len(nodes[b].choices)
                                          for _ in range(len(nodes[a].choices))])
            mat[j if flip else i][i if flip else j] += amount

    def pair_s(u: int, i: int, pu: int, ku: int, v: int, j: int, pv: int, kv: int,
               weight: str) -> float:
        if where(u, i, pu, ku) != where(v, j, pv, kv):
            return INFEASIBLE_S
        a, b = step_s(u, i, pu, weight), step_s(v, j, pv, weight)
        if (a is None) == (b is None):
            return 0.0
        return a if a is not None else b
    for weight, occ in sorted(readers.items()):
        (u, pu, ku), rest = occ[0], occ[1:]
        for v, pv, kv in rest:
            nu, nv = len(nodes[u].choices), len(nodes[v].choices)
            if u == v:
                for j in range(nu):
                    costs[u][j] += pair_s(u, j, pu, ku, v, j, pv, kv, weight)
                    to_stage(u, j, pu, ku, v, j, pv, kv, weight, u, u, False)
                continue
            a, b = (u, v) if (u, v) in edge_mats or (v, u) not in edge_mats else (v, u)
            acc = edge_mats.setdefault((a, b), [[0.0] * len(nodes[b].choices)
                                                for _ in range(len(nodes[a].choices))])
            for i in range(nu):
                for j in range(nv):
                    x = pair_s(u, i, pu, ku, v, j, pv, kv, weight)
                    to_stage(u, i, pu, ku, v, j, pv, kv, weight, a, b, (a, b) != (u, v))
                    if (a, b) == (u, v):
                        acc[i][j] += x
                    else:
                        acc[j][i] += x


def sharding_from_choice(graph: OpGraph, t: int, red: Reduction,
                         choice: tuple[int, ...]) -> Sharding:
    """Expand the ILP's node choices to one strategy per op of the whole graph."""
    per_rep: dict[int, OpStrategy] = {}
    for v, node in enumerate(red.nodes):
        for i, s in zip(node.ops, node.choices[choice[v]]):
            per_rep[i] = s

    def build() -> Sharding:
        chosen = []
        for i, op in enumerate(graph.ops):
            s = per_rep.get(red.rep[i])
            if s is None:
                s = replicate(op)
            elif red.rep[i] != i:
                # this op's own strategy of that name: its collectives on its own values (the
                # representative's would make every layer's tp gradient all-reduce look like a
                # reader of the first layer's weight, priced per micro-batch)
                s = strategies_by_name(graph, op, t).get(s.name, s)
            chosen.append(s)
        return Sharding.build(graph, t, chosen)
    # the same choice comes back for other micro-batches and memory budgets: built once
    # (strategies are named uniquely per op, and the same representatives give the same ops)
    return built_once(graph, ("ilp", t, red.rep, tuple(sorted(
        (i, s.name) for i, s in per_rep.items()))), build)
