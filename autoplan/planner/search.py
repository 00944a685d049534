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
from autoplan.estimate.config import ParallelConfig
from autoplan.estimate.estimator import validate
from autoplan.graph.analysis import analyze
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.planner import mesh as meshes
from autoplan.planner.assemble import assemble
from autoplan.planner.costing import (CLOSED_FORM_SLACK, Stats, evaluate, frugal,
                                      ilp_microbatches, ilp_sharding)
from autoplan.planner.ilp import ILPSolution
from autoplan.planner.options import SearchOptions  # (also imported from here by users)
from autoplan.planner.planfile import Plan
from autoplan.planner.refine import refine_dp, refine_pipe_ilp, refine_pipelined
from autoplan.planner.verdicts import (Candidate, alternatives, honours, infeasible,
                                       too_few_layers, why_none_honours)
from autoplan.planner import pins, space
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


def _baselines(graph: OpGraph, cluster: Any, gbs: int, base: dict[str, Any], profile: Any,
               opts: SearchOptions, stats: Stats) -> list[Candidate]:
    """Pure data parallel, FSDP only, and Megatron-style (TP with sequence parallelism inside a
    node, DP across) at every such degree and ZeRO stage: each at its best micro-batch size."""
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
        configs = [v for mbs in space.mbs_options(per_replica, SearchOptions(), graph)
                   for r in (("none", "selective", "full") if mtp else ("none",))
                   for v in space.with_compilation(
                       ParallelConfig(**{**base, **fields, "micro_batch_size": mbs,
                                         "recompute": r}), opts, graph)]
        cands = evaluate(graph, cluster, configs, sh, None, gbs, profile, opts, stats, label,
                         prune_dominated=True)
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
    search_options_arg(opts, progress=progress)
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
    stats = Stats(say=say)
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="plan()",
                     error=ConfigError)
    profile = profile_arg(profile, cluster, "plan()")
    base = {"precision": precision, "optimizer": optimizer}
    if "mixed_precision" in opts.force:      # never searched: the runtime runs autocast only
        base["mixed_precision"] = opts.force["mixed_precision"]
    base["compiled"] = space.compiled_choice(opts, cluster)
    cands: list[Candidate] = []
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
    ilp_cache: dict[tuple[int, int], tuple[Sharding, ILPSolution | None]] = {}
    bar_s: float | None = None           # the fastest fitting step found so far
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
        mbs_options = space.mbs_options(per_replica, opts, graph)
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
                    ctx = context_sharding(graph, shape.tp)
                    if ctx is None:     # not the layout asked for: no tp axis at this degree
                        stats.rejected = (
                            f"sharding='context' at tp={shape.tp}: ring attention cannot split "
                            "this model's sequence so (it needs scaled_dot_product_attention "
                            "with a sequence and head count that divide by tp); use "
                            "sharding='ilp' or 'megatron'")
                        say(f"{where} mbs {mbs}: {stats.rejected}")
                        continue
                    ilp_cache[key] = (ctx, None)
                else:
                    try:
                        ilp_cache[key] = ilp_sharding(graph, cluster, cfg, profile,
                                                       ilp_microbatches(cluster, shape, mbs,
                                                                         global_batch_size, m),
                                                       opts, stats, pinned=pinned)
                    except ConfigError as e:        # a pin that cannot hold at this size
                        say(f"{where} mbs {mbs}: {e}")
                        continue
            policies = space.policies(cfg, opts, cluster, graph,
                                      space.schedules(cfg, m, layers, opts))
            found = []
            skipped = stats.below_floor
            # a pipelined config whose floor is this far behind the best cannot win, even
            # simulated (costing.CLOSED_FORM_SLACK)
            behind = (bar_s * (1 + CLOSED_FORM_SLACK) if bar_s is not None else None)
            for ep in sorted({c.ep for c in policies}):
                group = [c for c in policies if c.ep == ep]
                ecfg = replace(cfg, ep=ep)
                sh, sol = ilp_cache[key]
                if ep > 1 and sol is not None:     # the ILP prices the experts' exchanges
                    if key + (ep,) not in ilp_cache:
                        ilp_cache[key + (ep,)] = ilp_sharding(
                            graph, cluster, ecfg, profile,
                            ilp_microbatches(cluster, shape, mbs, global_batch_size, m),
                            opts, stats, pinned=pinned)
                    sh, sol = ilp_cache[key + (ep,)]
                below = stats.below_floor
                found_ep = evaluate(graph, cluster, group, sh, sol, global_batch_size,
                                     profile, opts, stats, "search", prune_dominated=True,
                                     behind_s=behind)
                if (shape.tp > 1 and opts.sharding == "ilp" and opts.fixed_sharding is None
                        and not any(c.est.fits for c in found_ep)
                        and (found_ep or stats.below_floor == below)):
                    budget = cluster.device.memory_bytes - (
                        found_ep[0].est.stages[0].memory.margin_bytes if found_ep else 0.0)
                    sh2, sol2 = ilp_sharding(graph, cluster, ecfg, profile, m, opts, stats,
                                              frugal=frugal(group, m, opts, graph, budget),
                                              pinned=pinned)
                    if sol2.status in ("optimal", "feasible"):
                        found_ep += evaluate(graph, cluster, group, sh2, sol2,
                                              global_batch_size, profile, opts, stats, "search",
                                              prune_dominated=True, behind_s=behind)
                found += found_ep
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
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = refine_dp(graph, cluster, cands, global_batch_size, profile, opts, stats,
                           pinned)
    if opts.fixed_sharding is None and not opts.pin:   # a given sharding is the one to use
        cands += _baselines(graph, cluster, global_batch_size, base, profile, opts, stats)
    if not cands:
        raise ConfigError("no configuration could be costed; check the batch size and the "
                          "cluster size" + (f" (the last one refused: {stats.rejected})"
                                            if stats.rejected else ""))
    if opts.sharding == "ilp" and opts.fixed_sharding is None:
        cands = refine_pipe_ilp(graph, cluster, cands, global_batch_size, profile, opts,
                                 stats, pinned)
    cands = refine_pipelined(graph, cluster, cands, global_batch_size, profile, opts, stats)
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
