"""The pipeline schedule's share of a step (``estimate`` step 3): which chunks each rank runs,
their forward and backward seconds per micro-batch, and the schedule simulated
(``pipeline_sim``) three ways: with free sends (the fill-and-drain bubble), with the sends
(their waits) and with the data-parallel collectives on their own stream (what they expose);
or, for the planner's screening, the closed form of the bubble.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.estimate.cost_inputs import CostInputs, RangeCost
from autoplan.estimate.dp_terms import dp_collectives, fp32_gathered
from autoplan.estimate.overlap import overlap_interference
from autoplan.graph.analysis import reads_tables
from autoplan.estimate.pipeline_sim import W_FRACTION, PipelineTotals, pipeline_totals
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.sharding.parallel_config import SPLIT_BACKWARD, ParallelConfig


@dataclass(frozen=True)
class PipelineTiming:
    """The pipeline schedule's share of a step: which chunks each stage runs, their forward
    and backward seconds per micro-batch, the bottleneck stage, the fill-and-drain bubble and
    the waits on point-to-point sends; ``sim`` (None: closed form, or no pipeline) is the
    simulation, ``simulated_comm`` the (gradient syncs, gathers) it exposed."""

    stage_chunks: tuple[tuple[int, ...], ...]
    stage_f: tuple[float, ...]
    stage_b: tuple[float, ...]
    bottleneck: int
    bubble_s: float = 0.0
    p2p_s: float = 0.0
    sim: PipelineTotals | None = None
    simulated_comm: tuple[float, float] | None = None


def pipeline_timing(ci: CostInputs, costs: Sequence[RangeCost], m: int,
                    state_config: ParallelConfig, *, simulate: bool) -> PipelineTiming:
    """Stage times and the schedule's bubble and send waits: simulated (``pipeline_sim``), or
    the closed form when ``simulate`` is off (the planner's screening). ``state_config``: the
    config as its model state's ranks see it (``ParallelConfig.grad_view``)."""
    config, cluster = ci.config, ci.cluster
    p = config.pp
    stage_chunks = tuple(tuple(config.rank_chunks(s)) for s in range(p))
    stage_f = tuple(sum(costs[c].fwd_total_s for c in cs) for cs in stage_chunks)
    stage_b = tuple(sum(costs[c].bwd_total_s for c in cs) for cs in stage_chunks)
    bottleneck = max(range(p), key=lambda s: stage_f[s] + stage_b[s])
    timing = PipelineTiming(stage_chunks=stage_chunks, stage_f=stage_f, stage_b=stage_b,
                            bottleneck=bottleneck)
    if p == 1:
        return timing
    if not simulate:
        return replace(timing, bubble_s=_closed_form_bubble_s(config, stage_f, stage_b,
                                                              bottleneck),
                       p2p_s=2.0 * sum(_sends(config, cluster, costs)))
    return _simulated_timing(ci, costs, m, timing, state_config)


def _closed_form_bubble_s(config: ParallelConfig, stage_f: Sequence[float],
                          stage_b: Sequence[float], bottleneck: int) -> float:
    p, v = config.pp, config.virtual_stages
    if config.schedule in SPLIT_BACKWARD:   # W's fill all but F + B - W of a stage time
        t_mb = stage_f[bottleneck] + stage_b[bottleneck] * max(0.0, 1 - 2 * W_FRACTION)
        return (p - 1) / v * t_mb
    # fill and drain: one micro-batch through every other rank, forward and backward
    # ((p - 1) bottleneck stage-times on even stages; on uneven ones, what the
    # simulator finds where the bottleneck is the last rank, and above it elsewhere)
    return sum(stage_f[r] + stage_b[r] for r in range(p) if r != bottleneck) / v


def _simulated_timing(ci: CostInputs, costs: Sequence[RangeCost], m: int,
                      timing: PipelineTiming, state_config: ParallelConfig) -> PipelineTiming:
    """The schedule simulated three ways: with free sends (the bubble), with the sends (their
    waits) and with the data-parallel collectives on their own stream (what they expose)."""
    config, cluster = ci.config, ci.cluster
    fwd = [c.fwd_total_s for c in costs]
    bwd = [c.bwd_total_s for c in costs]
    sends = _sends(config, cluster, costs)
    kw = dict(schedule=config.schedule, p=config.pp, v=config.virtual_stages, m=m, fwd_s=fwd,
              bwd_s=bwd, activation_bytes=[c.activation_bytes for c in costs])
    no_collectives = pipeline_totals(send_s=sends, **kw)
    free_sends = pipeline_totals(**kw).makespan_s
    sync_s, fsdp_s = _chunk_collectives(state_config, cluster, costs, m,
                                        frozenset(ci.compute.fp8_gathered.values()),
                                        reads_tables(ci.graph))
    sim = no_collectives
    if any(sync_s) or any(map(any, fsdp_s)):
        sim = pipeline_totals(send_s=sends, sync_s=sync_s, fsdp_s=fsdp_s,
                              layers=[max(1, c.num_layers) for c in costs], **kw)
    bottleneck = max(range(config.pp), key=lambda r: sim.busy_s[r])
    return replace(
        timing, bottleneck=bottleneck,
        bubble_s=max(0.0, free_sends - sim.busy_s[bottleneck]),      # fill and drain
        p2p_s=max(0.0, no_collectives.makespan_s - free_sends),      # waiting on the sends
        sim=sim, simulated_comm=_exposed_collectives(sim, no_collectives.makespan_s,
                                                     overlap_interference(cluster)))


def _sends(config: ParallelConfig, cluster: Any, costs: Sequence[RangeCost]) -> list[float]:
    """Per chunk boundary, the point-to-point time of one micro-batch's activations (free
    between two chunks on one rank: the V schedules' turn)."""
    out = []
    for c in range(len(costs) - 1):
        a, b = config.chunk_rank(c), config.chunk_rank(c + 1)
        out.append(0.0 if a == b else cluster.p2p_time_s(
            costs[c].boundary_bytes, config.dims.rank_at({MeshAxis.PP: a}),
            config.dims.rank_at({MeshAxis.PP: b})))
    return out


def _chunk_collectives(config: ParallelConfig, cluster: Any, costs: Sequence[RangeCost],
                       m: int, fp8_gathered: frozenset[str] = frozenset(), tables: bool = True
                       ) -> tuple[list[float], list[tuple[float, float, float]]]:
    """Per chunk, for the simulator: the per-step gradient sync of the dp group and, under
    FSDP (ZeRO-3), the per-micro-batch (gather before forward, gather before backward,
    reduce-scatter after), as torch's schedule runs them (``fsdp_step_counts``);
    ``fp8_gathered``: the FQNs of the weights FSDP gathers in fp8."""
    sync, fsdp = [], []
    for c, cost in enumerate(costs):
        layers = max(1, cost.num_layers)
        grad_sync, ag, rs = dp_collectives(config, cluster, cost.params, layers,
                                            config.chunk_rank(c), cost.expert_params,
                                            fp8_params=cost.elements_of(
                                                lambda f: f in fp8_gathered),
                                            fp32_params=fp32_gathered(config, cost.params,
                                                                      cost.layer_params, tables))
        fwd_gathers, bwd_gathers = fsdp_step_counts(m)
        # the tp step all-reduce is priced exposed, per stage; FSDP's reduce-scatter once a
        # step, after the last backward
        sync.append(grad_sync + layers * rs)
        fsdp.append((layers * ag * fwd_gathers / m, layers * ag * bwd_gathers / m, 0.0))
    return sync, fsdp


def fsdp_step_counts(m: int) -> tuple[int, int]:
    """(forward gathers, backward gathers) of a ZeRO-3 (FSDP2) chunk's weights in a pipelined
    step of ``m`` micro-batches: torch's schedule runs every backward without gradient sync
    or reshard (``PipelineStage.backward_maybe_with_nosync``) and reduce-scatters once after
    the last (``perform_reduce_grad``), so each forward gathers (and reshards after), but only
    the first backward does; counted on gloo (``tests/test_fsdp_step_pricing.py``: m + 1
    gathers, one reduce-scatter per unit a step)."""
    return m, 1


def _exposed_collectives(sim: PipelineTotals, without_s: float, interference: float
                         ) -> tuple[float, float]:
    """(gradient syncs, gathers): what the simulated collectives added to the step, plus the
    interference of the overlapped rest, split by their time on the busiest stream."""
    if not any(sim.comm_busy_s):
        return 0.0, 0.0
    exposed = max(0.0, sim.makespan_s - without_s)
    busiest = max(range(len(sim.comm_busy_s)), key=lambda r: sim.comm_busy_s[r])
    total = sim.comm_busy_s[busiest]
    added = exposed + interference * max(0.0, total - exposed)
    share = sim.gather_s[busiest] / total if total > 0 else 0.0
    return added * (1 - share), added * share
