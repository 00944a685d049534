"""``replan``: a plan for the devices a job has now, warm-started from the plan it ran on.

When the world of a run changes (a node died and torchrun's elastic rendezvous re-formed it
smaller, or the run is resumed on more or fewer devices), the job needs a plan for the new
world that trains the same thing: the same model, the same numerics and, where it can, the same
global batch. In order, the first that gives a plan that fits:

1. **warm start**: a small neighbourhood of the last plan's mesh, searched in one ``plan``
   call restricted to its meshes (``SearchOptions.meshes``) with the numerics pinned: tp and
   cp each halved, kept or doubled (tp inside a node), and per (tp, cp) the pipeline degrees
   nearest the last one whose dp divides the new world and the global batch (``neighbourhood``);
   the search re-solves the rest (expert parallelism, schedule, micro-batch size, ZeRO stage,
   recomputation, offload, compilation). Where the last layout's dp (tp, cp, pp kept) does not
   divide the batch, that layout with uneven data-parallel shares (``dp_shares``: the
   batch's micro-batches spread as evenly as they go, the fullest replica pricing the step)
   is a candidate too. The fastest that fits wins.
2. **full search**, the global batch kept: any mesh of the new world whose dp divides it.
3. **nearest batch**: no mesh of the new world divides the global batch (or none that does
   fits): the nearest multiple of the warm-start dp (of the world when the last layout does
   not divide it), ties to the larger, first with the last layout (its family kept), then by a
   full search. Stated, never silent.

``batch="nearest"``, where the last layout's dp does not divide the batch, keeps that layout
(``warm_force``: its tp, cp, pp and ep degrees, pipeline schedule, sequence parallelism and cp
layout; dp derived) at the nearest batch it splits, before anything else (order 3 warm, 1, 2,
3 full): the run then trains on another global batch from there on. Keeping the batch (the default) may
need another layout (Llama-3-8B's batch of 16 on 56 GPUs: a pipeline of 7, since every dp of
56 devices without one is a multiple of 7), which the neighbourhood finds without a full
search (``benchmarks/replan_time.py``).

Every step keeps the numerics of the last plan (precision, 16-bit weight policy, fp8, gradient
compression, optimizer-state format): a re-plan changes the layout, not what is computed. The
planner is deterministic, so every rank that calls ``replan`` with the same graph, cluster and
last config gets the same plan (the runtime checks that they agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoplan.errors import ConfigError, PlanError
from autoplan.estimate.partition import main_block
from autoplan.graph.oprules import uses_batch_statistics
from autoplan.planner.candidates import NoFeasiblePlanError
from autoplan.planner.planfile import Plan
from autoplan.planner.search import plan as make_plan
from autoplan.sharding.parallel_config import ParallelConfig

# what a re-plan never changes: the numerics of the run
NUMERICS = ("mixed_precision", "fp8", "grad_compression", "optimizer_state")
# the layout family a warm start keeps (dp and what depends on it are re-solved)
FAMILY = ("tp", "cp", "pp", "ep", "sequence_parallel", "cp_layout")
PIPELINE_FAMILY = ("schedule", "virtual_stages")
BATCH_POLICIES = ("keep", "nearest")


@dataclass(frozen=True, kw_only=True)
class Replan:
    """A plan for the new world and how it was found."""

    plan: Plan
    how: str                    # "warm start", "full search"
    requested_batch: int        # the run's global batch
    batch_note: str             # "" when the global batch is kept, else why and what instead

    @property
    def batch_kept(self) -> bool:
        return self.plan.training.global_batch_size == self.requested_batch


def warm_force(last: ParallelConfig, world: int) -> dict[str, Any] | None:
    """The ParallelConfig fields a warm start pins for ``world`` devices: the last plan's
    numerics and layout family, dp = world / (tp cp pp); None where that does not divide."""
    rest = last.tp * last.cp * last.pp
    if world % rest:
        return None
    dp = world // rest
    if last.ep > 1 and dp % last.ep:
        return None
    force = {k: getattr(last, k) for k in NUMERICS + FAMILY}
    if last.pp > 1:
        force.update({k: getattr(last, k) for k in PIPELINE_FAMILY})
    force["dp"] = dp
    return force


def nearest_batch(batch: int, multiple_of: int) -> int:
    """The multiple of ``multiple_of`` nearest ``batch`` (ties to the larger; at least one)."""
    below = batch // multiple_of * multiple_of
    above = below + multiple_of
    if below == 0 or above - batch <= batch - below:
        return above
    return below


def even_shares(total: int, dp: int) -> tuple[int, ...]:
    """``total`` micro-batches over ``dp`` replicas as evenly as they go, the fuller first."""
    q, r = divmod(total, dp)
    return (q + 1,) * r + (q,) * (dp - r)


def neighbourhood(last: ParallelConfig, world: int, global_batch_size: int, layers: int,
                  devices_per_node: int) -> tuple[tuple[int, int, int, int], ...]:
    """The meshes a warm start searches, as (pp, dp, cp, tp): tp and cp each halved, kept or
    doubled (tp inside a node); per (tp, cp), the pipeline degrees nearest the last one (the
    last itself or the nearest below, and the nearest above) among those whose dp divides the
    world and the global batch, with at most ``layers`` stages and at least as many
    micro-batches as stages (the search's rule: fewer is mostly bubble). Sorted."""
    out = set()
    for tp in sorted({last.tp // 2 or 1, last.tp, last.tp * 2}):
        if tp > devices_per_node:
            continue
        for cp in sorted({last.cp // 2 or 1, last.cp, last.cp * 2}):
            if world % (tp * cp):
                continue
            rest = world // (tp * cp)
            pps = [pp for pp in range(1, min(rest, layers) + 1)
                   if rest % pp == 0 and global_batch_size % (rest // pp) == 0
                   and (pp == 1 or global_batch_size // (rest // pp) >= pp)]
            below = [pp for pp in pps if pp <= last.pp]
            above = [pp for pp in pps if pp > last.pp]
            for pp in below[-1:] + above[:1]:
                out.add((pp, rest // pp, cp, tp))
    return tuple(sorted(out))


def replan(graph: Any, cluster: Any, *, last: ParallelConfig, global_batch_size: int,
           batch: str = "keep", profile: Any = None, name: str | None = None,
           progress: Callable[[str], None] | None = None) -> Replan:
    """A plan of ``graph`` on ``cluster`` warm-started from ``last`` (the config the run
    trained under), for the run's ``global_batch_size``; ``batch``: "keep" the global batch
    wherever any plan can, or take the "nearest" the warm start can before a full search (see
    the module docstring)."""
    if batch not in BATCH_POLICIES:
        raise ConfigError(f"replan(): batch must be one of {BATCH_POLICIES}, got {batch!r}")
    world = cluster.world_size
    warm = warm_force(last, world)
    numerics = {k: getattr(last, k) for k in NUMERICS}

    def attempt(force: dict[str, Any], size: int, **options: Any) -> Plan | None:
        # a warm start pins the layout: no baseline of another layout could be chosen
        try:
            return make_plan(graph, cluster, global_batch_size=size, precision=last.precision,
                             optimizer=last.optimizer, profile=profile, name=name,
                             progress=progress, force=force,
                             baselines="dp" not in force and "meshes" not in options,
                             **options)
        except (NoFeasiblePlanError, ConfigError):
            return None

    gbs = global_batch_size
    step = warm["dp"] if warm is not None else world
    near = nearest_batch(gbs, step)
    if batch == "nearest" and warm is not None and near != gbs:
        found = attempt(warm, near)
        if found is not None:
            return Replan(plan=found, how="warm start", requested_batch=gbs, batch_note=(
                f"the global batch {gbs} is no multiple of the warm start's dp {step} on "
                f"{world} devices; using {near}, the nearest (--elastic-batch nearest)"))
    found = warm_neighbourhood(graph, cluster, last, gbs, warm, numerics, attempt)
    if found is not None:
        return Replan(plan=found, how="warm start", requested_batch=gbs, batch_note="")
    found = attempt(numerics, gbs)
    if found is not None:
        return Replan(plan=found, how="full search", requested_batch=gbs, batch_note="")
    note = (f"the global batch {gbs} cannot be kept on {world} devices (no plan whose data-"
            f"parallel degree divides it fits); using {near}, the nearest multiple of dp "
            f"{step}")
    if warm is not None and batch == "keep":
        found = attempt(warm, near)
        if found is not None:
            return Replan(plan=found, how="warm start", requested_batch=gbs, batch_note=note)
    found = attempt(numerics, near)
    if found is not None:
        return Replan(plan=found, how="full search", requested_batch=gbs, batch_note=note)
    raise PlanError(f"no plan of this model fits on {world} devices, for the global batch "
                    f"{gbs} or {near}: resume on more devices")


def warm_neighbourhood(graph: Any, cluster: Any, last: ParallelConfig, gbs: int,
                       warm: dict[str, Any] | None, numerics: dict[str, Any],
                       attempt: Callable[..., Plan | None]) -> Plan | None:
    """The warm start keeping the global batch: the fastest fitting plan of the neighbourhood
    (``neighbourhood``: one search over its meshes, tp and the numerics pinned, the rest
    re-solved) and, where the last layout's dp does not divide the batch, of that layout with
    uneven data-parallel shares (``dp_shares``: the batch's micro-batches spread as evenly as
    they go; the step is the fullest replica's). None: nothing there fits."""
    block = main_block(graph)
    meshes = neighbourhood(last, cluster.world_size, gbs, len(block.instances) if block else 1,
                           cluster.devices_per_node)
    found = [p for p in [attempt(numerics, gbs, meshes=meshes) if meshes else None]
             if p is not None]
    # uneven shares cannot run a model whose batch statistics are shared over dp in every
    # micro-batch (runtime/build.py refuses them)
    statistics = graph.meta.get("train", True) is not False and any(
        uses_batch_statistics(op) for op in graph.ops)
    if warm is not None and gbs % warm["dp"] and not statistics:
        dp = warm["dp"]
        for mbs in (m for m in (1, 2, 4, 8) if gbs % m == 0 and gbs // m >= dp):
            uneven = attempt({**warm, "micro_batch_size": mbs,
                              "dp_shares": even_shares(gbs // mbs, dp)}, gbs)
            if uneven is not None:
                found.append(uneven)
                break           # a larger micro-batch only evens the shares less
    # (plan() returns only plans that fit)
    return min(found, key=lambda p: p.predicted["step_time_s"]) if found else None
