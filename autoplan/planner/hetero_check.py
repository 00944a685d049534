"""The ``hetero`` section of a plan file (schema 9): a plan for a heterogeneous cluster's pools.

Written by ``planner/hetero_planfile.py``, checked here (``planfile_check.check_plan`` calls
:func:`check_hetero`); every problem raises PlanError naming its JSON path. The section::

    "hetero": {
      "placement": "stages" | "replicas",   # pipeline stages on the pools, or dp replicas (pp 1)
      "pools": [{"name", "device", "num_nodes", "first_rank", "num_ranks",
                 "device_memory_bytes", "peak_flops"}, ...],      # in rank order
      "units": [{"pool", "ranks", "layers" | "microbatches",     # per stage, or per replica
                 "peak_memory_bytes", "device_memory_bytes", "fits"}, ...],
      "pool_step_s": [...],       # per pool: its stages' forward+backward, or its replicas' step
      "even_step_s": float,       # the same config with its work split evenly on the pools
      "slowest_gpu": {"device", "config", "step_time_s", "peak_memory_bytes", "fits"}
    }

``slowest_gpu`` is the plan of the cluster as its slowest GPU (every rank priced as the slowest
pool's device): the figure the heterogeneous plan's gain is reported against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from autoplan.planner.planfile_values import a_bool, a_list, a_num, a_str, an_int, closed_keys, fail
from autoplan.sharding.parallel_config import ParallelConfig

HETERO_SCHEMA = 9
PLACEMENTS = ("stages", "replicas")
HETERO_KEYS = ("placement", "pools", "units", "pool_step_s", "even_step_s", "slowest_gpu")
POOL_KEYS = ("name", "device", "num_nodes", "first_rank", "num_ranks", "device_memory_bytes",
             "peak_flops")
UNIT_KEYS = ("pool", "ranks", "peak_memory_bytes", "device_memory_bytes", "fits")
WORK_KEY = {"stages": "layers", "replicas": "microbatches"}
SLOWEST_KEYS = ("device", "config", "step_time_s", "peak_memory_bytes", "fits")
MAX_POOLS = 16


def check_hetero(h: Any, world: int, config: ParallelConfig,
                 read_config: Callable[[Any, str], ParallelConfig]) -> None:
    """The section against the plan's world size and config (``read_config``: the plan
    format's config reader, which names the path of a bad field)."""
    h = closed_keys(h, "hetero", HETERO_KEYS)
    placement = a_str(h["placement"], "hetero.placement", choices=PLACEMENTS)
    pools = a_list(h["pools"], "hetero.pools")
    if not 2 <= len(pools) <= MAX_POOLS:
        fail("hetero.pools", f"{len(pools)} pools; a heterogeneous plan has 2 to {MAX_POOLS}")
    first = 0
    for i, p in enumerate(pools):
        path = f"hetero.pools[{i}]"
        closed_keys(p, path, POOL_KEYS)
        a_str(p["name"], f"{path}.name", limit=1000)
        a_str(p["device"], f"{path}.device", limit=1000)
        an_int(p["num_nodes"], f"{path}.num_nodes", lo=1)
        if an_int(p["first_rank"], f"{path}.first_rank") != first:
            fail(f"{path}.first_rank", f"{p['first_rank']}, but the pools number their ranks "
                 f"one after another from 0: expected {first}")
        first += an_int(p["num_ranks"], f"{path}.num_ranks", lo=1)
        a_num(p["device_memory_bytes"], f"{path}.device_memory_bytes")
        a_num(p["peak_flops"], f"{path}.peak_flops")
    if first != world:
        fail("hetero.pools", f"hold {first} ranks, the plan's world size is {world}")
    _check_units(h["units"], placement, pools, config)
    steps = a_list(h["pool_step_s"], "hetero.pool_step_s")
    if len(steps) != len(pools):
        fail("hetero.pool_step_s", f"{len(steps)} values for {len(pools)} pools")
    for i, x in enumerate(steps):
        a_num(x, f"hetero.pool_step_s[{i}]")
    a_num(h["even_step_s"], "hetero.even_step_s")
    s = closed_keys(h["slowest_gpu"], "hetero.slowest_gpu", SLOWEST_KEYS)
    a_str(s["device"], "hetero.slowest_gpu.device", limit=1000)
    read_config(s["config"], "hetero.slowest_gpu.config")
    a_num(s["step_time_s"], "hetero.slowest_gpu.step_time_s")
    a_num(s["peak_memory_bytes"], "hetero.slowest_gpu.peak_memory_bytes")
    a_bool(s["fits"], "hetero.slowest_gpu.fits")


def _check_units(units: Any, placement: str, pools: list[Mapping[str, Any]],
                 config: ParallelConfig) -> None:
    """One unit per stage (pp > 1) or per dp replica (pp = 1), each inside its pool."""
    units = a_list(units, "hetero.units")
    want = config.pp if placement == "stages" else config.dp
    if (placement == "stages") != (config.pp > 1) or len(units) != want:
        fail("hetero.units", f"{len(units)} {placement} for config pp={config.pp}, "
             f"dp={config.dp}: stages on pools need pp > 1 and one unit per stage, replicas "
             "pp = 1 and one unit per dp replica")
    work = WORK_KEY[placement]
    shares = config.dp_shares
    for j, u in enumerate(units):
        path = f"hetero.units[{j}]"
        closed_keys(u, path, UNIT_KEYS + (work,))
        pool = an_int(u["pool"], f"{path}.pool")
        if pool >= len(pools):
            fail(f"{path}.pool", f"{pool}, but the plan has {len(pools)} pools")
        lo = pools[pool]["first_rank"]
        hi = lo + pools[pool]["num_ranks"]
        for k, r in enumerate(a_list(u["ranks"], f"{path}.ranks")):
            if not lo <= an_int(r, f"{path}.ranks[{k}]") < hi:
                fail(f"{path}.ranks[{k}]", f"rank {r} is not in pool {pool} (ranks {lo} to "
                     f"{hi - 1}): a unit lies in one pool")
        n = an_int(u[work], f"{path}.{work}", lo=1)
        if work == "microbatches" and shares is not None and n != shares[j]:
            fail(f"{path}.microbatches", f"{n}, but config.dp_shares[{j}] is {shares[j]}")
        a_num(u["peak_memory_bytes"], f"{path}.peak_memory_bytes")
        a_num(u["device_memory_bytes"], f"{path}.device_memory_bytes")
        a_bool(u["fits"], f"{path}.fits")


__all__ = ["HETERO_SCHEMA", "PLACEMENTS", "check_hetero"]
