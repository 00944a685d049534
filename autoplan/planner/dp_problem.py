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

One pipeline stage only (pp = 1): with pipelines the bottleneck stage's share and the
simulated schedule would enter, and the search keeps the shared sharding there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.estimate.config import ParallelConfig
from autoplan.estimate.dp_terms import StageParams, Term, stage_terms
from autoplan.estimate.partition import partition
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.ilp import ILPProblem, Linear, Overlap
from autoplan.planner.problem import Reduction


@dataclass(frozen=True)
class Held:
    """Per node and strategy, the parameter elements one rank holds, for all instances the node
    stands for: outside the experts, in expert slabs, and (of both) inside the layers."""

    dense: Linear
    experts: Linear
    in_layers: Linear
    tensors: int            # parameter tensors the optimizer steps (whatever the sharding)
    layers: int

    def at(self, problem: ILPProblem, choice: Sequence[int]) -> tuple[float, float, float]:
        return (self.dense.value(problem, choice), self.experts.value(problem, choice),
                self.in_layers.value(problem, choice))


def held_params(graph: OpGraph, red: Reduction, t: int, ep: int) -> Held:
    """What each choice holds (as ``chunk_cost`` counts a rank's parameters: each storage once
    per node, split over tp where the strategy reads it split, expert slabs over ep)."""
    from autoplan.estimate.chunk_cost import chunk_parts
    experts_of = set()
    if ep > 1:
        from autoplan.graph.experts import find_experts
        found = find_experts(graph)
        experts_of = set(found.param_values) if found is not None else set()
    (chunk,) = partition(graph, 1)
    in_layer: set[int] = set()
    tensors = 0
    for start, stop, is_layer in chunk_parts(chunk):
        if is_layer:
            in_layer.update(range(start, stop))
        tensors += len({graph.value(n).base for i in range(start, stop)
                        for n in graph.ops[i].inputs if graph.value(n).kind == "param"})
    dense, expert, layer = [], [], []
    for node in red.nodes:
        d_row, e_row, l_row = [], [], []
        for chosen in node.choices:
            seen: set[str] = set()
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
        dense.append(tuple(d_row))
        expert.append(tuple(e_row))
        layer.append(tuple(l_row))
    return Held(Linear(0.0, tuple(dense)), Linear(0.0, tuple(expert)), Linear(0.0, tuple(layer)),
                tensors, max(1, len(chunk.layers)))


def _combine(held: Held, coef: tuple[float, float, float], const: float) -> Linear:
    """const + coef . (dense, experts, in-layer) elements, per node and strategy."""
    a, b, c = coef
    rows = tuple(tuple(a * x + b * y + c * z for x, y, z in zip(dr, er, lr))
                 for dr, er, lr in zip(held.dense.nodes, held.experts.nodes,
                                       held.in_layers.nodes))
    return Linear(const, rows)


def _tangent(f: Callable[[float, float, float], float], at: tuple[float, float, float]
             ) -> tuple[tuple[float, float, float], float]:
    """(gradient, intercept) of ``f`` at ``at`` by forward differences (``f`` is affine in
    each of its arguments on each side of a collective's algorithm crossover)."""
    f0 = f(*at)
    grad = []
    for k in range(3):
        step = max(abs(at[k]) * 1e-3, 1.0)
        moved = list(at)
        moved[k] += step
        grad.append((f(*moved) - f0) / step)
    return tuple(grad), f0 - sum(g * x for g, x in zip(grad, at))


def with_dp_terms(red: Reduction, graph: OpGraph, cluster: Any, config: ParallelConfig,
                  m: int, compute: Any, profile: Any, interference: float,
                  reference: Sequence[int]) -> ILPProblem:
    """``red``'s problem (built for ``config``'s recompute policy and ZeRO's tp step shard)
    with ``config``'s dp, ZeRO, optimizer, offload and framework terms, linearized at the
    choice ``reference`` (see the module doc). pp must be 1."""
    if config.pp != 1:
        raise ValueError("the dp terms are priced for one pipeline stage (pp = 1)")
    problem = red.problem
    held = held_params(graph, red, config.tp, config.ep)

    def terms_at(dense: float, experts: float, in_layers: float) -> list[Term]:
        stage = StageParams(params=dense + experts, experts=experts, layer_params=in_layers,
                            tensors=held.tensors, layers=held.layers)
        return stage_terms(config, cluster, stage, m, 0, compute, profile)
    at = held.at(problem, reference)
    base = terms_at(*at)
    costs = [list(c) for c in problem.node_costs]
    constant = problem.constant_s + _framework_s(graph, profile, compute, m)
    overlaps = list(problem.overlaps)
    for k, term in enumerate(base):
        coef, const = _tangent(lambda *p, k=k: terms_at(*p)[k].seconds, at)
        comm = _combine(held, coef, const)
        if not term.window:
            constant += term.times * comm.const
            for v, row in enumerate(comm.nodes):
                for j, c in enumerate(row):
                    costs[v][j] += term.times * c
            continue
        fcoef, fconst = _tangent(lambda *p, k=k: terms_at(*p)[k].first_s, at)
        window = red.fwd if term.window == "fwd" else red.bwd
        overlaps.append(Overlap(comm, window, _combine(held, fcoef, fconst), interference,
                                term.times))
    return replace(problem, node_costs=tuple(tuple(c) for c in costs), overlaps=tuple(overlaps),
                   constant_s=constant)


def _framework_s(graph: OpGraph, profile: Any, compute: Any, m: int) -> float:
    """The eager framework's time outside the kernels (``estimate``'s overhead): per step, and
    per op forward and backward every micro-batch."""
    cal = getattr(profile, "calibration", None)
    if cal is None:
        return 0.0
    (chunk,) = partition(graph, 1)
    return ((getattr(cal, "step_overhead_s", 0.0) or 0.0)
            + getattr(cal, "framework_s_per_op", 0.0) * 2 * (chunk.stop - chunk.start) * m
            * compute.slowdown)
