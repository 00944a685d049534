"""The sharding ILP of one configuration, with the rest of its step.

The tp-axis ILP (``problem.py``) prices what the sharding does to each micro-batch: compute,
recomputation, tensor-parallel collectives. It is solved once per mesh and micro-batch size
and shared by every ZeRO stage, recompute policy and offload choice costed on it. But the
sharding also decides what data parallelism moves: a weight split over tp has 1/tp of its
gradient to all-reduce over dp, of its shard to gather under FSDP, of its elements to step.
For one configuration this module adds those terms, as ``estimate`` prices them
(``estimate/dp_terms.py``: gradient sync, ZeRO gathers, optimizer, host traffic), so that the
ILP's objective for a choice is the estimate's step time of the plan the choice makes:
- the terms' seconds are functions of the parameters a rank holds (``StageParams``), which are
  linear in the choice (each node's strategy says which of its weights it splits); the
  collectives are affine in their bytes on each side of the flat/hierarchical crossover, so
  they are linearized at a reference choice (the tp-axis ILP's answer): exact where the
  algorithm does not change, which is where the search moves;
- the traffic hidden behind the forward or backward compute becomes an ``Overlap`` term of the
  ILP (one binary each), with the compute window the choice makes (``Reduction.fwd``/``bwd``);
- the optimizer step and host traffic are linear; the framework's per-op time is a constant.

One pipeline stage only (pp = 1): a pipelined configuration's ILP is ``pipe_problem``'s, which
takes each rank's terms from ``dp_pieces``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

from autoplan.estimate.chunk_cost import chunk_parts
from autoplan.estimate.dp_terms import StageParams, Term, stage_terms
from autoplan.estimate.partition import partition
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.ilp import ILPProblem, Linear, Overlap
from autoplan.planner.problem import INFEASIBLE_S, Reduction
from autoplan.sharding.parallel_config import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class DpPricing:
    """What the data-parallel terms are priced with, for one configuration: its degrees and
    ZeRO stage, the cluster, the micro-batches per step, the compute model, the measured
    profile (None: none), and how much overlapped traffic slows the compute it hides behind."""

    config: ParallelConfig
    cluster: Any
    microbatches: int
    compute: Any
    profile: Any = None
    interference: float


@dataclass(frozen=True)
class Held:
    """Per node and choice, the parameter elements one rank holds, for all instances the node
    stands for: sharded as the configuration shards them (outside the experts), expert slabs,
    (of all) inside the layers, and weights ZeRO-3 keeps whole (``dp_whole``)."""

    dense: Linear
    experts: Linear
    in_layers: Linear
    whole: Linear
    tensors: int            # parameter tensors the optimizer steps (whatever the sharding)
    layers: int

    def at(self, problem: ILPProblem, choice: Sequence[int]) -> tuple[float, ...]:
        return tuple(x.value(problem, choice)
                     for x in (self.dense, self.experts, self.in_layers, self.whole))


def held_params(graph: OpGraph, red: Reduction, t: int, ep: int, *,
                among: Collection[int] | None = None) -> Held:
    """What each choice holds (as ``chunk_cost`` counts a rank's parameters: each storage once,
    in the first node reading it, split over tp where the strategy reads it split, expert slabs
    over ep). ``among``: the nodes of one pipeline rank, which hold once what they share (a V
    schedule's tied embedding and LM head on rank 0); the other nodes count all they read,
    as the ranks they run on each hold a copy."""
    experts_of = set()
    if ep > 1:
        found = find_experts(graph)
        experts_of = set(found.param_values) if found is not None else set()
    (chunk,) = partition(graph, 1)
    in_layer: set[int] = set()
    for start, stop, is_layer in chunk_parts(chunk):
        if is_layer:
            in_layer.update(range(start, stop))
    tensors = len({graph.value(n).base for op in graph.ops for n in op.inputs
                   if graph.value(n).kind == "param"})
    dense, expert, layer = [], [], []
    claimed: set[str] = set()      # a weight two nodes read (tied): the first one holds it
    for u, node in enumerate(red.nodes):
        shares = among is None or u in among
        d_row, e_row, l_row = [], [], []
        mine = {graph.value(n).base for i in node.ops for n in graph.ops[i].inputs
                if graph.value(n).kind == "param"}
        for chosen in node.choices:
            seen: set[str] = set(claimed) if shares else set()
            d = e = lay = 0.0
            for i, s in zip(node.ops, chosen):
                for k, n in enumerate(graph.ops[i].inputs):
                    v = graph.value(n)
                    if v.kind != "param" or v.base in seen:
                        continue
                    seen.add(v.base)
                    split = k < len(s.inputs) and s.inputs[k].kind == "S"
                    held = v.meta.numel / (t if split else 1)
                    if v.base in experts_of:
                        held /= ep
                        e += held
                    else:
                        d += held
                    if i in in_layer:
                        lay += held
            d_row.append(node.mult * d)
            e_row.append(node.mult * e)
            l_row.append(node.mult * lay)
        if shares:
            claimed |= mine
        dense.append(tuple(d_row))
        expert.append(tuple(e_row))
        layer.append(tuple(l_row))
    zero = tuple(tuple(0.0 for _ in row) for row in dense)
    return Held(Linear(0.0, tuple(dense)), Linear(0.0, tuple(expert)), Linear(0.0, tuple(layer)),
                Linear(0.0, zero), tensors, max(1, len(chunk.layers)))


def _combine(held: Held, coef: Sequence[float], const: float) -> Linear:
    """const + coef . (sharded, experts, in-layer, whole) elements, per node and choice."""
    rows = tuple(tuple(sum(c * x for c, x in zip(coef, xs)) for xs in zip(*cols))
                 for cols in zip(held.dense.nodes, held.experts.nodes, held.in_layers.nodes,
                                 held.whole.nodes))
    return Linear(const, rows)


def _tangent(f: Callable[..., float], at: Sequence[float]
             ) -> tuple[tuple[float, ...], float]:
    """(gradient, intercept) of ``f`` at ``at`` by forward differences (``f`` is affine in
    each of its arguments on each side of a collective's algorithm crossover)."""
    f0 = f(*at)
    grad = []
    for k in range(len(at)):
        step = max(abs(at[k]) * 1e-3, 1.0)
        moved = list(at)
        moved[k] += step
        grad.append((f(*moved) - f0) / step)
    return tuple(grad), f0 - sum(g * x for g, x in zip(grad, at))


@dataclass(frozen=True)
class DpProblem:
    """One configuration's ILP. Under ZeRO-3 every node holding weights has each strategy
    twice: its weights sharded over dp, or kept whole (``options``: per node and choice, the
    strategy of the shared problem and whether its weights are kept whole)."""

    problem: ILPProblem
    options: tuple[tuple[tuple[int, bool], ...], ...]

    def strategies(self, choice: Sequence[int]) -> tuple[int, ...]:
        """The shared problem's choice (``sharding_from_choice`` takes it)."""
        return tuple(self.options[v][k][0] for v, k in enumerate(choice))

    def whole_nodes(self, choice: Sequence[int]) -> list[int]:
        return [v for v, k in enumerate(choice) if self.options[v][k][1]]

    def lift(self, strategies: Sequence[int]) -> tuple[int, ...]:
        """The choice of ``strategies`` with every weight sharded."""
        return tuple(opts.index((j, False)) for opts, j in zip(self.options, strategies))


def keeps_weights_whole(config: ParallelConfig) -> bool:
    """Whether the ILP may keep weights whole under ``config``'s ZeRO-3 (``dp_whole``)."""
    return (config.zero_stage == 3 and config.dp > 1 and config.pp == 1 and config.ep == 1
            and config.dp_shard is None and not config.offload_params and config.cp == 1)


def with_dp_terms(red: Reduction, graph: OpGraph, pricing: DpPricing, *,
                  reference: Sequence[int], whole_extra_bytes: float | None = None
                  ) -> DpProblem:
    """``red``'s problem (built for ``pricing.config``'s recompute policy, ZeRO's tp step shard
    and its state bytes per parameter) with its dp, ZeRO, optimizer, offload and framework
    terms, linearized at the choice ``reference`` of ``red``'s problem (see the module doc).
    ``whole_extra_bytes``: under ZeRO-3, what keeping a weight whole adds per element to its
    state (the choice is offered where given, ``keeps_weights_whole``). pp must be 1."""
    config = pricing.config
    if config.pp != 1:
        raise ValueError("the dp terms are priced for one pipeline stage (pp = 1)")
    held = held_params(graph, red, config.tp, config.ep)
    options = tuple(tuple((j, False) for j in range(len(row))) for row in held.dense.nodes)
    problem, fwd, bwd = red.problem, red.fwd, red.bwd
    if whole_extra_bytes is not None and keeps_weights_whole(config) and not config.dp_whole:
        options = tuple(opts + tuple((j, True) for j, _ in opts) if any(row) else opts
                        for opts, row in zip(options, held.dense.nodes))
        problem, fwd, bwd, held = _with_whole(problem, fwd, bwd, held, options,
                                              whole_extra_bytes, _sharing(graph, red))
    out = DpProblem(problem, options)
    start = out.lift(reference)
    rows, constant, overlaps, charges = dp_pieces(problem, held, options, pricing,
                                                  pp_index=0, fwd=fwd, bwd=bwd, start=start)
    costs = tuple(tuple(c + x for c, x in zip(cs, xs))
                  for cs, xs in zip(problem.node_costs, rows))
    return replace(out, problem=replace(
        problem, node_costs=costs, overlaps=problem.overlaps + overlaps,
        constant_s=problem.constant_s + constant + framework_s(
            graph, pricing.profile, pricing.compute, pricing.microbatches),
        charges=problem.charges + charges))


def dp_pieces(problem: ILPProblem, held: Held, options: Any, pricing: DpPricing, *,
              pp_index: int, fwd: Linear, bwd: Linear, start: Sequence[int]
              ) -> tuple[list[list[float]], float, tuple[Overlap, ...], tuple]:
    """Pipeline rank ``pp_index``'s dp, ZeRO, optimizer and offload terms for the parameters
    ``held`` says each choice holds there, hidden behind its compute windows ``fwd`` / ``bwd``,
    linearized at the choice ``start`` of ``problem``: (per node and choice the seconds added,
    a constant, the overlap terms, the charges)."""
    def terms_at(dense: float, experts: float, in_layers: float, whole: float) -> list[Term]:
        stage = StageParams(params=dense + experts + whole, experts=experts,
                            layer_params=in_layers, tensors=held.tensors, layers=held.layers,
                            whole=whole)
        return stage_terms(pricing.config.grad_view(), pricing.cluster, stage,
                           pricing.microbatches, pp_index, pricing.compute, pricing.profile)
    at = held.at(problem, start)
    # whole weights add a term (their all-reduce): the tangent is taken with some held whole
    probe = at if at[3] or not any(o[1] for opts in options for o in opts) else (
        at[0] / 2, at[1], at[2], at[0] / 2)
    base = terms_at(*probe)
    rows = [[0.0] * len(c) for c in problem.node_costs]
    constant = 0.0
    overlaps = []
    charges = []
    whole_options = tuple((v, k) for v, opts in enumerate(options)
                          for k, (_, w) in enumerate(opts) if w)
    for k, term in enumerate(base):
        coef, const = _tangent(lambda *p, k=k: terms_at(*p)[k].seconds, probe)
        comm = _combine(held, coef, const)
        fcoef, fconst = _tangent(lambda *p, k=k: terms_at(*p)[k].first_s, probe)
        first = _combine(held, fcoef, fconst)
        if term.whole_only:         # its latency only where some weight is kept whole
            if term.window:
                comm = replace(comm, const=0.0, switched=((comm.const, whole_options),))
                first = replace(first, const=0.0, switched=((first.const, whole_options),))
            else:
                charges.append((term.times * comm.const, whole_options))
                comm = replace(comm, const=0.0)
        if not term.window:
            constant += term.times * comm.const
            for v, row in enumerate(comm.nodes):
                for j, c in enumerate(row):
                    rows[v][j] += term.times * c
            continue
        window = fwd if term.window == "fwd" else bwd
        overlaps.append(Overlap(comm, window, first, pricing.interference, term.times))
    return rows, constant, tuple(overlaps), tuple(charges)


def _sharing(graph: OpGraph, red: Reduction) -> set[tuple[int, int]]:
    """Pairs of nodes that read one weight (a tied LM head and embedding)."""
    readers: dict[str, set[int]] = {}
    for v, node in enumerate(red.nodes):
        for i in node.ops:
            for n in graph.ops[i].inputs:
                val = graph.value(n)
                if val.kind == "param":
                    readers.setdefault(val.base, set()).add(v)
    return {(u, v) for nodes in readers.values() for u in nodes for v in nodes if u != v}


def _with_whole(problem: ILPProblem, fwd: Linear, bwd: Linear, held: Held,
                options: tuple[tuple[tuple[int, bool], ...], ...], extra_bytes: float,
                sharing: set[tuple[int, int]]) -> tuple[ILPProblem, Linear, Linear, Held]:
    """Everything indexed by the expanded choices: a whole choice costs what its strategy
    costs, holds its sharded weights whole, and adds ``extra_bytes`` per such element. Two
    nodes reading one weight keep it whole or sharded together (``sharing``: their edge)."""
    def nodes(rows: Sequence[Sequence[float]], pick: Any = None) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple((pick or (lambda v, j, w, x: x))(v, j, w, rows[v][j])
                           for j, w in opts) for v, opts in enumerate(options))

    def mats(edges: Sequence[Any]) -> tuple:
        return tuple(tuple(tuple(m[i][j] for j, _ in options[v]) for i, _ in options[u])
                     for (u, v, _), m in zip(problem.edges, edges))

    def lin(x: Linear) -> Linear:
        return Linear(x.const, nodes(x.nodes), mats(x.edges) if x.edges else ())
    dense = held.dense.nodes
    def tied(u: int, v: int, m: Any) -> Any:
        if (u, v) not in sharing:
            return m
        return tuple(tuple(x + (INFEASIBLE_S if wu != wv else 0.0)
                           for x, (_, wv) in zip(row, options[v]))
                     for row, (_, wu) in zip(m, options[u]))
    grown = replace(
        problem, node_costs=nodes(problem.node_costs),
        node_memory=nodes(problem.node_memory,
                          lambda v, j, w, x: x + (extra_bytes * dense[v][j] if w else 0.0)),
        edges=tuple((u, v, tied(u, v, m)) for (u, v, _), m in zip(
            problem.edges, mats([r for _, _, r in problem.edges]))))
    held = Held(Linear(0.0, nodes(dense, lambda v, j, w, x: 0.0 if w else x)),
                lin(held.experts), lin(held.in_layers),
                Linear(0.0, nodes(dense, lambda v, j, w, x: x if w else 0.0)),
                held.tensors, held.layers)
    return grown, lin(fwd), lin(bwd), held


def whole_patterns(graph: OpGraph, red: Reduction, nodes: Sequence[int]) -> tuple[str, ...]:
    """``dp_whole`` for the weights of ``nodes`` in every instance they stand for: one
    pattern per weight of a repeated layer (``layers.*.attention.wq.weight``) where it matches
    exactly those, else the FQNs themselves."""
    wanted: set[str] = set()
    patterns: set[str] = set()
    all_fqns = {graph.value(v.base).fqn for v in graph.param_values}
    for v in nodes:
        for i in red.nodes[v].ops:
            for n in graph.ops[i].inputs:
                val = graph.value(n)
                if val.kind != "param":
                    continue
                fqn = graph.value(val.base).fqn
                names, glob = _instances(graph, i, fqn)
                wanted |= names
                hits = {f for f in all_fqns if fnmatchcase(f, glob)} if glob else set()
                patterns |= {glob} if glob and hits == names else names
    return tuple(sorted(patterns))


def _instances(graph: OpGraph, i: int, fqn: str) -> tuple[set[str], str | None]:
    """The FQNs ``fqn`` (read by op ``i``) stands for in every instance of its block, and a
    pattern for them (the instances' path with its last part a wildcard), if there is one."""
    for block in graph.blocks:
        first = block.instances[0]
        if first.start <= i < first.stop and fqn.startswith(first.path + "."):
            rest = fqn[len(first.path):]
            names = {inst.path + rest for inst in block.instances}
            head = first.path.rsplit(".", 1)[0] if "." in first.path else ""
            alike = all(inst.path.rsplit(".", 1)[0] == head for inst in block.instances)
            glob = (head + "." if head else "") + "*" + rest if alike else None
            return names, glob
    return {fqn}, None


def framework_s(graph: OpGraph, profile: Any, compute: Any, m: int,
                 ops: int | None = None) -> float:
    """The eager framework's time outside the kernels (``estimate``'s overhead): per step, and
    per op forward and backward every micro-batch (``ops``: the bottleneck stage's; default
    the whole graph's)."""
    cal = getattr(profile, "calibration", None)
    if cal is None:
        return 0.0
    if ops is None:
        (chunk,) = partition(graph, 1)
        ops = chunk.stop - chunk.start
    return ((getattr(cal, "step_overhead_s", 0.0) or 0.0)
            + getattr(cal, "framework_s_per_op", 0.0) * 2 * ops * m * compute.slowdown)
