"""Objectives beyond step time: how many devices to use, and the plan that is fastest, cheapest
or uses the least energy, with the Pareto front over the three.

With ``objective`` "cost" or "energy", or any of ``max_gpus``, ``tokens``, ``deadline_days``,
``budget_usd`` (``SearchOptions``), ``plan`` searches every device count of
:func:`device_counts` (the first ``n`` devices of the cluster: whole nodes, and powers of two
inside one node), each with the step-time search, and scores each count's fastest plan:

- run time: ``tokens / tokens_per_s`` with ``tokens``, else one step;
- cost: ``gpus x usd_per_gpu_hour x run time`` (list prices, ``cluster/economics.py``);
- energy: the step's energy (``estimate/energy.py``: power x time by what each device does)
  x the number of steps.

At one device count, a slower plan takes longer on the same devices, so it costs more; it may
use less energy (more idle, less compute), which this search does not explore: per count it
keeps the fastest plan. Plans that miss the deadline or exceed the budget are marked and left
out of the choice; the winner under the objective becomes the plan (its cluster: the devices
it uses), and the plan file records every count's figures (``objectives``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.cluster.cluster import Cluster
from autoplan.cluster.economics import (Economics, check_overrides, economics, no_power,
                                        no_price)
from autoplan.cluster.node_part import first_devices
from autoplan.errors import AutoplanError, ConfigError
from autoplan.estimate.energy import StepEnergy, step_energy
from autoplan.planner.objectives_report import section

OBJECTIVES = ("time", "cost", "energy")
SECONDS_PER_DAY = 86_400.0
MAX_TOKENS = 10 ** 18
MAX_DEADLINE_DAYS = 36_500.0
MAX_BUDGET_USD = 1e15
# the options that start the device-count search (any one of them)
_COUNT_OPTIONS = ("max_gpus", "budget_usd", "tokens", "deadline_days")


def wanted(opts: Any) -> bool:
    """Whether ``opts`` asks for more than the fastest plan on the whole cluster."""
    return opts.objective != "time" or any(getattr(opts, k) is not None for k in _COUNT_OPTIONS)


def _positive(value: Any, name: str, top: float, integral: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (isinstance(value, int) or not integral) and math.isfinite(value)
          and 0 < value <= top)
    if not ok:
        raise ConfigError(f"plan(): {name} must be a positive {'whole number' if integral else 'number'}"
                          f" up to {top:g}, got {value!r:.60}")


def check_request(opts: Any) -> None:
    """The objective options, each on its own and together; ConfigError saying the fix."""
    if opts.objective not in OBJECTIVES:
        raise ConfigError(f"plan(): objective must be one of {', '.join(OBJECTIVES)}, got "
                          f"{opts.objective!r:.60}")
    if opts.max_gpus is not None:
        _positive(opts.max_gpus, "max_gpus", 1 << 24, integral=True)
    if opts.tokens is not None:
        _positive(opts.tokens, "tokens", MAX_TOKENS, integral=True)
    if opts.deadline_days is not None:
        _positive(opts.deadline_days, "deadline_days", MAX_DEADLINE_DAYS)
    if opts.budget_usd is not None:
        _positive(opts.budget_usd, "budget_usd", MAX_BUDGET_USD)
    for name in ("deadline_days", "budget_usd"):
        if getattr(opts, name) is not None and opts.tokens is None:
            raise ConfigError(f"plan(): {name} bounds a whole run: give its length in tokens "
                              f"too (--tokens N, plan(tokens=N))")
    check_overrides(opts.economics, "plan(): economics", ConfigError)


def device_counts(cluster: Any, max_gpus: int | None) -> list[int]:
    """The device counts searched, ascending: powers of two up to one node, then whole nodes
    (a power of two of them, and the most that ``max_gpus`` allows), none over ``max_gpus``
    or the cluster. Bounded: about log2(devices) counts."""
    per_node = cluster.devices_per_node
    limit = min(max_gpus or cluster.world_size, cluster.world_size)
    counts = {1 << i for i in range(per_node.bit_length()) if (1 << i) <= min(per_node, limit)}
    most = limit // per_node
    counts |= {k * per_node for k in range(1, most + 1) if k & (k - 1) == 0 or k == most}
    return sorted(counts)


def sub_cluster(cluster: Any, n: int) -> Any:
    """The cluster's first ``n`` devices: ``n / devices_per_node`` whole nodes, or one node
    with its first ``n`` devices (``cluster/node_part.py``)."""
    if n == cluster.world_size:
        return cluster
    d = cluster.to_dict()
    per_node = cluster.devices_per_node
    if n % per_node == 0:
        return Cluster.from_dict({**d, "num_nodes": n // per_node})
    part = first_devices(d, n, name=cluster.name)
    base = cluster.name.partition("/")[0]
    return Cluster.from_dict({**part, "num_nodes": 1, "name": f"{base}/{n}"})


@dataclass(frozen=True, kw_only=True)
class Point:
    """One device count's fastest plan, scored. On pools (``objectives_pools.py``), ``devices``
    names which devices (``dgx-h100:4``, ``dgx-a100-80gb:4+dgx-h100:4``) and ``plan`` may be a
    HeteroPlan, whose config ``config`` writes; "" on one device type (the cluster's first
    ``gpus``; the plan's config)."""

    gpus: int
    plan: Any
    step_time_s: float
    tokens_per_s: float | None
    run_time_s: float
    cost_usd: float | None
    energy: StepEnergy | None          # of the whole run
    excluded: str = ""                 # why it may not be chosen ("" where it may)
    pareto: bool = False
    devices: str = ""
    config: str = ""

    @property
    def config_text(self) -> str:
        return self.config or self.plan.config.short()

    @property
    def energy_joules(self) -> float | None:
        return None if self.energy is None else self.energy.total_joules

    def value(self, objective: str) -> float | None:
        return {"time": self.run_time_s, "cost": self.cost_usd,
                "energy": self.energy_joules}[objective]


def scaled(e: StepEnergy, k: float) -> StepEnergy:
    return StepEnergy(**{f: getattr(e, f) * k for f in e.__dataclass_fields__})


def score(plan: Any, gpus: int, econ: Economics, opts: Any) -> Point:
    """``plan`` (on ``gpus`` devices) scored for a run of ``opts.tokens`` (one step without)."""
    pred = plan.predicted
    step_s = float(pred["step_time_s"])
    tps = pred.get("tokens_per_s")
    run_s = run_seconds(step_s, tps, opts)
    cost = (None if econ.usd_per_gpu_hour is None
            else gpus * econ.usd_per_gpu_hour * run_s / 3600.0)
    energy = None
    if econ.tdp_watt is not None:
        energy = scaled(step_energy(pred, gpus, econ), run_s / step_s if step_s > 0 else 0.0)
    return bounded(Point(gpus=gpus, plan=plan, step_time_s=step_s,
                         tokens_per_s=float(tps) if tps else None, run_time_s=run_s,
                         cost_usd=cost, energy=energy), opts)


def run_seconds(step_s: float, tokens_per_s: float | None, opts: Any) -> float:
    """A run of ``opts.tokens`` at ``tokens_per_s``, or one step without tokens."""
    if opts.tokens is None:
        return step_s
    if not tokens_per_s:
        raise ConfigError("plan(): tokens measures the run in tokens, but this model's "
                          "batch has no sequence (no tokens per step); leave tokens out "
                          "to compare plans per step")
    return opts.tokens / float(tokens_per_s)


def bounded(p: Point, opts: Any) -> Point:
    """``p`` marked excluded where it misses the deadline or exceeds the budget."""
    run_s, cost = p.run_time_s, p.cost_usd
    why = []
    if opts.deadline_days is not None and run_s > opts.deadline_days * SECONDS_PER_DAY:
        why.append(f"misses the deadline ({run_s / SECONDS_PER_DAY:,.2f} days)")
    if opts.budget_usd is not None and cost is not None and cost > opts.budget_usd:
        why.append(f"over the budget (${cost:,.2f})")
    return replace(p, excluded="; ".join(why))


def pareto(points: list[Point]) -> list[Point]:
    """``points`` with ``pareto`` set on those no other point beats on every known figure
    (run time, cost, energy) and strictly on one."""
    def figures(p: Point) -> tuple[float, ...]:
        return tuple(v for v in (p.run_time_s, p.cost_usd, p.energy_joules) if v is not None)

    out = []
    for p in points:
        fp = figures(p)
        beaten = any(q is not p and len(figures(q)) == len(fp)
                     and all(a <= b for a, b in zip(figures(q), fp)) and figures(q) != fp
                     for q in points)
        out.append(replace(p, pareto=not beaten))
    return out


def winners(points: list[Point]) -> dict[str, Point]:
    """Per objective, the best point that may be chosen (ties: the faster, then fewer GPUs);
    an objective whose figure is unknown (no price, no power) has none."""
    out = {}
    for obj in OBJECTIVES:
        pool = [p for p in points if not p.excluded and p.value(obj) is not None]
        if pool:
            out[obj] = min(pool, key=lambda p: (p.value(obj), p.run_time_s, p.gpus))
    return out


def _none_meets(points: list[Point], opts: Any) -> str:
    """What to change when every point is excluded."""
    fastest = min(points, key=lambda p: p.run_time_s)

    def on(p: Point) -> str:
        return f"{p.gpus} devices" + (f" ({p.devices})" if p.devices else "")
    parts = [f"no plan on up to {max(p.gpus for p in points)} devices meets "
             + " and ".join(x for x in (
                 f"the {opts.deadline_days:g}-day deadline" if opts.deadline_days else "",
                 f"the ${opts.budget_usd:,.2f} budget" if opts.budget_usd else "") if x)
             + f" for {opts.tokens:,} tokens."]
    if opts.deadline_days is not None:
        days = fastest.run_time_s / SECONDS_PER_DAY
        if days > opts.deadline_days:
            parts.append(f"The fastest, on {on(fastest)}, takes {days:,.2f} days: "
                         f"give --deadline {math.ceil(days * 100) / 100:g} or more, fewer "
                         f"tokens, or more devices (--max-gpus, a larger cluster).")
    priced = [p for p in points if p.cost_usd is not None and (
        opts.deadline_days is None or p.run_time_s <= opts.deadline_days * SECONDS_PER_DAY)]
    if opts.budget_usd is not None and priced:
        cheap = min(priced, key=lambda p: p.cost_usd)
        if cheap.cost_usd > opts.budget_usd:
            parts.append(f"The cheapest that meets the deadline, on {on(cheap)}, costs "
                         f"${cheap.cost_usd:,.2f}: give --budget-usd "
                         f"{math.ceil(cheap.cost_usd * 100) / 100:.2f} or more, fewer tokens, "
                         "or a lower price (--usd-per-gpu-hour).")
    return " ".join(parts)


def choose(points: list[Point], opts: Any, econ: Economics | Sequence[Economics]) -> Point:
    """The point the objective picks among those not excluded; ConfigError saying what to
    change where none is left or the objective's figure is unknown (``econ``: the devices'
    Economics, one per pool on pools)."""
    for e in (econ if isinstance(econ, Sequence) else (econ,)):
        if opts.objective == "cost" and e.usd_per_gpu_hour is None:
            raise ConfigError(no_price(e.device))
        if opts.objective == "energy" and e.tdp_watt is None:
            raise ConfigError(no_power(e.device))
        if opts.budget_usd is not None and e.usd_per_gpu_hour is None:
            raise ConfigError(no_price(e.device) + " (a budget needs a price)")
    best = winners(points).get(opts.objective)
    if best is None:
        raise ConfigError(_none_meets(points, opts))
    return best


def search_counts(cluster: Any, opts: Any, plan_on: Callable[[Any, Any], Any],
                  say: Callable[[str], None]) -> tuple[Point, list[Point], dict[str, Any]]:
    """Every count of :func:`device_counts` planned with ``plan_on(sub_cluster, inner_opts)``
    (the step-time search), scored, the front marked and the winner chosen. Returns (winner,
    points, the plan file's ``objectives`` section)."""
    econ = economics(cluster, opts.economics)
    inner = replace(opts, objective="time", max_gpus=None, budget_usd=None, tokens=None,
                    deadline_days=None, economics={})
    points, skipped = [], []
    for n in device_counts(cluster, opts.max_gpus):
        try:
            got = plan_on(sub_cluster(cluster, n), inner)
        except AutoplanError as e:       # nothing fits on so few devices, or no mesh
            skipped.append({"gpus": n, "why": str(e).splitlines()[0][:300]})
            say(f"{n} devices: no plan ({skipped[-1]['why'][:120]})")
            continue
        points.append(score(got, n, econ, opts))
        say(f"{n} devices: step {points[-1].step_time_s * 1e3:,.1f} ms "
            f"({got.config.short()})")
    if not points:
        raise ConfigError(f"no device count of up to {opts.max_gpus or cluster.world_size} "
                          f"gives a plan: {skipped[-1]['why'] if skipped else 'none searched'}")
    points = pareto(points)
    best = choose(points, opts, econ)
    return best, points, section(best, points, skipped, opts, econ, winners(points))
