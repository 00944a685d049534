"""The rules of a plan file's ``objectives`` section (schema 8; ``objectives_report.section``
writes it): closed objects, typed figures, the chosen count among the points and agreeing with
the plan's world size. PlanError names the JSON path of the first problem."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.planner import planfile_values as pc

OBJECTIVES_KEYS = ("objective", "chosen_gpus", "economics", "points", "winners", "skipped")
OBJECTIVES_OPTIONAL_KEYS = ("max_gpus", "tokens", "deadline_days", "budget_usd",
                            # on pools (planner/objectives_pools.py)
                            "chosen_devices", "winner_devices", "pool_economics")
ECONOMICS_KEYS = ("device", "usd_per_gpu_hour", "tdp_watt", "compute_fraction",
                  "communication_fraction", "idle_fraction", "price_kind", "price_date",
                  "source")
POINT_KEYS = ("gpus", "config", "step_time_s", "run_time_s", "pareto", "excluded")
POINT_OPTIONAL_KEYS = ("tokens_per_s", "cost_usd", "energy_joules", "compute_joules",
                       "communication_joules", "idle_joules", "devices")
SKIPPED_KEYS = ("gpus", "why")
OBJECTIVE_NAMES = ("time", "cost", "energy")
_TEXT = 4096


def _closed(d: Any, path: str, keys: tuple[str, ...], optional: tuple[str, ...]) -> Mapping:
    m = pc.a_map(d, path)
    pc.closed_keys({k: v for k, v in m.items() if k not in optional}, path, keys)
    return m


def check_objectives(sec: Any, world_size: int) -> None:
    """``objectives`` of a plan on ``world_size`` devices."""
    path = "objectives"
    sec = _closed(sec, path, OBJECTIVES_KEYS, OBJECTIVES_OPTIONAL_KEYS)
    pc.a_str(sec["objective"], f"{path}.objective", choices=OBJECTIVE_NAMES)
    chosen = pc.an_int(sec["chosen_gpus"], f"{path}.chosen_gpus", lo=1)
    if chosen != world_size:
        pc.fail(f"{path}.chosen_gpus", f"{chosen}, but the plan is for {world_size} devices "
                "(cluster.world_size)")
    for key in ("max_gpus", "tokens"):
        if key in sec:
            pc.an_int(sec[key], f"{path}.{key}", lo=1)
    for key in ("deadline_days", "budget_usd"):
        if key in sec:
            pc.a_num(sec[key], f"{path}.{key}")
    _check_economics(sec["economics"], f"{path}.economics")
    for i, e in enumerate(pc.a_list(sec.get("pool_economics", []), f"{path}.pool_economics")):
        _check_economics(e, f"{path}.pool_economics[{i}]")
    chosen_devices = pc.a_str(sec.get("chosen_devices", ""), f"{path}.chosen_devices",
                              limit=_TEXT, one_line=True)
    gpus, where = [], []
    for i, p in enumerate(pc.a_list(sec["points"], f"{path}.points")):
        at = f"{path}.points[{i}]"
        p = _closed(p, at, POINT_KEYS, POINT_OPTIONAL_KEYS)
        gpus.append(pc.an_int(p["gpus"], f"{at}.gpus", lo=1))
        where.append((gpus[-1], pc.a_str(p.get("devices", ""), f"{at}.devices", limit=_TEXT,
                                         one_line=True)))
        pc.a_str(p["config"], f"{at}.config", limit=_TEXT, one_line=True)
        pc.a_str(p["excluded"], f"{at}.excluded", limit=_TEXT, one_line=True)
        pc.a_bool(p["pareto"], f"{at}.pareto")
        for key in ("step_time_s", "run_time_s") + tuple(k for k in POINT_OPTIONAL_KEYS
                                                         if k in p and k != "devices"):
            pc.a_num(p[key], f"{at}.{key}")
    if (chosen, chosen_devices) not in where:
        pc.fail(f"{path}.chosen_gpus", f"{chosen} is not among the points' device counts "
                f"{gpus[:16]}" + (f" on {chosen_devices}" if chosen_devices else ""))
    if len(set(where)) != len(where):
        pc.fail(f"{path}.points", "two points with the same device count (and devices)")
    for k, v in pc.a_map(sec["winners"], f"{path}.winners").items():
        pc.a_str(k, f"{path}.winners", choices=OBJECTIVE_NAMES)
        if pc.an_int(v, f"{path}.winners.{k}", lo=1) not in gpus:
            pc.fail(f"{path}.winners.{k}", f"{v} is not among the points' device counts")
    for k, v in pc.a_map(sec.get("winner_devices", {}), f"{path}.winner_devices").items():
        pc.a_str(k, f"{path}.winner_devices", choices=OBJECTIVE_NAMES)
        if (sec["winners"].get(k), v) not in where:
            pc.fail(f"{path}.winner_devices.{k}", f"{v!r:.80} is not among the points' devices")
    for i, s in enumerate(pc.a_list(sec["skipped"], f"{path}.skipped")):
        s = pc.closed_keys(s, f"{path}.skipped[{i}]", SKIPPED_KEYS)
        pc.an_int(s["gpus"], f"{path}.skipped[{i}].gpus", lo=1)
        pc.a_str(s["why"], f"{path}.skipped[{i}].why", limit=_TEXT)


def _check_economics(e: Any, path: str) -> None:
    e = pc.closed_keys(e, path, ECONOMICS_KEYS)
    for key in ("device", "price_kind", "price_date", "source"):
        pc.a_str(e[key], f"{path}.{key}", limit=_TEXT)
    for key in ("usd_per_gpu_hour", "tdp_watt"):
        pc.a_num(e[key], f"{path}.{key}", none_ok=True)
    for key in ("compute_fraction", "communication_fraction", "idle_fraction"):
        if pc.a_num(e[key], f"{path}.{key}") > 1:
            pc.fail(f"{path}.{key}", f"a fraction of the TDP, at most 1, got {e[key]}")
