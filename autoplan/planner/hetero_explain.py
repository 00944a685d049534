"""The text of a heterogeneous plan's ``hetero`` section (``planner/hetero_check.py``): which
pool each pipeline stage or data-parallel replica runs on, its layers or micro-batches, its
peak memory against its own device's, and the predicted step against the cluster as its slowest
GPU. ``inspect`` prints it (``explain.py``); ``autoplan run`` prints where the stages or
replicas run when the job starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.planner.text_format import fmt_bytes, fmt_ranges, fmt_s
from autoplan.sharding.parallel_config import ParallelConfig


def hetero_text(plan: Any) -> str:
    """The section as ``inspect`` shows it ("" for a plan on one node type)."""
    h = plan.hetero
    if h is None:
        return ""
    stages = h["placement"] == "stages"
    pools = h["pools"]
    lines = [f"heterogeneous cluster: {len(pools)} pools, ranks numbered pool after pool; "
             + ("each pipeline stage on one pool, layers in proportion to its speed" if stages
                else "each data-parallel replica on one pool, micro-batches in proportion to "
                     "its speed")]
    for i, p in enumerate(pools):
        lines.append(f"  pool {i}  {p['name']:<16} ranks "
                     f"{fmt_ranges(range(p['first_rank'], p['first_rank'] + p['num_ranks'])):<9}"
                     f" {p['num_nodes']} node(s) of {p['device']}, "
                     f"{fmt_bytes(p['device_memory_bytes'])}, {_rate(p['peak_flops'])} peak; "
                     + ("stages' forward+backward " if stages else "its replicas' step ")
                     + fmt_s(h["pool_step_s"][i]))
    lines += ["  " + x for x in units_lines(plan)]
    base = h["slowest_gpu"]
    step = float(plan.predicted["step_time_s"])
    lines.append(f"  predicted step {fmt_s(step)} on the pools (the same config with its work "
                 f"split evenly: {fmt_s(h['even_step_s'])})")
    lines.append(f"  the cluster as its slowest GPU ({plan.cluster.world_size} x "
                 f"{base['device']}): {_short(base['config'])}, {fmt_s(base['step_time_s'])}"
                 + ("" if base["fits"] else " (does not fit)")
                 + f"; this plan's gain {base['step_time_s'] / step:.3f}x")
    return "\n".join(lines)


def units_lines(plan: Any) -> list[str]:
    """Each stage or replica (runs of alike ones together): its ranks, pool, work, memory."""
    stages = plan.hetero["placement"] == "stages"
    return [_unit_line(group, stages)
            for group in _groups(plan.hetero["units"], "layers" if stages else "microbatches")]


def _groups(units: Any, work: str) -> list[list[tuple[int, Mapping[str, Any]]]]:
    """Consecutive units of one pool and the same work and memory, together (64 replicas read
    as a few lines)."""
    out: list[list[tuple[int, Mapping[str, Any]]]] = []
    for j, u in enumerate(units):
        key = (u["pool"], u[work], u["peak_memory_bytes"], u["fits"])
        if out and (out[-1][0][1]["pool"], out[-1][0][1][work], out[-1][0][1][
                "peak_memory_bytes"], out[-1][0][1]["fits"]) == key:
            out[-1].append((j, u))
        else:
            out.append([(j, u)])
    return out


def _unit_line(group: list[tuple[int, Mapping[str, Any]]], stages: bool) -> str:
    first = group[0][1]
    index = fmt_ranges(j for j, _ in group)
    ranks = fmt_ranges(r for _, u in group for r in u["ranks"])
    name = ("stage" if stages else "dp replica") + ("s" if len(group) > 1 else "")
    work = (f"{first['layers']} layer(s)" if stages
            else f"{first['microbatches']} micro-batch(es) a step")
    return (f"{name} {index} (ranks {ranks}) on pool {first['pool']}: {work}"
            + (" each" if len(group) > 1 else "")
            + f", peak {fmt_bytes(first['peak_memory_bytes'])} of "
            f"{fmt_bytes(first['device_memory_bytes'])}"
            + ("" if first["fits"] else "  DOES NOT FIT"))


def _rate(flops: float) -> str:
    return f"{flops / 1e12:,.0f} TFLOP/s" if flops >= 1e13 else f"{flops / 1e9:,.3g} GFLOP/s"


def _short(config: Mapping[str, Any]) -> str:
    return ParallelConfig.from_dict(dict(config)).short()


__all__ = ["hetero_text", "units_lines"]
