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

What one strategy of one node costs is ``node_costs.py``'s; here the nodes and edges are
tabulated (in all, and per pipeline rank), tied weights priced, and the tables made an ILP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from autoplan.errors import ConfigError
from autoplan.estimate.partition import priced_ops
from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.axis_costs import sent_again
from autoplan.planner.cost_context import CostContext
from autoplan.planner.folding import Node, group, representatives
from autoplan.planner.ilp import ILPProblem, Linear
from autoplan.planner.kept_activations import activation_owners, layer_inputs
from autoplan.planner.node_costs import (INFEASIBLE_S, collective_bytes, node_cost,
                                         recomputes_comms, reshard_s, tied_state_bytes)
from autoplan.sharding.context_axis import ContextAxis, tp_allowed
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import Sharding, built_once, mutates_input
from autoplan.sharding.strategies import OpStrategy, strategies, strategies_by_name
from autoplan.sharding.strategy import replicate

__all__ = ["INFEASIBLE_S", "Reduction", "reduce_graph", "sharding_from_choice"]


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


# An edge of the full graph folded onto representatives: (producer node, consumer node, the
# value as the producer's representative names it, the consumer's representative op, its input
# slot)
EdgeKey = tuple[int, int, str, int, int]
Matrix = list[list[float]]
EdgeTerms = dict[tuple[int, int], Matrix]


@dataclass(frozen=True)
class _Folded:
    """The graph folded onto its first block instance and grouped into nodes
    (``folding.py``)."""

    rep: list[int]              # op -> representative op
    mult: dict[int, int]        # representative op -> instances it stands for
    inst: list[int]             # op -> block instance (-1: outside blocks)
    nodes: list[Node]
    node_of: dict[int, int]     # representative op -> node


def _fold(graph: OpGraph) -> _Folded:
    rep, mult, inst = representatives(graph)
    nodes, node_of = group(graph, rep, mult, inst)
    return _Folded(rep, mult, inst, nodes, node_of)


@dataclass(frozen=True)
class _StageMap:
    """Where each op runs under a pipeline layout: per op its rank and its chunk's first op."""

    stage_of: list[int]
    chunk_of: list[int]
    n_stages: int


@dataclass
class _Terms:
    """Per node and strategy, the whole step's terms, and per edge their pair matrices
    (mutable: edges inside a node, the experts' second sends and tied weights add to them)."""

    costs: list[list[float]]
    mems: list[list[float]]
    fwds: list[list[float]]
    bwds: list[list[float]]
    acts: list[list[float]]
    # per node and strategy, per instance its (forward, backward) beyond an even share
    extras: list[list[tuple[tuple[float, float], ...]]] = field(default_factory=list)
    edge_costs: EdgeTerms = field(default_factory=dict)
    edge_fwd: EdgeTerms = field(default_factory=dict)
    edge_bwd: EdgeTerms = field(default_factory=dict)


@dataclass
class _RankTerms:
    """Per pipeline rank, its share of each node's and edge's forward, backward and per-step
    seconds and kept activation bytes (mutable accumulators, as ``_Terms``)."""

    stage_of: list[int]
    fwd: list[list[list[float]]]
    bwd: list[list[list[float]]]
    acts: list[list[list[float]]]
    step: list[list[list[float]]]
    edge_fwd: list[EdgeTerms]
    edge_bwd: list[EdgeTerms]
    edge_step: list[EdgeTerms]


@dataclass(frozen=True)
class _UnheldOps:
    """The seconds per micro-batch of ops no node holds (no outputs: a metadata assert),
    whatever the choice: in all, and per pipeline rank (forward, backward)."""

    fwd_s: float
    bwd_s: float
    per_rank: list[list[float]]


def reduce_graph(ctx: CostContext,
                 stages: Sequence[Sequence[tuple[int, int]]] | None = None) -> Reduction:
    """The sharding problem of ``ctx``; ``stages`` (per pipeline rank, the op ranges of its
    chunks): also each rank's share of the per-micro-batch and per-step seconds."""
    graph = ctx.graph
    folded = _fold(graph)
    nodes = folded.nodes
    where = _stage_map(len(graph.ops), stages)
    share = _instance_share(folded, where)
    cache: dict[int, list[OpStrategy]] = {}
    for node in nodes:
        _expand(graph, node, ctx.t, cache, ctx.micro_batch, ctx.pinned, ctx.context)
    terms = _node_terms(ctx, nodes)
    ranks = _rank_shares(ctx, nodes, terms, share, where)
    if ctx.recompute == "full":     # the layers keep only their inputs, on their layer's rank
        for start, u, j, b in layer_inputs(graph, nodes, folded.rep, folded.node_of, ctx,
                                           where.chunk_of):
            terms.mems[u][j] += b * ctx.activation_multiplier
            if where.n_stages:
                ranks.acts[where.stage_of[start]][u][j] += b
    counts, rank_counts = (_count_edges(graph, folded, where) if where.n_stages
                           else _edge_counts(graph, folded))
    for key, count in sorted(counts.items()):
        per_mb = _edge_reshard_s(ctx, nodes, key, count)
        _add_edge_to_ranks(ranks, nodes, key, per_mb, count, rank_counts.get(key, ()))
        _add_edge(ctx, terms, nodes, key, per_mb)
    if ctx.experts is not None:
        sent_again(ctx, nodes, folded.node_of, terms.edge_costs, terms.costs)
    _tie_shared_weights(ctx, nodes, terms.edge_costs, terms.costs,
                        ranks if where.n_stages else None)
    return _reduction(ctx, folded, share, terms, ranks, _unheld_ops(ctx, folded, where))


def _stage_map(n_ops: int, stages: Sequence[Sequence[tuple[int, int]]] | None) -> _StageMap:
    stage_of = [0] * n_ops
    chunk_of = [0] * n_ops
    for r, ranges in enumerate(stages or ()):
        for start, stop in ranges:
            stage_of[start:stop] = [r] * (stop - start)
            chunk_of[start:stop] = [start] * (stop - start)
    return _StageMap(stage_of, chunk_of, len(stages or ()))


def _instance_share(folded: _Folded, where: _StageMap) -> list[list[int]]:
    """Per node: how many of its instances each rank runs (by the instance's leading op)."""
    rep, nodes, node_of = folded.rep, folded.nodes, folded.node_of
    share = [[0] * where.n_stages for _ in nodes]
    if where.n_stages:
        for i in range(len(rep)):
            v = node_of.get(rep[i])
            if v is not None and nodes[v].ops[0] == rep[i]:
                share[v][where.stage_of[i]] += 1
    return share


def _node_terms(ctx: CostContext, nodes: list[Node]) -> _Terms:
    """Every strategy of every node costed (``node_costs.node_cost``)."""
    savers, part_of = activation_owners(ctx.graph, ctx.recompute,
                                        ctx.held.copies if ctx.held is not None else None)
    per = [[node_cost(ctx, node, j, savers, part_of) for j in range(len(node.choices))]
           for node in nodes]
    again = tied_state_bytes(ctx, nodes)       # a tied weight: held once
    return _Terms(costs=[[c.time_s for c in row] for row in per],
                  mems=[[c.memory_bytes - b for c, b in zip(row, bs)]
                        for row, bs in zip(per, again)],
                  fwds=[[c.fwd_s for c in row] for row in per],
                  bwds=[[c.bwd_s for c in row] for row in per],
                  acts=[[c.act_bytes for c in row] for row in per],
                  extras=[[c.instance_extra for c in row] for row in per])


def _rank_shares(ctx: CostContext, nodes: list[Node], terms: _Terms, share: list[list[int]],
                 where: _StageMap) -> _RankTerms:
    """Per rank: its instances' share of each node's terms (an even share per instance, and
    the forward and backward seconds an instance costs beyond it where instances differ,
    ``NodeCost.instance_extra``, on the rank that runs it)."""
    n, ranks = len(nodes), range(where.n_stages)

    def shared(rows: list[list[float]]) -> list[list[list[float]]]:
        return [[[x * share[v][r] / nodes[v].mult for x in rows[v]] for v in range(n)]
                for r in ranks]
    step = [[[(c - ctx.microbatches * (f + b)) * share[v][r] / nodes[v].mult
              for c, f, b in zip(terms.costs[v], terms.fwds[v], terms.bwds[v])]
             for v in range(n)] for r in ranks]
    fwd, bwd = shared(terms.fwds), shared(terms.bwds)
    for v, row in enumerate(terms.extras if where.n_stages else ()):
        for j, extra in enumerate(row):
            for o, (f, b) in zip(nodes[v].copies[0], extra):
                fwd[where.stage_of[o]][v][j] += f
                bwd[where.stage_of[o]][v][j] += b
    return _RankTerms(stage_of=where.stage_of, fwd=fwd, bwd=bwd,
                      acts=shared(terms.acts), step=step, edge_fwd=[{} for _ in ranks],
                      edge_bwd=[{} for _ in ranks], edge_step=[{} for _ in ranks])


def _count_edges(graph: OpGraph, folded: _Folded, where: _StageMap
                 ) -> tuple[dict[EdgeKey, int], dict[EdgeKey, list[int]]]:
    """Every (producer, consumer) pair of the full graph, folded onto representatives: how
    many instances each edge stands for, in all and per rank (by the consumer)."""
    a = analyze(graph)
    rep, inst, node_of = folded.rep, folded.inst, folded.node_of
    counts: dict[EdgeKey, int] = {}
    rank_counts: dict[EdgeKey, list[int]] = {}
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
            if where.n_stages:
                rank_counts.setdefault(key, [0] * where.n_stages)[where.stage_of[c]] += 1
    return counts, rank_counts


def _edge_counts(graph: OpGraph, folded: _Folded
                 ) -> tuple[dict[EdgeKey, int], dict[EdgeKey, list[int]]]:
    """``_count_edges`` with no pipeline, kept on the graph (the folding is the graph's own:
    every tp-axis problem of the search counts the same edges)."""
    found = graph.__dict__.get("_autoplan_edge_counts")
    if found is None or found[0] != folded.rep:
        found = graph.__dict__["_autoplan_edge_counts"] = (
            folded.rep, *_count_edges(graph, folded, _stage_map(len(graph.ops), None)))
    return found[1], found[2]


def _edge_reshard_s(ctx: CostContext, nodes: list[Node], key: EdgeKey, count: int
                    ) -> list[list[tuple[float, float]]]:
    """Per (producer choice, consumer choice): the (forward, backward) reshard seconds per
    micro-batch of the ``count`` instances of edge ``key`` (a reshard into a layer replays
    under full recomputation, as the consumer's collectives do)."""
    u, v, x_rep, rc, k = key
    pos = nodes[v].ops.index(rc)
    ku, kv = len(nodes[u].choices), len(nodes[v].choices)
    per_mb = [[(0.0, 0.0)] * kv for _ in range(ku)]
    again = recomputes_comms(ctx, nodes[v])
    in_place = k == 0 and mutates_input(ctx.graph.ops[rc].target)
    for i in range(ku):
        src = nodes[u].placement[i].get(x_rep, REPLICATE)
        for j in range(kv):
            s = nodes[v].choices[j][pos]
            dst = s.inputs[k] if k < len(s.inputs) else REPLICATE
            if src != dst:
                f, b = (0.0, INFEASIBLE_S) if in_place else reshard_s(ctx, x_rep, src, dst, rc)
                per_mb[i][j] = (count * f, count * (b + f * again))
    return per_mb


def _add_edge_to_ranks(ranks: _RankTerms, nodes: list[Node], key: EdgeKey,
                       per_mb: list[list[tuple[float, float]]], count: int,
                       per_rank: Sequence[int]) -> None:
    """Each rank's share of the edge (by its consumers there): on the node's own choices
    where the edge joins two instances of one node."""
    u, v = key[0], key[1]
    ku, kv = len(nodes[u].choices), len(nodes[v].choices)
    for r, n_r in enumerate(per_rank):
        if not n_r:
            continue
        if u == v:
            for j in range(kv):
                ranks.fwd[r][v][j] += per_mb[j][j][0] * n_r / count
                ranks.bwd[r][v][j] += per_mb[j][j][1] * n_r / count
            continue
        for acc, pick in ((ranks.edge_fwd[r], 0), (ranks.edge_bwd[r], 1)):
            mat = acc.setdefault((u, v), [[0.0] * kv for _ in range(ku)])
            for i in range(ku):
                for j in range(kv):
                    mat[i][j] += per_mb[i][j][pick] * n_r / count


def _add_edge(ctx: CostContext, terms: _Terms, nodes: list[Node], key: EdgeKey,
              per_mb: list[list[tuple[float, float]]]) -> None:
    """The edge's step seconds and per-micro-batch forward and backward: a pair matrix, or
    the node's own terms where it joins two instances of one node."""
    u, v = key[0], key[1]
    ku, kv = len(nodes[u].choices), len(nodes[v].choices)
    if u == v:
        for j in range(kv):
            f, b = per_mb[j][j]
            terms.costs[v][j] += ctx.microbatches * (f + b)
            terms.fwds[v][j] += f
            terms.bwds[v][j] += b
        return
    for acc, pick in ((terms.edge_costs, lambda fb: ctx.microbatches * (fb[0] + fb[1])),
                      (terms.edge_fwd, lambda fb: fb[0]), (terms.edge_bwd, lambda fb: fb[1])):
        mat = acc.setdefault((u, v), [[0.0] * kv for _ in range(ku)])
        for i in range(ku):
            for j in range(kv):
                mat[i][j] += pick(per_mb[i][j])


def _unheld_ops(ctx: CostContext, folded: _Folded, where: _StageMap) -> _UnheldOps:
    """Ops no node holds cost what the estimate prices them (``partition.priced_ops``),
    whatever the choice."""
    rep, mult, node_of = folded.rep, folded.mult, folded.node_of
    priced = priced_ops(ctx.graph)
    fwd_s = bwd_s = 0.0
    per_rank = [[0.0, 0.0] for _ in range(where.n_stages)]
    for i in range(len(ctx.graph.ops)):
        if rep[i] not in node_of:
            c = ctx.compute.op_cost(priced[i])
            again = c.fwd_s if ctx.recompute == "full" and mult[rep[i]] > 1 else 0.0
            fwd_s, bwd_s = fwd_s + c.fwd_s, bwd_s + c.bwd_s + again
            if where.n_stages:
                per_rank[where.stage_of[i]][0] += c.fwd_s
                per_rank[where.stage_of[i]][1] += c.bwd_s + again
    return _UnheldOps(fwd_s, bwd_s, per_rank)


def _reduction(ctx: CostContext, folded: _Folded, share: list[list[int]], terms: _Terms,
               ranks: _RankTerms, unheld: _UnheldOps) -> Reduction:
    """The ILP of the tables, and the linear forms of the forward, backward and per-rank
    terms aligned with its edges."""
    problem = ILPProblem(
        node_costs=tuple(tuple(c) for c in terms.costs),
        node_memory=tuple(tuple(m) for m in terms.mems),
        edges=tuple((u, v, tuple(tuple(r) for r in mat))
                    for (u, v), mat in sorted(terms.edge_costs.items())),
        memory_budget=ctx.memory_budget,
        constant_s=ctx.microbatches * (unheld.fwd_s + unheld.bwd_s))

    def aligned(fixed: float, nodes_s: Matrix, edges_s: EdgeTerms) -> Linear:
        return Linear(fixed, tuple(tuple(c) for c in nodes_s),
                      tuple(tuple(tuple(r) for r in edges_s.get((u, v), [[0.0] * len(mat[0])]
                                                                * len(mat)))
                            for u, v, mat in problem.edges))
    n_stages = len(ranks.fwd)
    return Reduction(rep=tuple(folded.rep), node_of=folded.node_of, nodes=tuple(folded.nodes),
                     problem=problem,
                     fwd=aligned(unheld.fwd_s, terms.fwds, terms.edge_fwd),
                     bwd=aligned(unheld.bwd_s, terms.bwds, terms.edge_bwd),
                     stage_fwd=tuple(aligned(unheld.per_rank[r][0], ranks.fwd[r],
                                             ranks.edge_fwd[r]) for r in range(n_stages)),
                     stage_bwd=tuple(aligned(unheld.per_rank[r][1], ranks.bwd[r],
                                             ranks.edge_bwd[r]) for r in range(n_stages)),
                     stage_step=tuple(aligned(0.0, ranks.step[r], ranks.edge_step[r])
                                      for r in range(n_stages)),
                     stage_share=tuple(tuple(row) for row in share),
                     stage_acts=tuple(Linear(0.0, tuple(tuple(c) for c in ranks.acts[r]))
                                      for r in range(n_stages)))


class _Reader(NamedTuple):
    """An op reading a weight: its node, its position in the node, the input slot."""

    node: int
    pos: int
    slot: int


def _weight_readers(graph: OpGraph, nodes: list[Node]) -> dict[str, list[_Reader]]:
    readers: dict[str, list[_Reader]] = {}
    for v, node in enumerate(nodes):
        for pos, i in enumerate(node.ops):
            for k, n in enumerate(graph.ops[i].inputs):
                val = graph.value(n)
                if val.kind == "param":
                    readers.setdefault(val.base or n, []).append(_Reader(v, pos, k))
    return readers


@dataclass(frozen=True, eq=False)
class _TiedWeight:
    """The terms of one weight several ops read, per pair of their strategies."""

    ctx: CostContext
    nodes: list[Node]
    weight: str

    def placed(self, r: _Reader, j: int) -> Placement:
        s = self.nodes[r.node].choices[j][r.pos]
        return s.inputs[r.slot] if r.slot < len(s.inputs) else REPLICATE

    def grad_all_reduce_s(self, r: _Reader, j: int) -> tuple[float, float] | None:
        """Reader ``r``'s gradient all-reduce of the weight under strategy j: (per
        micro-batch when it runs in backward, once per step) seconds (None: its gradient is
        whole)."""
        ctx = self.ctx
        comms = [c for c in self.nodes[r.node].choices[j][r.pos].comms
                 if c.phase == "step" and ctx.graph.value(c.value).base == self.weight]
        if not comms:
            return None
        return (sum(ctx.collective_s(c.kind, collective_bytes(ctx, c.value, c.scale, "bwd"))
                    for c in comms),
                sum(ctx.collective_s(c.kind, collective_bytes(ctx, c.value, c.scale, "step"))
                    for c in comms))

    def every_microbatch_s(self, r: _Reader, j: int) -> float | None:
        """What that all-reduce adds when it runs every micro-batch instead of once per step."""
        x = self.grad_all_reduce_s(r, j)
        return None if x is None else self.ctx.microbatches * x[0] - x[1]

    def pair_s(self, r: _Reader, i: int, q: _Reader, j: int) -> float:
        """Reader ``r`` under strategy i beside reader ``q`` under j: cannot run where they
        place the weight differently; else what a mixed partial/whole gradient adds."""
        if self.placed(r, i) != self.placed(q, j):
            return INFEASIBLE_S
        a, b = self.every_microbatch_s(r, i), self.every_microbatch_s(q, j)
        if (a is None) == (b is None):
            return 0.0
        return a if a is not None else b

    def add_rank_share(self, ranks: _RankTerms, r: _Reader, i: int, q: _Reader, j: int,
                       on: tuple[int, int]) -> None:
        """The pair's per-rank share, on edge ``on`` (a, b) (or node a where a == b; (q's
        node, r's node): the matrix is indexed the other way round): the partial reader's
        rank gets its per-micro-batch all-reduce (backward) and loses its per-step one."""
        a, b = on
        flip = on != (r.node, q.node)
        if self.placed(r, i) != self.placed(q, j):
            return
        x, y = self.grad_all_reduce_s(r, i), self.grad_all_reduce_s(q, j)
        if (x is None) == (y is None):
            return
        nodes = self.nodes
        (mb, once), op = ((x, nodes[r.node].ops[r.pos]) if x is not None
                          else (y, nodes[q.node].ops[q.pos]))
        rank = ranks.stage_of[op]
        if a == b:
            ranks.bwd[rank][a][i] += mb
            ranks.step[rank][a][i] -= once
            return
        for acc, amount in ((ranks.edge_bwd[rank], mb), (ranks.edge_step[rank], -once)):
            mat = acc.setdefault((a, b), [[0.0] * len(nodes[b].choices)
                                          for _ in range(len(nodes[a].choices))])
            mat[j if flip else i][i if flip else j] += amount


def _tie_shared_weights(ctx: CostContext, nodes: list[Node], edge_mats: EdgeTerms,
                        costs: list[list[float]], ranks: _RankTerms | None = None) -> None:
    """A weight read by several ops (an LM head tied to the embedding) is one tensor with one
    placement: strategy pairs that would lay it out differently cannot run. And where one
    reader's gradient is partial (all-reduced once per step) and another's whole, the partial
    one is all-reduced every micro-batch instead (``sharding._mixed_weight_grads``): the pair
    pays the difference (``ranks``: on the partial reader's pipeline rank)."""
    for weight, occ in sorted(_weight_readers(ctx.graph, nodes).items()):
        tie = _TiedWeight(ctx, nodes, weight)
        first = occ[0]
        for other in occ[1:]:
            if first.node == other.node:
                _tie_inside_node(tie, costs, ranks, first, other)
            else:
                _tie_across_nodes(tie, edge_mats, ranks, first, other)


def _tie_inside_node(tie: _TiedWeight, costs: list[list[float]], ranks: _RankTerms | None,
                     first: _Reader, other: _Reader) -> None:
    u = first.node
    for j in range(len(tie.nodes[u].choices)):
        costs[u][j] += tie.pair_s(first, j, other, j)
        if ranks is not None:
            tie.add_rank_share(ranks, first, j, other, j, (u, u))


def _tie_across_nodes(tie: _TiedWeight, edge_mats: EdgeTerms, ranks: _RankTerms | None,
                      first: _Reader, other: _Reader) -> None:
    """On the pair's edge matrix (the existing one, either way round, else a new one)."""
    nodes, u, v = tie.nodes, first.node, other.node
    a, b = (u, v) if (u, v) in edge_mats or (v, u) not in edge_mats else (v, u)
    acc = edge_mats.setdefault((a, b), [[0.0] * len(nodes[b].choices)
                                        for _ in range(len(nodes[a].choices))])
    flip = (a, b) != (u, v)
    for i in range(len(nodes[u].choices)):
        for j in range(len(nodes[v].choices)):
            x = tie.pair_s(first, i, other, j)
            if ranks is not None:
                tie.add_rank_share(ranks, first, i, other, j, (a, b))
            if flip:
                acc[j][i] += x
            else:
                acc[i][j] += x


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
