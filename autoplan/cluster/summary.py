"""The human summary of a :class:`~autoplan.cluster.Cluster` (``autoplan cluster show``): its
devices, host, node, links, fabric, and what a few representative groups' collectives cost."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from autoplan.cluster.collectives import COLLECTIVE_KINDS
from autoplan.cluster.pools import describe_pools

_GIB = 1 << 30


def describe(cluster: Any) -> str:
    """A multi-line summary; a cluster of pools lists them, then its slowest pool's details."""
    if cluster.pools:
        return "\n".join([f"Cluster {cluster.name}: {cluster.world_size} ranks in "
                          f"{len(cluster.pools)} pools", *describe_pools(cluster),
                          *describe_homogeneous(cluster).splitlines()[1:]])
    return describe_homogeneous(cluster)


def describe_homogeneous(cluster: Any) -> str:
    """One node type's summary."""
    d, h, n = cluster.device, cluster.host, cluster.devices_per_node
    rates = ", ".join(f"{k} {v / 1e12:g}" for k, v in sorted(d.peak_flops.items(), key=lambda kv: -kv[1]))
    lines = [
        f"Cluster {cluster.name}: {cluster.num_nodes} node(s) x {n} {d.name} = {cluster.world_size} ranks, "
        f"backend {cluster.backend}",
    ]
    if cluster.description:
        lines.append(f"  {cluster.description}")
    if cluster.unseen:
        lines.append(f"  not discovered (assumed): {', '.join(cluster.unseen)}; describe them with a "
                     "cluster file where it matters")
    lines += [
        f"Device {d.name} ({d.kind}): {d.memory_bytes / _GIB:.1f} GiB, "
        f"{d.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s memory, "
        f"peak TFLOP/s {rates}; efficiency matmul {d.matmul_efficiency:.2f}, memory {d.memory_efficiency:.2f}; "
        f"launch {d.kernel_launch_s * 1e6:.1f} us" + (
            "" if d.matmul_shape_efficiency is None else
            f"; layer products at the rate of their shape (measured M, N, K "
            f"{d.matmul_shape_efficiency.sides[0]:,.0f} to "
            f"{d.matmul_shape_efficiency.sides[-1]:,.0f})"),
        f"Host per node: {h.memory_bytes / _GIB:,.0f} GiB DRAM; "
        f"per device {h.device_to_host_bandwidth_bytes_per_s / 1e9:.1f} GB/s "
        f"to host, CPU Adam {h.cpu_adam_params_per_s:.2g} params/s",
        "Node: " + ", ".join(f"{c} {k}" for k, c in Counter(k for _, k in cluster.node_topology.components).items()),
        "Links (per direction, per lane; effective = x efficiency):",
    ]
    lanes = Counter()
    for li in cluster.node_topology.links:
        lanes[li.link] += li.lanes
    nics = sum(1 for _, kind in cluster.node_topology.components if kind == "nic")
    for name, link in cluster.links.items():
        use = f"{lanes[name]} lanes per node" if name in lanes else f"fabric, {nics} NIC ports per node"
        lines.append(f"  {name:<10} {link.bandwidth_bytes_per_s / 1e9:8.2f} GB/s  eff {link.efficiency:.2f}  "
                     f"latency {link.latency_s * 1e6:5.2f} us  ({use})")
    if cluster.fabric is not None:
        f = cluster.fabric
        leaves = math.ceil(cluster.num_nodes * nics / f.leaf_ports)
        lines.append(f"Fabric: {f.link} two-level fat tree, {f.leaf_ports} NIC ports per leaf, {leaves} leaves, "
                     f"{f.num_spines if leaves > 1 else 0} spines, oversubscription {f.oversubscription:g}")
    lines.append(f"Graph: {cluster.graph.number_of_nodes()} vertices, {cluster.graph.number_of_edges()} edges")
    groups = _groups(cluster)
    lines.append("Per-rank ring bandwidth (effective):")
    for label, ranks in groups:
        lines.append(f"  {label:<34} {cluster.group_bandwidth_bytes_per_s(ranks) / 1e9:9.2f} GB/s")
    lines.append("Collective times for 1 GiB (ms):")
    lines.append(f"  {'group':<34}" + "".join(f"{k:>15}" for k in COLLECTIVE_KINDS))
    for label, ranks in groups:
        times = [cluster.collective_time_s(k, float(_GIB), ranks) * 1e3 for k in COLLECTIVE_KINDS]
        lines.append(f"  {label:<34}" + "".join(f"{t:15.3f}" for t in times))
    if cluster.world_size > 1:
        last = cluster.world_size - 1
        lines.append(f"p2p 1 GiB, rank 0 -> {last}: {cluster.p2p_time_s(float(_GIB), 0, last) * 1e3:.3f} ms")
    return "\n".join(lines)


def _groups(cluster: Any) -> list[tuple[str, list[int]]]:
    """Representative groups: one node, one rank per node, the whole cluster."""
    n = cluster.devices_per_node
    groups = [(f"intra-node ({n} ranks)", list(range(n)))] if n > 1 else []
    if cluster.num_nodes > 1:
        groups.append((f"one rank per node ({cluster.num_nodes} ranks)", [i * n for i in range(cluster.num_nodes)]))
        groups.append((f"whole cluster ({cluster.world_size} ranks)", list(range(cluster.world_size))))
    return groups or [("single rank", [0])]
