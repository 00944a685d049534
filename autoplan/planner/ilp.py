"""The sharding ILP (Alpa-style intra-operator pass), solved with PuLP / CBC.

Math. Nodes ``v`` (a group of ops that share one decision), each with strategies
``j = 0..k_v-1``; edges ``(u, v)`` where a tensor produced in ``u`` is consumed in ``v``.

Variables
    x[v, j] in {0, 1}      node v uses strategy j
    e[u, v, i, j] in [0,1] u uses i and v uses j (one per edge and strategy pair)
Objective (seconds per training step)
    min  sum_v sum_j c[v, j] x[v, j]  +  sum_(u,v) sum_(i,j) r[u, v, i, j] e[u, v, i, j]
    c: compute and the strategy's own collectives; r: resharding between the two placements.
Constraints
    one_strategy[v]:       sum_j x[v, j] = 1
    edge_row[u, v, i]:     sum_j e[u, v, i, j] = x[u, i]
    edge_col[u, v, j]:     sum_i e[u, v, i, j] = x[v, j]
    memory:                sum_v sum_j m[v, j] x[v, j] <= budget        (when a budget is given)
    memory_row[k]:         an affine function of x <= its bound         (``memory_rows``)
With x integral the two edge families force e = x_u (outer) x_v, so the linearization is exact.
Nodes with one strategy carry no variable: their terms fold into constants and neighbours' c.

Charges: a cost paid once where any of some strategies is chosen (a collective that runs when
some weight is kept whole): u >= x[v, j] for each, u in [0, 1], objective += cost * u. An
affine function's switched amounts (``Linear.switched``) take such a u the same way.

Overlap terms (data parallelism's traffic behind the compute, ``dp_problem``). Each prices
    times * (max(C - W, F) + phi * min(C, W))        (``estimate.overlap.overlap_exposed_s``)
where C (the communication), W (the compute window) and F (the part that cannot hide) are
affine in x and e (``Linear``). The max is convex: z >= C - W, z >= F. The min is not: it takes
one binary b and a bound M on C and W, y >= C - M b, y >= W - M (1 - b); minimizing picks
y = min(C, W). Objective += times * (z + phi * y).

Maxima (a pipelined configuration's step: the longest of the schedule's critical paths, each
affine in x and e, ``pipe_problem``): z >= L for each form L of a group, objective += z; the
minimum puts z on the largest.

Every solve has a time limit, runs CBC single-threaded (deterministic), checks the status
(PuLP says "Optimal" even when the time limit stopped CBC: ``sol_status`` tells) and reports
the objective, the best bound (from CBC's log), the gap and the problem size.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import pulp

from autoplan.errors import AutoplanError
from autoplan.estimate.overlap import overlap_exposed_s


Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Linear:
    """An affine function of the choice: ``const`` + nodes[v][j] for each node's strategy j +
    edges[k][i][j] for each edge k of the problem (aligned with ``ILPProblem.edges``; empty:
    no edge terms)."""

    const: float
    nodes: Matrix
    edges: tuple[Matrix, ...] = ()
    # (amount >= 0, ((node, strategy), ...)): added once where any of those is chosen
    switched: tuple[tuple[float, tuple[tuple[int, int], ...]], ...] = ()

    def value(self, problem: ILPProblem, choice: tuple[int, ...] | list[int]) -> float:
        total = self.const + sum(self.nodes[v][j] for v, j in enumerate(choice))
        for (u, v, _), mat in zip(problem.edges, self.edges):
            total += mat[choice[u]][choice[v]]
        return total + sum(a for a, when in self.switched
                           if any(choice[v] == j for v, j in when))

    def scaled(self, k: float) -> Linear:
        return Linear(self.const * k, tuple(tuple(c * k for c in cs) for cs in self.nodes),
                      tuple(tuple(tuple(c * k for c in row) for row in m) for m in self.edges),
                      tuple((a * k, when) for a, when in self.switched))

    def upper_bound(self, below: float = math.inf) -> float:
        """The largest value over all choices, counting only terms under ``below``."""
        def top(values) -> float:
            return max((c for c in values if c < below), default=0.0)
        return (self.const + sum(top(cs) for cs in self.nodes)
                + sum(top(c for row in m for c in row) for m in self.edges)
                + sum(a for a, _ in self.switched))


@dataclass(frozen=True)
class Overlap:
    """``times`` x ``overlap_exposed_s(comm, window, first, interference)``: communication
    hidden behind compute as far as the compute lasts (see the module doc)."""

    comm: Linear
    window: Linear
    first: Linear
    interference: float
    times: float = 1.0

    def value(self, problem: ILPProblem, choice: tuple[int, ...] | list[int]) -> float:
        return self.times * overlap_exposed_s(self.comm.value(problem, choice),
                                              self.window.value(problem, choice),
                                              self.first.value(problem, choice),
                                              self.interference)


@dataclass(frozen=True)
class ILPProblem:
    node_costs: tuple[tuple[float, ...], ...]          # c[v][j]
    node_memory: tuple[tuple[float, ...], ...]         # m[v][j] (bytes)
    edges: tuple[tuple[int, int, tuple[tuple[float, ...], ...]], ...]   # (u, v, r[i][j])
    memory_budget: float | None = None
    overlaps: tuple[Overlap, ...] = ()
    constant_s: float = 0.0          # seconds the choice does not change (in ``objective``)
    # (seconds, ((node, strategy), ...)): paid once where any of those is chosen
    charges: tuple[tuple[float, tuple[tuple[int, int], ...]], ...] = ()
    # (bytes as an affine function of the choice, bound): more memory constraints, one per
    # device that holds a different part (a pipelined configuration's ranks)
    memory_rows: tuple[tuple[Linear, float], ...] = ()
    # groups of affine functions of the choice: the objective adds each group's largest
    maxima: tuple[tuple[Linear, ...], ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def objective(self, choice: tuple[int, ...] | list[int]) -> float:
        total = self.constant_s + sum(self.node_costs[v][j] for v, j in enumerate(choice))
        for u, v, r in self.edges:
            total += r[choice[u]][choice[v]]
        total += sum(cost for cost, when in self.charges
                     if any(choice[v] == j for v, j in when))
        total += sum(max(f.value(self, choice) for f in group) for group in self.maxima)
        return total + sum(o.value(self, choice) for o in self.overlaps)

    def memory(self, choice: tuple[int, ...] | list[int]) -> float:
        return sum(self.node_memory[v][j] for v, j in enumerate(choice))

    def fits(self, choice: tuple[int, ...] | list[int]) -> bool:
        """Within the memory budget and every memory row."""
        return ((self.memory_budget is None or self.memory(choice) <= self.memory_budget)
                and all(row.value(self, choice) <= bound for row, bound in self.memory_rows))


@dataclass(frozen=True)
class ILPSolution:
    choice: tuple[int, ...]
    status: str                  # "optimal" | "feasible" | "infeasible" | "not_solved"
    objective: float
    bound: float | None
    gap: float | None
    num_variables: int
    num_constraints: int
    time_s: float


def brute_force(problem: ILPProblem) -> tuple[tuple[int, ...], float] | None:
    """Enumerate every combination (tests: small problems only). None when nothing fits."""
    sizes = [len(c) for c in problem.node_costs]
    if math.prod(sizes) > 2_000_000:
        raise AutoplanError(f"brute force over {math.prod(sizes):,} combinations is too large")
    best: tuple[tuple[int, ...], float] | None = None
    for choice in itertools.product(*[range(k) for k in sizes]):
        if not problem.fits(choice):
            continue
        obj = problem.objective(choice)
        if best is None or obj < best[1] - 1e-15:
            best = (choice, obj)
    return best


# Costs this large mark choices that cannot run (``problem.INFEASIBLE_S``): the overlaps' bounds
# leave them out
_CANNOT_RUN_S = 1.0e5

# With overlaps, CBC's root cuts and heuristics took 0.1-0.3 s on Llama-3-8B's problems, and
# branching alone 0.04 s to the same optimum (a handful of nodes: one binary per overlap)
_OVERLAP_OPTIONS = ["cuts off", "heuristicsOnOff off"]

_BOUND = re.compile(r"best possible\s+(-?[0-9.eE+-]+)", re.IGNORECASE)
_BOUND2 = re.compile(r"Continuous objective value is\s+(-?[0-9.eE+-]+)")


def _add_variables(prob: pulp.LpProblem, problem: ILPProblem, free: list[int]):
    x = {}
    for v in free:
        for j in range(len(problem.node_costs[v])):
            x[v, j] = pulp.LpVariable(f"x_{v}_{j}", cat=pulp.LpBinary)
    return x


def _add_one_strategy(prob, problem: ILPProblem, free: list[int], x) -> None:
    for v in free:
        prob += (pulp.lpSum(x[v, j] for j in range(len(problem.node_costs[v]))) == 1,
                 f"one_strategy_{v}")


def _objective_and_edges(prob, problem: ILPProblem, fixed: dict[int, int], x, evars):
    """Objective terms; edge variables (into ``evars``: edge -> (i, j) -> variable) and their
    two constraint families."""
    terms = []
    const = problem.constant_s
    in_overlaps = {k for lin in _forms(problem) for k, m in enumerate(lin.edges)
                   if any(c for row in m for c in row)}
    for v, costs in enumerate(problem.node_costs):
        if v in fixed:
            const += costs[fixed[v]]
        else:
            terms += [(x[v, j], costs[j]) for j in range(len(costs)) if costs[j]]
    n_edge_vars = 0
    for k, (u, v, r) in enumerate(problem.edges):
        if u in fixed and v in fixed:
            const += r[fixed[u]][fixed[v]]
        elif u in fixed:
            row = r[fixed[u]]
            terms += [(x[v, j], row[j]) for j in range(len(row)) if row[j]]
        elif v in fixed:
            terms += [(x[u, i], r[i][fixed[v]]) for i in range(len(r)) if r[i][fixed[v]]]
        elif all(c == 0 for row in r for c in row) and k not in in_overlaps:
            continue
        else:
            ku, kv = len(r), len(r[0])
            e = evars[k] = {(i, j): pulp.LpVariable(f"e_{k}_{i}_{j}", lowBound=0, upBound=1)
                            for i in range(ku) for j in range(kv)}
            n_edge_vars += len(e)
            for i in range(ku):
                prob += (pulp.lpSum(e[i, j] for j in range(kv)) == x[u, i], f"edge_row_{k}_{i}")
            for j in range(kv):
                prob += (pulp.lpSum(e[i, j] for i in range(ku)) == x[v, j], f"edge_col_{k}_{j}")
            terms += [(e[i, j], r[i][j]) for i in range(ku) for j in range(kv) if r[i][j]]
    return terms, const, n_edge_vars


def _forms(problem: ILPProblem) -> list[Linear]:
    """The affine functions the objective reads beside the node and edge costs."""
    return ([lin for o in problem.overlaps for lin in (o.comm, o.window, o.first)]
            + [lin for group in problem.maxima for lin in group])


def _maxima_terms(prob, problem: ILPProblem, fixed: dict[int, int], x, evars) -> list:
    """Objective terms of the maxima: z_g >= each form of group g (module doc)."""
    terms = []
    switches = _Switches(prefix="maxima_switch")
    for g, group in enumerate(problem.maxima):
        z = pulp.LpVariable(f"longest_{g}")
        for k, lin in enumerate(group):
            prob += (z >= _affine(problem, lin, fixed, x, evars, switches),
                     f"longest_{g}_{k}")
        terms.append(z)
    for k, row in enumerate(switches.rows):
        prob += (row, f"maxima_switch_row_{k}")
    return terms


@dataclass
class _Switches:
    """One variable u per set of strategies, with its rows u >= x[v, j] (``Linear.switched``)."""

    variables: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    prefix: str = "switch"

    def of(self, when: tuple[tuple[int, int], ...], x) -> pulp.LpVariable:
        if when not in self.variables:
            u = self.variables[when] = pulp.LpVariable(f"{self.prefix}_{len(self.variables)}",
                                                       lowBound=0, upBound=1)
            self.rows += [u >= x[v, j] for v, j in when]
        return self.variables[when]


def _affine(problem: ILPProblem, lin: Linear, fixed: dict[int, int], x, evars,
            switches: _Switches):
    """A ``Linear`` as a PuLP expression (edges with a fixed end fold onto the other's x; a
    switched amount times its set's u, only ever pushed up by the rows it is in, so that u is
    1 exactly where one of the set is chosen)."""
    const, terms = lin.const, []
    for amount, when in lin.switched:
        if any(fixed.get(v) == j for v, j in when):
            const += amount
            continue
        free = tuple((v, j) for v, j in when if v not in fixed)
        if free:
            terms.append((switches.of(free, x), amount))
    for v, cs in enumerate(lin.nodes):
        if v in fixed:
            const += cs[fixed[v]]
        else:
            terms += [(x[v, j], c) for j, c in enumerate(cs) if c]
    for k, ((u, v, _), m) in enumerate(zip(problem.edges, lin.edges)):
        if u in fixed and v in fixed:
            const += m[fixed[u]][fixed[v]]
        elif u in fixed:
            terms += [(x[v, j], c) for j, c in enumerate(m[fixed[u]]) if c]
        elif v in fixed:
            terms += [(x[u, i], row[fixed[v]]) for i, row in enumerate(m) if row[fixed[v]]]
        else:
            terms += [(evars[k][i, j], c) for i, row in enumerate(m) for j, c in enumerate(row)
                      if c]
    return _sum(terms, const)


def _sum(terms: list, const: float = 0.0) -> pulp.LpAffineExpression:
    """``terms`` ((variable, coefficient) pairs, or expressions) summed in order, plus
    ``const``: ``lpSum`` of the products, without an expression made per product."""
    out = pulp.LpAffineExpression()
    for t in terms:
        if type(t) is tuple:
            out.addterm(*t)
        else:
            out.addInPlace(t)
    out.constant += const
    return out


def _overlap_terms(prob, problem: ILPProblem, fixed: dict[int, int], x, evars,
                   cannot_run: float) -> tuple[list, dict[int, pulp.LpVariable]]:
    """Objective terms of the overlaps, with their variables and constraints (module doc);
    and each overlap's binary (1: the window is the shorter)."""
    terms, longer = [], {}
    switches = _Switches()
    for n, o in enumerate(problem.overlaps):
        comm = _affine(problem, o.comm, fixed, x, evars, switches)
        if o.interference >= 1.0:               # nothing hides: all of it is exposed
            terms.append(o.times * comm)
            continue
        window = _affine(problem, o.window, fixed, x, evars, switches)
        z = pulp.LpVariable(f"exposed_{n}", lowBound=0)
        y = pulp.LpVariable(f"hidden_{n}", lowBound=0)
        b = longer[n] = pulp.LpVariable(f"longer_{n}", cat=pulp.LpBinary)
        # b = 1: the window is the shorter. Each bound is the most its side can be (choices
        # that cannot run, priced beyond ``_CANNOT_RUN``, left out: never optimal, a y too
        # large there only prices them higher)
        big_comm = o.comm.upper_bound(cannot_run) * 1.001 + 1e-6
        big_window = o.window.upper_bound(cannot_run) * 1.001 + 1e-6
        prob += (z >= comm - window, f"exposed_past_{n}")
        prob += (z >= _affine(problem, o.first, fixed, x, evars, switches),
                 f"exposed_first_{n}")
        prob += (y >= comm - big_comm * b, f"hidden_comm_{n}")
        prob += (y >= window - big_window * (1 - b), f"hidden_window_{n}")
        terms += [o.times * z, o.times * o.interference * y]
    for k, row in enumerate(switches.rows):
        prob += (row, f"switch_row_{k}")
    return terms, longer


def _add_memory(prob, problem: ILPProblem, fixed: dict[int, int], x, evars) -> None:
    for k, (row, bound) in enumerate(problem.memory_rows):    # (node terms: bytes held)
        if row.switched or any(any(c for r in m for c in r) for m in row.edges):
            raise AutoplanError("a memory row prices nodes' choices only")
        prob += (_affine(problem, row, fixed, x, evars, _Switches()) <= bound,
                 f"memory_row_{k}")
    if problem.memory_budget is None:
        return
    fixed_mem = sum(problem.node_memory[v][j] for v, j in fixed.items())
    prob += (pulp.lpSum(problem.node_memory[v][j] * x[v, j] for (v, j) in x
                        if problem.node_memory[v][j])
             <= problem.memory_budget - fixed_mem, "memory")


def solve(problem: ILPProblem, *, time_limit_s: float = 30.0,
          start: tuple[int, ...] | None = None) -> ILPSolution:
    """The optimal choice (or the best found in the time limit). ``start``: a choice CBC starts
    from (its objective bounds the search from the first node)."""
    # PuLP 3.x announces its 4.0 API on every variable; the 2.7-3.x API used here is stable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(problem, time_limit_s, start)


def _solve(problem: ILPProblem, time_limit_s: float, start: tuple[int, ...] | None
           ) -> ILPSolution:
    t0 = time.perf_counter()
    fixed = {v: 0 for v, c in enumerate(problem.node_costs) if len(c) == 1}
    free = [v for v in range(problem.num_nodes) if v not in fixed]
    if not free:
        return _nothing_to_choose(problem, t0)
    # scale to milliseconds: CBC's tolerances are absolute, step times are seconds
    scale = 1e3
    prob, x = _model(problem, scale, fixed, free, start)
    log_text = _run_cbc(prob, time_limit_s, warm=start is not None,
                        overlaps=bool(problem.overlaps))
    return _solution(prob, problem, fixed, x, log_text=log_text, scale=scale, t0=t0)


def _nothing_to_choose(problem: ILPProblem, t0: float) -> ILPSolution:
    """Every node has one strategy: the choice is made, only its fit is in question."""
    choice = tuple(0 for _ in problem.node_costs)
    ok = problem.fits(choice)
    obj = problem.objective(choice)
    return ILPSolution(choice, "optimal" if ok else "infeasible", obj, obj, 0.0, 0, 0,
                       time.perf_counter() - t0)


def _scaled(problem: ILPProblem, scale: float) -> ILPProblem:
    """``problem`` with its seconds times ``scale`` (its bytes as they are)."""
    return ILPProblem(
        node_costs=tuple(tuple(c * scale for c in cs) for cs in problem.node_costs),
        node_memory=problem.node_memory,
        edges=tuple((u, v, tuple(tuple(c * scale for c in row) for row in r))
                    for u, v, r in problem.edges),
        memory_budget=problem.memory_budget,
        overlaps=tuple(Overlap(o.comm.scaled(scale), o.window.scaled(scale),
                               o.first.scaled(scale), o.interference, o.times)
                       for o in problem.overlaps),
        constant_s=problem.constant_s * scale,
        charges=tuple((c * scale, when) for c, when in problem.charges),
        memory_rows=problem.memory_rows,
        maxima=tuple(tuple(f.scaled(scale) for f in group) for group in problem.maxima))


def _model(problem: ILPProblem, scale: float, fixed: dict[int, int], free: list[int],
           start: tuple[int, ...] | None) -> tuple[pulp.LpProblem, dict]:
    """The PuLP model of ``problem`` in seconds times ``scale``: one binary per free node's
    strategy, the objective's terms (edges, overlaps, maxima, charges), the memory rows; its
    variables set at ``start`` where given."""
    scaled = _scaled(problem, scale)
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    x = _add_variables(prob, scaled, free)
    _add_one_strategy(prob, scaled, free, x)
    evars: dict[int, dict[tuple[int, int], pulp.LpVariable]] = {}
    terms, const, n_edge = _objective_and_edges(prob, scaled, fixed, x, evars)
    more, longer = _overlap_terms(prob, scaled, fixed, x, evars, _CANNOT_RUN_S * scale)
    terms += more
    terms += _maxima_terms(prob, scaled, fixed, x, evars)
    const = _add_charges(prob, scaled, fixed, x, terms, const)
    if start is not None:
        _warm_start(problem, start, x, longer)
    prob += _sum(terms, const)
    _add_memory(prob, scaled, fixed, x, evars)
    return prob, x


def _add_charges(prob: pulp.LpProblem, problem: ILPProblem, fixed: dict[int, int], x,
                 terms: list, const: float) -> float:
    """Each charge paid once where any of its strategies is chosen: into ``const`` where a
    fixed node chose one, else a variable at least each of them (into ``terms``); returns
    the constant."""
    for n, (cost, when) in enumerate(problem.charges):
        if any(fixed.get(v) == j for v, j in when):
            const += cost
            continue
        paid = pulp.LpVariable(f"charged_{n}", lowBound=0, upBound=1)
        for v, j in when:
            if v not in fixed:
                prob += (paid >= x[v, j], f"charge_{n}_{v}_{j}")
        terms.append(cost * paid)
    return const


def _warm_start(problem: ILPProblem, start: tuple[int, ...], x,
                longer: dict[int, pulp.LpVariable]) -> None:
    """CBC's first incumbent: the choice ``start`` and, per overlap, which side is longer
    there."""
    for (v, j), var in x.items():
        var.setInitialValue(1 if start[v] == j else 0)
    for n, b in longer.items():
        o = problem.overlaps[n]
        b.setInitialValue(1 if o.comm.value(problem, start) > o.window.value(problem, start)
                          else 0)


def _run_cbc(prob: pulp.LpProblem, time_limit_s: float, *, warm: bool, overlaps: bool) -> str:
    """Solve with CBC (one thread, a fixed seed: the same answer each run); returns its log."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))),
                                   threads=1, logPath=log,
                                   options=["randomSeed 1"] + (_OVERLAP_OPTIONS
                                                               if overlaps else []),
                                   warmStart=warm)
        prob.solve(solver)
        return open(log).read() if os.path.exists(log) else ""


def _solution(prob: pulp.LpProblem, problem: ILPProblem, fixed: dict[int, int], x, *,
              log_text: str, scale: float, t0: float) -> ILPSolution:
    """What CBC found: the chosen strategy per node, its objective in seconds, and (stopped
    short of optimal) the bound its log gives and the gap to it."""
    n_vars = len(prob.variables())
    n_cons = len(prob.constraints)
    elapsed = time.perf_counter() - t0
    sol = prob.sol_status
    if sol in (pulp.LpSolutionInfeasible, pulp.LpSolutionUnbounded) or prob.status == -1:
        return ILPSolution(tuple(), "infeasible", math.inf, None, None, n_vars, n_cons, elapsed)
    if sol == pulp.LpSolutionNoSolutionFound:
        return ILPSolution(tuple(), "not_solved", math.inf, None, None, n_vars, n_cons, elapsed)
    choice = []
    for v in range(problem.num_nodes):
        if v in fixed:
            choice.append(0)
            continue
        vals = [x[v, j].value() or 0.0 for j in range(len(problem.node_costs[v]))]
        choice.append(max(range(len(vals)), key=lambda j: vals[j]))
    choice_t = tuple(choice)
    objective = problem.objective(choice_t)
    if sol == pulp.LpSolutionOptimal:
        return ILPSolution(choice_t, "optimal", objective, objective, 0.0, n_vars, n_cons, elapsed)
    m = _BOUND.search(log_text) or _BOUND2.search(log_text)
    bound = float(m.group(1)) / scale if m else None
    gap = (objective - bound) / objective if bound is not None and objective > 0 else None
    return ILPSolution(choice_t, "feasible", objective, bound, gap, n_vars, n_cons, elapsed)
