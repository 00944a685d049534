"""The sharding ILP of one pipelined configuration, with its whole step.

The shared tp-axis ILP (``problem.py``) prices a sharding's per-micro-batch costs over the whole
model, as if it ran on one stage. A pipelined configuration's step (``estimate``'s, simulated)
is instead paced by its schedule: the longest chain of forwards, backwards and sends that wait
on one another (``estimate/critical_path.py``), then the data-parallel, ZeRO and optimizer
terms of the stage where they are largest. For one configuration with its stage layout fixed
(``chunk_layers``, each stage's recompute policy) this module writes that step as an ILP over
the same choices:
- each chunk's forward and backward seconds per micro-batch are linear in the choice
  (``reduce_graph(..., stages=...)``: each node's instances and each edge's consumers counted
  on the chunk that runs them), with its rank's own recompute policy;
- the sends are affine in the bytes that cross each boundary, whose placement the producing
  node's choice decides;
- the schedule's step is the longest of some critical paths, each a count of every chunk's
  forwards and backwards and of every boundary's sends (``ILPProblem.maxima``): the path of
  the schedule simulated at a reference choice (the shared ILP's answer), and those found at
  the answers of earlier solves (``finalists.refine_pipe_ilp`` adds each new one and solves
  again, a cutting plane). Every path is a chain of the schedule at any choice, so the longest
  is the simulated step wherever one of them is critical there, and below it elsewhere (zero
  bubble's weight gradients are placed where they fit, which the times decide: there a path
  found at one choice may not be a chain at another);
- the data-parallel terms are ``dp_problem``'s, for the parameters the rank holds, priced at
  the rank where they are largest at the reference (linearized there, as ``dp_problem``'s).
The objective equals the estimate of the plan a choice makes, with the pipeline simulated and
its collectives priced in closed form, at any choice that keeps the reference's critical path
and dp rank (``tests/test_ilp_objective.py``), and the search solves again where the answer
moved them. Each rank's memory is a row: the model state of the parameters it holds and the
activations of the micro-batches it keeps in flight, linear in the choice (``rank_memory``),
within the room the reference's estimate leaves beside its transient buffers; the estimate
checks the plan the answer makes before it is kept.
A weight read by several nodes (a tied LM head) costs its readers' ranks what the shared
problem's pair terms say, each on the rank of the reader whose gradient all-reduce moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.cost.dtypes import own_sizes
from autoplan.cost.memory import held_meta_bytes, model_state_bytes
from autoplan.estimate.chunk_cost import boundary_values, chunk_parts
from autoplan.estimate.critical_path import CriticalPath, critical_path
from autoplan.estimate.layout import in_flight
from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.cost_context import CostContext
from autoplan.planner.dp_problem import DpPricing, Held, dp_pieces, framework_s, held_params
from autoplan.planner.ilp import ILPProblem, Linear
from autoplan.planner.problem import INFEASIBLE_S, Reduction, reduce_graph
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.placement import REPLICATE


@dataclass(frozen=True)
class PipeTerms:
    """What the ILP is made of, whatever the choice it is linearized at: per chunk its forward
    and backward seconds per micro-batch (its rank's recompute policy's reduction), per rank
    their sums, its per-step tp seconds, the parameters each choice holds there and the
    activation bytes it keeps per micro-batch, and per chunk boundary the send of one
    micro-batch's activations."""

    red: Reduction
    chunk_fwd: tuple[Linear, ...]
    chunk_bwd: tuple[Linear, ...]
    fwd: tuple[Linear, ...]
    bwd: tuple[Linear, ...]
    step: tuple[Linear, ...]
    sends: tuple[Linear, ...]         # per chunk boundary (zero between two chunks of a rank)
    held: tuple[Held, ...]
    acts: tuple[Linear, ...]          # per rank: activation bytes kept per micro-batch


@dataclass(frozen=True)
class PipeProblem:
    """One pipelined configuration's ILP: its choices are ``red``'s (``sharding_from_choice``
    takes them); ``path``: the critical path of the schedule at the choice it was built at;
    ``paths``: every critical path its objective takes the longest of (``path`` first);
    ``bottleneck``: the rank busiest there; ``worst``: the rank whose dp terms it prices;
    ``terms``: to build it again at another choice."""

    problem: ILPProblem
    red: Reduction
    path: CriticalPath
    paths: tuple[CriticalPath, ...]
    bottleneck: int
    worst: int
    terms: PipeTerms


def stage_ranges(chunks: Sequence[Any], config: ParallelConfig) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, the op ranges of its chunks."""
    return [[(chunks[c].start, chunks[c].stop) for c in config.rank_chunks(r)]
            for r in range(config.pp)]


def _plus(*forms: tuple[float, Linear]) -> Linear:
    """sum k x form, over (k, form) pairs aligned with one problem."""
    base = forms[0][1]
    nodes = [[0.0] * len(row) for row in base.nodes]
    edges = [[[0.0] * len(r) for r in m] for m in base.edges]
    const = 0.0
    for k, f in forms:
        const += k * f.const
        for v, row in enumerate(f.nodes):
            for j, x in enumerate(row):
                nodes[v][j] += k * x
        for e, m in enumerate(f.edges):
            for i, r in enumerate(m):
                for j, x in enumerate(r):
                    edges[e][i][j] += k * x
    return Linear(const, tuple(tuple(r) for r in nodes),
                  tuple(tuple(tuple(r) for r in m) for m in edges))


def _stage_held(held: Held, red: Reduction, cs: Sequence[int], tensors: int,
                layers: int) -> Held:
    """What a rank holds: each node's instances in its chunks ``cs`` (``red``'s stages)."""
    def part(x: Linear) -> Linear:
        return Linear(0.0, tuple(tuple(c * sum(red.stage_share[v][k] for k in cs)
                                       / red.nodes[v].mult for c in row)
                                 for v, row in enumerate(x.nodes)))
    return Held(part(held.dense), part(held.experts), part(held.in_layers), part(held.whole),
                tensors, layers)


def _sends(graph: OpGraph, red: Reduction, ctx: CostContext, chunks: Sequence[Any],
           config: ParallelConfig, cluster: Any) -> tuple[Linear, ...]:
    """Per chunk boundary, the send of one micro-batch's activations across it
    (``estimate._sends``): the path's latency, and per crossing value the bytes its producer's
    choice leaves it (split over tp or whole), over the path's bandwidth; nothing between two
    chunks of one rank."""
    a = analyze(graph)
    own = own_sizes(ctx.held)     # activations' autocast dtypes
    zero = tuple(tuple(tuple(0.0 for _ in r) for r in m) for _, _, m in red.problem.edges)
    out = []
    for c in range(len(chunks) - 1):
        rows = [[0.0] * len(node.choices) for node in red.nodes]
        const = 0.0
        ra, rb = config.chunk_rank(c), config.chunk_rank(c + 1)
        if ra != rb:                     # (the V's turn: one rank, nothing sent)
            src, dst = (config.dims.rank_at({MeshAxis.PP: r}) for r in (ra, rb))
            latency = cluster.p2p_time_s(0.0, src, dst)
            per_byte = (cluster.p2p_time_s(2.0 ** 20, src, dst) - latency) / 2.0 ** 20
            const += latency
            for n in boundary_values(graph, chunks[c].stop):
                nbytes = held_meta_bytes(n, graph.value(n).meta, config.precision, own) * (
                    ctx.batch_scale if n in a.batch_dependent else 1.0)
                if ctx.context is not None:
                    nbytes *= ctx.context.value_scale(n)
                i = a.producer.get(n)
                u = red.node_of.get(red.rep[i]) if i is not None else None
                if u is None:
                    const += per_byte * nbytes
                    continue
                rp = red.rep[i]
                x_rep = graph.ops[rp].outputs[graph.ops[i].outputs.index(n)]
                for j, place in enumerate(red.nodes[u].placement):
                    split = place.get(x_rep, REPLICATE).kind == "S"
                    rows[u][j] += per_byte * nbytes / (config.tp if split else 1)
        out.append(Linear(const, tuple(tuple(r) for r in rows), zero))
    return tuple(out)


def terms(graph: OpGraph, cluster: Any, config: ParallelConfig, chunks: Sequence[Any],
          context_for: Callable[[str], CostContext]) -> PipeTerms:
    """``build``'s ingredients for ``config`` (pipelined, its layout fixed: ``chunks``);
    ``context_for(policy)``: the cost context of a recompute policy (the mesh's, with its
    micro-batches)."""
    p = config.pp
    ranges = [[(ch.start, ch.stop)] for ch in chunks]
    policies = [config.chunk_policy(c) for c in range(len(chunks))]
    reds = {pol: reduce_graph(context_for(pol), stages=ranges) for pol in sorted(set(policies))}
    red = next(iter(reds.values()))
    of = [reds[pol] for pol in policies]
    chunk_fwd = tuple(x.stage_fwd[c] for c, x in enumerate(of))
    chunk_bwd = tuple(x.stage_bwd[c] for c, x in enumerate(of))

    def per_rank(forms: Sequence[Linear]) -> tuple[Linear, ...]:
        return tuple(_plus(*((1.0, forms[c]) for c in config.rank_chunks(r)))
                     for r in range(p))
    ranks_held = []
    for r in range(p):
        cs = [chunks[c] for c in config.rank_chunks(r)]
        # each weight once on a rank (a V schedule's tied ends on rank 0), once on each rank
        # holding a copy
        tensors = len({graph.value(n).base for ch in cs for start, stop, _ in chunk_parts(ch)
                       for i in range(start, stop) for n in graph.ops[i].inputs
                       if graph.value(n).kind == "param"})
        mine = {v for v in range(len(red.nodes))
                if any(red.stage_share[v][k] for k in config.rank_chunks(r))}
        held = held_params(graph, red, config.tp, config.ep, among=mine)
        ranks_held.append(_stage_held(held, red, config.rank_chunks(r), tensors,
                                      max(1, sum(len(ch.layers) for ch in cs))))
    return PipeTerms(red, chunk_fwd, chunk_bwd, per_rank(chunk_fwd), per_rank(chunk_bwd),
                     per_rank([x.stage_step[c] for c, x in enumerate(of)]),
                     _sends(graph, red, context_for(config.stage_policy(0)), chunks, config,
                            cluster), tuple(ranks_held),
                     per_rank([x.stage_acts[c] for c, x in enumerate(of)]))


def rank_memory(t: PipeTerms, config: ParallelConfig, m: int,
                flight: Sequence[float] | None = None) -> tuple[Linear, ...]:
    """Per pipeline rank, the device bytes the choice decides there (``estimate``'s stage
    memory less its transient buffers and margin): the model state of the parameters it holds,
    ZeRO-sharded as ``config`` shards them, and the activations of the micro-batches it keeps in
    flight under its schedule: ``flight`` per rank (the simulated estimate's
    ``microbatches_in_flight`` at some choice), else the closed form's (``layout.in_flight``)."""
    state = model_state_bytes(1.0, dp=config.shard_degree, zero_stage=config.zero_stage,
                              precision=config.precision, optimizer=config.optimizer,
                              offload_optimizer=config.offload_optimizer,
                              offload_params=config.offload_params,
                              mixed_precision=config.mixed_precision,
                              optimizer_state=config.optimizer_state).total_bytes
    flights = list(flight) if flight is not None else [in_flight(config, m, r)
                                                       for r in range(config.pp)]
    return tuple(_plus((state, held.dense), (flights[r], acts))
                 for r, (held, acts) in enumerate(zip(t.held, t.acts)))


def build(graph: OpGraph, pricing: DpPricing, *, chunks: Sequence[Any],
          context_for: Callable[[str], CostContext], reference: Sequence[int],
          made: PipeTerms | None = None, memory_rows: tuple[tuple[Linear, float], ...] = (),
          paths: Sequence[CriticalPath] = ()) -> PipeProblem:
    """The ILP of ``pricing.config`` (pipelined, its layout fixed: ``chunks``), linearized at
    the choice ``reference``; ``context_for(policy)``: the cost context of a recompute policy
    (the mesh's, with ``pricing.microbatches``). The schedule's step is the longest of the
    critical path at ``reference`` and ``paths`` (those found at other choices: a cutting
    plane each); ``made``: the ``terms`` already made (a previous problem's); ``memory_rows``:
    per rank, its ``rank_memory`` and the most it may be."""
    config, cluster, m = pricing.config, pricing.cluster, pricing.microbatches
    p, v = config.pp, config.virtual_stages
    t = made or terms(graph, cluster, config, chunks, context_for)
    any_red, step = t.red, t.step
    problem = any_red.problem
    options = tuple(tuple((j, False) for j in range(len(row))) for row in problem.node_costs)
    dp = [dp_pieces(problem, t.held[r], options, pricing, pp_index=r, fwd=t.fwd[r],
                    bwd=t.bwd[r], start=reference) for r in range(p)]

    def at(forms: Sequence[Linear]) -> list[float]:
        return [f.value(problem, reference) for f in forms]
    path = critical_path(schedule=config.schedule, p=p, v=v, m=m, fwd_s=at(t.chunk_fwd),
                         bwd_s=at(t.chunk_bwd), send_s=at(t.sends))
    paths = tuple(dict.fromkeys((path, *paths)))
    busy = [f + b for f, b in zip(at(t.fwd), at(t.bwd))]
    bottleneck = max(range(p), key=lambda r: busy[r])
    worst = max(range(p), key=lambda r: _dp_value(problem, dp[r], step[r], reference))
    longest = tuple(_plus(*((a, f) for a, f in zip(q.fwd, t.chunk_fwd)),
                          *((b, f) for b, f in zip(q.bwd, t.chunk_bwd)),
                          *((k, f) for k, f in zip(q.sends, t.sends))) for q in paths)
    rows, constant, overlaps, charges = dp[worst]
    ops = sum(chunks[c].stop - chunks[c].start for c in config.rank_chunks(bottleneck))
    constant += framework_s(graph, pricing.profile, pricing.compute, m, ops)
    # what cannot run stays so (a tied weight laid out two ways: the shared problem's terms)
    def cannot(x: float) -> float:
        return INFEASIBLE_S if x >= INFEASIBLE_S else 0.0
    worst_step = step[worst]
    out = replace(
        problem,
        node_costs=tuple(tuple(x + y + cannot(z) for x, y, z in zip(a, b, c))
                         for a, b, c in zip(worst_step.nodes, rows, problem.node_costs)),
        edges=tuple((u, w, tuple(tuple(x + cannot(z) for x, z in zip(r, rz))
                                 for r, rz in zip(mat, shared)))
                    for (u, w, shared), mat in zip(problem.edges, _edges(worst_step, problem))),
        memory_budget=None, overlaps=overlaps, charges=charges,
        constant_s=worst_step.const + constant, memory_rows=memory_rows, maxima=(longest,))
    return PipeProblem(out, any_red, path, paths, bottleneck, worst, t)


def _edges(form: Linear, problem: ILPProblem) -> tuple:
    """``form``'s edge terms, zeros where it has none."""
    if form.edges:
        return form.edges
    return tuple(tuple(tuple(0.0 for _ in r) for r in m) for _, _, m in problem.edges)


def _dp_value(problem: ILPProblem, pieces: tuple, step: Linear, choice: Sequence[int]) -> float:
    """A rank's per-step terms at ``choice``: its tp step all-reduces and its dp terms."""
    rows, constant, overlaps, charges = pieces
    total = step.value(problem, choice) + constant + sum(
        rows[v][j] for v, j in enumerate(choice))
    total += sum(o.value(problem, choice) for o in overlaps)
    return total + sum(c for c, when in charges if any(choice[v] == j for v, j in when))
