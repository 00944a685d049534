"""Part of a preset's node: ``dgx-h100/1`` is a DGX H100 with only its first GPU.

A preset describes whole nodes; a user with one GPU of such a node (a workstation-sized job, a
one-GPU slice of a server) names it ``PRESET/K``: the same node with only its first ``K``
devices, the links of the others left out (``Cluster.from_spec("dgx-h100/1")``,
``Cluster.preset("dgx-h100/1")``, ``preset: dgx-h100/1`` in a cluster file, ``dgx-h100/2:4``
for four such nodes). The name is kept as written, so plans and fingerprints read it back.

The host figures of a preset are each device's share when every device of the node uses the
host at once (``cost_models/clusters.yaml``, header). With fewer devices the shares grow:

- ``device_to_host_bandwidth_bytes_per_s``: the preset's figure is the PCIe uplink divided by
  the devices sharing it (two GPUs per PCIe switch in a DGX); a kept device that shares its
  switch with fewer kept devices gets the uplink divided by that fewer (the least such gain
  over the kept devices, so no device is priced faster than its switch allows).
- ``cpu_adam_params_per_s``: the node's CPU-Adam throughput divided by its devices; ``K``
  devices share the same CPUs, so it scales by ``devices_per_node / K``.

Host memory and NVMe are the node's (the cost model divides them by ``devices_per_node``), so
one device gets all of them. A cluster file overrides any host figure key by key
(``preset: dgx-h100/1`` with ``host: {memory_bytes: 1099511627776}``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from autoplan.errors import ClusterError

_SEPARATOR = "/"
_DEVICE = re.compile(r"^(?:gpu|cpu)(\d+)$")   # a device of the node (GPUs; CPU rank processes)


def split_name(name: str) -> tuple[str, int | None]:
    """``"dgx-h100/1"`` -> ``("dgx-h100", 1)``; a plain preset name -> ``(name, None)``."""
    base, sep, tail = name.partition(_SEPARATOR)
    if not sep:
        return name, None
    if not (tail.isascii() and tail.isdigit() and len(tail) <= 6) or tail != str(int(tail)):
        raise ClusterError(f"cluster preset {name!r}: {tail!r} after '/' is not a device count "
                           f"(write PRESET/DEVICES, e.g. {base or 'dgx-h100'}/1 for one GPU of the node)")
    return base, int(tail)


def first_devices(entry: Mapping[str, Any], count: int, *, name: str) -> dict[str, Any]:
    """The preset ``entry`` with only its first ``count`` devices (see the module docstring)."""
    total = entry.get("devices_per_node")
    if not isinstance(total, int) or not 1 <= count <= total:
        raise ClusterError(f"cluster preset {name!r}: a node of this preset has {total} devices; "
                           f"keep 1 to {total} of them (e.g. {name.partition(_SEPARATOR)[0]}/1)")
    node = entry["node"]
    full = [_pairs(link) for link in node["links"]]
    kept = [[(a, b) for a, b in pairs if _kept(a, count) and _kept(b, count)] for pairs in full]
    links = [{**link, "a": [a for a, _ in pairs], "b": [b for _, b in pairs]}
             for link, pairs in zip(node["links"], kept) if pairs]
    host = dict(entry["host"])
    kinds = [link.get("link") for link in node["links"]]
    uplink_gain = min(_sharers(list(zip(kinds, full)), dev) / _sharers(list(zip(kinds, kept)), dev)
                      for dev in (f"gpu{i}" for i in range(count)))
    host["device_to_host_bandwidth_bytes_per_s"] = (
        float(host["device_to_host_bandwidth_bytes_per_s"]) * uplink_gain)
    host["cpu_adam_params_per_s"] = float(host["cpu_adam_params_per_s"]) * total / count
    host["source"] = (f"{host.get('source', 'not given')} Only the first {count} of the node's "
                      f"{total} devices: the host link and CPU Adam shares scaled to the devices "
                      f"left (autoplan/cluster/node_part.py).")
    return {**entry, "devices_per_node": count, "host": host,
            "node": {**node, "links": links},
            "description": f"{entry.get('description', name)} - only its first {count} device(s)"}


def _pairs(link: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A link entry's (a, b) pairs: lists zipped, a single name repeated."""
    a, b = link["a"], link["b"]
    n = max(len(x) if isinstance(x, list) else 1 for x in (a, b))
    return list(zip(a if isinstance(a, list) else [a] * n, b if isinstance(b, list) else [b] * n))


def _kept(component: Any, count: int) -> bool:
    match = _DEVICE.match(component) if isinstance(component, str) else None
    return match is None or int(match.group(1)) < count


def _sharers(links: list[tuple[str, list[tuple[str, str]]]], device: str) -> int:
    """How many devices share ``device``'s PCIe path to the host: the devices wired to the
    same switch or socket as it by a PCIe link (1 where it has none)."""
    most = 1
    for kind, pairs in links:
        if not str(kind).startswith("pcie"):
            continue           # NVLink / NVSwitch: device to device, not to the host
        for up in {b for a, b in pairs if a == device}:
            most = max(most, sum(1 for a, b in pairs if b == up and _DEVICE.match(str(a))))
    return most
