"""Hardware specs (devices, links, hosts) and the ``cost_models/`` data they are loaded from.

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_bytes_per_s`` bytes per second,
``peak_flops`` FLOP/s. Link bandwidths are *per direction*; a link's ``efficiency`` is the
fraction of that peak a collective library actually reaches on it (an estimate, see
``cost_models/links.yaml``).

Every loader validates what it reads and raises :class:`~autoplan.errors.ClusterError` naming the
bad item, the value seen and the fix; user input never meets an ``assert``.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from autoplan.errors import ClusterError

SCHEMA_VERSION = 1
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DEVICE_KINDS = ("gpu", "cpu")


# --------------------------------------------------------------------------- validation helpers
def check_keys(data: Any, allowed: tuple[str, ...], where: str, *, required: tuple[str, ...] = ()) -> None:
    """Raise ClusterError unless ``data`` is a mapping whose keys are all in ``allowed``."""
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    for key in data:
        if key not in allowed:
            raise ClusterError(
                f"{where}: unknown key {key!r}; allowed keys are {', '.join(allowed)} "
                "(check the spelling)"
            )
    missing = [key for key in required if key not in data]
    if missing:
        raise ClusterError(f"{where}: missing required key(s) {', '.join(missing)}; add them")


def number(value: Any, what: str, where: str, *, positive: bool = True, at_most: float | None = None) -> float:
    """Coerce a YAML/JSON value to a finite float (numeric strings such as ``"1.5e12"`` accepted,
    because YAML 1.1 reads exponents without a sign as strings) and range-check it."""
    if isinstance(value, bool):
        raise ClusterError(f"{where}: {what} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise ClusterError(f"{where}: {what} must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClusterError(f"{where}: {what} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ClusterError(f"{where}: {what} must be > 0, got {value!r}; give the real figure")
    if not positive and value < 0:
        raise ClusterError(f"{where}: {what} must be >= 0, got {value!r}")
    if at_most is not None and value > at_most:
        raise ClusterError(f"{where}: {what} must be <= {at_most}, got {value!r}")
    return float(value)


# Cluster sizes autoplan describes (a 131,072-device cluster builds in about 3 s); larger
# numbers are refused rather than left to exhaust memory.
MAX_NODES = 16_384
MAX_DEVICES_PER_NODE = 1_024
MAX_WORLD_SIZE = 131_072
MAX_LOCAL_PROCESSES = 1_024


def integer(value: Any, what: str, where: str, *, minimum: int = 1,
            maximum: int | None = None) -> int:
    """Coerce to int (integral floats such as ``8.0`` or ``4e9`` allowed) within bounds."""
    if isinstance(value, bool):
        raise ClusterError(f"{where}: {what} must be an integer, got {value!r}")
    if isinstance(value, (str, float)):
        as_float = number(value, what, where, positive=False)
        if as_float != int(as_float):
            raise ClusterError(f"{where}: {what} must be a whole number, got {value!r}")
        value = int(as_float)
    if not isinstance(value, int):
        raise ClusterError(f"{where}: {what} must be an integer, got {value!r}")
    if value < minimum:
        raise ClusterError(f"{where}: {what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ClusterError(f"{where}: {what} must be at most {maximum:,}, got {value:,} "
                           "(autoplan's documented limit)")
    return value


def text(value: Any, what: str, where: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise ClusterError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value


# --------------------------------------------------------------------------- immutable mapping
class FrozenMap(Mapping[str, float]):
    """A small immutable, hashable ``str -> float`` mapping (keeps frozen dataclasses hashable)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, float] | None = None) -> None:
        self._items = tuple(sorted((str(k), float(v)) for k, v in (items or {}).items()))

    def __getitem__(self, key: str) -> float:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._items)!r})"


def rows_curve(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A ``matmul_rows_efficiency`` curve: pairs (rows > 0, fraction in (0, 1]), rows rising."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ClusterError(f"{where}: matmul_rows_efficiency must be a list of [rows, fraction] "
                           f"pairs, got {value!r}")
    out = []
    for k, pair in enumerate(value):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ClusterError(f"{where}: matmul_rows_efficiency[{k}] must be [rows, fraction], "
                               f"got {pair!r}")
        rows = number(pair[0], f"matmul_rows_efficiency[{k}] rows", where)
        frac = number(pair[1], f"matmul_rows_efficiency[{k}] fraction", where, at_most=1.0)
        if out and rows <= out[-1][0]:
            raise ClusterError(f"{where}: matmul_rows_efficiency rows must rise, got {rows:g} "
                               f"after {out[-1][0]:g}")
        out.append((rows, frac))
    return tuple(out)


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU rank process): peak rates and calibrated efficiencies."""

    name: str
    kind: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_launch_s: float
    source: str
    # fraction of the measured machine one device gets: CPU rank processes that outnumber the
    # cores share them (a profile measured on the whole machine runs this much slower per rank)
    compute_share: float = 1.0
    # fraction of the communication hidden behind compute that still slows it (None: the cost
    # model's default for accelerators, whose collectives run on their own engines and share
    # SMs and memory bandwidth). CPU ranks with no spare core: 1.0, the transfers' copies and
    # reductions run on the cores the compute needs.
    overlap_interference: float | None = None
    # ((rows, fraction), ...): the rate of a matrix product with that many rows (its other two
    # sides large), relative to its rate at many rows, for the vendor GEMM library; rows
    # between points interpolate in log rows, beyond the ends hold. Empty: unknown, products
    # priced at matmul_efficiency whatever their rows. Prices the row chunks a product is cut
    # into where communication is pipelined with it (``tp_comm_overlap``).
    matmul_rows_efficiency: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        text(self.name, "name", "device")
        if self.kind not in DEVICE_KINDS:
            raise ClusterError(f"{where}: kind must be one of {', '.join(DEVICE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ClusterError(f"{where}: peak_flops must be a non-empty mapping dtype -> FLOP/s, got {self.peak_flops!r}")
        for key, value in self.peak_flops.items():
            if key not in PRECISIONS:
                raise ClusterError(f"{where}: peak_flops key {key!r} unknown; allowed: {', '.join(PRECISIONS)}")
            number(value, f"peak_flops[{key!r}]", where)
        object.__setattr__(self, "peak_flops", FrozenMap(self.peak_flops))
        object.__setattr__(self, "memory_bytes", integer(self.memory_bytes, "memory_bytes", where))
        number(self.memory_bandwidth_bytes_per_s, "memory_bandwidth_bytes_per_s", where)
        number(self.matmul_efficiency, "matmul_efficiency", where, at_most=1.0)
        number(self.memory_efficiency, "memory_efficiency", where, at_most=1.0)
        number(self.kernel_launch_s, "kernel_launch_s", where, positive=False)
        text(self.source, "source", where)
        number(self.compute_share, "compute_share", where, at_most=1.0)
        if self.overlap_interference is not None:
            number(self.overlap_interference, "overlap_interference", where, positive=False,
                   at_most=1.0)
        object.__setattr__(self, "matmul_rows_efficiency",
                           rows_curve(self.matmul_rows_efficiency, where))

    def peak_flops_for(self, precision: str) -> float:
        """Dense peak FLOP/s for a training precision ("bf16", "fp16", "fp32"; "tf32" explicit).

        fp32 is priced at the ``fp32`` (non-tensor-core) rate even on GPUs that have TF32 tensor
        cores: PyTorch keeps TF32 matmuls off by default, so this is the conservative choice.
        """
        if precision in self.peak_flops:
            return self.peak_flops[precision]
        raise ClusterError(
            f"device {self.name!r} has no {precision!r} rate (it supports {', '.join(self.peak_flops)}); "
            "pick one of those precisions or add the rate to cost_models/devices.yaml"
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["peak_flops"] = dict(self.peak_flops)
        if self.overlap_interference is None:
            del out["overlap_interference"]
        if self.matmul_rows_efficiency:
            out["matmul_rows_efficiency"] = [list(x) for x in self.matmul_rows_efficiency]
        else:
            del out["matmul_rows_efficiency"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "device") -> DeviceSpec:
        allowed = tuple(f.name for f in fields(cls)) + ("aliases", "notes")
        check_keys(data, allowed, where,
                   required=tuple(f.name for f in fields(cls)
                                  if f.name not in ("compute_share", "overlap_interference",
                                                    "matmul_rows_efficiency")))
        peak = data["peak_flops"]
        check_keys(peak, PRECISIONS, f"{where}.peak_flops")
        return cls(
            name=text(data["name"], "name", where),
            kind=data["kind"],
            peak_flops={k: number(v, f"peak_flops[{k!r}]", where) for k, v in peak.items()},
            memory_bytes=integer(data["memory_bytes"], "memory_bytes", where),
            memory_bandwidth_bytes_per_s=number(data["memory_bandwidth_bytes_per_s"], "memory_bandwidth_bytes_per_s", where),
            matmul_efficiency=number(data["matmul_efficiency"], "matmul_efficiency", where, at_most=1.0),
            memory_efficiency=number(data["memory_efficiency"], "memory_efficiency", where, at_most=1.0),
            kernel_launch_s=number(data["kernel_launch_s"], "kernel_launch_s", where, positive=False),
            source=text(data["source"], "source", where),
            compute_share=number(data.get("compute_share", 1.0), "compute_share", where,
                                 at_most=1.0),
            overlap_interference=(None if data.get("overlap_interference") is None else
                                  number(data["overlap_interference"], "overlap_interference",
                                         where, positive=False, at_most=1.0)),
            matmul_rows_efficiency=rows_curve(data.get("matmul_rows_efficiency", ()), where),
        )


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One link type (one lane: an NVLink, a PCIe x16 slot, a NIC port), per direction."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0
    source: str

    def __post_init__(self) -> None:
        where = f"link {self.name!r}"
        text(self.name, "name", "link")
        number(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s", where)
        number(self.latency_s, "latency_s", where, positive=False)
        number(self.efficiency, "efficiency", where, at_most=1.0)
        text(self.source, "source", where)

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        """What a collective library reaches on one lane: peak times efficiency."""
        return self.bandwidth_bytes_per_s * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, name: str | None = None, where: str = "link") -> LinkSpec:
        allowed = tuple(f.name for f in fields(cls)) + ("notes",)
        check_keys(data, allowed, where, required=("bandwidth_bytes_per_s", "latency_s", "source"))
        link_name = data.get("name", name)
        return cls(
            name=text(link_name, "name", where),
            bandwidth_bytes_per_s=number(data["bandwidth_bytes_per_s"], "bandwidth_bytes_per_s", where),
            latency_s=number(data["latency_s"], "latency_s", where, positive=False),
            efficiency=number(data.get("efficiency", 1.0), "efficiency", where, at_most=1.0),
            source=text(data["source"], "source", where),
        )


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """Host side of one node, as seen by each device (for offload)."""

    memory_bytes: int
    device_to_host_bandwidth_bytes_per_s: float
    cpu_adam_params_per_s: float
    source: str = "not given"

    def __post_init__(self) -> None:
        where = "host"
        object.__setattr__(self, "memory_bytes", integer(self.memory_bytes, "memory_bytes", where))
        number(self.device_to_host_bandwidth_bytes_per_s, "device_to_host_bandwidth_bytes_per_s", where)
        number(self.cpu_adam_params_per_s, "cpu_adam_params_per_s", where)
        text(self.source, "source", where)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "host") -> HostSpec:
        allowed = tuple(f.name for f in fields(cls)) + ("notes",)
        check_keys(data, allowed, where, required=tuple(f.name for f in fields(cls) if f.name != "source"))
        return cls(
            memory_bytes=integer(data["memory_bytes"], "memory_bytes", where),
            device_to_host_bandwidth_bytes_per_s=number(
                data["device_to_host_bandwidth_bytes_per_s"], "device_to_host_bandwidth_bytes_per_s", where
            ),
            cpu_adam_params_per_s=number(data["cpu_adam_params_per_s"], "cpu_adam_params_per_s", where),
            source=text(data.get("source", "not given"), "source", where),
        )


# --------------------------------------------------------------------------- cost_models data
def _data_dir() -> Any:
    """The ``cost_models`` data directory: the installed package, else the repository checkout."""
    try:
        return importlib.resources.files("autoplan.cost_models")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "cost_models"


@functools.lru_cache(maxsize=None)
def _load_yaml(filename: str) -> dict[str, Any]:
    resource = _data_dir() / filename
    try:
        # libyaml's loader where PyYAML was built with it (5x faster), the same safe subset
        raw = yaml.load(resource.read_text(encoding="utf-8"),
                        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        raise ClusterError(f"cost model data file {filename!r} not found in {_data_dir()}; reinstall autoplan") from None
    if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
        raise ClusterError(
            f"cost_models/{filename}: expected a mapping with schema_version {SCHEMA_VERSION}, "
            f"got schema_version {raw.get('schema_version') if isinstance(raw, dict) else raw!r}"
        )
    return raw


def raw_data(filename: str) -> dict[str, Any]:
    """A private deep copy of one ``cost_models`` YAML file (for tests and tools)."""
    return copy.deepcopy(_load_yaml(filename))


def device_names() -> tuple[str, ...]:
    return tuple(_load_yaml("devices.yaml")["devices"])


def link_names() -> tuple[str, ...]:
    return tuple(_load_yaml("links.yaml")["links"])


def preset_names() -> tuple[str, ...]:
    return tuple(_load_yaml("clusters.yaml")["presets"])


@functools.lru_cache(maxsize=None)
def load_device(name: str) -> DeviceSpec:
    """The named device from ``cost_models/devices.yaml``."""
    table = _load_yaml("devices.yaml")["devices"]
    if name not in table:
        raise ClusterError(
            f"unknown device {name!r}; known devices: {', '.join(table)} "
            "(or give the device as a mapping with the DeviceSpec fields)"
        )
    return DeviceSpec.from_dict({"name": name, **table[name]}, where=f"cost_models/devices.yaml: {name}")


def find_device_by_alias(product_name: str) -> DeviceSpec | None:
    """Match a driver-reported name such as ``"NVIDIA A100-SXM4-80GB"`` against device aliases."""
    wanted = product_name.strip().lower()
    for name, entry in _load_yaml("devices.yaml")["devices"].items():
        candidates = [name, *entry.get("aliases", ())]
        if any(wanted == c.lower() or wanted.endswith(c.lower()) for c in candidates):
            return load_device(name)
    return None


@functools.lru_cache(maxsize=None)
def load_link(name: str) -> LinkSpec:
    """The named link type from ``cost_models/links.yaml``."""
    table = _load_yaml("links.yaml")["links"]
    if name not in table:
        raise ClusterError(
            f"unknown link type {name!r}; known link types: {', '.join(table)} "
            "(or define it under 'links:' in the cluster file)"
        )
    return LinkSpec.from_dict(table[name], name=name, where=f"cost_models/links.yaml: {name}")


def preset_entry(name: str) -> dict[str, Any]:
    """A deep copy of one preset description from ``cost_models/clusters.yaml``."""
    presets = _load_yaml("clusters.yaml")["presets"]
    if name not in presets:
        raise ClusterError(f"unknown cluster preset {name!r}; presets: {', '.join(presets)}")
    return copy.deepcopy(presets[name])


__all__ = [
    "DeviceSpec",
    "FrozenMap",
    "HostSpec",
    "LinkSpec",
    "PRECISIONS",
    "SCHEMA_VERSION",
    "check_keys",
    "device_names",
    "find_device_by_alias",
    "integer",
    "link_names",
    "load_device",
    "load_link",
    "number",
    "preset_entry",
    "preset_names",
    "raw_data",
    "text",
]
