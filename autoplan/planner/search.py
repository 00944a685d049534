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
   schedule is a constraint) and are screened with the schedule's closed form. What cannot
   win is not costed: a config that only recomputes more than one that fits, and a pipelined
   one whose floor (``layout.step_floor_s``, below any layout's closed form) is more than
   ``CLOSED_FORM_SLACK`` behind the best found so far;
3. where nothing fits, solve the ILP again with the device memory as a constraint and cost the
   policies again with that sharding;
   then solve the best configurations without pipeline (up to three, within 5 % of the best)
   again, each with its own data-parallel terms (``dp_problem``: the shared ILP leaves them
   out; under ZeRO-3 each weight sharded or kept whole), keeping what it finds where no slower,
   and the best pipelined ones with their own step (``pipe_problem``: bottleneck stage, bubble,
   sends, the largest stage's dp terms; each rank's memory a row), keeping what it finds where
   faster;
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
from dataclasses import fields, replace
from typing import Any

from autoplan.errors import ConfigError
from autoplan.estimate.partition import main_block
from autoplan.gc_pause import with_fewer_collections
from autoplan.estimate.arguments import (batch_arg, capacity_arg, cluster_arg, options_error,
                                        profile_arg, search_options_arg)
from autoplan.estimate.estimator import validate
from autoplan.graph.analysis import analyze
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.planner import mesh as meshes, objectives, pins, search_space
from autoplan.planner.assemble import assemble
from autoplan.planner.search_costing import (CLOSED_FORM_SLACK, SearchContext, Stats, evaluate,
                                      frugal, frugal_sharding, ilp_microbatches,
                                      ilp_sharding)
from autoplan.planner.ilp import ILPSolution
from autoplan.planner.options import SearchOptions  # (also imported from here by users)
from autoplan.planner.planfile import OBJECTIVES_SCHEMA, Plan
from autoplan.planner.finalists import refine_dp, refine_pipe_ilp, refine_pipelined
from autoplan.planner.recompute_choice import refine_recompute
from autoplan.planner.candidates import (Candidate, alternatives, honours, infeasible,
                                       too_few_layers, why_none_honours)
from autoplan.sharding.doc_work import packed_work
from autoplan.sharding.mesh_axes import BASE_AXES
from autoplan.sharding.parallel_config import ParallelConfig, strongest_recompute
from autoplan.sharding.sharding import Sharding, context_sharding, megatron_sharding, replicated


def _megatron_tps(graph: OpGraph, cluster: Any, opts: SearchOptions) -> list[int]:
    """Tensor-parallel degrees for the Megatron baseline: inside a node, dividing the world
    (and every head count, as Megatron-LM requires)."""
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


def _baselines(sc: SearchContext, base: dict[str, Any]) -> list[Candidate]:
    """Pure data parallel, FSDP only, and Megatron-style (TP with sequence parallelism inside a
    node, DP across) at every such degree and ZeRO stage: each at its best micro-batch size."""
    graph, cluster, opts, gbs = sc.graph, sc.cluster, sc.opts, sc.global_batch_size
    world = cluster.world_size
    out: list[Candidate] = []
    specs = [("baseline: data parallel", dict(dp=world, tp=1, zero_stage=0), None),
             ("baseline: FSDP", dict(dp=world, tp=1, zero_stage=3), None)]
    # the tp axis carries the layout asked for: Megatron's with sharding="megatron", ring
    # attention's with "context"; the ILP's search ("ilp") weighs both
    for tp in _megatron_tps(graph, cluster, opts) if opts.sharding != "context" else ():
        for z in ((0, 1, 2, 3) if world // tp > 1 else (0,)):
            specs.append((f"baseline: Megatron (TP in node, DP across{', ZeRO-%d' % z if z else ''})",
                          dict(dp=world // tp, tp=tp, zero_stage=z, sequence_parallel=True), tp))
    for cp in _context_tps(graph, cluster, opts) if opts.sharding != "megatron" else ():
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
        configs = [v for mbs in search_space.mbs_options(per_replica, SearchOptions(), graph)
                   for r in (("none", "selective", "full") if mtp else ("none",))
                   for v in search_space.with_compilation(
                       ParallelConfig(**{**base, **fields, "micro_batch_size": mbs,
                                         "recompute": r}), opts, graph)]
        cands = evaluate(sc, configs, sh, None, label, prune_dominated=True)
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
    With ``objective="cost"`` or ``"energy"``, ``max_gpus``, ``tokens``, ``deadline_days`` or
    ``budget_usd``, it also chooses how many of the cluster's devices to use
    (``planner/objectives.py``): the plan is then for those devices, and its ``objectives``
    holds the figures of every device count searched and the Pareto front.
    """
    try:
        opts = SearchOptions(**options)
    except TypeError as e:
        raise options_error(e, "plan()", [f.name for f in fields(SearchOptions)]) from None
    global_batch_size = batch_arg(global_batch_size, "plan()")
    search_options_arg(opts, progress=progress)
    objectives.check_request(opts)
    cluster = cluster_arg(cluster, "plan()")
    if cluster.pools:
        raise ConfigError(f"plan() searches homogeneous clusters; {cluster.name} has "
                          f"{len(cluster.pools)} pools of different nodes: use "
                          "autoplan.plan_hetero(model, cluster, global_batch_size=...) (or "
                          "`autoplan plan`), which plans it against its slowest GPU and "
                          "balances the work on the pools")
    opts = _checked_options(opts)
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="plan()",
                     error=ConfigError)
    opts = replace(opts, seq_lengths=packed_work(graph, opts.seq_lengths,
                                                 cluster.device.kind))

    def plan_on(where: Any, o: SearchOptions) -> Plan:
        return _plan_on(graph, where, o, global_batch_size=global_batch_size,
                        precision=precision, optimizer=optimizer, profile=profile, name=name,
                        progress=progress)

    if not objectives.wanted(opts):
        return plan_on(cluster, opts)
    # the objectives: every device count searched for its fastest plan, then scored
    best, _points, section = objectives.search_counts(
        cluster, opts, plan_on, progress or (lambda _msg: None))
    return replace(best.plan, objectives=section, schema_version=OBJECTIVES_SCHEMA)


def _plan_on(graph: OpGraph, cluster: Any, opts: SearchOptions, *, global_batch_size: int,
             precision: str, optimizer: str, profile: Any, name: str | None,
             progress: Callable[[str], None] | None) -> Plan:
    """The fastest plan of ``graph`` on ``cluster`` (the search of the module docstring)."""
    stats = Stats(say=progress or (lambda _msg: None))
    profile = profile_arg(profile, cluster, "plan()")
    if precision == "auto":       # the search tries the precisions the device runs
        precision = search_space.auto_precision(cluster)
        opts = replace(opts, precision_auto=True)
    base = {"precision": precision, "optimizer": optimizer}
    holds = search_space.mixed_precision_choices(opts, precision)
    base["compiled"] = search_space.compiled_choice(opts, cluster)
    shapes, layers = _meshes(graph, cluster, opts)
    _check_forced_experts(graph, opts)
    sc = SearchContext(graph=graph, cluster=cluster, global_batch_size=global_batch_size,
                       profile=profile, opts=opts, stats=stats,
                       pinned=pins.resolve(graph, opts.pin) if opts.pin else {})
    cands = []
    for held in holds:             # each way of holding 16-bit weights the options allow
        cands += _search_held(sc, shapes, {**base, "mixed_precision": held}, layers)
    return _choose(sc, cands, {**base, "mixed_precision": holds[0]}, name)


def _search_held(sc: SearchContext, shapes: list[Any], base: dict[str, Any],
                 layers: int) -> list[Candidate]:
    """``_search_meshes`` for one way of holding the weights; 16-bit weights with an fp32
    master copy only on meshes the runtime runs them on (no cp or ep), also when forced,
    unless the user forced such a mesh too (then the runtime refuses the plan with its
    reason)."""
    if base["mixed_precision"] != "params" or base["precision"] == "fp32":
        return _search_meshes(sc, shapes, base, layers)
    mine = [s for s in shapes if search_space.runs_master_weights(s)]
    if "mixed_precision" in sc.opts.force and not mine:
        return _search_meshes(sc, shapes, base, layers)
    return _search_meshes(sc, mine, base, layers) if mine else []


def _checked_options(opts: SearchOptions) -> SearchOptions:
    """``opts`` checked against one another, with the forced ``dp_whole`` as a config holds
    it and the capacity factor validated."""
    opts = replace(opts, expert_capacity_factor=capacity_arg(opts.expert_capacity_factor))
    if not isinstance(opts.force, dict):
        raise ConfigError(f"plan(): force must be a dict of ParallelConfig fields, got "
                          f"{opts.force!r:.60}")
    if "dp_whole" in opts.force:           # as a config holds it
        opts = replace(opts, force={**opts.force, "dp_whole": ParallelConfig(
            dp=2, zero_stage=3, dp_whole=opts.force["dp_whole"]).dp_whole})
    if "layer_recompute" in opts.force:    # as a config holds it (and checked as one)
        opts = replace(opts, force={**opts.force, "layer_recompute": ParallelConfig(
            recompute=strongest_recompute(opts.force["layer_recompute"]),
            layer_recompute=opts.force["layer_recompute"]).layer_recompute})
    if "layer_offload" in opts.force:      # as a config holds it (checked as one)
        opts = replace(opts, force={**opts.force, "layer_offload": ParallelConfig(
            layer_offload=opts.force["layer_offload"]).layer_offload})
    if opts.sharding not in ("ilp", "megatron", "context"):
        raise ConfigError(f"sharding must be 'ilp', 'megatron' or 'context', got "
                          f"{opts.sharding!r}")
    if opts.pin and (opts.sharding != "ilp" or opts.fixed_sharding is not None):
        raise ConfigError("pin= fixes some ops' strategies for the ILP to plan around: use it "
                          "with sharding='ilp' and no fixed sharding")
    return opts


def _meshes(graph: OpGraph, cluster: Any, opts: SearchOptions) -> tuple[list[Any], int]:
    """The mesh shapes to search (those the forced degrees allow) and the model's layer
    count; ConfigError where no mesh matches."""
    block = main_block(graph)
    layers = len(block.instances) if block else 1
    shapes = meshes.enumerate_meshes(cluster, max_tp=opts.max_tp, max_pp=opts.max_pp,
                                     num_layers=layers,
                                     context_degrees=search_space.context_degrees(graph, cluster,
                                                                                  opts))
    shapes = [s for s in shapes if all(s.degree(a) == opts.force[a.value] for a in BASE_AXES
                                       if a.value in opts.force)]
    if opts.meshes is not None:
        allowed = {tuple(m) for m in opts.meshes}
        shapes = [s for s in shapes if tuple(s.degree(a) for a in BASE_AXES) in allowed]
        if not shapes:
            raise ConfigError(f"no mesh of {cluster.world_size} devices among meshes="
                              f"{list(opts.meshes)} (pp, dp, cp, tp) matches force={opts.force}"
                              f" and the model's {layers} layers: widen meshes or drop it")
    if not shapes:
        raise ConfigError(f"no mesh of {cluster.world_size} devices matches force={opts.force}"
                          + too_few_layers(opts.force.get("pp", 1), layers, block))
    return shapes, layers


def _check_forced_experts(graph: OpGraph, opts: SearchOptions) -> None:
    """A forced expert-parallel degree needs experts that split evenly over it."""
    if opts.force.get("ep", 1) != 1:
        found = find_experts(graph)
        if found is None:
            raise ConfigError(f"force ep={opts.force['ep']}: the model has no experts to split "
                              "(expert parallelism needs a product of stacked expert weights: "
                              "a grouped product, as HF Mixtral and torchtitan-style MoE layers "
                              "trace, or bmm / einsum over an experts dim leading the tokens, "
                              "the weight and the output)")
        if found.num_experts % opts.force["ep"]:
            raise ConfigError(f"force ep={opts.force['ep']}: the model's "
                              f"{found.num_experts} experts do not split evenly over it")


# the shared tp-axis answers, per (tp, micro-batch size, cp) and with ep appended per ep degree
SharedShardings = dict[tuple[int, ...], tuple[Sharding, ILPSolution | None]]


def _search_meshes(sc: SearchContext, shapes: list[Any], base: dict[str, Any],
                   layers: int) -> list[Candidate]:
    """Every mesh at every micro-batch size, its policies costed on the shared sharding of its
    tp axis; larger micro-batches only where a smaller one fit (they only need more memory)."""
    graph, opts, stats, say = sc.graph, sc.opts, sc.stats, sc.stats.say
    gbs = sc.global_batch_size
    cands: list[Candidate] = []
    shared: SharedShardings = {}
    bar_s: float | None = None           # the fastest fitting step found so far
    for shape in shapes:
        where = f"mesh {shape.describe()}"
        why = ((pins.unavailable(graph, sc.pinned, shape.tp) if shape.tp > 1
                else "tp=1 shards nothing") if sc.pinned else None)
        if why:
            say(f"{where}: the pins cannot hold ({why}), skipped")
            continue
        shares = opts.force.get("dp_shares")
        if shares is not None:      # uneven replicas: the micro-batch makes up the batch
            total = sum(shares)
            if len(shares) != shape.dp or gbs % total:
                say(f"{where}: dp_shares {list(shares)} do not split global batch {gbs} over "
                    f"dp, skipped")
                continue
            mbs_options = [gbs // total]
        elif gbs % shape.dp:
            say(f"{where}: global batch {gbs} does not split over dp, skipped")
            continue
        else:
            mbs_options = search_space.mbs_options(gbs // shape.dp, opts, graph)
        if shape.cp > 1:
            # a micro-batch of several sequences splits over dp instead, with no ring
            mbs_options = mbs_options[:1]
        for mbs in search_space.forced(opts, "micro_batch_size", mbs_options):
            cfg = ParallelConfig(pp=shape.pp, dp=shape.dp, tp=shape.tp, cp=shape.cp,
                                 cp_layout=search_space.context_layout(graph, shape.cp, opts),
                                 micro_batch_size=mbs, dp_shares=shares, **base)
            m = cfg.microbatches(gbs)
            if shape.pp > 1 and "micro_batch_size" not in opts.force and (
                    m < shape.pp or mbs > 4):
                # few micro-batches per stage: mostly bubble (and 1F1B needs one per stage)
                say(f"{where} mbs {mbs}: "
                    f"{few_microbatches(m, shape.pp, shape.dp, mbs)}, skipped")
                break
            try:
                m = validate(graph, sc.cluster, cfg, gbs)
            except ConfigError as e:
                say(f"{where} mbs {mbs}: {e}")
                break
            if _sharding_of(sc, shape, cfg, m, shared, f"{where} mbs {mbs}") is None:
                continue
            skipped = stats.below_floor
            # a pipelined config whose floor is this far behind the best cannot win, even
            # simulated (search_costing.CLOSED_FORM_SLACK)
            behind = (bar_s * (1 + CLOSED_FORM_SLACK) if bar_s is not None else None)
            found = _cost_mesh(sc, shape, cfg, m, layers, shared, behind)
            cands += found
            fit = [c for c in found if c.est.fits]
            best = min(fit, key=Candidate.key) if fit else None
            skipped = stats.below_floor - skipped
            if best is not None and honours(best.est.config, opts.force):
                bar_s = min(bar_s or best.est.step_time_s, best.est.step_time_s)
            say(f"{where} mbs {mbs}: "
                + (f"best {best.est.step_time_s * 1e3:,.1f} ms ({best.est.config.short()})"
                   if best else "nothing fits" if not skipped else "nothing costed")
                + (f", {skipped} skipped (floor over {behind * 1e3:,.1f} ms)" if skipped
                   else "")
                + f"  [{stats.evaluated} configs, {stats.ilps} ILPs, "
                  f"{time.perf_counter() - stats.t0:.1f} s]")
            if best is None and not skipped:
                break       # larger micro-batches only need more memory
    return cands


def few_microbatches(m: int, pp: int, dp: int, mbs: int) -> str:
    """Why the search leaves a pipelined mesh's (larger) micro-batches out: fewer micro-batches
    than stages (a step mostly bubble, and 1F1B cannot run them), or micro-batches over 4
    samples (a smaller one shrinks the bubble), and what would let them in."""
    if m < pp:
        return (f"{m} micro-batch{'es' if m != 1 else ''} per step for {pp} pipeline stages "
                f"(mostly bubble; 1F1B needs one per stage): a global batch of at least "
                f"pp x dp x micro_batch_size = {pp * dp * mbs} would let it in")
    return f"micro-batches of {mbs} samples over pp={pp}: smaller ones shrink the bubble"


def _sharding_of(sc: SearchContext, shape: Any, cfg: ParallelConfig, m: int,
                 shared: SharedShardings, where: str
                 ) -> tuple[Sharding, ILPSolution | None] | None:
    """``_shared_sharding`` for ``cfg``'s mesh, kept in ``shared``: the tp-axis problem depends
    on the micro-batch and on whether the program is compiled (which prices its element-wise
    ops), not on pp or dp. Each compiled family gets its own: an eager twin
    (``search_space.with_compilation``) on the compiled program's sharding may not fit where
    on its own it does. None: no tp axis here (said why)."""
    key = (shape.tp, cfg.micro_batch_size, shape.cp, cfg.compiled)
    if key not in shared:
        got = _shared_sharding(sc, shape, cfg, m, where)
        if got is None:
            return None
        shared[key] = got
    return shared[key]


def _shared_sharding(sc: SearchContext, shape: Any, cfg: ParallelConfig, m: int,
                     where: str) -> tuple[Sharding, ILPSolution | None] | None:
    """The tp axis's sharding for ``cfg``'s mesh and micro-batch, shared by every policy
    costed there: the given one, none at tp 1, Megatron's or ring attention's as asked, else
    the ILP's (its per-step gradient all-reduces of replicated weights weigh with m: priced
    at the m of the mesh without pipeline, whichever mesh asks first, so that forcing pp or dp
    never changes the sharding a free search finds). None: no such axis here (said why)."""
    graph, opts, stats = sc.graph, sc.opts, sc.stats
    fixed = opts.fixed_sharding
    if fixed is not None and fixed.t == shape.tp:
        return fixed, None
    if shape.tp == 1:
        return replicated(graph), None
    if opts.sharding == "megatron":
        return megatron_sharding(graph, shape.tp,
                                 bool(opts.force.get("sequence_parallel"))), None
    if opts.sharding == "context":
        ctx = context_sharding(graph, shape.tp)
        if ctx is None:     # not the layout asked for: no tp axis at this degree
            stats.rejected = (
                f"sharding='context' at tp={shape.tp}: ring attention cannot split "
                "this model's sequence so (it needs scaled_dot_product_attention "
                "with a sequence and head count that divide by tp); use "
                "sharding='ilp' or 'megatron'")
            stats.say(f"{where}: {stats.rejected}")
            return None
        return ctx, None
    try:
        return ilp_sharding(sc, cfg, ilp_microbatches(
            shape, micro_batch_size=cfg.micro_batch_size,
            global_batch_size=sc.global_batch_size, m=m))
    except ConfigError as e:        # a pin that cannot hold at this size
        stats.say(f"{where}: {e}")
        return None


def _cost_mesh(sc: SearchContext, shape: Any, cfg: ParallelConfig, m: int, layers: int,
               shared: SharedShardings, behind: float | None) -> list[Candidate]:
    """Every policy of ``cfg``'s mesh and micro-batch costed, per expert-parallel degree and
    compiled family, each family on the mesh's sharding solved at its own prices (solved again
    with the experts' exchanges priced where ep > 1). The search's own family (``cfg.compiled``)
    goes first; its eager twins (``search_space.with_compilation``: what compiled layers cannot
    run, selective recomputation under collectives and activation offload) follow, less those
    a fitting compiled config beats outright (``_beaten_twins``)."""
    policies = search_space.policies(cfg, sc.opts, sc.cluster, sc.graph,
                              search_space.schedules(cfg, m, layers, sc.opts))
    where = f"mesh {shape.describe()} mbs {cfg.micro_batch_size}"
    found: list[Candidate] = []
    for ep, compiled in sorted({(c.ep, c.compiled) for c in policies},
                               key=lambda k: (k[1] != cfg.compiled, k[0])):
        group = [c for c in policies if c.ep == ep and c.compiled == compiled]
        if compiled != cfg.compiled:
            beaten = _beaten_twins(found)
            group = [c for c in group if _plain(c) not in beaten]
        ecfg = replace(cfg, ep=ep, compiled=compiled)
        got = _family_sharding(sc, shape, ecfg, m, shared, where) if group else None
        if got is not None:
            found += _cost_group(sc, ecfg, group, *got, m, behind)
    return found


def _beaten_twins(found: list[Candidate]) -> set[tuple]:
    """The ``_plain`` keys of the eager configs the compiled ones ``found`` beat outright: where
    a compiled config fits recomputing and offloading nothing, at the eager one's ZeRO stage or
    another of 0-2 (which move the same bytes: an all-reduce is a reduce-scatter and an
    all-gather). That one is no slower (compiled prices are no higher, on a sharding solved for
    them) and recomputation and offload only add time, so the eager twin would be there only to
    save memory that is not short."""
    return {_plain(x.est.config) for x in found if x.est.fits and _keeps_all(x.est.config)}


def _keeps_all(c: ParallelConfig) -> bool:
    """Whether ``c`` recomputes nothing and offloads no activations, in any layer or stage."""
    return (c.recompute == "none" and not c.offloads_activations
            and not any(p != "none" for p in (c.stage_recompute or ()))
            and not any(p != "none" for p in (c.layer_recompute or ())))


def _plain(c: ParallelConfig) -> tuple:
    """``c``'s fields but its compilation, recomputation, activation offload, stage layout and
    what its sharding sets, with ZeRO stages 0-2 as one."""
    skip = {"compiled", "recompute", "offload_activations", "layer_recompute", "layer_offload",
            "stage_recompute", "chunk_layers", "sequence_parallel", "tp_comm_overlap",
            "zero_stage"}
    return (3 if c.zero_stage == 3 else 0,
            *(getattr(c, f.name) for f in fields(c) if f.name not in skip))


def _family_sharding(sc: SearchContext, shape: Any, ecfg: ParallelConfig, m: int,
                     shared: SharedShardings, where: str
                     ) -> tuple[Sharding, ILPSolution | None] | None:
    """The mesh's shared sharding solved at ``ecfg``'s prices (compiled or not), at its
    expert degree (solved again with the experts' exchanges priced where ep > 1)."""
    got = _sharding_of(sc, shape, replace(ecfg, ep=1), m, shared, where)
    if got is None or ecfg.ep == 1 or got[1] is None:
        return got
    key = (shape.tp, ecfg.micro_batch_size, shape.cp, ecfg.compiled, ecfg.ep)
    if key not in shared:
        shared[key] = ilp_sharding(sc, ecfg, ilp_microbatches(
            shape, micro_batch_size=ecfg.micro_batch_size,
            global_batch_size=sc.global_batch_size, m=m))
    return shared[key]


def _cost_group(sc: SearchContext, ecfg: ParallelConfig, group: list[ParallelConfig],
                sh: Sharding, sol: ILPSolution | None, m: int,
                behind: float | None) -> list[Candidate]:
    """``group`` (one ep degree) costed on ``sh``; where nothing fits on the ILP's sharding,
    also on the memory-constrained ILP's (its budget the device less the margin), and for a
    pipeline still without a fit, on Megatron's sharding (the vocabulary split)."""
    opts, stats = sc.opts, sc.stats
    below = stats.below_floor
    found = evaluate(sc, group, sh, sol, "search", prune_dominated=True, behind_s=behind)
    if (ecfg.tp > 1 and opts.sharding == "ilp" and opts.fixed_sharding is None
            and not any(c.est.fits for c in found)
            and (found or stats.below_floor == below)):
        budget = sc.cluster.device.memory_bytes - (
            found[0].est.stages[0].memory.margin_bytes if found else 0.0)
        got = frugal_sharding(sc, ecfg, m, frugal(group, m, opts, sc.graph, budget))
        if got is not None and got[1].status in ("optimal", "feasible"):
            found += evaluate(sc, group, *got, "search", prune_dominated=True,
                              behind_s=behind)
        if ecfg.pp > 1 and not any(c.est.fits for c in found):
            # the tp axis's ILP is solved once per micro-batch for every pp (its memory the
            # whole model's): it may keep the vocabulary whole, which a pipeline's first and
            # last stages then cannot hold; Megatron's sharding splits it
            found += evaluate(sc, group, megatron_sharding(sc.graph, ecfg.tp, True), None,
                              "search", prune_dominated=True, behind_s=behind)
    return found


def _choose(sc: SearchContext, cands: list[Candidate], base: dict[str, Any],
            name: str | None) -> Plan:
    """The finalists solved again (``finalists``), the baselines added, and the fastest fitting
    configuration that honours the forced fields as the plan, the next ``top_k`` its
    alternatives."""
    opts, stats = sc.opts, sc.stats
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = refine_dp(sc, cands)
    if opts.fixed_sharding is None and not opts.pin and opts.baselines:
        cands += _baselines(sc, base)     # (a given sharding is the one to use)
    if not cands:
        raise ConfigError("no configuration could be costed; check the batch size and the "
                          "cluster size" + (f" (the last one refused: {stats.rejected})"
                                            if stats.rejected else ""))
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = refine_pipe_ilp(sc, cands)
    cands = refine_pipelined(sc, cands)
    cands = refine_recompute(sc, cands)
    # forced fields bind the choice; baselines that differ stay as alternatives
    fitting = sorted((c for c in cands if c.est.fits and honours(c.est.config, opts.force)),
                     key=Candidate.key)
    if opts.force and not any(honours(c.est.config, opts.force) for c in cands):
        raise ConfigError(f"no configuration with force={opts.force} could be costed: "
                          + why_none_honours(cands, opts.force, stats))
    if not fitting:
        raise infeasible(cands, sc.cluster, opts.force)
    best = fitting[0]
    return assemble(sc.graph, sc.cluster, best,
                    alternatives(cands, best, opts.top_k, opts.force),
                    stats, sc.global_batch_size, name, opts.expert_capacity_factor,
                    opts.seq_lengths)
