"""Step time and memory of one ParallelConfig on a heterogeneous cluster (``cluster/pools.py``).

Ranks are numbered pool after pool and the mesh puts pp outermost (then dp, cp, tp), so a
config places its work on the pools in one of two ways, and any other way is refused:

- **stages on pools** (pp > 1): every pipeline stage's ranks lie in one pool. Each model chunk
  is priced (compute, recomputation, its tensor-parallel collectives) on the device of the
  stage that runs it, on that pool's node; the schedule is simulated over the mixed stage times;
  sends between stages on different pools, and each stage's gradient sync, are priced on the
  links they cross (``Cluster.group_profile``). Uneven ``chunk_layers`` give the faster pool
  more layers.
- **replicas on pools** (pp = 1): every data-parallel replica's cp x tp ranks lie in one pool
  and replica ``j`` runs ``dp_shares[j]`` micro-batches per step (even when None). Each
  replica's step is priced on its pool's device with its share of micro-batches and the
  gradient sync of the whole dp group (crossing pools: on the slower NIC); the step is the
  slowest replica's (they meet at the gradient sync).

Each stage's optimizer step is priced on its own device, and the framework's overhead per op
on the bottleneck stage's (replicas on pools: each replica's own device). With
``seq_lengths`` (the data's document lengths, ``sharding/seq_lengths.py``), every pool prices
attention at the packed documents' expected masked work (``sharding/doc_work.py``), as
``estimate()`` does on one device type.
Memory: each stage (or replica) is held against its own device's memory (under ``dp_shares``
with FSDP, a replica of two micro-batches or more holds its gradients, under ZeRO-3 its
weights too, unsharded for the step, as the runtime does); the Estimate's
``device_memory_bytes`` is the smallest of the devices used, its peak the largest stage's.
A homogeneous cluster never comes here: ``estimate()`` prices it as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.errors import ConfigError
from autoplan.estimate.arguments import batch_arg, cluster_arg, profile_arg
from autoplan.estimate.chunk_cost import chunk_cost
from autoplan.estimate.estimator import (assemble_estimate, chunk_offload_flags, chunk_policy,
                                         cost_inputs, pipeline_timing, reserved_bytes,
                                         stage_estimate, time_breakdown, validate)
from autoplan.estimate.layout import chunks_for
from autoplan.estimate.result import Estimate
from autoplan.graph.trace import as_graph
from autoplan.sharding.doc_work import packed_work
from autoplan.sharding.parallel_config import ParallelConfig

STAGES, REPLICAS = "stages", "replicas"


@dataclass(frozen=True)
class HeteroEstimate:
    """A config priced on pools: the Estimate of the step (the bottleneck's breakdown), how the
    work lies on the pools (``placement``: "stages" or "replicas"), the pool of each stage (or
    replica), the micro-batches each replica runs, and per pool the step its ranks would take
    alone (replicas) or the forward+backward seconds of its stages (stages)."""

    estimate: Estimate
    placement: str
    pool_of_unit: tuple[int, ...]
    dp_shares: tuple[int, ...] | None
    pool_step_s: tuple[float, ...]
    # replicas on pools: each replica's own Estimate (its pool's device, its share), whose
    # step is its own busy time within the step (``estimate/energy.py`` reads it); stages: ()
    unit_estimates: tuple[Estimate, ...] = ()

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


def placement(cluster: Any, config: ParallelConfig) -> tuple[str, tuple[int, ...]]:
    """("stages", pool of each stage) or ("replicas", pool of each dp replica); ConfigError
    (saying which degrees would fit) where a stage or a replica straddles two pools."""
    pools = cluster.pools
    bounds = [p.first_rank for p in pools[1:]]
    if config.pp > 1:
        size = config.world_size // config.pp
        if any(b % size for b in bounds):
            raise ConfigError(
                f"pp={config.pp} puts {size} ranks in each stage, but the pools start at ranks "
                f"{[0, *bounds]}: a stage would straddle two device types; choose pp so that "
                f"every pool holds whole stages (a multiple of {len(pools)} that divides each "
                "pool's rank count evenly)")
        return STAGES, tuple(cluster.pool_of(s * size) for s in range(config.pp))
    size = config.cp * config.tp
    if any(b % size for b in bounds):
        raise ConfigError(
            f"cp x tp = {size} ranks per data-parallel replica, but the pools start at ranks "
            f"{[0, *bounds]}: a replica (its tensor-parallel group) would straddle two device "
            "types; choose tp and cp whose product divides every pool's rank count")
    return REPLICAS, tuple(cluster.pool_of(d * size) for d in range(config.dp))


def shares_arg(dp_shares: Any, config: ParallelConfig, global_batch_size: int) -> tuple[int, ...]:
    """The micro-batches of each replica: ``dp_shares`` checked against dp and the batch, or the
    even split where None."""
    mbs = config.micro_batch_size
    if dp_shares is None:
        return (config.microbatches(global_batch_size),) * config.dp
    shares = tuple(dp_shares)
    if len(shares) != config.dp or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                       for s in shares):
        raise ConfigError(f"dp_shares {list(shares)!r:.80} must give one whole number >= 1 per "
                          f"dp replica ({config.dp})")
    if mbs * sum(shares) != global_batch_size:
        raise ConfigError(f"dp_shares {list(shares)} run {sum(shares)} micro-batches of {mbs} = "
                          f"{mbs * sum(shares)} samples per step, the global batch is "
                          f"{global_batch_size}: make micro_batch_size x sum(dp_shares) equal it")
    return shares


def estimate_hetero(model: Any, cluster: Any, *, config: ParallelConfig, global_batch_size: int,
                    dp_shares: Sequence[int] | None = None, example_inputs: Any = None,
                    loss_fn: Any = None, targets: Any = None,
                    profile: Any = "auto", memory_margin_bytes: float | None = None,
                    sharding: Any = None, simulate_pipeline: bool = True,
                    expert_capacity_factor: float = 1.0, seq_lengths: Any = None
                    ) -> HeteroEstimate:
    """Price ``config`` on a heterogeneous ``cluster`` (see the module docstring); ``dp_shares``
    (pp = 1): micro-batches per dp replica, in dp-rank order, where the config has none of its
    own (``ParallelConfig.dp_shares``); the Estimate's config carries them. ``seq_lengths``: a
    file path, a ``LengthHistogram`` or a ``PackedWork``, as ``estimate()`` takes it."""
    cluster = cluster_arg(cluster, "estimate_hetero()")
    if not cluster.pools:
        raise ConfigError("estimate_hetero() prices heterogeneous clusters (pools); use "
                          "autoplan.estimate() for a homogeneous one")
    global_batch_size = batch_arg(global_batch_size, "estimate_hetero()")
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="estimate_hetero()",
                     error=ConfigError)
    if config.dp_shares is not None:
        if dp_shares is not None and tuple(dp_shares) != config.dp_shares:
            raise ConfigError(f"dp_shares {list(dp_shares)} differ from the config's "
                              f"{list(config.dp_shares)}; give them once")
        dp_shares, config = config.dp_shares, replace(config, dp_shares=None)
    where, pool_of_unit = placement(cluster, config)
    if where == STAGES and dp_shares is not None:
        raise ConfigError("dp_shares split micro-batches between replicas on different pools; "
                          f"with pp={config.pp} every stage lies in one pool: drop dp_shares or "
                          "use pp=1")
    views = {i: cluster.pool_view(i) for i in sorted(set(pool_of_unit))}
    documents = packed_work(graph, seq_lengths)
    profiles = {i: profile_arg(profile, v, "estimate_hetero()") for i, v in views.items()}
    inputs = {i: cost_inputs(graph, v, config, profiles[i], sharding, expert_capacity_factor,
                             documents) for i, v in views.items()}
    kw = dict(graph=graph, cluster=cluster, views=views, inputs=inputs,
              profiles=profiles, margin=memory_margin_bytes, simulate=simulate_pipeline)
    if where == STAGES:
        for v in views.values():
            validate(graph, v, config, global_batch_size)
        est, per_pool = _stages_on_pools(config=config, global_batch_size=global_batch_size,
                                         pool_of_stage=pool_of_unit,
                                         main=replace(inputs[pool_of_unit[0]], cluster=cluster),
                                         **kw)
        return HeteroEstimate(estimate=est, placement=STAGES, pool_of_unit=pool_of_unit,
                              dp_shares=None, pool_step_s=per_pool)
    shares = shares_arg(dp_shares, config, global_batch_size)
    runs = {}                 # (pool, share) -> Estimate of a replica there with that share
    for pool, share in sorted(set(zip(pool_of_unit, shares))):
        batch = config.micro_batch_size * share * config.dp
        # under shares, priced as shares (FSDP meets its peers once a step:
        # ``cost.memory.holds_step_whole``), each replica as if every one ran its count
        run = config if dp_shares is None else replace(config, dp_shares=(share,) * config.dp)
        validate(graph, views[pool], run, batch)
        est, _ = _stages_on_pools(config=run, global_batch_size=batch,
                                  pool_of_stage=(pool,), chunk_pool=pool,
                                  main=replace(inputs[pool], cluster=cluster), **kw)
        runs[pool, share] = est
    worst = max(runs, key=lambda k: runs[k].step_time_s)
    slow = runs[worst]
    step = slow.step_time_s
    per_pool = tuple(max((e.step_time_s for (p, _), e in runs.items() if p == i), default=0.0)
                     for i in range(len(cluster.pools)))
    est = replace(
        slow, global_batch_size=global_batch_size, num_microbatches=max(shares),
        model_flops_per_step=slow.model_flops_per_step * global_batch_size / (
            config.micro_batch_size * worst[1] * config.dp),
        samples_per_s=global_batch_size / step,
        tokens_per_s=(slow.tokens_per_s / slow.samples_per_s * global_batch_size / step
                      if slow.tokens_per_s else None),
        peak_memory_bytes=max(e.peak_memory_bytes for e in runs.values()),
        device_memory_bytes=min(e.device_memory_bytes for e in runs.values()))
    est = replace(est, mfu=_mfu(est, cluster, config, pool_of_unit),
                  config=config if dp_shares is None else replace(config, dp_shares=shares))
    return HeteroEstimate(estimate=est, placement=REPLICAS, pool_of_unit=pool_of_unit,
                          dp_shares=None if dp_shares is None else shares, pool_step_s=per_pool,
                          unit_estimates=tuple(runs[u] for u in zip(pool_of_unit, shares)))


def _stages_on_pools(*, graph: Any, cluster: Any, views: dict, inputs: dict, main: Any,
                     profiles: dict, margin: Any, simulate: bool, config: ParallelConfig,
                     global_batch_size: int, pool_of_stage: tuple[int, ...],
                     chunk_pool: int | None = None) -> tuple[Estimate, tuple[float, ...]]:
    """The estimator's steps (``estimator.estimate``) with each chunk priced on the device of
    the stage running it (``chunk_pool``: every chunk on that pool) and the schedule, the
    collectives between stages and the dp terms on the cluster's own links; each stage's
    optimizer step on its own device."""
    m = config.microbatches(global_batch_size)
    chunks = chunks_for(main)
    costs = []
    for c, ch in enumerate(chunks):
        pool = chunk_pool if chunk_pool is not None else pool_of_stage[config.chunk_rank(c)]
        costs.append(chunk_cost(inputs[pool], ch, chunk_policy(config, chunks, c),
                                chunk_offload_flags(config, chunks, c)))
    state_config = config.grad_view()
    timing = pipeline_timing(main, costs, m, state_config, simulate=simulate)
    stage_pool = [chunk_pool if chunk_pool is not None else pool_of_stage[s]
                  for s in range(config.pp)]
    time = time_breakdown(main, costs, chunks, timing, m, profiles[stage_pool[0]], state_config,
                          stage_devices=[(inputs[p].compute, profiles[p]) for p in stage_pool])
    stages = []
    for s in range(config.pp):
        pool = stage_pool[s]
        stages.append(stage_estimate(main, costs, chunks, timing, m, s,
                                     reserved_bytes(views[pool], margin), state_config))
    est = assemble_estimate(main, chunks, tuple(stages), time, global_batch_size, m)
    used = [views[chunk_pool if chunk_pool is not None else p] for p in pool_of_stage]
    mem = [float(v.device.memory_bytes) for v in used]
    over = [f"stage {s}: peak memory {st.memory.total_bytes / 2**30:.1f} GiB exceeds its "
            f"{used[s].device.name}'s {mem[s] / 2**30:.1f} GiB"
            for s, st in enumerate(stages) if st.memory.total_bytes > mem[s]]
    warnings = tuple(w for w in est.warnings if not w.startswith("peak memory")) + tuple(over)
    per_pool = tuple(sum(timing.stage_f[s] + timing.stage_b[s]
                         for s in range(config.pp) if pool_of_stage[s] == i)
                     for i in range(len(cluster.pools)))
    est = replace(est, device_memory_bytes=min(mem), warnings=warnings)
    if chunk_pool is None:
        est = replace(est, mfu=_mfu(est, cluster, config, pool_of_stage))
    return est, per_pool


def _mfu(est: Estimate, cluster: Any, config: ParallelConfig, pool_of_unit: Sequence[int]
         ) -> float:
    """Model FLOPs per second over the peak of every rank's own device."""
    per_unit = config.world_size // len(pool_of_unit)
    peak = sum(cluster.pools[p].device.peak_flops_for(config.precision) * per_unit
               for p in pool_of_unit)
    return est.model_flops_per_step / (est.step_time_s * peak) if est.step_time_s > 0 else 0.0


__all__ = ["HeteroEstimate", "REPLICAS", "STAGES", "estimate_hetero", "placement", "shares_arg"]
