"""``plan``: the search over meshes, per-op sharding, pipeline stages, ZeRO, recomputation,
offload and batching.

Order of the search (each level uses the cost model of ``estimate``, so the planner and the
estimator can never disagree about a configuration):
1. trace the model (or take an OpGraph);
2. for each mesh shape pp x dp x tp (tensor parallelism inside a node) and each micro-batch size
   dividing the per-replica batch: solve the sharding ILP for the tp axis (time-optimal; tp 1
   needs none; every stage's tp sub-mesh has the same shape, so the solution serves them all),
   then cost every ZeRO stage x recompute policy x optimizer offload x pipeline schedule with
   that sharding. Pipelined configs get their stage split and each stage's recompute policy
   from the min-max dynamic program of ``layout.search_layout`` (each stage's memory under its
   schedule is a constraint) and are screened with the schedule's closed form;
3. where nothing fits, solve the ILP again with the device memory as a constraint and cost the
   policies again with that sharding;
   then solve the best configurations without pipeline (up to three, within 5 % of the best)
   again, each with its own data-parallel terms (``dp_problem``: the shared ILP leaves them
   out; under ZeRO-3 each weight sharded or kept whole), keeping what it finds where no slower,
   and the best pipelined ones with their own step (``pipe_problem``: bottleneck stage, bubble,
   sends, the largest stage's dp terms), keeping what it finds where faster;
4. add the three baselines (pure data parallel, FSDP only, Megatron-style TP inside a node and
   DP across) costed by the same model, so the plan is never predicted slower than them;
5. simulate the best pipelined candidates (and the best of each schedule) event by event;
6. pick the fastest configuration that fits; keep the next ``top_k`` as alternatives, each with
   why it lost. If nothing fits, raise ``NoFeasiblePlanError`` with the least memory any
   configuration needs and what would make one fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from autoplan.cost.compute import compute_model
from autoplan.cost.memory import bytes_per_param
from autoplan.errors import ConfigError
from autoplan.gc_pause import with_fewer_collections
from autoplan.estimate.arguments import (batch_arg, capacity_arg, cluster_arg, options_error,
                                        profile_arg)
from autoplan.estimate.config import ParallelConfig
from autoplan.estimate.estimator import estimate, validate
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.planner import mesh as meshes
from autoplan.planner.dp_problem import keeps_weights_whole
from autoplan.planner.ilp import ILPSolution, solve
from autoplan.planner.assemble import assemble
from autoplan.planner.planfile import Plan
from autoplan.planner.verdicts import (Candidate, alternatives, honours, infeasible,
                                       too_few_layers, why_none_honours)
from autoplan.estimate.overlap import overlap_interference
from autoplan.planner.problem import (CostContext, ExpertExchanges, expert_exchanges, reduce_graph,
                                     sharding_from_choice)
from autoplan.planner import pins, space
from autoplan.sharding.sharding import (Sharding, context_sharding, megatron_sharding, replicated,
                                       replicated_on)


_SP_STYLES = frozenset({"colwise_sp", "rowwise_sp", "vocab_sp", "seq"})


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the search may choose from. ``force`` pins ParallelConfig fields (e.g.
    ``{"tp": 2, "zero_stage": 3}``); everything else is searched."""

    micro_batch_sizes: tuple[int, ...] | None = None   # default: powers of two up to 64
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload_optimizer: tuple[bool, ...] = (False, True)
    max_tp: int | None = None
    max_pp: int | None = None    # pipeline degrees up to this (None: up to the layer count)
    force: dict[str, Any] = field(default_factory=dict)
    top_k: int = 5
    ilp_time_limit_s: float = 20.0
    sharding: str = "ilp"        # "ilp", "megatron" (Megatron-LM's rule, for comparisons) or
                                 # "context" (the sequence split everywhere: ring attention)
    fixed_sharding: Any = None   # a Sharding to use on its tp degree (``autoplan verify``)
    memory_margin_bytes: float | None = None
    expert_capacity_factor: float = 1.0   # MoE routing imbalance priced (estimate() doc)
    pin: dict[str, str] = field(default_factory=dict)   # op pattern -> strategy (pins.py)


@dataclass
class _Stats:
    ilps: int = 0
    evaluated: int = 0
    rejected: str = ""            # why the last config could not be costed (ConfigError)
    largest: tuple[int, int] = (0, 0)     # variables, constraints of the largest ILP solved
    t0: float = field(default_factory=time.perf_counter)
    say: Callable[[str], None] = lambda _msg: None    # the caller's progress messages


@dataclass(frozen=True)
class _Frugal:
    """What the memory-constrained ILP holds per device: the most memory-saving of the
    configurations it is solved for (their state bytes per parameter and activations in flight,
    both per pipeline stage, and the strongest recomputation allowed)."""

    budget_bytes: float
    state_bytes_per_param: float
    activation_multiplier: float
    recompute: str


def _frugal(configs: list[ParallelConfig], m: int, opts: SearchOptions, graph: OpGraph,
            budget_bytes: float) -> _Frugal:
    from autoplan.cost.memory import model_state_bytes
    from autoplan.estimate.config import strongest_recompute
    from autoplan.estimate.layout import in_flight
    state = min(model_state_bytes(1.0, dp=c.shard_degree, zero_stage=c.zero_stage,
                                  precision=c.precision, optimizer=c.optimizer,
                                  offload_optimizer=c.offload_optimizer,
                                  offload_params=c.offload_params).total_bytes / c.pp
                for c in configs)
    # a stage holds 1/pp of the layers, its first stage in_flight micro-batches of them
    flight = min(in_flight(c, m, 0) / c.pp for c in configs)
    return _Frugal(budget_bytes, state, flight,
                   strongest_recompute(space.recompute_options(opts, graph)))


def _ilp_microbatches(cluster: Any, shape: Any, mbs: int, gbs: int, m: int) -> int:
    """The micro-batches the tp-axis problem weighs per-step costs with: those of the mesh
    without pipeline (dp x mbs over the whole cluster), whichever mesh asks first, so that
    forcing pp or dp never changes the sharding a free search finds."""
    flat = cluster.world_size // (shape.tp * shape.cp) * mbs
    return gbs // flat if gbs % flat == 0 else m


def _exchanges(graph: OpGraph, cluster: Any, config: ParallelConfig, opts: SearchOptions
               ) -> ExpertExchanges | None:
    """Expert parallelism's exchanges on ``config``'s ep group, for the ILP (ep > 1)."""
    if config.ep == 1:
        return None
    from autoplan.graph.experts import find_experts
    group = config.ep_group()
    counts = 8.0 * find_experts(graph).num_experts * config.ep
    return expert_exchanges(
        graph, lambda nbytes: cluster.collective_time_s("all_to_all", nbytes, group),
        cluster.collective_time_s("all_gather", counts, group), opts.expert_capacity_factor)


def _ilp_sharding(graph: OpGraph, cluster: Any, config: ParallelConfig, profile: Any,
                  m: int, opts: SearchOptions, stats: _Stats,
                  frugal: _Frugal | None = None, pinned: dict[int, str] | None = None
                  ) -> tuple[Sharding, ILPSolution]:
    """The tp-axis sharding for ``config``'s mesh and micro-batch: the fastest, or under
    ``frugal`` the fastest whose model state and activations fit its budget; ``pinned`` ops
    (``pins.resolve``) keep their strategy."""
    ctx = _context(graph, cluster, config, profile, m, opts, frugal, pinned)
    red = reduce_graph(ctx)
    sol = solve(red.problem, time_limit_s=opts.ilp_time_limit_s)
    what = ("tp axis, memory-constrained" if frugal else "tp axis") + (
        f", ep{config.ep}" if config.ep > 1 else "")
    return _solved(graph, config.tp, red, _counted(sol, stats, config, what), stats)


def _counted(sol: ILPSolution, stats: _Stats, config: ParallelConfig, what: str
             ) -> ILPSolution:
    """``sol``, counted in the search's statistics (ILPs solved, the largest) and reported to
    the progress callback (its mesh, size, time and gap)."""
    stats.ilps += 1
    stats.largest = max(stats.largest, (sol.num_variables, sol.num_constraints))
    gap = "" if sol.gap is None else f", gap {sol.gap * 100:.2f}%"
    stats.say(f"  ILP ({what}) for mesh pp{config.pp} x dp{config.dp}"
              + (f" x cp{config.cp}" if config.cp > 1 else "")
              + f" x tp{config.tp} mbs {config.micro_batch_size}: {sol.num_variables} "
              f"variables, {sol.num_constraints} constraints, {sol.time_s:.3f} s, "
              f"{sol.status}{gap}")
    return sol


def _solved(graph: OpGraph, t: int, red: Any, sol: ILPSolution, stats: _Stats
            ) -> tuple[Sharding, ILPSolution]:
    if sol.status in ("infeasible", "not_solved"):
        return replicated_on(graph, t), sol
    return sharding_from_choice(graph, t, red, sol.choice), sol


def _context(graph: OpGraph, cluster: Any, config: ParallelConfig, profile: Any, m: int,
             opts: SearchOptions, frugal: _Frugal | None, pinned: dict[int, str] | None
             ) -> CostContext:
    from autoplan.sharding.context_axis import context_axis
    t = config.tp
    group = config.tp_group()
    cp_group = config.cp_group()
    compute = compute_model(graph, cluster.device, config.precision, profile)
    w, g, o = bytes_per_param(config.precision, config.optimizer)
    return CostContext(graph=graph, t=t, compute=compute,
                      context=context_axis(graph, config.cp),
                      cp_collective_s=lambda kind, nbytes: cluster.collective_time_s(
                          kind, nbytes, cp_group),
                      collective_s=lambda kind, nbytes: cluster.collective_time_s(kind, nbytes,
                                                                                  group),
                      batch_scale=config.micro_batch_size / graph.batch_size, microbatches=m,
                      precision=config.precision,
                      recompute=frugal.recompute if frugal else "none",
                      state_bytes_per_param=frugal.state_bytes_per_param if frugal else w + g + o,
                      activation_multiplier=frugal.activation_multiplier if frugal else 1.0,
                      memory_budget=frugal.budget_bytes if frugal else None,
                      interference=overlap_interference(cluster),
                      experts=_exchanges(graph, cluster, config, opts),
                      pinned=pinned or None)


def _dp_sharding(graph: OpGraph, cluster: Any, cand: Candidate, gbs: int,
                 opts: SearchOptions, profile: Any, stats: _Stats,
                 pinned: dict[int, str] | None
                 ) -> tuple[ParallelConfig, Sharding, ILPSolution] | None:
    """The sharding for exactly ``cand``'s config (pp 1): the tp-axis ILP with its recompute
    policy, ZeRO stage and the rest of its step (``dp_problem``), linearized at the shared
    ILP's choice, within the device memory the candidate leaves for state and activations;
    under ZeRO-3 it may keep weights whole (``dp_whole``). Its objective is then
    ``estimate``'s step time. None where it finds nothing."""
    from autoplan.cost.memory import model_state_bytes
    from autoplan.planner.dp_problem import whole_patterns, with_dp_terms
    config = cand.est.config
    m = config.microbatches(gbs)

    def state(dp: int, zero: int) -> float:
        return model_state_bytes(1.0, dp=dp, zero_stage=zero, precision=config.precision,
                                 optimizer=config.optimizer,
                                 offload_optimizer=config.offload_optimizer,
                                 offload_params=config.offload_params).total_bytes
    sharded = state(config.shard_degree, config.zero_stage)
    mem = cand.est.stages[0].memory
    ctx = replace(_context(graph, cluster, config, profile, m, opts, None, pinned),
                  recompute=config.recompute, state_bytes_per_param=sharded,
                  memory_budget=cluster.device.memory_bytes - mem.margin_bytes
                  - mem.transient_bytes,
                  step_shard=config.shard_degree if config.zero_stage >= 2 else 1)
    red = reduce_graph(ctx)
    reference = (cand.ilp.choice if cand.ilp is not None else   # tp 1: every op replicated
                 tuple(next((j for j, ch in enumerate(node.choices)
                             if all(st.name == "replicate" for st in ch)), 0)
                       for node in red.nodes))
    dp = with_dp_terms(red, graph, cluster, config, m, ctx.compute, profile, ctx.interference,
                       reference, whole_extra_bytes=None if "dp_whole" in opts.force
                       else state(1, 0) - sharded)
    start = dp.lift(reference)
    if dp.problem.memory(start) > dp.problem.memory_budget:
        start = None                            # no head start that does not fit
    sol = _counted(solve(dp.problem, time_limit_s=opts.ilp_time_limit_s, start=start), stats,
                   config, f"with ZeRO-{config.zero_stage}'s data-parallel terms")
    if sol.status not in ("optimal", "feasible"):
        return None
    whole = whole_patterns(graph, red, dp.whole_nodes(sol.choice))
    sh = sharding_from_choice(graph, config.tp, red, dp.strategies(sol.choice))
    return replace(config, dp_whole=whole), sh, sol


def _evaluate(graph: OpGraph, cluster: Any, configs: list[ParallelConfig], sh: Sharding,
              sol: ILPSolution | None, gbs: int, profile: Any, opts: SearchOptions,
              stats: _Stats, label: str, simulate: bool = False) -> list[Candidate]:
    out = []
    sp = sh.t > 1 and any(s.style in _SP_STYLES for s in sh.op_strategy)
    for c in configs:
        # tp_comm_overlap only when asked for (the runtime cannot run it), and where it applies
        overlap = bool(opts.force.get("tp_comm_overlap")) and sp
        if c.sequence_parallel != sp or c.tp_comm_overlap != overlap:
            c = replace(c, sequence_parallel=sp, tp_comm_overlap=overlap)
        try:
            if c.pp > 1 and c.chunk_layers is None:
                c = _with_stage_layout(graph, cluster, c, sh, gbs, profile, opts)
            est = estimate(graph, cluster, config=c, global_batch_size=gbs, profile=profile,
                           sharding=sh, memory_margin_bytes=opts.memory_margin_bytes,
                           simulate_pipeline=simulate,
                           expert_capacity_factor=opts.expert_capacity_factor)
        except ConfigError as e:
            stats.rejected = str(e)
            continue
        stats.evaluated += 1
        out.append(Candidate(est, sh, sol, label))
    return out


def _with_stage_layout(graph: OpGraph, cluster: Any, config: ParallelConfig, sh: Sharding,
                       gbs: int, profile: Any, opts: SearchOptions) -> ParallelConfig:
    """The pipelined config with its stage split and per-stage recomputation chosen to fit the
    device (``layout.search_layout``); when nothing fits, the most memory-saving policy on a
    time-balanced split (so the infeasibility report has a candidate)."""
    from autoplan.graph.analysis import analyze
    from autoplan.estimate.chunk_cost import CostInputs
    from autoplan.estimate.estimator import _margin
    from autoplan.estimate.config import strongest_recompute
    from autoplan.estimate.layout import chunks_for, search_layout, with_layout
    m = config.microbatches(gbs)
    policies = space.recompute_options(opts, graph)
    from autoplan.sharding.context_axis import context_axis
    ci = CostInputs(graph=graph, analysis=analyze(graph), sharding=sh,
                    compute=compute_model(graph, cluster.device, config.precision, profile),
                    cluster=cluster, config=config, expert_load=opts.expert_capacity_factor,
                    context=context_axis(graph, config.cp))
    pinned = {k: tuple(opts.force[k]) for k in ("chunk_layers", "stage_recompute")
              if k in opts.force}
    if pinned:                                  # the user's split and/or per-stage policies
        stage = pinned.get("stage_recompute", (config.recompute,) * config.pp)
        counts = pinned.get("chunk_layers") or tuple(
            len(c.layers) for c in chunks_for(replace(ci, config=replace(
                config, recompute=strongest_recompute(stage)))))
        return with_layout(config, counts, stage, canonical="stage_recompute" not in pinned)
    budget = cluster.device.memory_bytes - _margin(cluster, opts.memory_margin_bytes)
    found = search_layout(ci, m, policies, budget)
    if found is not None:
        return found
    return replace(config, recompute=strongest_recompute(policies))


def _megatron_tps(graph: OpGraph, cluster: Any, opts: SearchOptions) -> list[int]:
    """Tensor-parallel degrees for the Megatron baseline: inside a node, dividing the world
    (and every head count, as Megatron-LM requires)."""
    from autoplan.graph.analysis import analyze
    heads = analyze(graph).head_counts
    return [tp for tp in meshes.divisors(cluster.devices_per_node)
            if tp > 1 and cluster.world_size % tp == 0 and all(h % tp == 0 for h in heads)
            and (opts.max_tp is None or tp <= opts.max_tp)]


def _context_tps(graph: OpGraph, cluster: Any, opts: SearchOptions) -> list[int]:
    """Context-parallel degrees for its baseline: inside a node, where the model's attention
    can run as ring attention on that many ranks."""
    return [cp for cp in meshes.divisors(cluster.devices_per_node)
            if cp > 1 and cluster.world_size % cp == 0
            and (opts.max_tp is None or cp <= opts.max_tp)
            and context_sharding(graph, cp) is not None]


def _baselines(graph: OpGraph, cluster: Any, gbs: int, base: dict[str, Any], profile: Any,
               opts: SearchOptions, stats: _Stats) -> list[Candidate]:
    """Pure data parallel, FSDP only, and Megatron-style (TP with sequence parallelism inside a
    node, DP across) at every such degree and ZeRO stage: each at its best micro-batch size."""
    world = cluster.world_size
    out: list[Candidate] = []
    specs = [("baseline: data parallel", dict(dp=world, tp=1, zero_stage=0), None),
             ("baseline: FSDP", dict(dp=world, tp=1, zero_stage=3), None)]
    for tp in _megatron_tps(graph, cluster, opts):
        for z in ((0, 1, 2, 3) if world // tp > 1 else (0,)):
            specs.append((f"baseline: Megatron (TP in node, DP across{', ZeRO-%d' % z if z else ''})",
                          dict(dp=world // tp, tp=tp, zero_stage=z, sequence_parallel=True), tp))
    for cp in _context_tps(graph, cluster, opts):
        for z in ((1, 3) if world // cp > 1 else (0,)):
            specs.append((f"baseline: context parallel (sequence split in node, DP across"
                          f"{', ZeRO-%d' % z if z else ''})",
                          dict(dp=world // cp, tp=cp, zero_stage=z), ("context", cp)))
    for label, fields, mtp in specs:
        per_replica = gbs // fields["dp"] if gbs % fields["dp"] == 0 else 0
        if not per_replica:
            continue
        if isinstance(mtp, tuple):
            sh, mtp = context_sharding(graph, mtp[1]), mtp[1]
        else:
            sh = (megatron_sharding(graph, mtp, True) if mtp else replicated(graph))
        configs = [ParallelConfig(**{**base, **fields, "micro_batch_size": mbs, "recompute": r})
                   for mbs in space.mbs_options(per_replica, SearchOptions())
                   for r in (("none", "selective", "full") if mtp else ("none",))]
        cands = _evaluate(graph, cluster, configs, sh, None, gbs, profile, opts, stats, label)
        fitting = [c for c in cands if c.est.fits]
        pool = fitting or cands
        if pool:
            out.append(min(pool, key=Candidate.key))
    return out


@with_fewer_collections
def plan(model: Any, cluster: Any, *, global_batch_size: int, example_inputs: Any = None,
         loss_fn: Any = None, targets: Any = None, precision: str = "bf16",
         optimizer: str = "adamw", profile: Any = "auto", name: str | None = None,
         progress: Callable[[str], None] | None = None, **options: Any) -> Plan:
    """Find the fastest configuration that fits and return it as a ``Plan`` (see module doc).

    ``options`` are ``SearchOptions`` fields (``force={...}``, ``top_k``, ``max_tp``...).
    """
    try:
        opts = SearchOptions(**options)
    except TypeError as e:
        raise options_error(e, "plan()", [f.name for f in fields(SearchOptions)]) from None
    global_batch_size = batch_arg(global_batch_size, "plan()")
    cluster = cluster_arg(cluster, "plan()")
    opts = replace(opts, expert_capacity_factor=capacity_arg(opts.expert_capacity_factor))
    if not isinstance(opts.force, dict):
        raise ConfigError(f"plan(): force must be a dict of ParallelConfig fields, got "
                          f"{opts.force!r:.60}")
    if "dp_whole" in opts.force:           # as a config holds it
        opts = replace(opts, force={**opts.force, "dp_whole": ParallelConfig(
            dp=2, zero_stage=3, dp_whole=opts.force["dp_whole"]).dp_whole})
    if opts.sharding not in ("ilp", "megatron", "context"):
        raise ConfigError(f"sharding must be 'ilp', 'megatron' or 'context', got "
                          f"{opts.sharding!r}")
    if opts.pin and (opts.sharding != "ilp" or opts.fixed_sharding is not None):
        raise ConfigError("pin= fixes some ops' strategies for the ILP to plan around: use it "
                          "with sharding='ilp' and no fixed sharding")
    say = progress or (lambda _msg: None)
    stats = _Stats(say=say)
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="plan()",
                     error=ConfigError)
    profile = profile_arg(profile, cluster, "plan()")
    base = {"precision": precision, "optimizer": optimizer}
    cands: list[Candidate] = []
    from autoplan.estimate.partition import main_block
    block = main_block(graph)
    layers = len(block.instances) if block else 1
    shapes = meshes.enumerate_meshes(cluster, max_tp=opts.max_tp, max_pp=opts.max_pp,
                                     num_layers=layers,
                                     context_degrees=space.context_degrees(graph, cluster, opts))
    shapes = [s for s in shapes if all(getattr(s, k) == v for k, v in opts.force.items()
                                       if k in ("dp", "tp", "pp", "cp"))]
    if not shapes:
        raise ConfigError(f"no mesh of {cluster.world_size} devices matches force={opts.force}"
                          + too_few_layers(opts.force.get("pp", 1), layers, block))
    if opts.force.get("ep", 1) != 1:
        from autoplan.graph.experts import find_experts
        found = find_experts(graph)
        if found is None:
            raise ConfigError(f"force ep={opts.force['ep']}: the model has no experts to split "
                              "(expert parallelism needs a grouped product of stacked expert "
                              "weights, as HF Mixtral and torchtitan-style MoE layers trace)")
        if found.num_experts % opts.force["ep"]:
            raise ConfigError(f"force ep={opts.force['ep']}: the model's "
                              f"{found.num_experts} experts do not split evenly over it")
    ilp_cache: dict[tuple[int, int], tuple[Sharding, ILPSolution | None]] = {}
    pinned = pins.resolve(graph, opts.pin) if opts.pin else {}
    for shape in shapes:
        where = (f"mesh pp{shape.pp} x dp{shape.dp}" + (f" x cp{shape.cp}" if shape.cp > 1
                                                         else "") + f" x tp{shape.tp}")
        why = ((pins.unavailable(graph, pinned, shape.tp) if shape.tp > 1
                else "tp=1 shards nothing") if pinned else None)
        if why:
            say(f"{where}: the pins cannot hold ({why}), skipped")
            continue
        if global_batch_size % shape.dp:
            say(f"{where}: global batch {global_batch_size} does not split over dp, skipped")
            continue
        per_replica = global_batch_size // shape.dp
        mbs_options = space.mbs_options(per_replica, opts)
        if shape.cp > 1:
            # a micro-batch of several sequences splits over dp instead, with no ring
            mbs_options = mbs_options[:1]
        for mbs in space.forced(opts, "micro_batch_size", mbs_options):
            cfg = ParallelConfig(pp=shape.pp, dp=shape.dp, tp=shape.tp, cp=shape.cp,
                                 micro_batch_size=mbs, **base)
            try:
                m = validate(graph, cluster, cfg, global_batch_size)
            except ConfigError as e:
                say(f"{where} mbs {mbs}: {e}")
                break
            if shape.pp > 1 and "micro_batch_size" not in opts.force and (
                    m < shape.pp or mbs > 4):
                break                 # few micro-batches per stage: mostly bubble
            # the tp-axis problem depends on the micro-batch, not on pp or dp (only the per-step
            # gradient all-reduces of replicated weights weigh with m: priced at the m of the
            # mesh without pipeline, whichever mesh asks first, so that forcing pp or dp never
            # changes the sharding a free search finds)
            key = (shape.tp, mbs, shape.cp)
            if key not in ilp_cache:
                fixed = opts.fixed_sharding
                if fixed is not None and fixed.t == shape.tp:
                    ilp_cache[key] = (fixed, None)
                elif shape.tp == 1:
                    ilp_cache[key] = (replicated(graph), None)
                elif opts.sharding == "megatron":
                    ilp_cache[key] = (megatron_sharding(
                        graph, shape.tp, bool(opts.force.get("sequence_parallel"))), None)
                elif opts.sharding == "context":
                    ilp_cache[key] = (context_sharding(graph, shape.tp)
                                      or replicated_on(graph, shape.tp), None)
                else:
                    try:
                        ilp_cache[key] = _ilp_sharding(graph, cluster, cfg, profile,
                                                       _ilp_microbatches(cluster, shape, mbs,
                                                                         global_batch_size, m),
                                                       opts, stats, pinned=pinned)
                    except ConfigError as e:        # a pin that cannot hold at this size
                        say(f"{where} mbs {mbs}: {e}")
                        continue
            policies = space.policies(cfg, opts, cluster, graph,
                                      space.schedules(cfg, m, layers, opts))
            found = []
            for ep in sorted({c.ep for c in policies}):
                group = [c for c in policies if c.ep == ep]
                ecfg = replace(cfg, ep=ep)
                sh, sol = ilp_cache[key]
                if ep > 1 and sol is not None:     # the ILP prices the experts' exchanges
                    if key + (ep,) not in ilp_cache:
                        ilp_cache[key + (ep,)] = _ilp_sharding(
                            graph, cluster, ecfg, profile,
                            _ilp_microbatches(cluster, shape, mbs, global_batch_size, m),
                            opts, stats, pinned=pinned)
                    sh, sol = ilp_cache[key + (ep,)]
                found_ep = _evaluate(graph, cluster, group, sh, sol, global_batch_size,
                                     profile, opts, stats, "search")
                if (shape.tp > 1 and opts.sharding == "ilp" and opts.fixed_sharding is None
                        and not any(c.est.fits for c in found_ep)):
                    budget = cluster.device.memory_bytes - (
                        found_ep[0].est.stages[0].memory.margin_bytes if found_ep else 0.0)
                    sh2, sol2 = _ilp_sharding(graph, cluster, ecfg, profile, m, opts, stats,
                                              frugal=_frugal(group, m, opts, graph, budget),
                                              pinned=pinned)
                    if sol2.status in ("optimal", "feasible"):
                        found_ep += _evaluate(graph, cluster, group, sh2, sol2,
                                              global_batch_size, profile, opts, stats, "search")
                found += found_ep
            cands += found
            fit = [c for c in found if c.est.fits]
            best = min(fit, key=Candidate.key) if fit else None
            say(f"{where} mbs {mbs}: "
                + (f"best {best.est.step_time_s * 1e3:,.1f} ms ({best.est.config.short()})"
                   if best else "nothing fits")
                + f"  [{stats.evaluated} configs, {stats.ilps} ILPs, "
                  f"{time.perf_counter() - stats.t0:.1f} s]")
            if best is None:
                break       # larger micro-batches only need more memory
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = _refine_dp(graph, cluster, cands, global_batch_size, profile, opts, stats,
                           pinned)
    if opts.fixed_sharding is None and not opts.pin:   # a given sharding is the one to use
        cands += _baselines(graph, cluster, global_batch_size, base, profile, opts, stats)
    if not cands:
        raise ConfigError("no configuration could be costed; check the batch size and the "
                          "cluster size" + (f" (the last one refused: {stats.rejected})"
                                            if stats.rejected else ""))
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = _refine_pipe_ilp(graph, cluster, cands, global_batch_size, profile, opts,
                                 stats, pinned)
    cands = _refine_pipelined(graph, cluster, cands, global_batch_size, profile, opts, stats)
    # forced fields bind the choice; baselines that differ stay as alternatives
    fitting = sorted((c for c in cands if c.est.fits and honours(c.est.config, opts.force)),
                     key=Candidate.key)
    if opts.force and not any(honours(c.est.config, opts.force) for c in cands):
        raise ConfigError(f"no configuration with force={opts.force} could be costed: "
                          + why_none_honours(cands, opts.force, stats))
    if not fitting:
        raise infeasible(cands, cluster, opts.force)
    best = fitting[0]
    return assemble(graph, cluster, best, alternatives(cands, best, opts.top_k, opts.force),
                    stats, global_batch_size, name, opts.expert_capacity_factor)


def _refine_dp(graph: OpGraph, cluster: Any, cands: list[Candidate], gbs: int, profile: Any,
               opts: SearchOptions, stats: _Stats, pinned: dict[int, str],
               finalists: int = 3, within: float = 0.05) -> list[Candidate]:
    """The shared tp-axis ILP leaves out what its sharding does to data parallelism's traffic
    and the optimizer (it serves every ZeRO stage): the best few ILP-sharded configurations
    without pipeline (up to ``finalists``, within ``within`` of the best fitting one) are
    solved again with their own terms (``dp_problem``), and the sharding found replaces theirs
    where it is no slower (its ILP's objective is then the plan's predicted step time)."""
    out = list(cands)
    done: set[ParallelConfig] = set()
    best = min((c.est.step_time_s for c in cands if c.est.fits), default=None)
    for k, c in sorted(enumerate(cands), key=lambda kc: kc[1].key()):
        cfg = c.est.config
        if len(done) == finalists or best is None or c.est.step_time_s > best * (1 + within):
            break
        # tp 1 has no sharding to choose, but under ZeRO-3 which weights to keep whole
        fsdp_only = (c.ilp is None and cfg.tp == 1 and keeps_weights_whole(cfg)
                     and "dp_whole" not in opts.force and opts.fixed_sharding is None)
        if (not fsdp_only and (c.ilp is None or c.ilp.status not in ("optimal", "feasible"))
                or cfg.pp > 1 or not c.est.fits or cfg in done
                or cfg.dp_whole):   # (forced ones)
            continue
        done.add(cfg)
        found = _dp_sharding(graph, cluster, c, gbs, opts, profile, stats, pinned)
        if found is None:
            continue
        new, sh, sol = found
        better = [r for r in _evaluate(graph, cluster, [new], sh, sol, gbs, profile, opts,
                                       stats, c.label) if r.est.fits and r.key() <= c.key()]
        if better:
            out[k] = better[0]
    return out


def _refine_pipe_ilp(graph: OpGraph, cluster: Any, cands: list[Candidate], gbs: int,
                     profile: Any, opts: SearchOptions, stats: _Stats, pinned: dict[int, str],
                     finalists: int = 3, rounds: int = 3, within: float = 0.05
                     ) -> list[Candidate]:
    """The shared ILP priced a pipelined configuration's sharding as one stage; the best few
    pipelined configurations (up to ``finalists``, their stage layout fixed) are solved again
    with their own step (``pipe_problem``: the bottleneck stage's micro-batches and bubble,
    the sends, the dp terms of the stage where they are largest; those within ``within`` of
    the best configuration found, as ``_refine_dp`` takes them), linearized at the shared
    answer and again at each new answer while it moves the bottleneck or the dp stage (up to
    ``rounds``); what it finds replaces the shared sharding where it fits and is faster. Not
    with expert or context parallelism (their terms are the shared problem's only)."""
    from autoplan.estimate.chunk_cost import CostInputs
    from autoplan.estimate.layout import chunks_for
    from autoplan.graph.analysis import analyze
    from autoplan.planner import pipe_problem
    out = list(cands)
    done = 0
    best = min((c.est.step_time_s for c in cands if c.est.fits), default=None)
    for k, c in sorted(enumerate(cands), key=lambda kc: kc[1].key()):
        cfg = c.est.config
        if done == finalists or best is None or c.est.step_time_s > best * (1 + within):
            break
        if (cfg.pp == 1 or not c.est.fits or c.ilp is None or cfg.ep > 1 or cfg.cp > 1
                or c.ilp.status not in ("optimal", "feasible") or c.label != "search"):
            continue
        done += 1
        m = cfg.microbatches(gbs)
        base = _context(graph, cluster, cfg, profile, m, opts, None, pinned)
        chunks = chunks_for(CostInputs(graph=graph, analysis=analyze(graph),
                                       sharding=c.sharding, compute=base.compute,
                                       cluster=cluster, config=cfg))

        def build(reference: tuple[int, ...]) -> Any:
            return pipe_problem.build(graph, cluster, cfg, m, chunks,
                                      lambda pol: replace(base, recompute=pol), base.compute,
                                      profile, base.interference, reference)
        pipe = build(c.ilp.choice)
        found: dict[tuple[int, ...], ILPSolution] = {}
        for _ in range(rounds):
            sol = _counted(solve(pipe.problem, time_limit_s=opts.ilp_time_limit_s,
                                 start=c.ilp.choice), stats, cfg, "the pipelined step")
            if sol.status not in ("optimal", "feasible") or sol.choice in found:
                break
            found[sol.choice] = sol
            moved = build(sol.choice)
            if (moved.bottleneck, moved.worst) == (pipe.bottleneck, pipe.worst):
                break
            pipe = moved
        for choice, sol in found.items():   # (where the stages moved: each answer priced)
            sh = sharding_from_choice(graph, cfg.tp, pipe.red, choice)
            better = [r for r in _evaluate(graph, cluster, [cfg], sh, sol, gbs, profile, opts,
                                           stats, c.label)
                      if r.est.fits
                      and r.est.step_time_s < out[k].est.step_time_s * (1 - 1e-9)]
            if better:
                out[k] = better[0]
    return out


def _refine_pipelined(graph: OpGraph, cluster: Any, cands: list[Candidate], gbs: int,
                      profile: Any, opts: SearchOptions, stats: _Stats,
                      finalists: int = 8, within: float = 0.10) -> list[Candidate]:
    """Pipelined candidates were screened with the closed form; simulate the best few and the
    best of each schedule at each micro-batch size within ``within`` of the best, so that the
    plan's figures are the simulator's and no schedule's optimism in the closed form crowds
    out another's best. (The closed form is within 2.5 % of the simulation on the benchmark's
    plans, ``benchmarks/search_time.py``: a schedule's best further behind cannot win.)"""
    piped = sorted((c for c in cands if c.est.config.pp > 1 and c.est.fits), key=Candidate.key)
    if not piped:
        return cands
    chosen = piped[:finalists]
    best_of: dict[tuple[str, int], Candidate] = {}
    for c in piped:
        if c.est.step_time_s <= piped[0].est.step_time_s * (1 + within):
            best_of.setdefault((c.est.config.schedule, c.est.config.micro_batch_size), c)
    chosen += best_of.values()
    keep = [c for c in cands if c.est.config.pp == 1]
    seen = set()
    for c in chosen:
        if id(c) in seen:
            continue
        seen.add(id(c))
        keep += _evaluate(graph, cluster, [c.est.config], c.sharding, c.ilp, gbs, profile,
                          opts, stats, c.label, simulate=True)
    return keep
