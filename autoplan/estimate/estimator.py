"""``estimate``: step time and memory of one ParallelConfig on one cluster.

Order of the computation (each step uses only what the previous ones produced):
1. trace (or take) the OpGraph, validate the config against graph, cluster and batch;
2. cut the graph into pipeline chunks; per chunk and per micro-batch: compute time of every op
   (profile or roofline, scaled to the micro-batch and the TP shard), recomputation, the
   tensor-parallel collectives (exposed: each one blocks the op after it), and the activations
   kept for backward;
3. combine chunks into pipeline stages and simulate the schedule (``pipeline_sim``): the
   makespan, the bubble (fill and drain) and the waits on point-to-point sends, and the
   activations each rank holds at its peak;
4. data-parallel gradient sync and ZeRO gathers, hidden behind backward compute only as far as
   that compute lasts; then the optimizer step (on the device, or on the host when offloaded);
5. memory per stage: model states (ZeRO), activations times the micro-batches in flight under
   the schedule, transient buffers, and a workspace margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost.analysis import GraphAnalysis, analyze
from autoplan.cost.compute import ComputeModel, compute_model
from autoplan.cost.memory import (PRECISION_BYTES, _meta_bytes, activation_bytes,
                                  model_state_bytes, sharding_for, working_set_bytes)
from autoplan.errors import ConfigError
from autoplan.estimate.config import MULTI_CHUNK_SCHEDULES, ParallelConfig
from autoplan.estimate.partition import Chunk, partition
from autoplan.estimate.pipeline_sim import W_FRACTION, W_KEEPS, simulate
from autoplan.estimate.result import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.planner.placement import REPLICATE
from autoplan.planner.sharding import Sharding

# Bytes an optimizer step reads and writes per parameter (grad, weights, states; Adam keeps
# fp32 master + two moments under mixed precision). The step is memory-bound.
_OPT_STEP_BYTES = {"adamw": 28, "adam": 28, "sgd": 20}


@dataclass(frozen=True)
class _ChunkCost:
    fwd_compute_s: float
    bwd_compute_s: float
    recompute_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_step_s: float              # once per step: tp-axis gradient all-reduces (replicated weights)
    activation_bytes: float
    working_set_bytes: float
    params: float                 # parameters per device (after TP sharding)
    param_tensors: int            # parameter tensors (an optimizer's per-tensor costs)
    boundary_bytes: float         # activation sent to the next chunk per micro-batch
    num_layers: int


def validate(graph: OpGraph, cluster: Any, config: ParallelConfig,
             global_batch_size: int) -> int:
    """Check the config against the model, the cluster and the batch; returns micro-batches."""
    if config.world_size != cluster.world_size:
        raise ConfigError(
            f"dp x tp x pp = {config.dp} x {config.tp} x {config.pp} = {config.world_size} "
            f"but the cluster has {cluster.world_size} devices; choose degrees whose product "
            f"is {cluster.world_size}")
    m = config.microbatches(global_batch_size)
    a = analyze(graph)
    if config.tp > 1:
        for h in sorted(a.head_counts):
            if h % config.tp:
                raise ConfigError(
                    f"tp={config.tp} does not divide the model's {h} attention heads; "
                    f"tensor parallelism splits whole heads: use a tp that divides {h}")
    if (config.pp > 1 and m % config.pp and (config.schedule == "interleaved_1f1b" or (
            config.schedule == "zero_bubble" and config.virtual_stages > 1))):
        raise ConfigError(f"{config.schedule} over {config.virtual_stages} chunks per rank needs "
                          f"the micro-batch count ({m}) to be a multiple of pp ({config.pp}); "
                          "change the batch or micro_batch_size")
    if config.micro_batch_size > global_batch_size:
        raise ConfigError(f"micro_batch_size {config.micro_batch_size} exceeds the global batch "
                          f"{global_batch_size}")
    return m


def _work_scale(a: GraphAnalysis, graph: OpGraph, sh: Sharding, i: int,
                batch_scale: float) -> float:
    """Work of op ``i`` relative to its traced work: the micro-batch, then its tp shard."""
    batch_dep = any(o in a.batch_dependent for o in graph.ops[i].outputs)
    return (batch_scale if batch_dep else 1.0) / sh.work_divisor(i)


def _comm_bytes(graph: OpGraph, a: GraphAnalysis, config: ParallelConfig, value: str,
                scale: float, t: int, batch_scale: float) -> float:
    v = graph.value(value)
    nbytes = _meta_bytes(v.meta, config.precision)
    if value in a.batch_dependent:
        nbytes *= batch_scale
    return nbytes * (1.0 / t if scale < 0 else scale)


def tp_comm_s(graph: OpGraph, a: GraphAnalysis, sh: Sharding, cluster: Any,
              config: ParallelConfig, start: int, stop: int,
              batch_scale: float) -> tuple[float, float, float]:
    """(forward, backward, per-step) seconds of tp-axis collectives issued by ops[start:stop]:
    the strategies' own collectives and the reshards between producers and consumers."""
    if sh.t == 1:
        return 0.0, 0.0, 0.0
    group = config.tp_group()
    t = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
    for _i, c in sh.comms(start, stop):
        nbytes = _comm_bytes(graph, a, config, c.value, c.scale, sh.t, batch_scale)
        t[c.phase] += cluster.collective_time_s(c.kind, nbytes, group)
    for r in sh.reshards_in(start, stop):
        nbytes = _comm_bytes(graph, a, config, r.value, r.scale, sh.t, batch_scale)
        t[r.phase] += cluster.collective_time_s(r.kind, nbytes, group)
    return t["fwd"], t["bwd"], t["step"]


@dataclass(frozen=True)
class _RangeCost:
    """Costs of one contiguous op range for one micro-batch (a layer, or the ops around them)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_step_s: float
    activation_bytes: float
    working_set_bytes: float
    params: float
    param_tensors: int


def _range_cost(graph: OpGraph, a: GraphAnalysis, sh: Sharding, compute: ComputeModel,
                cluster: Any, config: ParallelConfig, start: int, stop: int,
                batch_scale: float, policy: str) -> _RangeCost:
    mbs = config.micro_batch_size
    fwd = bwd = recompute = 0.0
    for i in range(start, stop):
        c = compute.op_cost(i, _work_scale(a, graph, sh, i, batch_scale))
        fwd += c.fwd_s
        bwd += c.bwd_s
        if policy == "full" or policy == "selective" and i in a.score_ops:
            recompute += c.fwd_s
    tp_fwd, tp_bwd, tp_step = tp_comm_s(graph, a, sh, cluster, config, start, stop, batch_scale)
    if policy == "full":
        recompute += tp_fwd
    acts = activation_bytes(graph, start, stop, micro_batch_size=mbs, sharding=sh,
                            recompute=policy, precision=config.precision)
    working = (working_set_bytes(graph, start, stop, micro_batch_size=mbs, sharding=sh,
                                 precision=config.precision) if policy == "full" else 0.0)
    # parameters the range reads, each storage once (a tied weight on two stages is held by
    # both, as Megatron-LM does with the embedding and the LM head)
    params = 0.0
    seen: set[str] = set()
    for i in range(start, stop):
        for n in graph.ops[i].inputs:
            v = graph.value(n)
            if v.kind == "param" and v.base not in seen:
                seen.add(v.base)
                split = sh.input_placement(graph, i, n).kind == "S"
                params += v.meta.numel / (sh.t if split else 1)
    return _RangeCost(fwd, bwd, recompute, tp_fwd, tp_bwd, tp_step, acts, working, params,
                      len(seen))


def _chunk_cost(graph: OpGraph, a: GraphAnalysis, sh: Sharding, compute: ComputeModel,
                cluster: Any, config: ParallelConfig, chunk: Chunk,
                batch_scale: float) -> _ChunkCost:
    """Sum of the chunk's layers (recompute policy applies) and the ops around them (keep all).
    Layers after the second are alike (same block, same strategies): the second is reused."""
    ranges: list[tuple[int, int, str]] = []
    pos = chunk.start
    for (s, e) in chunk.layer_ranges:
        if pos < s:
            ranges.append((pos, s, "none"))
        ranges.append((s, e, config.recompute))
        pos = e
    if pos < chunk.stop:
        ranges.append((pos, chunk.stop, "none"))
    parts: list[_RangeCost] = []
    steady: _RangeCost | None = None
    layer_no = 0
    for (s, e, policy) in ranges:
        is_layer = (s, e) in chunk.layer_ranges
        if is_layer and layer_no >= 2 and steady is not None:
            parts.append(steady)
        else:
            rc = _range_cost(graph, a, sh, compute, cluster, config, s, e, batch_scale, policy)
            parts.append(rc)
            if is_layer and layer_no == 1:
                steady = rc
        layer_no += is_layer

    boundary = 0.0
    for n in _boundary_values(graph, a, chunk.stop):
        v = graph.value(n)
        b = _meta_bytes(v.meta, config.precision) * (batch_scale if n in a.batch_dependent else 1)
        if sh.value_placement.get(n, REPLICATE).kind == "S":
            b /= sh.t
        boundary += b
    return _ChunkCost(
        fwd_compute_s=sum(p.fwd_s for p in parts), bwd_compute_s=sum(p.bwd_s for p in parts),
        recompute_s=sum(p.recompute_s for p in parts), tp_fwd_s=sum(p.tp_fwd_s for p in parts),
        tp_bwd_s=sum(p.tp_bwd_s for p in parts), tp_step_s=sum(p.tp_step_s for p in parts),
        activation_bytes=sum(p.activation_bytes for p in parts),
        working_set_bytes=max((p.working_set_bytes for p in parts), default=0.0),
        params=sum(p.params for p in parts), param_tensors=sum(p.param_tensors for p in parts),
        boundary_bytes=boundary, num_layers=len(chunk.layers))


def _stage_weights(graph: OpGraph, a: GraphAnalysis, sh: Sharding, compute: ComputeModel,
                   cluster: Any, config: ParallelConfig,
                   batch_scale: float) -> tuple[float, float, float] | None:
    """Seconds per micro-batch of the ops before the layers, of one layer, and after them."""
    from autoplan.estimate.partition import main_block
    block = main_block(graph)
    if block is None:
        return None
    first, last = block.instances[0], block.instances[-1]
    inst = block.instances[1] if len(block.instances) > 1 else first

    def secs(start: int, stop: int, policy: str) -> float:
        if start >= stop:
            return 0.0
        r = _range_cost(graph, a, sh, compute, cluster, config, start, stop, batch_scale, policy)
        return r.fwd_s + r.bwd_s + r.recompute_s + r.tp_fwd_s + r.tp_bwd_s
    return (secs(0, first.start, "none"), secs(inst.start, inst.stop, config.recompute),
            secs(last.stop, len(graph.ops), "none"))


def _cached_chunk_cost(graph: OpGraph, a: GraphAnalysis, sh: Sharding, compute: ComputeModel,
                       cluster: Any, config: ParallelConfig, chunk: Chunk,
                       batch_scale: float) -> _ChunkCost:
    """A chunk's costs depend on the sharding, micro-batch, recompute policy and precision, not
    on ZeRO, offload or the schedule: the planner reuses them across those (kept on the graph,
    keyed by the objects' identities, which live as long as the search holds them)."""
    cache = graph.__dict__.setdefault("_autoplan_chunk_costs", {})
    key = (id(sh), id(compute), id(cluster), chunk.start, chunk.stop, config.micro_batch_size,
           config.recompute, config.precision, config.tp)
    hit = cache.get(key)
    if hit is not None and hit[0] is sh and hit[1] is compute and hit[2] is cluster:
        return hit[3]
    cost = _chunk_cost(graph, a, sh, compute, cluster, config, chunk, batch_scale)
    if len(cache) > 4096:
        cache.clear()
    cache[key] = (sh, compute, cluster, cost)
    return cost


def _boundary_values(graph: OpGraph, a: GraphAnalysis, cut: int) -> list[str]:
    """Activations produced before op ``cut`` and read at or after it (what a stage sends);
    computed once per cut and kept on the graph."""
    cache = graph.__dict__.setdefault("_autoplan_boundaries", {})
    if cut not in cache:
        cache[cut] = _crossing(graph, cut)
    return cache[cut]


def _crossing(graph: OpGraph, cut: int) -> list[str]:
    if cut >= len(graph.ops):
        return []
    produced_before = set()
    for op in graph.ops[:cut]:
        produced_before.update(op.outputs)
    crossing = []
    seen = set()
    for op in graph.ops[cut:]:
        for n in op.inputs:
            v = graph.value(n)
            if n in produced_before and v.base not in seen and v.meta.is_float:
                seen.add(v.base)
                crossing.append(v.base)
    return crossing


def _in_flight(config: ParallelConfig, m: int, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak."""
    p, v = config.pp, config.virtual_stages
    if p == 1:
        return 1.0
    if config.schedule == "gpipe":
        return float(m)
    extra = 0.0
    if config.schedule == "zero_bubble":   # deferred W's keep half their chunk's activations
        extra = W_KEEPS * min(m * v, p * v) / v
    if config.schedule in MULTI_CHUNK_SCHEDULES and v > 1:
        chunks = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
        return chunks / v + extra    # in units of this rank's whole (all-chunk) activations
    return float(min(m, p - stage)) + extra


def estimate(model: Any, cluster: Any, *, config: ParallelConfig, global_batch_size: int,
             example_inputs: Sequence[Any] | None = None, loss_fn: Any = None,
             targets: Any = None, profile: Any = "auto",
             memory_margin_bytes: float | None = None,
             sharding: Sharding | None = None, simulate_pipeline: bool = True) -> Estimate:
    """Predict step time, memory per device, and their breakdowns for ``config``.

    ``model`` is an ``nn.Module`` (traced with ``example_inputs``, on meta or real device) or an
    ``OpGraph``. ``profile``: a ProfileDB, ``None`` (roofline only) or ``"auto"`` (the
    measured profile of the cluster's device type, when one is installed). ``sharding``: the
    per-op tensor-parallel strategies (from the planner); by default Megatron-LM's rule for
    ``config.tp`` and ``config.sequence_parallel``. ``simulate_pipeline=False`` uses the closed
    form for pipelined configs (bubble (p-1)/v stage-times, the schedule's in-flight formulas):
    the planner screens with it and simulates the finalists.
    """
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be an autoplan.ParallelConfig, got {type(config).__name__}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="estimate()",
                     error=ConfigError)
    m = validate(graph, cluster, config, global_batch_size)
    a = analyze(graph)
    if profile == "auto":
        from autoplan.cost.profile_db import ProfileDB
        profile = ProfileDB.find(cluster.device.name)
    compute = compute_model(graph, cluster.device, config.precision, profile)
    batch_scale = config.micro_batch_size / graph.batch_size
    p, v = config.pp, config.virtual_stages
    sh = sharding_for(graph, config.tp, config.sequence_parallel, sharding)
    if sh.t != config.tp:
        raise ConfigError(f"the sharding is for tp={sh.t} but the config has tp={config.tp}")
    chunks = partition(graph, p * v, _stage_weights(graph, a, sh, compute, cluster, config,
                                                    batch_scale) if p * v > 1 else None)
    costs = [_cached_chunk_cost(graph, a, sh, compute, cluster, config, c, batch_scale)
             for c in chunks]

    # --- pipeline schedule: simulated (pipeline_sim) ------------------------------------------
    stage_chunks = [[c for c in range(len(chunks)) if c % p == s] for s in range(p)]
    stage_f = [sum(costs[c].fwd_compute_s + costs[c].tp_fwd_s for c in cs) for cs in stage_chunks]
    stage_b = [sum(costs[c].bwd_compute_s + costs[c].tp_bwd_s + costs[c].recompute_s
                   for c in cs) for cs in stage_chunks]
    bottleneck = max(range(p), key=lambda s: stage_f[s] + stage_b[s])
    sim = None
    bubble_s = p2p_s = 0.0
    if p > 1 and not simulate_pipeline:
        t_mb = stage_f[bottleneck] + stage_b[bottleneck]
        if config.schedule == "zero_bubble":   # W's fill all but F + B - W of a stage time
            t_mb = stage_f[bottleneck] + stage_b[bottleneck] * max(0.0, 1 - 2 * W_FRACTION)
        bubble_s = (p - 1) / v * t_mb
        p2p_s = 2.0 * sum(cluster.p2p_time_s(costs[c].boundary_bytes,
                                             config.rank(pp_index=c % p, dp_index=0, tp_index=0),
                                             config.rank(pp_index=(c + 1) % p, dp_index=0,
                                                         tp_index=0))
                          for c in range(len(chunks) - 1))
    elif p > 1:
        fwd = [c.fwd_compute_s + c.tp_fwd_s for c in costs]
        bwd = [c.bwd_compute_s + c.tp_bwd_s + c.recompute_s for c in costs]
        sends = [cluster.p2p_time_s(costs[c].boundary_bytes,
                                    config.rank(pp_index=c % p, dp_index=0, tp_index=0),
                                    config.rank(pp_index=(c + 1) % p, dp_index=0, tp_index=0))
                 for c in range(len(chunks) - 1)]
        kw = dict(schedule=config.schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd,
                  activation_bytes=[c.activation_bytes for c in costs])
        sim = simulate(send_s=sends, **kw)
        free_sends = simulate(**kw).makespan_s
        bottleneck = max(range(p), key=lambda r: sim.busy_s[r])
        bubble_s = free_sends - sim.busy_s[bottleneck]     # fill and drain
        p2p_s = sim.makespan_s - free_sends                 # waiting on point-to-point sends
    bc = [costs[c] for c in stage_chunks[bottleneck]]
    compute_s = m * sum(c.fwd_compute_s + c.bwd_compute_s for c in bc)
    recompute_s = m * sum(c.recompute_s for c in bc)
    tp_s = m * sum(c.tp_fwd_s + c.tp_bwd_s for c in bc)

    # --- data parallel / ZeRO, optimizer, offload (worst stage) -------------------------------
    w_bytes = PRECISION_BYTES[config.precision]
    dp_sync = zero_gather = opt_s = offload_s = 0.0
    for s in range(p):
        params = sum(costs[c].params for c in stage_chunks[s])
        tensors = sum(costs[c].param_tensors for c in stage_chunks[s])
        layers = max(1, sum(costs[c].num_layers for c in stage_chunks[s]))
        bwd_window = stage_b[s]          # backward of the last micro-batch hides the sync
        gather = 0.0
        # gradient sync: tp-axis all-reduces of replicated weights, then the dp group's
        comm = sum(costs[c].tp_step_s for c in stage_chunks[s])
        fsdp_sync = 0.0
        if config.dp > 1:
            group = config.dp_group(pp_index=s)
            grad_bytes = params * w_bytes
            if config.zero_stage == 3:
                # FSDP: per layer, an all-gather before its forward, and again before its
                # backward followed by a reduce-scatter of its gradients, every micro-batch
                # (the runtime does not skip gradient sync between micro-batches)
                layer_bytes = params * w_bytes / layers
                ag = cluster.collective_time_s("all_gather", layer_bytes, group)
                rs = cluster.collective_time_s("reduce_scatter", layer_bytes, group)
                fwd_x = overlap_exposed_s(layers * ag, stage_f[s], ag)
                bwd_x = overlap_exposed_s(layers * (ag + rs), stage_b[s], ag + rs)
                gather = m * (fwd_x + bwd_x * ag / (ag + rs))
                fsdp_sync = m * bwd_x * rs / (ag + rs)
            else:
                kind = "all_reduce" if config.zero_stage == 0 else "reduce_scatter"
                comm += cluster.collective_time_s(kind, grad_bytes, group)
            if config.zero_stage in (1, 2):   # updated shards gathered after the step
                gather = cluster.collective_time_s("all_gather", params * w_bytes, group)
        sync = overlap_exposed_s(comm, bwd_window, comm / layers) if comm > 0 else 0.0
        sync += fsdp_sync
        owned = params / (config.dp if config.zero_stage >= 1 else 1)
        if config.offload_params:
            # weight shards go up for the forward and again for the backward gather of every
            # micro-batch, gradient shards come down; the optimizer steps on the host
            host = cluster.host
            o = owned / host.cpu_adam_params_per_s
            moved = m * owned * (2 * w_bytes + w_bytes)
            off = moved / host.device_to_host_bandwidth_bytes_per_s
        elif config.offload_optimizer:
            host = cluster.host
            o = owned / host.cpu_adam_params_per_s
            moved = owned * (w_bytes + w_bytes)          # grads down, weights up
            off = moved / host.device_to_host_bandwidth_bytes_per_s
        else:
            o = _optimizer_step_s(owned, tensors, config, compute, profile)
            off = 0.0
        if sync + gather + o + off > dp_sync + zero_gather + opt_s + offload_s:
            dp_sync, zero_gather, opt_s, offload_s = sync, gather, o, off

    overhead_s = getattr(getattr(profile, "calibration", None), "step_overhead_s", 0.0) or 0.0
    comm_exposed = {"tp": tp_s, "dp_grad_sync": dp_sync, "zero_param_gather": zero_gather,
                    "pp_p2p": p2p_s, "offload": offload_s}
    time = TimeBreakdown(compute_s=compute_s, recompute_s=recompute_s,
                         comm_exposed_s=comm_exposed, bubble_s=bubble_s, optimizer_s=opt_s,
                         overhead_s=overhead_s)
    step_s = time.total_s

    # --- memory per stage -------------------------------------------------------------------
    device_mem = float(cluster.device.memory_bytes)
    margin = _margin(cluster, memory_margin_bytes)
    stages = []
    for s in range(p):
        cs = [costs[c] for c in stage_chunks[s]]
        params = sum(c.params for c in cs)
        states = model_state_bytes(params, dp=config.dp, zero_stage=config.zero_stage,
                                   precision=config.precision, optimizer=config.optimizer,
                                   offload_optimizer=config.offload_optimizer,
                                   offload_params=config.offload_params)
        act_mb = sum(c.activation_bytes for c in cs)
        if sim is not None and act_mb > 0:   # the simulated peak of the schedule
            in_flight = sim.peak_activation_bytes[s] / act_mb
        else:
            in_flight = _in_flight(config, m, s)
        transient = max(c.working_set_bytes for c in cs)
        layers = max(1, sum(c.num_layers for c in cs))
        if config.zero_stage == 3 and config.dp > 1:
            # two layers' weights gathered at once (prefetch) plus their unsharded gradients
            transient += 2 * (params / layers) * w_bytes * 2
        mem = MemoryBreakdown(params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
                              optimizer_bytes=states.optimizer_bytes,
                              activations_bytes=act_mb * in_flight, transient_bytes=transient,
                              margin_bytes=margin, offloaded_bytes=states.offloaded_bytes)
        stages.append(StageEstimate(
            index=s, layers=tuple(l for c in stage_chunks[s] for l in chunks[c].layers),
            num_ops=sum(chunks[c].stop - chunks[c].start for c in stage_chunks[s]),
            params_per_device=params, fwd_s=stage_f[s], bwd_s=stage_b[s],
            activation_bytes_per_microbatch=act_mb, microbatches_in_flight=in_flight,
            memory=mem, chunks=tuple(chunks[c].layers for c in stage_chunks[s])))
    per_device = tuple(stages[r // (config.dp * config.tp)].memory.total_bytes
                       for r in range(config.world_size))
    peak = max(per_device)

    model_flops = (graph.fwd_flops + graph.bwd_flops) * global_batch_size / graph.batch_size
    peak_flops = cluster.device.peak_flops_for(config.precision) * config.world_size
    mfu = model_flops / (step_s * peak_flops) if step_s > 0 else 0.0
    tokens = _tokens_per_sample(graph)
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
    layer_acts = 0.0
    if chunks[0].layer_ranges:
        s0, e0 = chunks[0].layer_ranges[0]
        layer_acts = activation_bytes(graph, s0, e0, micro_batch_size=config.micro_batch_size,
                                      sharding=sh, recompute=config.recompute,
                                      precision=config.precision)
    return Estimate(
        config=config, global_batch_size=global_batch_size, num_microbatches=m,
        step_time_s=step_s, time=time, peak_memory_bytes=peak, device_memory_bytes=device_mem,
        host_memory_per_device_bytes=cluster.host.memory_bytes / cluster.devices_per_node,
        stages=tuple(stages), per_device_memory_bytes=per_device,
        model_flops_per_step=model_flops, mfu=mfu, samples_per_s=global_batch_size / step_s,
        tokens_per_s=global_batch_size * tokens / step_s if tokens else None,
        activation_bytes_per_layer=layer_acts, warnings=tuple(warnings))


def _optimizer_step_s(params: float, tensors: int, config: ParallelConfig,
                      compute: ComputeModel, profile: Any) -> float:
    """Measured AdamW rates where calibrated (per parameter + per tensor), else memory-bound."""
    cal = getattr(profile, "calibration", None)
    if cal is not None and config.optimizer in ("adam", "adamw"):
        return (params * cal.optimizer_s_per_param
                + tensors * cal.optimizer_s_per_tensor) * compute.slowdown
    return (params * _OPT_STEP_BYTES[config.optimizer] / compute.tput.memory_bytes_per_s
            + tensors * compute.tput.launch_s)


# Communication overlapped with compute still slows it: NCCL's kernels run on the SMs and share
# HBM bandwidth with the GEMMs they hide behind. ESTIMATE, like the efficiencies in devices.yaml:
# a share of the overlapped communication time is charged to the compute stream.
OVERLAP_INTERFERENCE = 0.15


def overlap_exposed_s(comm_s: float, window_s: float, first_s: float) -> float:
    """Seconds ``comm_s`` of communication adds to a phase of ``window_s`` seconds of compute
    it overlaps: what does not fit in the window (at least ``first_s``, the part that must come
    before any compute, e.g. the first layer's gather) plus the interference of the rest."""
    if comm_s <= 0:
        return 0.0
    return max(comm_s - window_s, first_s) + OVERLAP_INTERFERENCE * min(comm_s, window_s)


def _margin(cluster: Any, margin: float | None) -> float:
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
