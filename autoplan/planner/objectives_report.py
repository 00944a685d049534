"""The objectives search written down: the plan file's ``objectives`` section (plain JSON,
rounded like the rest of the plan) and its text table, read back from that section so that
``inspect`` prints what ``plan`` printed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SIG_DIGITS = 6
JOULES_PER_KWH = 3.6e6
_PARTS = ("compute", "communication", "idle")


def _r(x: float) -> float:
    return float(f"{x:.{SIG_DIGITS}g}")


def section(best: Any, points: list[Any], skipped: list[dict[str, Any]], opts: Any,
            econ: Any, winners: Mapping[str, Any]) -> dict[str, Any]:
    """The plan file's ``objectives``: the request, the prices and power used, every device
    count's figures (``objectives.Point``), the winner under each objective (``winners``) and
    the counts with no plan. On pools (``econ`` one Economics per pool), each point names its
    ``devices``, the winners and the choice name theirs too, and ``pool_economics`` lists every
    pool's prices and power (``economics``: the first pool's)."""
    pooled = not hasattr(econ, "to_dict")
    econs = list(econ) if pooled else [econ]
    rows = []
    for p in points:
        row: dict[str, Any] = {"gpus": p.gpus, "config": p.config_text,
                               "step_time_s": _r(p.step_time_s),
                               "run_time_s": _r(p.run_time_s), "pareto": p.pareto,
                               "excluded": p.excluded}
        if p.tokens_per_s is not None:
            row["tokens_per_s"] = _r(p.tokens_per_s)
        if p.cost_usd is not None:
            row["cost_usd"] = _r(p.cost_usd)
        if p.energy is not None:
            row["energy_joules"] = _r(p.energy.total_joules)
            for part in _PARTS:      # a part under 1e-9 of the whole is rounding: 0
                j = getattr(p.energy, f"{part}_joules")
                row[f"{part}_joules"] = _r(j) if j > 1e-9 * p.energy.total_joules else 0.0
        if p.devices:
            row["devices"] = p.devices
        rows.append(row)
    econ_d = [{k: (_r(v) if isinstance(v, float) else v) for k, v in e.to_dict().items()}
              for e in econs]
    out: dict[str, Any] = {
        "objective": opts.objective, "chosen_gpus": best.gpus,
        "economics": econ_d[0], "points": rows,
        "winners": {k: p.gpus for k, p in winners.items()},
        "skipped": [dict(s) for s in skipped],
    }
    if pooled:
        out.update(chosen_devices=best.devices, pool_economics=econ_d,
                   winner_devices={k: p.devices for k, p in winners.items()})
    for key in ("max_gpus", "tokens", "deadline_days", "budget_usd"):
        if getattr(opts, key) is not None:
            v = getattr(opts, key)
            out[key] = v if isinstance(v, int) else _r(float(v))
    return out


def gpus_text(n: int) -> str:
    """``1 GPU``, ``1,024 GPUs``."""
    return f"{n:,} GPU" + ("" if n == 1 else "s")


def _duration(s: float) -> str:
    if s >= 2 * 86_400:
        return f"{s / 86_400:,.2f} d"
    if s >= 2 * 3600:
        return f"{s / 3600:,.2f} h"
    if s >= 120:
        return f"{s / 60:,.1f} min"
    if s >= 1:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.2f} ms"


def _usd(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"${x:,.2f}" if x >= 100 else f"${x:.4g}"


def _energy(j: float | None, kwh: bool = True) -> str:
    """Kilowatt-hours for a run, joules for a step (``kwh`` False)."""
    if j is None:
        return "n/a"
    if not kwh:
        return f"{j:,.4g} J"
    x = j / JOULES_PER_KWH
    return f"{x:,.1f} kWh" if x >= 100 else f"{x:.4g} kWh"


def table(sec: Mapping[str, Any]) -> str:
    """The front as text: one row per device count (``*``: on the Pareto front, ``>``: the
    plan), the winner under each objective, what was excluded and the prices used."""
    per = (f"a run of {sec['tokens']:,} tokens" if "tokens" in sec else "one step")
    e = sec["economics"]
    kwh = max((p.get("energy_joules", 0.0) for p in sec["points"]), default=0.0) \
        >= 0.1 * JOULES_PER_KWH

    def energy(j: float | None) -> str:
        return _energy(j, kwh)

    lines = [f"objectives: {sec['objective']} (figures for {per}; * on the Pareto front over "
             "time, cost and energy, > the plan)"]
    head = f"    {'GPUs':>5}  {'time':>12}  {'cost':>12}  {'energy':>13}  config"
    lines.append(head)
    for p in sec["points"]:
        mark = (">" if is_chosen(sec, p) else " ") + ("*" if p["pareto"] else " ")
        lines.append(f"  {mark}{p['gpus']:>5}  {_duration(p['run_time_s']):>12}  "
                     f"{_usd(p.get('cost_usd')):>12}  {energy(p.get('energy_joules')):>13}  "
                     + (f"{p['devices']}: " if p.get("devices") else "")
                     + f"{p['config']}" + (f"  [excluded: {p['excluded']}]" if p["excluded"]
                                           else ""))
    for s in sec.get("skipped", ()):
        lines.append(f"    {s['gpus']:>5}  no plan: {s['why'][:100]}")
    chosen = next(p for p in sec["points"] if is_chosen(sec, p))
    if "energy_joules" in chosen and chosen["energy_joules"] > 0:
        lines.append("  the plan's energy: " + ", ".join(
            f"{part} {energy(chosen[part + '_joules'])} "
            f"({chosen[part + '_joules'] / chosen['energy_joules'] * 100:.0f}%)"
            for part in _PARTS))
    wins, where = sec.get("winners", {}), sec.get("winner_devices", {})
    lines.append("  wins: " + ", ".join(
        f"{k} -> {gpus_text(wins[k])}" + (f" ({where[k]})" if where.get(k) else "")
        for k in ("time", "cost", "energy") if k in wins) + (
        "" if len(wins) == 3 else " (no price or power known for the others)"))
    bounds = [f"deadline {sec['deadline_days']:g} days" if "deadline_days" in sec else "",
              f"budget ${sec['budget_usd']:,.2f}" if "budget_usd" in sec else "",
              f"at most {sec['max_gpus']} GPUs" if "max_gpus" in sec else ""]
    if any(bounds):
        lines.append("  bounds: " + ", ".join(b for b in bounds if b))
    for e in sec.get("pool_economics", [e]):
        price = (f"${e['usd_per_gpu_hour']:g}/GPU-hour ({e['price_kind']}"
                 + (f" list price, {e['price_date']}" if e.get("price_date") else "") + ")"
                 if e.get("usd_per_gpu_hour") is not None else "no price")
        power = (f"{e['tdp_watt']:g} W TDP x {e['compute_fraction']:g} computing, "
                 f"{e['communication_fraction']:g} communicating, {e['idle_fraction']:g} idle "
                 "(assumed fractions)" if e.get("tdp_watt") is not None else "no power figure")
        lines.append(f"  {e['device']}: {price}; {power}; GPU boards only "
                     "(cost_models/economics.yaml)")
    return "\n".join(lines)


def is_chosen(sec: Mapping[str, Any], point: Mapping[str, Any]) -> bool:
    """Whether ``point`` (a row of ``sec["points"]``) is the plan's: its count, and on pools
    its devices."""
    return (point["gpus"] == sec["chosen_gpus"]
            and point.get("devices", "") == sec.get("chosen_devices", ""))
