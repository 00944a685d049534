"""``estimate``: step time and memory of one ParallelConfig on one cluster.

Order of the computation (each step uses only what the previous ones produced):
1. trace (or take) the OpGraph, validate the config against graph, cluster and batch;
2. cut the graph into pipeline chunks (``layout``: the config's ``chunk_layers``, or the split
   balancing the chunks' times); per chunk and per micro-batch (``chunk_cost``): compute time
   of every op (profile or roofline, scaled to the micro-batch and the TP shard), its stage's
   recomputation, the tensor-parallel collectives (exposed: each one blocks the op after it),
   and the activations kept for backward;
3. combine chunks into pipeline stages and simulate the schedule (``pipeline_timing`` over
   ``pipeline_sim``): the makespan, the bubble (fill and drain) and the waits on
   point-to-point sends, and the activations each rank holds at its peak;
4. data-parallel gradient sync and ZeRO gathers, hidden behind backward compute only as far as
   that compute lasts; then the optimizer step (on the device, or on the host when offloaded);
5. memory per stage: model states (ZeRO), activations times the micro-batches in flight under
   the schedule, transient buffers, and a workspace margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import chain, repeat
from typing import Any

from autoplan.graph.analysis import analyze, reads_tables
from autoplan.cost.compute import compute_model
from autoplan.cost.float8 import Float8Setting, fp8_flops_per_s
from autoplan.cost.memory import (PRECISION_BYTES, activation_bytes, nvme_host_buffer_bytes,
                                  holds_step_whole, model_state_bytes, sharding_for,
                                  step_whole_states)
from autoplan.cost.powersgd import powersgd_buffer_bytes
from autoplan.errors import ConfigError
from autoplan.estimate.arguments import (batch_arg, capacity_arg, cluster_arg,
                                        estimate_options_arg, microbatches_arg, profile_arg)
from autoplan.estimate.chunk_cost import (cached_on_graph, chunk_cost, chunk_parts, range_cost,
                                          tied_grad_buffer_bytes)
from autoplan.estimate.cost_inputs import CostInputs, RangeCost
from autoplan.estimate.dp_terms import StageParams, fp32_gathered, price, stage_terms
from autoplan.estimate.float8_choice import fp8_choices
from autoplan.estimate.held_params import rank_repeated
from autoplan.estimate.layout import chunks_for, in_flight
from autoplan.estimate.overlap import overlap_interference
from autoplan.estimate.partition import pipeline_units
from autoplan.estimate.pipeline_timing import PipelineTiming, pipeline_timing
from autoplan.estimate.result import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.sharding.context_axis import context_axis
from autoplan.sharding.doc_work import PackedWork, packed_work, useful_share
from autoplan.sharding.mesh_axes import STAGE_AXES
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.sharding import Sharding

def validate(graph: OpGraph, cluster: Any, config: ParallelConfig,
             global_batch_size: int) -> int:
    """Check the config against the model, the cluster and the batch; returns micro-batches."""
    if config.world_size != cluster.world_size:
        names = "dp x tp x pp" + (" x cp" if config.cp > 1 else "")
        sizes = f"{config.dp} x {config.tp} x {config.pp}" + (
            f" x {config.cp}" if config.cp > 1 else "")
        raise ConfigError(
            f"{names} = {sizes} = {config.world_size} but the cluster has "
            f"{cluster.world_size} devices; choose degrees whose product is "
            f"{cluster.world_size}")
    m = microbatches_arg(config.microbatches(global_batch_size), config)
    why = schedule_refusal(config, m)
    if why:
        raise ConfigError(why)
    if config.micro_batch_size > global_batch_size:
        raise ConfigError(f"micro_batch_size {config.micro_batch_size} exceeds the global batch "
                          f"{global_batch_size}")
    if config.layer_recompute is not None and len(config.layer_recompute) != len(
            pipeline_units(graph)):
        raise ConfigError(f"layer_recompute names {len(config.layer_recompute)} policies, the "
                          f"model has {len(pipeline_units(graph))} layers: give one per layer")
    if config.layer_offload is not None and len(config.layer_offload) != len(
            pipeline_units(graph)):
        raise ConfigError(f"layer_offload has {len(config.layer_offload)} flags, the model "
                          f"has {len(pipeline_units(graph))} layers: give one per layer")
    if config.chunk_layers is not None:
        units = len(pipeline_units(graph))
        if sum(config.chunk_layers) != units:
            raise ConfigError(f"chunk_layers {list(config.chunk_layers)} add up to "
                              f"{sum(config.chunk_layers)} layers, the model has {units}")
    if config.fp8 != "none" and not fp8_flops_per_s(cluster.device):
        raise ConfigError(f"fp8={config.fp8!r} needs fp8 tensor cores (H100, H200 and later); "
                          f"the cluster's {cluster.device.name} has none (its rates: "
                          f"{', '.join(sorted(cluster.device.peak_flops))}): plan with "
                          "precision 'bf16' and fp8 'none'")
    if config.offload_nvme and not cluster.host.has_nvme:
        raise ConfigError(f"offload_nvme=True keeps the offloaded state on the node's NVMe, but "
                          f"cluster {cluster.name!r} has none: give its host nvme_bytes, "
                          "nvme_read_bytes_per_s and nvme_write_bytes_per_s in a cluster file, "
                          "or drop offload_nvme")
    return m


def schedule_refusal(config: ParallelConfig, m: int) -> str | None:
    """Why ``config``'s pipeline schedule cannot run ``m`` micro-batches a step (torch's
    schedules refuse them), with the change that lets it; None where it can."""
    if config.pp == 1:
        return None
    if m % config.pp and (config.schedule == "interleaved_1f1b" or (
            config.schedule == "zero_bubble" and config.virtual_stages > 1)):
        return (f"{config.schedule} over {config.virtual_stages} chunks per rank needs the "
                f"micro-batch count ({m}) to be a multiple of pp ({config.pp}); change the "
                "batch or micro_batch_size")
    if config.schedule == "dualpipev" and m < 2 * config.pp:
        return (f"dualpipev needs at least as many micro-batches as chunks (2 x pp = "
                f"{2 * config.pp}), got {m}; raise the batch or lower micro_batch_size")
    if config.schedule == "1f1b" and m < config.pp:
        return (f"1f1b needs at least as many micro-batches as pipeline stages (pp = "
                f"{config.pp}), got {m} (global batch / dp {config.dp} / micro_batch_size "
                f"{config.micro_batch_size}): raise the global batch to at least "
                f"{config.pp * config.dp * config.micro_batch_size}, lower micro_batch_size or "
                "pp, or use schedule 'gpipe'")
    return None


def estimate(model: Any, cluster: Any, *, config: ParallelConfig, global_batch_size: int,
             example_inputs: Sequence[Any] | None = None, loss_fn: Any = None,
             targets: Any = None, profile: Any = "auto",
             memory_margin_bytes: float | None = None,
             sharding: Sharding | None = None, simulate_pipeline: bool = True,
             expert_capacity_factor: float = 1.0, seq_lengths: Any = None) -> Estimate:
    """Predict step time, memory per device, and their breakdowns for ``config``.

    ``model`` is an ``nn.Module`` (traced with ``example_inputs``, on meta or real device) or an
    ``OpGraph``. ``profile``: a ProfileDB, ``None`` (roofline only) or ``"auto"`` (the
    measured profile of the cluster's device type, when one is installed). ``sharding``: the
    per-op tensor-parallel strategies (from the planner); by default Megatron-LM's rule for
    ``config.tp`` and ``config.sequence_parallel``. ``simulate_pipeline=False`` uses the closed
    form for pipelined configs (bubble: one micro-batch through every other rank over v, or
    (p-1)/v of the bottleneck's unfilled stage-times under a split backward; the schedule's
    in-flight formulas):
    the planner screens with it and simulates the finalists. ``expert_capacity_factor``
    (MoE, >= 1): the router's capacity factor, read as how far above the balanced share of
    routed rows the busiest expert-parallel rank may get (its expert compute, activations and
    all-to-all grow by it); 1 prices perfectly balanced routing. ``seq_lengths`` (a file
    path or a ``LengthHistogram``, ``sharding/seq_lengths``): the data's document lengths,
    packed into the traced sequence behind a document mask; attention is priced at what the
    kernel that runs computes: its expected masked work on a GPU (flex attention's block
    mask), the whole square on a CPU (SDPA's dense mask) and on a ring (every block whole);
    MFU counts the masked work (``sharding/doc_work``).
    """
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autoplan.ParallelConfig, got {type(config).__name__}")
    global_batch_size = batch_arg(global_batch_size, "estimate()")
    estimate_options_arg(memory_margin_bytes=memory_margin_bytes, sharding=sharding,
                         simulate_pipeline=simulate_pipeline)
    cluster = cluster_arg(cluster, "estimate()")
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="estimate()",
                     error=ConfigError)
    if cluster.pools:     # priced here, every rank would be the slowest pool's device
        raise ConfigError(f"estimate() prices homogeneous clusters; {cluster.name} has "
                          f"{len(cluster.pools)} pools of different nodes: use "
                          "autoplan.estimate_hetero(model, cluster, config=..., "
                          "global_batch_size=...), which prices each stage or replica on its "
                          "pool's device (or cluster.slowest() for the slowest-GPU figure)")
    m = validate(graph, cluster, config, global_batch_size)
    profile = profile_arg(profile, cluster, "estimate()")
    ci = cost_inputs(graph, cluster, config, profile, sharding, expert_capacity_factor,
                     packed_work(graph, seq_lengths, cluster.device.kind))
    chunks = chunks_for(ci)
    costs = [chunk_cost(ci, ch, chunk_policy(config, chunks, c), chunk_offload_flags(
        config, chunks, c)) for c, ch in enumerate(chunks)]
    # the model state, its gradient sync and ZeRO's traffic span the dp x cp ranks
    state_config = config.grad_view()
    schedule = pipeline_timing(ci, costs, m, state_config, simulate=simulate_pipeline)
    time = time_breakdown(ci, costs, chunks, schedule, m, profile, state_config)
    margin = reserved_bytes(cluster, memory_margin_bytes)
    stages = tuple(stage_estimate(ci, costs, chunks, schedule, m, s, margin, state_config)
                   for s in range(config.pp))
    est = assemble_estimate(ci, chunks, stages, time, global_batch_size, m)
    if config.layer_recompute is None and config.layer_offload is None:
        return est
    return replace(est, layer_recompute=layer_recompute_costs(ci, chunks, costs))


def layer_recompute_costs(ci: CostInputs, chunks: Sequence[Any],
                          costs: Sequence[RangeCost] = ()) -> tuple[dict[str, Any], ...]:
    """Per layer (model order) under ``layer_recompute`` or ``layer_offload``: its path and
    policy, the bytes it keeps on the device per micro-batch, the bytes it saves against
    recomputing and offloading nothing, and the seconds its recomputation adds to each
    micro-batch's backward; under ``layer_offload`` also the bytes it sends to host memory per
    micro-batch and the seconds of those copies left exposed (what ``inspect`` shows)."""
    out = []
    config = ci.config
    for c, ch in enumerate(chunks):
        like = {(u.start, u.stop): u.like for u in ch.units}
        pol = chunk_policy(config, chunks, c)
        policies = (pol,) * len(ch.layers) if isinstance(pol, str) else pol
        sent = {l.path: l for l in costs[c].offload.layers} if costs else {}
        for path, span, policy in zip(ch.layers, ch.layer_ranges, policies):
            mine = range_cost(ci, *like.get(span, span), policy)
            none = range_cost(ci, *like.get(span, span), "none")
            moved = sent[path].moved_bytes if path in sent else 0.0
            row = {"layer": path, "policy": policy,
                   "kept_bytes": mine.activation_bytes - moved,
                   "saved_bytes": none.activation_bytes - mine.activation_bytes + moved,
                   "recompute_s": mine.recompute_s}
            if config.layer_offload is not None:
                row["offloaded_bytes"] = moved
                row["offload_s"] = sent[path].exposed_s if path in sent else 0.0
            out.append(row)
    return tuple(out)


def chunk_offload_flags(config: ParallelConfig, chunks: Sequence[Any], c: int
                        ) -> tuple[bool, ...] | None:
    """Per layer of chunk ``c``, whether it offloads its saved activations
    (``layer_offload``, over the layers of all chunks in model order); None: the config's
    count per chunk."""
    if config.layer_offload is None:
        return None
    first = sum(len(ch.layer_ranges) for ch in chunks[:c])
    return config.layer_offload[first:first + len(chunks[c].layer_ranges)]


def chunk_policy(config: ParallelConfig, chunks: Sequence[Any], c: int
                 ) -> str | tuple[str, ...]:
    """The recompute policy of chunk ``c``: its stage's, or one per layer it holds
    (``layer_recompute``, over the layers of all chunks in model order)."""
    if config.layer_recompute is None:
        return config.chunk_policy(c)
    first = sum(len(ch.layer_ranges) for ch in chunks[:c])
    return config.layer_recompute[first:first + len(chunks[c].layer_ranges)]


def cost_inputs(graph: OpGraph, cluster: Any, config: ParallelConfig, profile: Any,
                sharding: Sharding | None, expert_capacity_factor: float,
                documents: PackedWork | None = None) -> CostInputs:
    """What every chunk's cost reads: the device's compute model, the tp sharding (checked to
    be for ``config.tp`` and to compose with its context parallelism) and the expert load."""
    compute = compute_model(graph, cluster.device, config.precision, profile,
                            config.mixed_precision, config.compiled, Float8Setting.of(config))
    sh = sharding_for(graph, config.tp, config.sequence_parallel, sharding)
    if sh.t != config.tp:
        raise ConfigError(f"the sharding is for tp={sh.t} but the config has tp={config.tp}")
    ci = CostInputs(graph=graph, analysis=analyze(graph), sharding=sh, compute=compute,
                    cluster=cluster, config=config,
                    expert_load=capacity_arg(expert_capacity_factor),
                    context=context_axis(graph, config.cp, config.cp_layout),
                    documents=documents)
    why = ci.context.conflicts(sh) if ci.context is not None else []
    if why:
        raise ConfigError(f"the tp sharding does not run under cp={config.cp}: {why[0]}"
                          + (f" (and {len(why) - 1} more)" if len(why) > 1 else "")
                          + "; plan with autoplan.plan(..., force={'cp': ...}) for a tp "
                          "sharding that composes with it")
    return ci


def time_breakdown(ci: CostInputs, costs: Sequence[RangeCost], chunks: Sequence[Any],
                   timing: PipelineTiming, m: int, profile: Any,
                   state_config: ParallelConfig,
                   stage_devices: Sequence[tuple[Any, Any]] | None = None) -> TimeBreakdown:
    """Seconds per step on the bottleneck stage, by cause: its compute, recompute and exposed
    tp/ep/cp collectives over ``m`` micro-batches, the schedule's bubble and sends, the worst
    stage's data-parallel, optimizer and offload terms, and the framework's overhead.
    ``stage_devices`` (pools, ``estimate/hetero.py``): per stage, the (ComputeModel, profile)
    of its own device, which prices its optimizer step and its framework overhead; None: ``ci``'s
    and ``profile`` for every stage."""
    config = ci.config
    stage_devices = stage_devices or ((ci.compute, profile),) * config.pp
    bc = [costs[c] for c in timing.stage_chunks[timing.bottleneck]]
    compute_s = m * sum(c.fwd_s + c.bwd_s for c in bc)
    recompute_s = m * sum(c.recompute_s for c in bc)
    tp_s = m * sum(c.tp_fwd_s + c.tp_bwd_s for c in bc)
    ep_s = m * sum(c.ep_fwd_s + c.ep_bwd_s for c in bc)
    cp_s = m * sum(c.cp_s for c in bc)
    dp_sync, zero_gather, opt_s, offload_s = _worst_stage_dp_terms(ci, costs, chunks, timing, m,
                                                                   stage_devices, state_config)
    if timing.simulated_comm is not None:
        dp_sync += timing.simulated_comm[0]
        zero_gather += timing.simulated_comm[1]
    bottleneck_compute, bottleneck_profile = stage_devices[timing.bottleneck]
    cal = getattr(bottleneck_profile, "calibration", None)
    overhead_s = getattr(cal, "step_overhead_s", 0.0) or 0.0
    # eager framework time outside the kernels: per op, forward and backward, every micro-batch
    ops_bottleneck = sum(chunks[c].stop - chunks[c].start
                         for c in timing.stage_chunks[timing.bottleneck])
    overhead_s += (getattr(cal, "framework_s_per_op", 0.0) * 2 * ops_bottleneck * m
                   * bottleneck_compute.slowdown)
    comm_exposed = {"tp": max(0.0, tp_s - cp_s), "dp_grad_sync": dp_sync,
                    "zero_param_gather": zero_gather,
                    "pp_p2p": timing.p2p_s, "offload": offload_s}
    if config.ep > 1:
        comm_exposed["ep_all_to_all"] = ep_s
    if cp_s > 0:                      # context parallelism: ring attention's exposed passes
        comm_exposed["cp_ring"] = cp_s
    offload_s = m * sum(c.offload.fwd_exposed_s + c.offload.bwd_exposed_s for c in bc)
    if config.offloads_activations:   # activation copies to the host and back, exposed
        comm_exposed["activation_offload"] = offload_s
    return TimeBreakdown(compute_s=compute_s, recompute_s=recompute_s,
                         comm_exposed_s=comm_exposed, bubble_s=timing.bubble_s,
                         optimizer_s=opt_s, overhead_s=overhead_s)


def _worst_stage_dp_terms(ci: CostInputs, costs: Sequence[RangeCost], chunks: Sequence[Any],
                          timing: PipelineTiming, m: int,
                          stage_devices: Sequence[tuple[Any, Any]],
                          state_config: ParallelConfig) -> tuple[float, float, float, float]:
    """(gradient sync, ZeRO gathers, optimizer, offload) seconds of the stage where they add
    up to most: data parallel, ZeRO and the optimizer step (on the stage's own device,
    ``stage_devices[s]``), hidden behind backward compute only as far as that compute lasts."""
    config, cluster = ci.config, ci.cluster
    interference = overlap_interference(cluster)
    dp_sync = zero_gather = opt_s = offload_s = 0.0
    for s in range(config.pp):
        terms = stage_terms(state_config, cluster,
                            stage_params(costs, timing.stage_chunks[s], config, ci,
                                         chunks), m, s,
                            *stage_devices[s], simulated=timing.simulated_comm is not None)
        x = price(terms, timing.stage_f[s], timing.stage_b[s], interference)
        # the tp-axis all-reduce of replicated weights' partial gradients runs after backward,
        # in one flattened call (runtime/optim.py TensorParallelGrads): exposed
        sync = sum(costs[c].tp_step_s for c in timing.stage_chunks[s]) + x["dp_grad_sync"]
        gather, o, off = x["zero_param_gather"], x["optimizer"], x["offload"]
        if sync + gather + o + off > dp_sync + zero_gather + opt_s + offload_s:
            dp_sync, zero_gather, opt_s, offload_s = sync, gather, o, off
    return dp_sync, zero_gather, opt_s, offload_s


def stage_estimate(ci: CostInputs, costs: Sequence[RangeCost], chunks: Sequence[Any],
                   timing: PipelineTiming, m: int, s: int, margin: float,
                   state_config: ParallelConfig) -> StageEstimate:
    """Stage ``s``: its layers and times, and the bytes one of its devices holds at its peak
    (model states, the activations of the micro-batches in flight, transient buffers and the
    ``margin``)."""
    config = ci.config
    cs = [costs[c] for c in timing.stage_chunks[s]]
    held = stage_params(costs, timing.stage_chunks[s], config, ci, chunks)
    params, whole = held.params, held.whole
    states = _stage_states(config, held, state_config.shard_degree)
    step_whole = holds_step_whole(state_config, m)
    if step_whole:       # FSDP's shards held whole (``whole`` is not FSDP's)
        experts = held.experts
        states = step_whole_states(states, params - whole - experts, config,
                                   state_config.shard_degree)
        if experts and config.dp // config.ep > 1:     # sharded over the ranks holding them
            states = step_whole_states(states, experts, config, config.dp // config.ep)
    act_mb = sum(c.activation_bytes for c in cs)
    if timing.sim is not None and act_mb > 0:   # the simulated peak of the schedule
        flight = timing.sim.peak_activation_bytes[s] / act_mb
    else:
        flight = in_flight(config, m, s)
    # a weight two chunks of this rank read (a V schedule's tied ends): its backward buffer
    transient = max(c.working_set_bytes for c in cs) + tied_grad_buffer_bytes(
        config, sum(c.params for c in cs) - held.params)
    layers = max(1, sum(c.num_layers for c in cs))
    if config.zero_stage == 3 and config.grad_degree > 1 and not step_whole:
        # two layers' weights gathered at once (prefetch) plus their unsharded gradients
        # (held whole for the step, the weights and gradients are counted whole instead: the
        # last backward's gathers run with the weights of the last forward freed)
        transient += 2 * ((params - whole) / layers) * PRECISION_BYTES[config.precision] * 2
    transient += root_unit_bytes(config, held, step_whole, reads_tables(ci.graph))
    # offloaded activations: each micro-batch in flight holds its layers' copies in host memory
    offloaded = sum(c.offload.moved_bytes for c in cs)
    host_acts = offloaded * flight
    mem = MemoryBreakdown(params_bytes=states.params_bytes,
                          grads_bytes=states.grads_bytes + powersgd_buffer_bytes(
                              ci.graph, config, params),
                          optimizer_bytes=states.optimizer_bytes,
                          activations_bytes=act_mb * flight, transient_bytes=transient,
                          margin_bytes=margin,
                          offloaded_bytes=states.offloaded_bytes + nvme_host_buffer_bytes(
                              states.nvme_bytes, layers) + host_acts,
                          nvme_bytes=states.nvme_bytes)
    mine = timing.stage_chunks[s]
    return StageEstimate(
        index=s, layers=tuple(l for c in mine for l in chunks[c].layers),
        num_ops=sum(chunks[c].stop - chunks[c].start for c in mine),
        params_per_device=params, fwd_s=timing.stage_f[s], bwd_s=timing.stage_b[s],
        activation_bytes_per_microbatch=act_mb, microbatches_in_flight=flight,
        memory=mem, chunks=tuple(chunks[c].layers for c in mine),
        offloaded_activation_bytes_per_microbatch=offloaded)


def root_unit_bytes(config: ParallelConfig, held: StageParams, step_whole: bool,
                    tables: bool = True) -> float:
    """FSDP's root unit: the weights outside the stage's layers (embedding, final norm, head).
    Under ZeRO-3 they are gathered through the whole forward, the root's, and again through
    the whole backward (the runtime reshards the root after its forward too); under autocast
    in fp32 where the model reads a table (``tables``, ``dp_terms.fp32_gathered``). Where the gathered weights
    are counted already in the training precision (ZeRO-2's kept copies, weights held whole
    for the step), the fp32 gathers add their other half."""
    if not config.uses_fsdp or config.grad_degree <= 1:
        return 0.0
    w = PRECISION_BYTES[config.precision]
    in32 = fp32_gathered(config, held.params - held.whole, held.layer_params, tables)
    if config.zero_stage == 3 and not step_whole:
        outside = max(0.0, held.params - held.whole - held.layer_params)
        return (outside - in32) * w + in32 * PRECISION_BYTES["fp32"]
    return in32 * (PRECISION_BYTES["fp32"] - w)


def _stage_states(config: ParallelConfig, held: StageParams, shard_degree: int) -> Any:
    """The model-state bytes of one rank of a stage: ZeRO-sharded over the dp x cp ranks,
    except weights ZeRO-3 keeps whole (whole on every rank) and expert weights (sharded over
    the ranks holding them)."""
    params, whole, experts = held.params, held.whole, held.experts
    states = _states(config, params - experts - whole, shard_degree)
    if whole:            # weights ZeRO-3 keeps whole: whole states on every rank
        w = model_state_bytes(whole, dp=1, zero_stage=0, precision=config.precision,
                              optimizer=config.optimizer,
                              offload_optimizer=config.offload_optimizer,
                              mixed_precision=config.mixed_precision,
                              offload_nvme=config.offload_nvme,
                              optimizer_state=config.optimizer_state)
        states = replace(states, params_bytes=states.params_bytes + w.params_bytes,
                         grads_bytes=states.grads_bytes + w.grads_bytes,
                         optimizer_bytes=states.optimizer_bytes + w.optimizer_bytes,
                         offloaded_bytes=states.offloaded_bytes + w.offloaded_bytes,
                         nvme_bytes=states.nvme_bytes + w.nvme_bytes)
    if experts:          # expert weights' state: sharded over the ranks holding them
        e = _states(config, experts, config.dp // config.ep)
        states = replace(states, params_bytes=states.params_bytes + e.params_bytes,
                         grads_bytes=states.grads_bytes + e.grads_bytes,
                         optimizer_bytes=states.optimizer_bytes + e.optimizer_bytes,
                         offloaded_bytes=states.offloaded_bytes + e.offloaded_bytes,
                         nvme_bytes=states.nvme_bytes + e.nvme_bytes)
    return states


def _model_flops(ci: CostInputs) -> float:
    """The traced batch's forward and backward FLOPs; under packed documents attention's are
    their masked share (``doc_work``), the work a document-masked step does."""
    graph, docs = ci.graph, ci.documents
    total = float(graph.fwd_flops + graph.bwd_flops)
    if docs is None:
        return total
    for i, op in enumerate(graph.ops):
        share = useful_share(graph, i, docs)
        if share is not None:
            total -= (1.0 - share) * (op.fwd_flops + op.bwd_flops)
    return total


def assemble_estimate(ci: CostInputs, chunks: Sequence[Any], stages: tuple[StageEstimate, ...],
                      time: TimeBreakdown, global_batch_size: int, m: int) -> Estimate:
    """The Estimate of the step: memory per device, throughput and MFU, what to warn about,
    and the activations of one layer."""
    graph, cluster, config = ci.graph, ci.cluster, ci.config
    step_s = time.total_s
    # ranks are pp-major: each stage's dp x cp x tp ranks in a row
    per_device = tuple(chain.from_iterable(
        repeat(s.memory.total_bytes, config.dims.degree(STAGE_AXES)) for s in stages))
    peak = max(s.memory.total_bytes for s in stages)
    model_flops = _model_flops(ci) * global_batch_size / graph.batch_size
    peak_flops = cluster.device.peak_flops_for(config.precision) * config.world_size
    mfu = model_flops / (step_s * peak_flops) if step_s > 0 else 0.0
    tokens = _tokens_per_sample(graph)
    layer_acts = 0.0
    if chunks[0].layer_ranges:
        s0, e0 = chunks[0].layer_ranges[0]
        policy = config.stage_policy(0)
        # kept on the graph with the range costs (its inputs are among their key's)
        layer_acts = cached_on_graph(ci, "_autoplan_layer_acts", (s0, e0, policy), lambda: (
            activation_bytes(graph, s0, e0, micro_batch_size=config.micro_batch_size,
                             sharding=ci.sharding, recompute=policy,
                             precision=config.precision, context=ci.context, held=ci.held)))
    return Estimate(
        config=config, global_batch_size=global_batch_size, num_microbatches=m,
        step_time_s=step_s, time=time, peak_memory_bytes=peak,
        device_memory_bytes=float(cluster.device.memory_bytes),
        host_memory_per_device_bytes=cluster.host.memory_bytes / cluster.devices_per_node,
        nvme_per_device_bytes=cluster.host.nvme_bytes / cluster.devices_per_node,
        stages=stages, per_device_memory_bytes=per_device,
        model_flops_per_step=model_flops, mfu=mfu, samples_per_s=global_batch_size / step_s,
        tokens_per_s=global_batch_size * tokens / step_s if tokens else None,
        activation_bytes_per_layer=layer_acts,
        warnings=_warnings(cluster, config, stages, peak) + _fp32_products(ci),
        fp8_linears=tuple(c.to_dict() for c in fp8_choices(ci)))


def _fp32_products(ci: CostInputs) -> tuple[str, ...]:
    """A 16-bit plan whose products autocast cannot reach run in fp32 (HF's experts): say so,
    and how to run them in 16 bits."""
    paths, share = ci.compute.fp32_products
    if not paths:
        return ()
    where = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    return (f"{share:.0%} of the model's FLOPs (grouped products in {where}) run in fp32: "
            "autocast does not reach a grouped product, and the model feeds it fp32 weights; "
            "to run them in 16 bits, hold the weights in 16 bits (mixed_precision='params')",)


def _warnings(cluster: Any, config: ParallelConfig, stages: Sequence[StageEstimate],
              peak: float) -> tuple[str, ...]:
    """What the user should know of a config that may still run: tp across nodes, memory over
    the device's, offloaded bytes over the host's share."""
    device_mem = float(cluster.device.memory_bytes)
    warnings = []
    if config.tp > cluster.devices_per_node:
        warnings.append(f"tp={config.tp} spans nodes ({cluster.devices_per_node} devices per "
                        "node): tensor-parallel collectives cross the inter-node fabric")
    if peak > device_mem:
        warnings.append(f"peak memory {peak / 2**30:.1f} GiB exceeds the device's "
                        f"{device_mem / 2**30:.1f} GiB")
    host_share = cluster.host.memory_bytes / cluster.devices_per_node
    offloaded = max((s.memory.offloaded_bytes for s in stages), default=0.0)
    if offloaded > host_share:
        warnings.append(f"{offloaded / 2**30:.1f} GiB offloaded per device exceeds its share of "
                        f"host memory ({host_share / 2**30:.1f} GiB)")
    nvme_share = cluster.host.nvme_bytes / cluster.devices_per_node
    on_nvme = max((s.memory.nvme_bytes for s in stages), default=0.0)
    if on_nvme > nvme_share:
        warnings.append(f"{on_nvme / 2**30:.1f} GiB offloaded to NVMe per device exceeds its "
                        f"share of the node's NVMe ({nvme_share / 2**30:.1f} GiB)")
    return tuple(warnings)


def _states(config: ParallelConfig, params: float, shard: int) -> Any:
    return model_state_bytes(params, dp=shard, zero_stage=config.zero_stage,
                             precision=config.precision, optimizer=config.optimizer,
                             offload_optimizer=config.offload_optimizer,
                             offload_params=config.offload_params,
                             mixed_precision=config.mixed_precision,
                             offload_nvme=config.offload_nvme,
                             optimizer_state=config.optimizer_state)


def stage_params(costs: Sequence[RangeCost], mine: Sequence[int], config: ParallelConfig,
                 ci: CostInputs, chunks: Sequence[Any]) -> StageParams:
    """What one rank of the stage running chunks ``mine`` holds: each weight once, though two
    of its chunks read it (``held_params``: a V schedule's tied embedding and LM head); of
    them, the weights FSDP gathers in fp8 (``ComputeModel.fp8_gathered``)."""
    again = rank_repeated(ci, [[(a, b) for a, b, _ in chunk_parts(chunks[c])] for c in mine])
    fp8_gathered = frozenset(ci.compute.fp8_gathered.values())
    fp8 = [(f, n) for c in mine for f, n in costs[c].param_elements if f in fp8_gathered]
    return StageParams(fp8=sum(n for _, n in fp8), fp8_tensors=len({f for f, _ in fp8}),
                       params=sum(costs[c].params for c in mine) - again.elements,
                       experts=sum(costs[c].expert_params for c in mine) - again.experts,
                       layer_params=sum(costs[c].layer_params for c in mine),
                       tensors=sum(costs[c].param_tensors for c in mine) - again.tensors,
                       layers=max(1, sum(costs[c].num_layers for c in mine)),
                       whole=_whole(config, [costs[c] for c in mine]))


def _whole(config: ParallelConfig, costs: Sequence[RangeCost]) -> float:
    """Of the parameters a rank holds, the elements ZeRO-3 keeps whole (``dp_whole``)."""
    if not config.dp_whole:
        return 0.0
    return sum(c.elements_of(config.keeps_whole) for c in costs)


def reserved_bytes(cluster: Any, margin: float | None) -> float:
    """Device memory a plan leaves free: ``margin`` (``memory_margin_bytes``) where given, else
    nothing on a CPU and 1 GiB plus 3 % on a GPU."""
    if margin is not None:
        if margin < 0:
            raise ConfigError(f"memory_margin_bytes must be >= 0, got {margin}")
        return float(margin)
    if cluster.device.kind == "cpu":
        return 0.0
    # CUDA context, NCCL buffers, allocator fragmentation: a fixed reserve plus a fraction
    return 1.0 * 2**30 + 0.03 * cluster.device.memory_bytes


def _tokens_per_sample(graph: OpGraph) -> int | None:
    """Sequence length when the first input is a (batch, seq) integer tensor of token ids."""
    if not graph.inputs:
        return None
    meta = graph.value(graph.inputs[0]).meta
    if len(meta.shape) == 2 and not meta.is_float:
        return meta.shape[1]
    return None
