"""Device meshes over a cluster and where their ranks land on the topology.

Ranks are laid out pipeline-outermost, tensor-parallel innermost (``sharding/mesh_axes.py``), and
rank r runs on the cluster's r-th device (node-major). So a tensor-parallel group is ``tp``
consecutive devices of one node, inside the node's fastest domain (NVSwitch / NVLink) whenever
``tp`` divides the devices per node; data-parallel peers of a group sit at the same position on
other GPUs or nodes. ``enumerate_meshes`` keeps tensor parallelism inside a node unless a node
holds a single device; pipeline degrees join in the pipeline issue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoplan.errors import ConfigError
from autoplan.sharding.mesh_axes import ParallelDims


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_meshes(cluster: Any, *, max_tp: int | None = None, max_pp: int | None = None,
                     num_layers: int = 1, allow_cross_node_tp: bool = False,
                     context_degrees: Sequence[int] = ()) -> list[ParallelDims]:
    """pp x dp x cp x tp shapes covering the cluster: tp inside a node (tp divides the node's
    devices), pp at most the number of layers (stages are contiguous layer ranges); a cp axis
    of each of ``context_degrees`` (the sequence split over an axis of its own) where it
    divides the rest."""
    world = cluster.world_size
    per_node = cluster.devices_per_node
    out = []
    for tp in divisors(world):
        if max_tp is not None and tp > max_tp:
            continue
        inside = per_node % tp == 0
        if not inside and not (allow_cross_node_tp and tp % per_node == 0):
            continue
        for pp in divisors(world // tp):
            if pp > max(1, num_layers) or (max_pp is not None and pp > max_pp):
                continue
            out.append(ParallelDims(dp=world // (tp * pp), tp=tp, pp=pp))
            out += [ParallelDims(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
                    for cp in context_degrees if cp > 1 and (world // (tp * pp)) % cp == 0]
    return out


def rank_to_device(cluster: Any, world_size: int) -> tuple[str, ...]:
    if world_size != cluster.world_size:
        raise ConfigError(f"a mesh of {world_size} ranks does not cover the cluster's "
                          f"{cluster.world_size} devices")
    return tuple(cluster.device_names)


def tp_domain(cluster: Any, ranks: tuple[int, ...]) -> str:
    """What joins one tensor-parallel group: nvswitch, nvlink, pcie, node (CPU ranks), network."""
    if len(ranks) <= 1:
        return "none"
    if len({cluster.node_of(r) for r in ranks}) > 1:
        return "network"
    g = cluster.graph
    names = [cluster.device_names[r] for r in ranks]
    if cluster.device.kind == "cpu":
        return "node"

    def neighbours(n: str) -> dict[str, str]:
        return {m: g.edges[n, m].get("link", "") for m in g.neighbors(n)}
    switch_sets = []
    for n in names:
        switch_sets.append({m for m, link in neighbours(n).items()
                            if g.nodes[m].get("kind") == "nvswitch"})
    if all(switch_sets) and set.intersection(*switch_sets):
        return "nvswitch"
    if all(names[j] in neighbours(names[i]) and "nvlink" in neighbours(names[i])[names[j]]
           for i in range(len(names)) for j in range(len(names)) if i != j):
        return "nvlink"
    return "pcie"
