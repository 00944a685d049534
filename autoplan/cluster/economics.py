"""What a cluster's devices cost and draw: :class:`Economics`, for the cost and energy objectives.

The figures come, in order of precedence, from the plan's options (``economics={...}``,
``--usd-per-gpu-hour``, ``--tdp-watt``), the cluster file's ``economics:`` mapping, and
``cost_models/economics.yaml`` (list prices and datasheet TDPs with their sources, and the
assumed power fractions of the busy/idle model: see that file's header).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from autoplan.cluster import specs
from autoplan.cluster.values import check_keys
from autoplan.errors import ClusterError, ConfigError

FRACTIONS = ("compute_fraction", "communication_fraction", "idle_fraction")
# what a cluster file's ``economics:`` and the plan options may set
OVERRIDE_KEYS = ("usd_per_gpu_hour", "tdp_watt", *FRACTIONS)
_MAX_USD_PER_GPU_HOUR = 1e6
_MAX_WATT = 1e6


@dataclass(frozen=True, kw_only=True)
class Economics:
    """One device type's price and power, and the power model's fractions of its TDP."""

    device: str
    usd_per_gpu_hour: float | None       # None: no price known (cost cannot be computed)
    tdp_watt: float | None               # None: no power known (energy cannot be computed)
    compute_fraction: float
    communication_fraction: float
    idle_fraction: float
    price_kind: str = "none"             # "on-demand", "capacity-block", "given", "none"
    price_date: str = ""
    source: str = ""

    def watt(self, state: str) -> float:
        """Power of one device while ``state`` is "compute", "communication" or "idle"."""
        if self.tdp_watt is None:
            raise ConfigError(no_power(self.device))
        return self.tdp_watt * getattr(self, f"{state}_fraction")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def no_power(device: str) -> str:
    return (f"no power figure for device {device!r}: give its board power with "
            f"--tdp-watt W (plan(economics={{'tdp_watt': W}})) or 'economics: {{tdp_watt: W}}' in a cluster file")


def no_price(device: str) -> str:
    return (f"no price for device {device!r}: give one with --usd-per-gpu-hour X "
            f"(plan(economics={{'usd_per_gpu_hour': X}})) or 'economics: {{usd_per_gpu_hour: X}}' in a cluster "
            "file (cost_models/economics.yaml lists the recorded list prices)")


def check_overrides(data: Any, where: str, error: type[Exception] = ClusterError
                    ) -> dict[str, float]:
    """A mapping of :data:`OVERRIDE_KEYS` to finite non-negative numbers (fractions at most 1,
    prices and power positive)."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: economics must be a mapping of {', '.join(OVERRIDE_KEYS)}, got "
                    f"{type(data).__name__}")
    try:
        check_keys(data, OVERRIDE_KEYS, where)
    except ClusterError as e:
        raise error(str(e)) from None
    out = {}
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise error(f"{where}: {key} takes a finite number, got {value!r:.60}")
        top = 1.0 if key in FRACTIONS else (
            _MAX_USD_PER_GPU_HOUR if key == "usd_per_gpu_hour" else _MAX_WATT)
        low_ok = key in FRACTIONS
        if value < 0 or (value == 0 and not low_ok) or value > top:
            raise error(f"{where}: {key} {value!r} out of range: "
                        + ("a fraction of the TDP, 0 to 1" if key in FRACTIONS else
                           f"a positive number up to {top:g}"))
        out[key] = float(value)
    return out


def economics(cluster: Any, overrides: Mapping[str, Any] | None = None) -> Economics:
    """The cluster's device economics: ``cost_models/economics.yaml``, the cluster file's
    ``economics:`` and then ``overrides`` (the plan's options) on top."""
    table = specs.raw_data("economics.yaml")
    model = table["power_model"]
    name = cluster.device.name
    entry = table["devices"].get(name, {})
    base: dict[str, Any] = {k: model[k] for k in FRACTIONS}
    base.update(usd_per_gpu_hour=entry.get("usd_per_gpu_hour"),
                tdp_watt=entry.get("tdp_watt"))
    kind = entry.get("price_kind", "none") if entry.get("usd_per_gpu_hour") else "none"
    date = entry.get("price_date", "") or ""
    source = " ".join(str(entry.get("source", "")).split()) or (
        f"device {name!r} is not in cost_models/economics.yaml")
    given = {**(getattr(cluster, "economics", None) or {}), **(overrides or {})}
    if "usd_per_gpu_hour" in given:
        kind, date = "given", ""
    if given:
        source = f"{source} Given: {', '.join(f'{k} {v:g}' for k, v in sorted(given.items()))}."
    base.update(given)
    return Economics(device=name, price_kind=kind, price_date=str(date), source=source,
                     **{k: (None if base[k] is None else float(base[k]))
                        for k in ("usd_per_gpu_hour", "tdp_watt", *FRACTIONS)})
