"""Objectives on heterogeneous clusters (pools): which of the pools' devices to use, and the
plan that is fastest, cheapest or uses the least energy, with the Pareto front over the three.

The candidates (:func:`subsets`), each planned for step time:

- **one pool alone**: every device count the homogeneous search tries on it
  (``objectives.device_counts``: powers of two inside one node, then whole nodes), each planned
  by the homogeneous search (``plan``) on that pool's node type;
- **several pools together**, each whole: the heterogeneous search (``plan_hetero``: work in
  proportion to speed). Every combination of two or more pools while there are at most
  ``MAX_COMBINED_POOLS`` pools, else only all of them; a combination over ``max_gpus`` is left
  out (fewer nodes of a pool beside another pool are not searched).

Each is scored as ``objectives.score`` scores a device count, with each device at its own
pool's figures (``cluster/economics.py``: a pool's list price and TDP, or its cluster file's
``economics:``; the plan's overrides, ``--usd-per-gpu-hour`` and ``--tdp-watt``, apply to every
pool):

- run time: ``tokens / tokens_per_s`` (one step without tokens);
- cost: the sum over pools of its GPUs used x its price per GPU-hour x run time;
- energy: ``estimate/energy.hetero_step_energy`` (each stage or replica at its own device's
  power, busy by what it does) x the number of steps.

As on one device type, per candidate the fastest plan is kept (on the same devices a slower one
costs more). Deadline and budget exclude points; the winner under the objective is the result:
a ``Plan`` for one pool's devices (runnable as it is) or a ``HeteroPlan`` over several pools.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.cluster.cluster import Cluster
from autoplan.cluster.economics import economics
from autoplan.errors import AutoplanError, ConfigError
from autoplan.estimate.energy import hetero_step_energy
from autoplan.graph.trace import as_graph
from autoplan.planner import objectives
from autoplan.planner.hetero import HeteroPlan, plan_hetero
from autoplan.planner.objectives import Point
from autoplan.planner.objectives_report import section
from autoplan.planner.options import SearchOptions
from autoplan.planner.planfile_check import OBJECTIVES_SCHEMA
from autoplan.planner.search import plan
from autoplan.sharding.doc_work import packed_work

MAX_COMBINED_POOLS = 4       # up to 11 combinations of pools; beyond, all pools only
OBJECTIVE_KEYS = ("objective", "max_gpus", "tokens", "deadline_days", "budget_usd",
                   "economics")


@dataclass(frozen=True, kw_only=True)
class Subset:
    """Devices a candidate uses: a label (``dgx-h100:4``, ``dgx-h100/4`` for 4 GPUs of one
    node, ``dgx-a100-80gb:4+dgx-h100:4``), the cluster they form and the pools they come from."""

    label: str
    cluster: Any
    pools: tuple[int, ...]

    @property
    def gpus(self) -> int:
        return self.cluster.world_size


@dataclass(frozen=True)
class PoolsPlan:
    """The objectives search on pools: the winner (``best.plan``: a ``Plan`` on one pool's
    devices, its ``objectives`` set, or a ``HeteroPlan`` over several pools), every point
    scored, and the ``objectives`` section (``objectives_report.section``)."""

    best: Point
    points: tuple[Point, ...]
    objectives: dict[str, Any]

    @property
    def hetero(self) -> HeteroPlan | None:
        return self.best.plan if isinstance(self.best.plan, HeteroPlan) else None


def wanted(options: dict[str, Any]) -> bool:
    """Whether ``plan_hetero``-style keyword ``options`` ask for the objectives search."""
    return objectives.wanted(objective_options(options))


def objective_options(options: dict[str, Any]) -> SearchOptions:
    """The objectives fields of ``options`` (the rest left at their defaults), checked."""
    opts = SearchOptions(**{k: options[k] for k in OBJECTIVE_KEYS if options.get(k) is not None})
    objectives.check_request(opts)
    return opts


def subsets(cluster: Any, max_gpus: int | None) -> list[Subset]:
    """The candidates of the module docstring, single pools first (pool order, count
    ascending), then combinations of pools (fewer pools first)."""
    out = []
    per_node = cluster.devices_per_node
    names = [p.cluster.name for p in cluster.pools]
    # pools of one name (the same preset with other NICs) are told apart by their index
    named = [n if names.count(n) == 1 else f"pool{i}={n}" for i, n in enumerate(names)]
    for i, pool in enumerate(cluster.pools):
        c = pool.cluster
        for n in objectives.device_counts(c, max_gpus):
            label = (f"{named[i]}:{n // per_node}" if n % per_node == 0
                     else f"{named[i]}/{n}")
            out.append(Subset(label=label, cluster=objectives.sub_cluster(c, n), pools=(i,)))
    k = len(cluster.pools)
    sizes = range(2, k + 1) if k <= MAX_COMBINED_POOLS else (k,)
    for size in sizes:
        for combo in itertools.combinations(range(k), size):
            members = [cluster.pools[i].cluster for i in combo]
            if max_gpus is not None and sum(m.world_size for m in members) > max_gpus:
                continue
            label = "+".join(f"{named[i]}:{cluster.pools[i].cluster.num_nodes}"
                             for i in combo)
            whole = (cluster if size == k else
                     Cluster.heterogeneous(members, name=label))
            out.append(Subset(label=label, cluster=whole, pools=combo))
    return out


def score_hetero(result: HeteroPlan, subset: Subset, econs: Sequence[Any], opts: Any) -> Point:
    """A heterogeneous plan over ``subset``'s pools scored: each pool's devices at its price
    and power (``econs[i]``: the whole cluster's pool ``i``)."""
    het = result.best.balanced
    est = het.estimate
    step_s = est.step_time_s
    run_s = objectives.run_seconds(step_s, est.tokens_per_s, opts)
    mine = [econs[i] for i in subset.pools]   # the subset's own pools, in its order
    ranks = [p.num_ranks for p in subset.cluster.pools]
    prices = [e.usd_per_gpu_hour for e in mine]
    cost = (None if any(p is None for p in prices)
            else sum(n * p for n, p in zip(ranks, prices)) * run_s / 3600.0)
    energy = None
    if all(e.tdp_watt is not None for e in mine):
        energy = objectives.scaled(hetero_step_energy(het, mine),
                                    run_s / step_s if step_s > 0 else 0.0)
    config = result.best.config.short() + f" on pools ({het.placement})"
    return objectives.bounded(Point(
        gpus=subset.gpus, plan=result, step_time_s=step_s, tokens_per_s=est.tokens_per_s,
        run_time_s=run_s, cost_usd=cost, energy=energy, devices=subset.label,
        config=config), opts)


def plan_pools(model: Any, cluster: Any, *, global_batch_size: int,
               plan_fn: Callable[..., Any] = plan, example_inputs: Any = None,
               loss_fn: Any = None, targets: Any = None, profile: Any = "auto",
               progress: Callable[[str], None] | None = None, **options: Any) -> PoolsPlan:
    """The search of the module docstring. ``options``: ``plan()``'s (``objective``,
    ``max_gpus``, ``tokens``, ``deadline_days``, ``budget_usd``, ``economics`` for the
    objectives; the rest, ``seq_lengths`` and ``force`` included, for every candidate's
    step-time search)."""
    if not getattr(cluster, "pools", ()):
        raise ConfigError("plan_pools() plans heterogeneous clusters (pools, e.g. "
                          "dgx-a100-80gb:4+dgx-h100:4); use autoplan.plan(..., objective=...) "
                          "for this one")
    say = progress or (lambda _msg: None)
    opts = objective_options(options)
    inner = {k: v for k, v in options.items() if k not in OBJECTIVE_KEYS}
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets,
                     who="plan_pools()", error=ConfigError)
    if inner.get("seq_lengths") is not None:     # read once, priced by every candidate
        inner["seq_lengths"] = packed_work(graph, inner["seq_lengths"])
    econs = [economics(p.cluster, opts.economics) for p in cluster.pools]
    points, skipped = [], []
    for sub in subsets(cluster, opts.max_gpus):
        try:
            if len(sub.pools) == 1:
                got = plan_fn(graph, sub.cluster, global_batch_size=global_batch_size,
                              profile=profile, **inner)
                point = replace(objectives.score(got, sub.gpus, econs[sub.pools[0]], opts),
                                devices=sub.label)
            else:
                got = plan_hetero(graph, sub.cluster, global_batch_size=global_batch_size,
                                  plan_fn=plan_fn, profile=profile, **inner)
                point = score_hetero(got, sub, econs, opts)
        except AutoplanError as e:       # nothing fits on so few devices, or no mesh
            skipped.append({"gpus": sub.gpus, "why": f"{sub.label}: "
                            + str(e).splitlines()[0][:300]})
            say(f"{sub.label}: no plan ({skipped[-1]['why'][:120]})")
            continue
        points.append(point)
        say(f"{sub.label} ({sub.gpus} devices): step {point.step_time_s * 1e3:,.1f} ms "
            f"({point.config_text})")
    if not points:
        raise ConfigError(f"no device subset of {cluster.name} gives a plan: "
                          f"{skipped[-1]['why'] if skipped else 'none searched'}")
    points = objectives.pareto(points)
    best = objectives.choose(points, opts, econs)
    won = objectives.winners(points)
    sec = section(best, points, skipped, opts, econs, won)
    if not isinstance(best.plan, HeteroPlan):     # one pool's plan: the file says how chosen
        best = replace(best, plan=replace(best.plan, objectives=sec,
                                          schema_version=OBJECTIVES_SCHEMA))
    return PoolsPlan(best=best, points=tuple(points), objectives=sec)


__all__ = ["MAX_COMBINED_POOLS", "PoolsPlan", "Subset", "plan_pools", "score_hetero",
           "subsets", "wanted"]
