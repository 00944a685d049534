"""What a plan depends on in a cluster, and how two clusters' hardware differ.

A plan is matched to the cluster it runs on by its hardware, not by the cluster's name nor by
figures that vary between identical machines (calibrated rates, the exact memory a driver
reports, host memory): the device model, kind and memory, the backend, the node count and
devices per node, the links a device is wired with inside a node, and the network between
nodes. ``Cluster.local()`` on a node of eight H100s describes the same hardware as the
``dgx-h100`` preset, so a plan made for ``dgx-h100:2`` matches two such nodes.

Rules of the comparison (:func:`compare`):

- GPUs: a different device model, backend, node count, devices per node, intra-node links or
  network refuses the plan; memory counts as the same within ``MEMORY_TOLERANCE`` (a driver
  reports 79.1 GiB of an "80 GB" H100).
- CPU rank processes: any CPU job of the plan's world size runs it; a different CPU model,
  memory per rank or split of the ranks over nodes only makes the prediction stale (it was
  priced for the CPU it was planned on).
- What discovery cannot see (the network between nodes; the NVLinks without ``nvidia-smi``) is
  listed in the cluster's ``unseen`` and not compared.

Each difference is one :class:`Difference`: ``"device: H100-SXM5-80GB planned, A100-SXM4-80GB
here"``; ``refuses`` says whether it refuses the plan or only makes its prediction stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# what discovery may leave unknown; a cluster lists them in ``unseen``
UNSEEN_ASPECTS = ("node_links", "fabric")
MEMORY_TOLERANCE = 0.10          # relative: 79.1 GiB reported for an 80 GiB part is the same
_GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A cluster's hardware, as plans are matched by. ``None``: not known (a plan written
    before plans recorded it, or what local discovery cannot see)."""

    device: str                           # device model, e.g. "H100-SXM5-80GB"
    num_nodes: int
    devices_per_node: int
    device_kind: str | None = None        # "gpu" | "cpu"
    device_memory_bytes: int | None = None
    backend: str | None = None            # "nccl" | "gloo"
    node_links: tuple[str, ...] | None = None   # links at a device: ("nvlink4 x18", "pcie5-x16")
    fabric: str | None = None             # the link between nodes ("ib-ndr"); "" for one node
    # a heterogeneous cluster's pools in rank order, each one line (:func:`pool_line`): nodes,
    # device and memory, links in a node, NIC; None for a homogeneous cluster
    pools: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("node_links", "pools"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @staticmethod
    def of(cluster: Any) -> Hardware:
        """The hardware of a :class:`~autoplan.cluster.Cluster`."""
        unseen = set(getattr(cluster, "unseen", ()))
        devices = {f"{cluster.device.kind}{i}" for i in range(cluster.devices_per_node)}
        links = sorted({li.link if li.lanes == 1 else f"{li.link} x{li.lanes}"
                        for li in cluster.node_topology.links if li.a in devices or li.b in devices})
        fabric = cluster.fabric.link if cluster.fabric is not None and cluster.num_nodes > 1 else ""
        pools = getattr(cluster, "pools", ())
        # heterogeneous: the pools in order, so a plan for them matches only the same pools
        device = (" + ".join(f"{p.cluster.num_nodes}x {p.device.name}" for p in pools) if pools
                  else cluster.device.name)
        return Hardware(device=device, num_nodes=cluster.num_nodes,
                        devices_per_node=cluster.devices_per_node,
                        device_kind=cluster.device.kind,
                        device_memory_bytes=int(cluster.device.memory_bytes),
                        backend=cluster.backend,
                        node_links=None if "node_links" in unseen else tuple(links),
                        fabric=None if "fabric" in unseen else fabric,
                        pools=tuple(pool_line(p.cluster, cluster.num_nodes > 1)
                                    for p in pools) if pools else None)

    def summary(self) -> str:
        """One line: ``2 nodes x 8 H100-SXM5-80GB (80.0 GiB), nvlink4 x18 + pcie5-x16, ib-ndr``."""
        parts = [f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} x "
                 f"{self.devices_per_node} {self.device}"
                 + (f" ({self.device_memory_bytes / _GIB:.1f} GiB)"
                    if self.device_memory_bytes is not None else "")]
        if self.node_links is not None:
            parts.append(" + ".join(self.node_links) or "no links")
        if self.fabric:
            parts.append(self.fabric)
        return ", ".join(parts)

    def extras(self) -> dict[str, Any]:
        """The fields a plan file keeps under ``cluster.hardware`` (the others are beside it;
        ``pools`` only where the cluster has them, so other plans read as before)."""
        return {"device_kind": self.device_kind, "device_memory_bytes": self.device_memory_bytes,
                "backend": self.backend,
                "node_links": None if self.node_links is None else list(self.node_links),
                "fabric": self.fabric,
                **({"pools": list(self.pools)} if self.pools is not None else {})}


def pool_line(cluster: Any, networked: bool) -> str:
    """One pool of a heterogeneous cluster as plans are matched by: ``2 nodes x 8
    H100-SXM5-80GB (80.0 GiB), nvlink4 x18 + pcie5-x16, NIC ib-ndr`` (the NIC where the whole
    cluster has more than one node)."""
    h = Hardware.of(cluster)
    line = (f"{h.num_nodes} node{'s' if h.num_nodes != 1 else ''} x {h.devices_per_node} "
            f"{h.device} ({(h.device_memory_bytes or 0) / _GIB:.1f} GiB), "
            + (" + ".join(h.node_links or ()) or "no links"))
    if networked and cluster.fabric is not None:
        line += f", NIC {cluster.fabric.link}"
    return line


# the fields under ``cluster.hardware``: always written, and written only for pools
EXTRA_KEYS = tuple(f.name for f in fields(Hardware)
                   if f.name not in ("device", "num_nodes", "devices_per_node", "pools"))
OPTIONAL_EXTRA_KEYS = ("pools",)


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One way the hardware here differs from the hardware planned for."""

    what: str                    # "device", "nodes", ...
    planned: str
    here: str
    refuses: bool                # False: the plan runs, its prediction is stale

    def __str__(self) -> str:
        return f"{self.what}: {self.planned} planned, {self.here} here"


def compare(planned: Hardware, here: Hardware) -> tuple[Difference, ...]:
    """Every difference between the hardware a plan was made for and the hardware here."""
    planned_kind = planned.device_kind or ("cpu" if planned.device.startswith("cpu-") else None)
    cpu = planned_kind == "cpu" and here.device_kind == "cpu"     # CPU ranks on both sides
    out: list[Difference] = []

    def differ(what: str, a: Any, b: Any, refuses: bool, text: Any = str) -> None:
        if a is not None and b is not None and a != b:
            out.append(Difference(what=what, planned=text(a), here=text(b), refuses=refuses))

    differ("device kind", planned.device_kind, here.device_kind, True)
    differ("backend", planned.backend, here.backend, True)
    if planned.world_size != here.world_size:
        out.append(Difference(what="ranks", planned=str(planned.world_size),
                              here=str(here.world_size), refuses=True))
    differ("device", planned.device, here.device, not cpu)
    a, b = planned.device_memory_bytes, here.device_memory_bytes
    if a is not None and b is not None and abs(a - b) > MEMORY_TOLERANCE * max(a, b):
        out.append(Difference(what="device memory", planned=f"{a / _GIB:.1f} GiB",
                              here=f"{b / _GIB:.1f} GiB", refuses=not cpu))
    differ("nodes", planned.num_nodes, here.num_nodes, not cpu)
    differ("devices per node", planned.devices_per_node, here.devices_per_node, not cpu)
    differ("links in a node", planned.node_links, here.node_links, not cpu,
           lambda v: " + ".join(v) or "none")
    if planned.num_nodes > 1 and here.num_nodes > 1:
        differ("network", planned.fabric, here.fabric, not cpu)
    if planned.pools != here.pools and (planned.pools is not None or here.pools is not None):
        out.append(Difference(what="pools", planned=_pools_text(planned.pools),
                              here=_pools_text(here.pools), refuses=not cpu))
    return tuple(out)


def _pools_text(pools: tuple[str, ...] | None) -> str:
    return ("[" + "; ".join(f"pool {i}: {p}" for i, p in enumerate(pools)) + "]" if pools
            else "one node type")


def from_extras(*, device: str, num_nodes: int, devices_per_node: int,
                extras: Mapping[str, Any] | None) -> Hardware:
    """A Hardware from a plan's cluster fields and its ``hardware`` object (None: older plan)."""
    return Hardware(device=device, num_nodes=num_nodes, devices_per_node=devices_per_node,
                    **dict(extras or {}))


__all__ = ["Difference", "EXTRA_KEYS", "Hardware", "MEMORY_TOLERANCE", "OPTIONAL_EXTRA_KEYS",
           "UNSEEN_ASPECTS", "compare", "from_extras", "pool_line"]
