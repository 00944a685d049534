"""What the search costs with: its statistics, the shared tp-axis ILP for a mesh and
micro-batch (and its memory-constrained variant), one configuration's own dp-terms ILP, and the
costing of configurations on a sharding (``estimate``, with a pipelined config's stage layout
chosen first). ``search.plan`` walks the space with these; ``finalists`` solves the finalists
again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autoplan.cost.compute import compute_model
from autoplan.cost.dtypes import held_bytes
from autoplan.cost.float8 import Float8Setting
from autoplan.cost.memory import model_state_bytes
from autoplan.errors import ConfigError
from autoplan.estimate.cost_inputs import CostInputs
from autoplan.estimate.estimator import estimate, reserved_bytes
from autoplan.estimate.float8_choice import fp8_choices, fp8_skip
from autoplan.estimate.layout import chunks_for, in_flight, search_layout, step_floor_s, with_layout
from autoplan.estimate.overlap import overlap_interference
from autoplan.graph.analysis import analyze
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.planner import search_space
from autoplan.planner.axis_costs import expert_exchanges
from autoplan.planner.cost_context import CostContext, ExpertExchanges
from autoplan.planner.dp_problem import DpPricing, whole_patterns, with_dp_terms
from autoplan.planner.ilp import ILPSolution, solve
from autoplan.planner.options import SearchOptions
from autoplan.planner.problem import reduce_graph, sharding_from_choice
from autoplan.planner.candidates import Candidate
from autoplan.sharding.context_axis import context_axis
from autoplan.sharding.mesh_axes import MeshAxis, ParallelDims
from autoplan.sharding.parallel_config import ParallelConfig, strongest_recompute
from autoplan.sharding.sharding import Sharding, replicated_on

SP_STYLES = frozenset({"colwise_sp", "rowwise_sp", "vocab_sp", "seq"})


@dataclass
class Stats:
    ilps: int = 0
    evaluated: int = 0
    rejected: str = ""            # why the last config could not be costed (ConfigError)
    largest: tuple[int, int] = (0, 0)     # variables, constraints of the largest ILP solved
    below_floor: int = 0          # pipelined configs skipped: their floor behind the best
    # the largest relative gap of the ILPs solved (0.0: every one proven optimal or
    # infeasible; None: none solved yet); ``gap_unknown``: one stopped with no bound to read
    worst_gap: float | None = None
    gap_unknown: bool = False
    # memory-constrained ILPs not solved: no sharding can fit their budget (``frugal_sharding``)
    over_budget: int = 0
    # per memory family (``_memory_family``), what its frugal problems needed at the least:
    # (state bytes per parameter, activation multiplier, least bytes over every choice)
    least_memory: dict[tuple, list[tuple[float, float, float]]] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)
    say: Callable[[str], None] = lambda _msg: None    # the caller's progress messages


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """What every step of one search reads: the model, the cluster, the global batch, the op
    profile (None: roofline), the options, the statistics it counts into (the one mutable
    part) and the ops the user pinned to a strategy (``pins.resolve``: op index -> name)."""

    graph: OpGraph
    cluster: Any
    global_batch_size: int
    profile: Any
    opts: SearchOptions
    stats: Stats
    pinned: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Frugal:
    """What the memory-constrained ILP holds per device: the most memory-saving of the
    configurations it is solved for (their state bytes per parameter and activations in flight,
    both per pipeline stage, and the strongest recomputation allowed)."""

    budget_bytes: float
    state_bytes_per_param: float
    activation_multiplier: float
    recompute: str


def frugal(configs: list[ParallelConfig], m: int, opts: SearchOptions, graph: OpGraph,
            budget_bytes: float) -> Frugal:
    state = min(model_state_bytes(1.0, dp=c.shard_degree, zero_stage=c.zero_stage,
                                  precision=c.precision, optimizer=c.optimizer,
                                  offload_optimizer=c.offload_optimizer,
                                  offload_params=c.offload_params,
                                  mixed_precision=c.mixed_precision,
                                  optimizer_state=c.optimizer_state).total_bytes / c.pp
                for c in configs)
    # a stage holds 1/pp of the layers, its first stage in_flight micro-batches of them
    flight = min(in_flight(c, m, 0) / c.pp for c in configs)
    return Frugal(budget_bytes, state, flight,
                   strongest_recompute(search_space.recompute_options(opts, graph)))


def ilp_microbatches(dims: ParallelDims, *, micro_batch_size: int, global_batch_size: int,
                     m: int) -> int:
    """The micro-batches the tp-axis problem weighs per-step costs with: those of ``dims``'s
    mesh without pipeline (its pp and dp ranks all data-parallel, ``micro_batch_size`` each),
    whichever mesh asks first, so that forcing pp or dp never changes the sharding a free
    search finds; ``m`` where the global batch does not split so."""
    flat = dims.degree((MeshAxis.PP, MeshAxis.DP)) * micro_batch_size
    return global_batch_size // flat if global_batch_size % flat == 0 else m


def exchanges(graph: OpGraph, cluster: Any, config: ParallelConfig, opts: SearchOptions
               ) -> ExpertExchanges | None:
    """Expert parallelism's exchanges on ``config``'s ep group, for the ILP (ep > 1)."""
    if config.ep == 1:
        return None
    group = config.ep_group()
    counts = 8.0 * find_experts(graph).num_experts * config.ep
    return expert_exchanges(
        graph, lambda nbytes: cluster.collective_time_s("all_to_all", nbytes, group),
        cluster.collective_time_s("all_gather", counts, group), opts.expert_capacity_factor)


def ilp_sharding(sc: SearchContext, config: ParallelConfig, m: int, *,
                 frugal: Frugal | None = None) -> tuple[Sharding, ILPSolution]:
    """The tp-axis sharding for ``config``'s mesh and ``m`` micro-batches: the fastest, or
    under ``frugal`` the fastest whose model state and activations fit its budget; the
    search's pinned ops keep their strategy."""
    return _solved_ilp(sc, config, reduce_graph(cost_context(sc, config, m, frugal)),
                       frugal is not None)


def _solved_ilp(sc: SearchContext, config: ParallelConfig, red: Any, frugal: bool
                ) -> tuple[Sharding, ILPSolution]:
    sol = solve(red.problem, time_limit_s=sc.opts.ilp_time_limit_s)
    what = ("tp axis, memory-constrained" if frugal else "tp axis") + (
        f", ep{config.ep}" if config.ep > 1 else "")
    return solved(sc.graph, config.tp, red, counted(sol, sc.stats, config, what))


def frugal_sharding(sc: SearchContext, config: ParallelConfig, m: int, frugal: Frugal
                    ) -> tuple[Sharding, ILPSolution] | None:
    """``ilp_sharding`` under ``frugal``, or None where no choice of strategies fits its
    budget, found without CBC: the problem's least memory (each node at its smallest) over
    the budget, or a floor on it from a problem of the same memory family solved before.

    The floor is exact: a strategy's bytes are ``s P + a A + O`` (``node_costs.node_cost``:
    state bytes per parameter ``s`` times its parameters, the activation multiplier ``a``
    times the activations it keeps, and what it keeps once; ``P, A, O >= 0`` and the same
    for every problem of the family, whose strategies, shapes and kept values are the same),
    so at ``(s2, a2)`` each strategy needs at least ``r = min(s2 / s1, a2 / a1, 1)`` times
    what it needed at ``(s1, a1)``, and the least sum at least ``r`` times that one's."""
    family = sc.stats.least_memory.setdefault(_memory_family(config, frugal), [])
    s2, a2 = frugal.state_bytes_per_param, frugal.activation_multiplier
    floor = max((least * min(s2 / s1 if s1 else math.inf, a2 / a1 if a1 else math.inf, 1.0)
                 for s1, a1, least in family), default=0.0)
    if floor > frugal.budget_bytes:
        return _over_budget(sc, config, floor, frugal, "a floor from a problem solved before")
    red = reduce_graph(cost_context(sc, config, m, frugal))
    least = sum(min(row) for row in red.problem.node_memory)
    family.append((s2, a2, least))
    if least > frugal.budget_bytes:
        return _over_budget(sc, config, least, frugal, "each node at its smallest")
    return _solved_ilp(sc, config, red, True)


def _memory_family(config: ParallelConfig, frugal: Frugal) -> tuple:
    """What a frugal problem's bytes per strategy depend on beyond ``s`` and ``a``: the tp
    degree and micro-batch (the strategies and their shapes), the cp axis, the experts, the
    dtypes held and the recomputation; not pp, dp or the compiled program's prices."""
    return (config.tp, config.micro_batch_size, config.cp, config.cp_layout, config.ep,
            config.precision, config.mixed_precision, frugal.recompute)


def _over_budget(sc: SearchContext, config: ParallelConfig, need: float, frugal: Frugal,
                 how: str) -> None:
    sc.stats.over_budget += 1
    sc.stats.say(f"  ILP (tp axis, memory-constrained) for mesh {config.dims.describe()} "
                 f"mbs {config.micro_batch_size}: not solved, no sharding fits: it needs at "
                 f"least {need / 2**30:,.1f} GiB ({how}), the budget is "
                 f"{frugal.budget_bytes / 2**30:,.1f} GiB")
    return None


def counted(sol: ILPSolution, stats: Stats, config: ParallelConfig, what: str
             ) -> ILPSolution:
    """``sol``, counted in the search's statistics (ILPs solved, the largest, the worst gap)
    and reported to the progress callback (its mesh, size, time and gap)."""
    stats.ilps += 1
    stats.largest = max(stats.largest, (sol.num_variables, sol.num_constraints))
    # proven optimal or infeasible: no gap; stopped by the time limit: the log's, if any
    gap = 0.0 if sol.status in ("optimal", "infeasible") else sol.gap
    if gap is None:
        stats.gap_unknown = True
    else:
        stats.worst_gap = max(stats.worst_gap or 0.0, gap)
    gap = "" if sol.gap is None else f", gap {sol.gap * 100:.2f}%"
    stats.say(f"  ILP ({what}) for mesh {config.dims.describe()} "
              f"mbs {config.micro_batch_size}: {sol.num_variables} "
              f"variables, {sol.num_constraints} constraints, {sol.time_s:.3f} s, "
              f"{sol.status}{gap}")
    return sol


def solved(graph: OpGraph, t: int, red: Any, sol: ILPSolution
           ) -> tuple[Sharding, ILPSolution]:
    """The sharding ``sol`` chooses (every op replicated where it has no answer), and ``sol``."""
    if sol.status in ("infeasible", "not_solved"):
        return replicated_on(graph, t), sol
    return sharding_from_choice(graph, t, red, sol.choice), sol


def cost_context(sc: SearchContext, config: ParallelConfig, m: int,
                 frugal: Frugal | None = None) -> CostContext:
    """The ILP's prices for ``config``'s tp group at ``m`` micro-batches: as fast as may be,
    or under ``frugal`` within its memory budget."""
    graph, cluster, pinned = sc.graph, sc.cluster, sc.pinned
    t = config.tp
    group = config.tp_group()
    cp_group = config.cp_group()
    compute = compute_model(graph, cluster.device, config.precision, sc.profile,
                            config.mixed_precision, config.compiled,
                            Float8Setting.of(config))
    whole_state = model_state_bytes(1.0, dp=1, zero_stage=0, precision=config.precision,
                                    optimizer=config.optimizer,
                                    mixed_precision=config.mixed_precision,
                                    optimizer_state=config.optimizer_state).total_bytes
    return CostContext(graph=graph, t=t, compute=compute,
                      context=context_axis(graph, config.cp, config.cp_layout),
                      documents=sc.opts.seq_lengths,
                      cp_collective_s=lambda kind, nbytes: cluster.collective_time_s(
                          kind, nbytes, cp_group),
                      collective_s=lambda kind, nbytes: cluster.collective_time_s(kind, nbytes,
                                                                                  group),
                      batch_scale=config.micro_batch_size / graph.batch_size, microbatches=m,
                      precision=config.precision,
                      recompute=frugal.recompute if frugal else "none",
                      state_bytes_per_param=(frugal.state_bytes_per_param if frugal
                                             else whole_state),
                      activation_multiplier=frugal.activation_multiplier if frugal else 1.0,
                      memory_budget=frugal.budget_bytes if frugal else None,
                      interference=overlap_interference(cluster),
                      experts=exchanges(graph, cluster, config, sc.opts),
                      pinned=pinned or None,
                      held=held_bytes(graph, config.precision, config.mixed_precision,
                                      cluster.device.kind))


def dp_sharding(sc: SearchContext, cand: Candidate
                ) -> tuple[ParallelConfig, Sharding, ILPSolution] | None:
    """The sharding for exactly ``cand``'s config (pp 1): the tp-axis ILP with its recompute
    policy, ZeRO stage and the rest of its step (``dp_problem``), linearized at the shared
    ILP's choice, within the device memory the candidate leaves for state and activations;
    under ZeRO-3 it may keep weights whole (``dp_whole``). Its objective is then
    ``estimate``'s step time. None where it finds nothing."""
    graph, cluster, opts = sc.graph, sc.cluster, sc.opts
    config = cand.est.config
    m = config.microbatches(sc.global_batch_size)

    def state(dp: int, zero: int) -> float:
        return model_state_bytes(1.0, dp=dp, zero_stage=zero, precision=config.precision,
                                 optimizer=config.optimizer,
                                 offload_optimizer=config.offload_optimizer,
                                 offload_params=config.offload_params,
                                 mixed_precision=config.mixed_precision,
                                 optimizer_state=config.optimizer_state).total_bytes
    sharded = state(config.shard_degree, config.zero_stage)
    mem = cand.est.stages[0].memory
    ctx = replace(cost_context(sc, config, m),
                  recompute=config.recompute, state_bytes_per_param=sharded,
                  memory_budget=cluster.device.memory_bytes - mem.margin_bytes
                  - mem.transient_bytes,
                  step_shard=config.shard_degree if config.zero_stage >= 2 else 1)
    red = reduce_graph(ctx)
    reference = (cand.ilp.choice if cand.ilp is not None else   # tp 1: every op replicated
                 tuple(next((j for j, ch in enumerate(node.choices)
                             if all(st.name == "replicate" for st in ch)), 0)
                       for node in red.nodes))
    pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=ctx.compute,
                        profile=sc.profile, interference=ctx.interference)
    dp = with_dp_terms(red, graph, pricing, reference=reference,
                       whole_extra_bytes=None if "dp_whole" in opts.force
                       else state(1, 0) - sharded)
    start = dp.lift(reference)
    if dp.problem.memory(start) > dp.problem.memory_budget:
        start = None                            # no head start that does not fit
    sol = counted(solve(dp.problem, time_limit_s=opts.ilp_time_limit_s, start=start),
                  sc.stats, config, f"with ZeRO-{config.zero_stage}'s data-parallel terms")
    if sol.status not in ("optimal", "feasible"):
        return None
    whole = whole_patterns(graph, red, dp.whole_nodes(sol.choice))
    sh = sharding_from_choice(graph, config.tp, red, dp.strategies(sol.choice))
    return replace(config, dp_whole=whole), sh, sol


# recomputation only trades step time for memory: a stronger policy is never faster
# (``estimate`` adds its forward compute; tests/test_search_prune.py). Offload is not ordered:
# an offloaded optimizer step can run faster than a launch-bound one on the device.
_RECOMPUTE_RANK = {"none": 0, "selective": 1, "ops": 2, "full": 3}


# how far below its closed form a pipelined config's simulated step may come: the search skips
# those whose closed form cannot come within this of the best (measured: 2.5 % on the
# benchmark's plans, 5 % on tiny models; ``finalists.refine_pipelined`` simulates within it)
CLOSED_FORM_SLACK = 0.10


def evaluate(sc: SearchContext, configs: list[ParallelConfig], sh: Sharding,
             sol: ILPSolution | None, label: str, *, simulate: bool = False,
             prune_dominated: bool = False, behind_s: float | None = None
             ) -> list[Candidate]:
    """``configs`` costed on ``sh``. ``prune_dominated``: a config is skipped where one costed
    before it differs only in a weaker recomputation policy and fits: it would be no faster
    (``configs`` in the order ``search_space.policies`` makes, weaker policies first), and a
    pipelined config's optimizer-offloaded twin where ``search_space.offload_twin_needless``
    says of the config costed before it that the twin cannot be faster. ``behind_s``:
    a pipelined config is skipped where even its floor (``layout.step_floor_s``, a lower bound
    on any stage layout's closed form) is beyond it; counted in ``stats.below_floor``."""
    graph, cluster, opts, stats = sc.graph, sc.cluster, sc.opts, sc.stats
    gbs = sc.global_batch_size
    out = []
    # per the rest of a config, the (policy rank, offloaded layers) pairs that fit: recomputing
    # or offloading more than a fitting config that offloads nothing, or offloading more with
    # the same policy, only adds time. Not recomputing more where layers are offloaded: it
    # shrinks what they copy, so full recomputation with every layer offloaded can beat
    # offload alone (Llama-3-8B on one H100, mbs 8: 97 s against 150 s; test_search_prune)
    fitting: dict[ParallelConfig, list[tuple[int, int]]] = {}
    sp = sh.t > 1 and any(s.style in SP_STYLES for s in sh.op_strategy)
    # pipelined configs whose optimizer-offloaded twin cannot be faster (offload is offered
    # beside pipelines: ``search_space.optimizer_offloads``); each costed before its twin
    needless: set[ParallelConfig] = set()
    for c in configs:
        if (prune_dominated and c.pp > 1 and c.offload_optimizer
                and "offload_optimizer" not in opts.force
                and replace(c, offload_optimizer=False, offload_nvme=False) in needless):
            continue
        given = c
        rest = (replace(c, recompute="none", offload_activations=0)
                if prune_dominated and c.pp == 1 and c.layer_recompute is None
                and c.layer_offload is None else None)
        rank = (_RECOMPUTE_RANK.get(c.recompute, 0), c.offload_activations)
        if rest is not None and any((r <= rank[0] and k == 0) or (r == rank[0] and k <= rank[1])
                                    for r, k in fitting.get(rest, ())):
            continue
        # tp_comm_overlap only when asked for (the runtime cannot run it), and where it applies
        overlap = bool(opts.force.get("tp_comm_overlap")) and sp
        if c.sequence_parallel != sp or c.tp_comm_overlap != overlap:
            c = replace(c, sequence_parallel=sp, tp_comm_overlap=overlap)
        try:
            if c.fp8 != "none" and "fp8_skip" not in opts.force:
                # the linears where fp8 does not pay at this sharding stay in 16 bits
                c = replace(c, fp8_skip=fp8_skip(fp8_choices(
                    cost_inputs(sc, replace(c, fp8_skip=()), sh))))
            if c.pp > 1 and c.chunk_layers is None:
                ci = cost_inputs(sc, c, sh)
                if behind_s is not None and step_floor_s(
                        ci, c.microbatches(gbs), search_space.recompute_options(opts, graph, c)
                ) > behind_s:
                    stats.below_floor += 1
                    continue
                c = with_stage_layout(sc, c, sh, ci)
            est = estimate(graph, cluster, config=c, global_batch_size=gbs, profile=sc.profile,
                           sharding=sh, memory_margin_bytes=opts.memory_margin_bytes,
                           simulate_pipeline=simulate,
                           expert_capacity_factor=opts.expert_capacity_factor,
                           seq_lengths=opts.seq_lengths)
        except ConfigError as e:
            stats.rejected = str(e)
            continue
        stats.evaluated += 1
        out.append(Candidate(est, sh, sol, label))
        if (c.pp > 1 and not c.offload_optimizer
                and search_space.offload_twin_needless(est, graph, cluster)):
            needless.add(given)
        if rest is not None and est.fits:
            fitting.setdefault(rest, []).append(rank)
    return out


def cost_inputs(sc: SearchContext, config: ParallelConfig, sh: Sharding) -> CostInputs:
    """What a range's cost reads (``cost_inputs.CostInputs``) for ``config`` on ``sh``."""
    graph, cluster = sc.graph, sc.cluster
    return CostInputs(graph=graph, analysis=analyze(graph), sharding=sh,
                      compute=compute_model(graph, cluster.device, config.precision,
                                            sc.profile, config.mixed_precision,
                                            config.compiled, Float8Setting.of(config)),
                      cluster=cluster, config=config,
                      expert_load=sc.opts.expert_capacity_factor,
                      context=context_axis(graph, config.cp, config.cp_layout),
                      documents=sc.opts.seq_lengths)


def with_stage_layout(sc: SearchContext, config: ParallelConfig, sh: Sharding,
                      ci: CostInputs | None = None) -> ParallelConfig:
    """The pipelined config with its stage split and per-stage recomputation chosen to fit the
    device (``layout.search_layout``); when nothing fits, the most memory-saving policy on a
    time-balanced split (so the infeasibility report has a candidate). ``ci``: its
    ``cost_inputs`` where already made."""
    graph, cluster, opts = sc.graph, sc.cluster, sc.opts
    m = config.microbatches(sc.global_batch_size)
    policies = search_space.recompute_options(opts, graph, config)
    ci = ci or cost_inputs(sc, config, sh)
    if "layer_recompute" in opts.force:         # the user's per-layer policies: time-balanced
        return replace(config, chunk_layers=opts.force.get("chunk_layers") or tuple(
            len(c.layers) for c in chunks_for(ci)))
    pinned = {k: tuple(opts.force[k]) for k in ("chunk_layers", "stage_recompute")
              if k in opts.force}
    if pinned:                                  # the user's split and/or per-stage policies
        stage = pinned.get("stage_recompute", (config.recompute,) * config.pp)
        counts = pinned.get("chunk_layers") or tuple(
            len(c.layers) for c in chunks_for(replace(ci, config=replace(
                config, recompute=strongest_recompute(stage)))))
        return with_layout(config, counts, stage, canonical="stage_recompute" not in pinned)
    budget = cluster.device.memory_bytes - reserved_bytes(cluster, opts.memory_margin_bytes)
    found = search_layout(ci, m, policies, budget)
    if found is not None:
        return found
    return replace(config, recompute=strongest_recompute(policies))
