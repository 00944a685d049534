"""The mesh axes on the topology, as values: which ranks form each axis's groups, which links
their collectives cross and at what bandwidth, and which nodes a picture draws in detail.

``autoplan inspect PLAN --topology`` prints :func:`axis_groups_text` and draws
``topology_draw.draw_topology`` from these; ``autoplan cluster show --png`` draws the cluster
alone. Everything here reads a :class:`~autoplan.cluster.Cluster` and a
:class:`~autoplan.sharding.mesh_axes.ParallelDims` (no plan, no matplotlib).

Each axis is shown by one example: rank 0's group on it (``ParallelDims.group(axis, 0)``), the
group DeviceMesh makes for rank 0. What the group's traffic crosses depends on its pattern:

- ``ring`` (tp, cp, dp collectives): inside a node, the widest paths between the node's members
  in ring order; a group spanning nodes also crosses each member's path to its nearest NIC, the
  NIC's port to its fabric leaf, and the leaf-spine uplinks when its nodes hang off several
  leaves. Its bandwidth is the per-rank ring bandwidth the cost model prices it at;
- ``all_to_all`` (ep): every pair's path; the bandwidth is the bytes a rank sends over the time
  the cost model gives the exchange;
- ``p2p`` (pp): the path from each stage's rank to the next stage's; the bandwidth is the
  slowest such send.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.errors import ClusterError
from autoplan.sharding.mesh_axes import MeshAxis, ParallelDims

AXIS_ORDER = ("tp", "cp", "ep", "dp", "pp")
# axis -> (traffic pattern, what crosses)
AXIS_TRAFFIC = {
    "tp": ("ring", "all-reduce, or all-gather + reduce-scatter, of activations per layer"),
    "cp": ("ring", "ring attention: key/value blocks passed around the ring"),
    "ep": ("all_to_all", "all-to-all: tokens to their experts and back"),
    "dp": ("ring", "gradient all-reduce (reduce-scatter + all-gather under ZeRO/FSDP)"),
    "pp": ("p2p", "activations forward and gradients back to the neighbouring stage"),
}
KIND_NAMES = {"nvswitch": "NVSwitch", "pcie_switch": "PCIe switch", "socket": "CPU socket",
              "nic": "NIC", "leaf": "leaf switch", "spine": "spine switch"}
_KIND_ORDER = ("device", "nvswitch", "pcie_switch", "nic", "socket", "leaf", "spine")


@dataclass(frozen=True, kw_only=True)
class LinkUse:
    """One kind of link a group's traffic crosses: its type, what it joins, its peak bandwidth
    per direction (one cable with its lanes)."""

    link: str                       # link type, e.g. "nvlink4"
    joins: str                      # e.g. "GPU-NVSwitch", "NIC-leaf switch"
    lanes: float
    bandwidth_bytes_per_s: float

    def describe(self) -> str:
        lanes = f" x{self.lanes:g}" if self.lanes != 1 else ""
        return f"{self.link}{lanes} {self.joins} ({gbps(self.bandwidth_bytes_per_s)})"


@dataclass(frozen=True, kw_only=True)
class AxisGroup:
    """One mesh axis on the topology, by rank 0's group on it."""

    axis: str                       # "tp", "cp", "ep", "dp", "pp"
    size: int                       # ranks per group
    num_groups: int
    example: tuple[int, ...]        # rank 0's group, in order along the axis
    nodes: tuple[int, ...]          # the nodes the example spans
    pattern: str                    # "ring", "all_to_all", "p2p"
    traffic: str                    # what crosses, in words
    links: tuple[LinkUse, ...]
    bandwidth_bytes_per_s: float    # per rank, effective (as the cost model prices it)


def gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:,.1f} GB/s" if bytes_per_s < 1e13 else "unbounded"


def fmt_ranks(ranks: Sequence[int], *, limit: int = 8) -> str:
    """``0-7``, ``0, 2, 4, 6``, ``0, 8, 16, ..., 120 (every 8th)``."""
    ranks = list(ranks)
    if len(ranks) > 2 and all(b - a == 1 for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) <= limit:
        return ", ".join(map(str, ranks))
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    head = ", ".join(map(str, ranks[:3]))
    if len(steps) == 1:
        return f"{head}, ..., {ranks[-1]} (step {steps.pop()})"
    return f"{head}, ..., {ranks[-1]} ({len(ranks)} ranks)"


def fmt_nodes(nodes: Sequence[int]) -> str:
    nodes = sorted(nodes)
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    return f"nodes {fmt_ranks(nodes)}"


# ---------------------------------------------------------------- links
def _kind(cluster: Any, vertex: str) -> str:
    kind = cluster.graph.nodes[vertex]["kind"]
    return "device" if kind == cluster.device.kind else kind


def _kind_name(cluster: Any, kind: str) -> str:
    return cluster.device.kind.upper() if kind == "device" else KIND_NAMES.get(kind, kind)


def edge_use(cluster: Any, u: str, v: str) -> LinkUse:
    """The LinkUse of the graph edge u-v (full vertex names)."""
    attrs = cluster.graph.edges[u, v]
    ends = sorted((_kind(cluster, u), _kind(cluster, v)), key=_KIND_ORDER.index)
    return LinkUse(link=attrs["link"], joins="-".join(_kind_name(cluster, k) for k in ends),
                   lanes=attrs["lanes"], bandwidth_bytes_per_s=attrs["bandwidth_bytes_per_s"])


def _local_edges(cluster: Any, pairs: Iterable[tuple[int, int]]) -> set[tuple[str, str]]:
    """The template node's edges on the widest paths between local device pairs."""
    node = cluster.node_model
    return {e for a, b in pairs if a != b for e in node.path_edges(a, b)}


def _fabric_uses(cluster: Any, ranks: Sequence[int]) -> list[LinkUse]:
    """The links out of the nodes: each member's path to its nearest NIC, the NIC's fabric
    port, and the spine uplinks where the nodes hang off several leaves."""
    node, per = cluster.node_model, cluster.devices_per_node
    edges: set[tuple[str, str]] = set()
    for r in ranks:
        local = r % per
        edges |= set(node.path_edges(local, node.nearest_nics[local][0]))
    uses = [edge_use(cluster, f"n0.{u}", f"n0.{v}") for u, v in sorted(edges)]
    nic = f"n0.{node.nearest_nics[0][0]}"
    leaf = next(v for v in cluster.graph.neighbors(nic) if _kind(cluster, v) == "leaf")
    uses.append(edge_use(cluster, nic, leaf))
    nodes = {r // per for r in ranks}
    first = min(cluster.leaves_of_node(n)[0] for n in nodes)
    last = max(cluster.leaves_of_node(n)[1] for n in nodes)
    if first != last:
        uses.append(edge_use(cluster, "leaf0", "spine0"))
    return uses


def links_crossed(cluster: Any, ranks: Sequence[int], pattern: str) -> tuple[LinkUse, ...]:
    """The kinds of link the traffic of ``ranks`` crosses (``pattern``: ring, all_to_all or
    p2p in the order given), fastest first, each once."""
    per = cluster.devices_per_node
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // per, []).append(r % per)
    if pattern == "p2p":
        pairs = [(a % per, b % per) for a, b in zip(ranks, ranks[1:]) if a // per == b // per]
        crossing = [r for a, b in zip(ranks, ranks[1:]) if a // per != b // per for r in (a, b)]
    elif pattern in ("ring", "all_to_all"):
        pairs = []
        for local in by_node.values():
            if pattern == "ring":
                pairs += list(zip(local, local[1:] + local[:1]))
            else:
                pairs += [(a, b) for a in local for b in local]
        crossing = list(ranks) if len(by_node) > 1 else []
    else:
        raise ClusterError(f"unknown traffic pattern {pattern!r}; use ring, all_to_all or p2p")
    uses = [edge_use(cluster, f"n0.{u}", f"n0.{v}") for u, v in sorted(_local_edges(cluster, pairs))]
    if crossing:
        uses += _fabric_uses(cluster, crossing)
    return tuple(sorted(set(uses), key=lambda x: (-x.bandwidth_bytes_per_s, x.link, x.joins)))


def group_bandwidth(cluster: Any, ranks: Sequence[int], pattern: str) -> float:
    """Per-rank effective bandwidth of the group's traffic, as the cost model prices it."""
    if len(ranks) < 2:
        return float("inf")
    if pattern == "p2p":
        return min(cluster.p2p_bandwidth_bytes_per_s(a, b) for a, b in zip(ranks, ranks[1:]))
    profile = cluster.group_profile(ranks)
    if pattern == "all_to_all":
        n = len(ranks)
        return (n - 1) / n / profile.all_to_all_s_per_byte
    return profile.ring_bandwidth_bytes_per_s


# ---------------------------------------------------------------- axes
def mesh_axis_groups(cluster: Any, dims: ParallelDims) -> tuple[AxisGroup, ...]:
    """Each mesh axis of more than one rank (tp, cp, ep, dp, pp), by rank 0's group."""
    if dims.world_size != cluster.world_size:
        raise ClusterError(f"the mesh {dims.describe()} has {dims.world_size} ranks but the "
                           f"cluster {cluster.name!r} {cluster.world_size} devices; give the "
                           "plan's cluster")
    per = cluster.devices_per_node
    out = []
    for name in AXIS_ORDER:
        axis = MeshAxis(name)
        size = dims.degree(axis)
        if size < 2:
            continue
        example = dims.group(axis, 0)
        pattern, traffic = AXIS_TRAFFIC[name]
        out.append(AxisGroup(
            axis=name, size=size, num_groups=dims.world_size // size, example=example,
            nodes=tuple(sorted({r // per for r in example})), pattern=pattern, traffic=traffic,
            links=links_crossed(cluster, example, pattern),
            bandwidth_bytes_per_s=group_bandwidth(cluster, example, pattern)))
    return tuple(out)


def axis_groups_text(cluster: Any, groups: Sequence[AxisGroup]) -> str:
    """Per axis: group size and count, rank 0's group, what crosses which links, bandwidth."""
    per = cluster.devices_per_node
    lines = [f"mesh axes on the topology (rank 0's group on each axis; rank r is device "
             f"n<r // {per}>.{cluster.device.kind}<r % {per}>; bandwidths per direction)"]
    if not groups:
        lines.append("  every mesh axis has one rank: no collectives cross any link")
    for g in groups:
        where = fmt_nodes(g.nodes)
        lines.append(f"  {g.axis:<3} {g.size:>5,} ranks x {g.num_groups:,} group"
                     f"{'s' * (g.num_groups != 1)}   rank 0's: {fmt_ranks(g.example)}; {where}")
        lines.append(f"        {g.traffic}")
        lines.append("        crosses " + "; ".join(u.describe() for u in g.links))
        per_rank = ("each send" if g.pattern == "p2p" else "per rank")
        lines.append(f"        {gbps(g.bandwidth_bytes_per_s)} {per_rank} effective "
                     f"(the cost model's {g.pattern.replace('_', '-')} bandwidth)")
    return "\n".join(lines)


def shown_nodes(num_nodes: int, groups: Sequence[AxisGroup] = (), *,
                limit: int = 3) -> tuple[int, ...]:
    """The nodes a picture draws in detail: all of them up to ``limit + 1``; else node 0, the
    next node of each axis's example that spans nodes, then its last, then the cluster's
    first and last nodes, ``limit`` in all."""
    if num_nodes <= limit + 1:
        return tuple(range(num_nodes))
    chosen = [0]
    candidates = [n for g in groups for n in g.nodes[1:2]]
    candidates += [g.nodes[-1] for g in groups] + [1, num_nodes - 1]
    for n in candidates:
        if len(chosen) == limit:
            break
        if n not in chosen:
            chosen.append(n)
    return tuple(sorted(chosen))
