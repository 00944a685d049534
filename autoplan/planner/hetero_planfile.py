"""A heterogeneous plan (``planner/hetero.py``) written as a runnable plan file.

The search on pools answers with a config (uneven ``chunk_layers`` for stages on pools, uneven
``dp_shares`` for replicas on pools) and its estimate on the pools; ``autoplan run``,
``inspect`` and ``compile`` need a :class:`~autoplan.planner.planfile.Plan`. This module makes
one, in order:

1. the plan's sharding (per-op strategies, parameter placements, recomputation per layer,
   stages and their ranks): the homogeneous search on the cluster as its slowest GPU
   (``Cluster.slowest()``, the same node count and devices per node, so the same mesh and
   ranks) with every field of the chosen config forced. The balanced config itself is what
   the runtime runs: ``chunk_layers`` split the stages, ``dp_shares`` the micro-batches.
2. its cluster: the heterogeneous one, whose hardware lists the pools (``cluster.hardware.
   pools``), so that the plan matches only the same pools and is refused elsewhere saying what
   differs (``cluster/hardware.py``);
3. its prediction: the estimate on the pools (``estimate/hetero.py``); its alternatives: the
   other candidates balanced on the pools;
4. the ``hetero`` section (``planner/hetero_check.py``): which pool each stage or replica runs
   on, its layers or micro-batches, its peak memory against its own device's, the per-pool
   times, the even split's step, and the cluster-as-its-slowest-GPU plan's figures (the gain
   ``inspect`` reports).

Pure and deterministic, as the search.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from autoplan.errors import ConfigError
from autoplan.estimate.estimator import estimate
from autoplan.estimate.hetero import STAGES
from autoplan.planner import mesh as meshes
from autoplan.planner.hetero_check import HETERO_SCHEMA
from autoplan.planner.planfile import Alternative, ClusterInfo, Plan, predicted_from_estimate
from autoplan.planner.search import plan
from autoplan.sharding.parallel_config import ParallelConfig

# plan() options that would narrow the forced search below the chosen config
# (progress: the forced search that shapes the file is not the search the user watched)
_NOT_PASSED = ("force", "top_k", "max_tp", "max_pp", "meshes", "progress")


def hetero_plan(result: Any, graph: Any, cluster: Any, *, global_batch_size: int,
                plan_fn: Callable[..., Any] = plan, profile: Any = "auto",
                **plan_options: Any) -> Plan:
    """The runnable Plan of ``result`` (``plan_hetero``'s HeteroPlan for ``graph`` on the
    heterogeneous ``cluster``); ``plan_options``: those the search was given (precision,
    optimizer, name...), passed to ``plan_fn`` for the sharding of step 1."""
    cfg = result.best.config
    force = {f.name: getattr(cfg, f.name) for f in fields(ParallelConfig)
             if getattr(cfg, f.name) is not None}
    options = {k: v for k, v in plan_options.items() if k not in _NOT_PASSED}
    shaped = plan_fn(graph, cluster.slowest(), global_batch_size=global_batch_size,
                     profile=profile, force=force, top_k=0, **options)
    if shaped.config != cfg:
        raise ConfigError(f"the sharding search on {cluster.slowest().name} chose "
                          f"{shaped.config.short()} for the heterogeneous plan's "
                          f"{cfg.short()}: report this; plan with --force of that config's "
                          "fields meanwhile")
    est = result.best.balanced.estimate
    world = cfg.world_size
    mesh = replace(shaped.mesh, rank_to_device=meshes.rank_to_device(cluster, world),
                   tp_domain=meshes.tp_domain(cluster, cfg.tp_group()))
    others = tuple(
        Alternative(config=c.config, step_time_s=c.balanced.step_time_s,
                    peak_memory_bytes=c.balanced.estimate.peak_memory_bytes,
                    fits=c.balanced.estimate.fits,
                    why_lost=_why_lost(c.balanced.step_time_s, est.step_time_s))
        for c in result.candidates[1:1 + plan_options.get("top_k", 5)])
    section = hetero_section(result, graph, cluster, global_batch_size=global_batch_size,
                             profile=profile, stages=shaped.stages)
    return replace(shaped, cluster=ClusterInfo.of(cluster), mesh=mesh,
                   predicted=predicted_from_estimate(est), alternatives=others,
                   hetero=section, schema_version=HETERO_SCHEMA)


def _why_lost(step_s: float, best_s: float) -> str:
    return f"{(step_s / best_s - 1) * 100:.1f}% slower on the pools, balanced as this plan"


def hetero_section(result: Any, graph: Any, cluster: Any, *, global_batch_size: int,
                   profile: Any, stages: tuple[Mapping[str, Any], ...]) -> dict[str, Any]:
    """The plan file's ``hetero`` section (``planner/hetero_check.py``) of ``result``."""
    het = result.best.balanced
    base = result.baseline
    pools = [{"name": p.cluster.name, "device": p.device.name, "num_nodes": p.cluster.num_nodes,
              "first_rank": p.first_rank, "num_ranks": p.num_ranks,
              "device_memory_bytes": float(p.device.memory_bytes),
              "peak_flops": float(p.device.peak_flops_for(result.best.config.precision))}
             for p in cluster.pools]
    if het.placement == STAGES:
        units = _stage_units(het, cluster, stages)
    else:
        units = _replica_units(het, graph, cluster, global_batch_size, profile)
    return {"placement": het.placement, "pools": pools, "units": units,
            "pool_step_s": list(het.pool_step_s), "even_step_s": result.best.even_step_s,
            "slowest_gpu": {"device": base.cluster.device, "config": base.config.to_dict(),
                            "step_time_s": float(base.predicted["step_time_s"]),
                            "peak_memory_bytes": float(base.predicted["peak_memory_bytes"]),
                            "fits": bool(base.predicted["fits"])}}


def _stage_units(het: Any, cluster: Any, stages: tuple[Mapping[str, Any], ...]
                 ) -> list[dict[str, Any]]:
    """Each pipeline stage: its pool, ranks, layers and peak memory against its device's."""
    out = []
    for s, pool in enumerate(het.pool_of_unit):
        peak = het.estimate.stages[s].memory.total_bytes
        have = float(cluster.pools[pool].device.memory_bytes)
        out.append({"pool": pool, "ranks": list(stages[s]["ranks"]),
                    "layers": len(stages[s]["layers"]), "peak_memory_bytes": peak,
                    "device_memory_bytes": have, "fits": peak <= have})
    return out


def _replica_units(het: Any, graph: Any, cluster: Any, global_batch_size: int,
                   profile: Any) -> list[dict[str, Any]]:
    """Each data-parallel replica: its pool, ranks, micro-batches and peak memory, priced as
    ``estimate_hetero`` prices it (its pool's node type everywhere, every replica running its
    count), which holds only the largest peak."""
    cfg = het.estimate.config
    size = cfg.cp * cfg.tp
    shares = het.dp_shares or (cfg.microbatches(global_batch_size),) * cfg.dp
    peaks: dict[tuple[int, int], float] = {}
    out = []
    for d, (pool, share) in enumerate(zip(het.pool_of_unit, shares)):
        if (pool, share) not in peaks:
            run = cfg if het.dp_shares is None else replace(cfg, dp_shares=(share,) * cfg.dp)
            batch = global_batch_size if het.dp_shares is None else (
                cfg.micro_batch_size * share * cfg.dp)
            peaks[pool, share] = estimate(graph, cluster.pool_view(pool), config=run,
                                          global_batch_size=batch,
                                          profile=profile).peak_memory_bytes
        have = float(cluster.pools[pool].device.memory_bytes)
        out.append({"pool": pool, "ranks": list(range(d * size, (d + 1) * size)),
                    "microbatches": share, "peak_memory_bytes": peaks[pool, share],
                    "device_memory_bytes": have, "fits": peaks[pool, share] <= have})
    return out


__all__ = ["hetero_plan", "hetero_section"]
