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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from autoplan.cluster import node_part
from autoplan.cluster.gemm_table import GemmShapeTable
from autoplan.cluster.values import check_keys, integer, number, text
from autoplan.errors import ClusterError

SCHEMA_VERSION = 1
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
DEVICE_KINDS = ("gpu", "cpu")


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
    # the vendor GEMM library's measured rate by product shape, relative to a large product
    # (``gemm_table``); None: unknown, every product priced at matmul_efficiency
    matmul_shape_efficiency: GemmShapeTable | None = None

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
        if self.matmul_shape_efficiency is not None and not isinstance(
                self.matmul_shape_efficiency, GemmShapeTable):
            object.__setattr__(self, "matmul_shape_efficiency",
                               GemmShapeTable.from_value(self.matmul_shape_efficiency, where))

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
        if self.matmul_shape_efficiency is not None:
            out["matmul_shape_efficiency"] = self.matmul_shape_efficiency.to_value()
        else:
            del out["matmul_shape_efficiency"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "device") -> DeviceSpec:
        allowed = tuple(f.name for f in fields(cls)) + ("aliases", "notes")
        check_keys(data, allowed, where,
                   required=tuple(f.name for f in fields(cls)
                                  if f.name not in ("compute_share", "overlap_interference",
                                                    "matmul_shape_efficiency")))
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
            matmul_shape_efficiency=(None if data.get("matmul_shape_efficiency") is None else
                                     GemmShapeTable.from_value(data["matmul_shape_efficiency"],
                                                               where)),
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


_HOST_REQUIRED = ("memory_bytes", "device_to_host_bandwidth_bytes_per_s", "cpu_adam_params_per_s")


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """Host side of one node, as seen by each device (for offload).

    NVMe (ZeRO-Infinity's third tier, Rajbhandari et al. 2021): ``nvme_bytes`` is the node's
    local NVMe capacity usable for offload, ``nvme_read_bytes_per_s`` and
    ``nvme_write_bytes_per_s`` the node's aggregate sequential rates (its drives striped, RAID
    0); each device gets ``1 / devices_per_node`` of all three when every device offloads at
    once. Optional: absent (0) means the node has no NVMe for offload, and old cluster files
    read as before."""

    memory_bytes: int
    device_to_host_bandwidth_bytes_per_s: float
    cpu_adam_params_per_s: float
    source: str = "not given"
    nvme_bytes: int = 0
    nvme_read_bytes_per_s: float = 0.0
    nvme_write_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        where = "host"
        object.__setattr__(self, "memory_bytes", integer(self.memory_bytes, "memory_bytes", where))
        number(self.device_to_host_bandwidth_bytes_per_s, "device_to_host_bandwidth_bytes_per_s", where)
        number(self.cpu_adam_params_per_s, "cpu_adam_params_per_s", where)
        text(self.source, "source", where)
        if self.nvme_bytes:
            object.__setattr__(self, "nvme_bytes", integer(self.nvme_bytes, "nvme_bytes", where))
            for k in ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
                object.__setattr__(self, k, number(getattr(self, k), k, where))
        elif self.nvme_read_bytes_per_s or self.nvme_write_bytes_per_s:
            raise ClusterError(f"{where}: NVMe rates given without nvme_bytes; give the node's "
                               "NVMe capacity too, or drop the rates (no NVMe)")

    @property
    def has_nvme(self) -> bool:
        """Whether the node has NVMe drives for offload (``nvme_bytes`` given)."""
        return self.nvme_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        """The fields; the NVMe ones only where the node has NVMe (old descriptions and their
        fingerprints unchanged)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.has_nvme:
            for k in ("nvme_bytes", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
                del out[k]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "host") -> HostSpec:
        allowed = tuple(f.name for f in fields(cls)) + ("notes",)
        check_keys(data, allowed, where, required=tuple(f.name for f in fields(cls)
                                                        if f.name in _HOST_REQUIRED))
        return cls(
            memory_bytes=integer(data["memory_bytes"], "memory_bytes", where),
            device_to_host_bandwidth_bytes_per_s=number(
                data["device_to_host_bandwidth_bytes_per_s"], "device_to_host_bandwidth_bytes_per_s", where
            ),
            cpu_adam_params_per_s=number(data["cpu_adam_params_per_s"], "cpu_adam_params_per_s", where),
            source=text(data.get("source", "not given"), "source", where),
            nvme_bytes=data.get("nvme_bytes", 0),
            nvme_read_bytes_per_s=data.get("nvme_read_bytes_per_s", 0.0),
            nvme_write_bytes_per_s=data.get("nvme_write_bytes_per_s", 0.0),
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
    """A deep copy of one preset description from ``cost_models/clusters.yaml``;
    ``PRESET/K``: the preset's node with only its first ``K`` devices (``node_part.py``)."""
    presets = _load_yaml("clusters.yaml")["presets"]
    base, count = node_part.split_name(name)
    if base not in presets:
        raise ClusterError(f"unknown cluster preset {base!r}; presets: {', '.join(presets)} "
                           "(PRESET/K: its first K devices, e.g. dgx-h100/1)")
    entry = copy.deepcopy(presets[base])
    return entry if count is None else node_part.first_devices(entry, count, name=name)


def is_preset(name: str) -> bool:
    """Whether ``name`` names a preset or part of one's node (``dgx-h100/1``)."""
    base, sep, tail = name.partition("/")
    return base in preset_names() and (not sep or tail.isdigit())


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
    "is_preset",
    "preset_entry",
    "preset_names",
    "raw_data",
    "text",
]
