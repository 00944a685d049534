"""Heterogeneous clusters: an ordered list of homogeneous node pools.

A heterogeneous :class:`~autoplan.cluster.Cluster` is written ``dgx-a100-80gb:4+dgx-h100:4``
(presets joined by ``+``) or, in a cluster file, as ``pools:`` (a list of cluster
descriptions, each homogeneous: ``{preset: dgx-h100, num_nodes: 4}``). Ranks are numbered pool
after pool, node-major inside each pool, so the mesh (pp outermost, then dp, cp, tp) puts
pipeline stages, and with pp = 1 data-parallel replicas, on the pools in order.

What every part of autoplan that does not know about pools sees is the *slowest pool's* node
type over all the nodes (:func:`slowest_dict`): the device with the lowest bf16 (else fp32)
peak, its node and NICs. That is the cluster planned as its slowest GPU, the baseline a
heterogeneous plan is compared with, and a safe reading of any figure not priced per pool.

Per pool, :meth:`Cluster.pool_view` is the whole cluster as if every node were that pool's
type: a rank's compute, its tensor-parallel collectives (inside its node) and its memory are
priced on it. A collective or a send whose ranks lie in one pool is priced on that pool's view;
one that crosses pools on the worst of the views it touches (the slower NIC, the longer
latency): :func:`worst_profile`.

Pools must share the backend, the device kind and the devices per node (so the rank layout and
a tensor-parallel group inside one node mean the same thing in every pool).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cluster import values
from autoplan.cluster.collectives import GroupProfile
from autoplan.cluster.values import check_keys, text
from autoplan.errors import ClusterError

# the keys a heterogeneous description may hold at its top level
POOL_TOP_KEYS = ("schema_version", "name", "description", "pools", "source")
MAX_POOLS = 16


@dataclass(frozen=True, kw_only=True)
class Pool:
    """One homogeneous pool: its description (a homogeneous Cluster of its own nodes) and the
    ranks it holds, ``first_rank .. first_rank + num_ranks - 1``."""

    cluster: Any
    first_rank: int

    @property
    def num_ranks(self) -> int:
        return self.cluster.world_size

    @property
    def device(self) -> Any:
        return self.cluster.device

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_ranks)

    def label(self) -> str:
        return f"{self.cluster.name}:{self.cluster.num_nodes}"


def device_speed_flops(device: Any) -> float:
    """The rate pools are ranked by: bf16 peak where the device has one, else fp32."""
    peaks = device.peak_flops
    return float(peaks.get("bf16") or peaks.get("fp32") or max(peaks.values()))


def check_pools(pools: Sequence[Any], where: str) -> None:
    """Refuse pools that cannot share one rank layout, saying which and what to change."""
    if not 1 <= len(pools) <= MAX_POOLS:
        raise ClusterError(f"{where}: a heterogeneous cluster takes 1 to {MAX_POOLS} pools, got "
                           f"{len(pools)}")
    first = pools[0]
    for i, p in enumerate(pools):
        if getattr(p, "pools", None):
            raise ClusterError(f"{where}: pool {i} ({p.name!r}) is itself heterogeneous; list "
                               "its pools one by one")
        for attr, what in (("devices_per_node", "devices per node"), ("backend", "backend")):
            if getattr(p, attr) != getattr(first, attr):
                raise ClusterError(
                    f"{where}: pool {i} ({p.name!r}) has {getattr(p, attr)} {what}, pool 0 "
                    f"({first.name!r}) {getattr(first, attr)}; pools must agree on {what} "
                    "(describe the odd nodes with a cluster file whose node has as many "
                    "devices, or plan the pools separately)")
        if p.device.kind != first.device.kind:
            raise ClusterError(f"{where}: pool {i} has {p.device.kind} devices, pool 0 "
                               f"{first.device.kind}; mix GPU pools with GPU pools only")


def slowest_index(pools: Sequence[Any]) -> int:
    """The pool whose device is slowest (the first of equals)."""
    speeds = [device_speed_flops(p.device) for p in pools]
    return speeds.index(min(speeds))


def slowest_dict(pools: Sequence[Any], name: str) -> dict[str, Any]:
    """The description of the slowest pool's node type over all the pools' nodes."""
    base = pools[slowest_index(pools)].to_dict()
    base["num_nodes"] = sum(p.num_nodes for p in pools)
    base["name"] = name
    base.pop("economics", None)
    return base


def place(pools: Sequence[Any]) -> tuple[Pool, ...]:
    """The pools with the ranks they hold, in order."""
    out, first = [], 0
    for p in pools:
        out.append(Pool(cluster=p, first_rank=first))
        first += p.world_size
    return tuple(out)


def pool_of_rank(pools: Sequence[Pool], rank: int) -> int:
    for i, p in enumerate(pools):
        if rank < p.first_rank + p.num_ranks:
            return i
    raise ClusterError(f"rank {rank} is past the last pool")


def worst_profile(profiles: Sequence[GroupProfile]) -> GroupProfile:
    """A group crossing pools: each bandwidth the lowest and each latency the longest of the
    views it touches (its ring runs at the pace of its slowest link)."""
    first = profiles[0]
    if len(profiles) == 1:
        return first
    return GroupProfile(
        num_ranks=first.num_ranks, num_nodes=first.num_nodes,
        ranks_per_node=first.ranks_per_node,
        ring_bandwidth_bytes_per_s=min(p.ring_bandwidth_bytes_per_s for p in profiles),
        ring_step_latency_s=max(p.ring_step_latency_s for p in profiles),
        intra_bandwidth_bytes_per_s=min(p.intra_bandwidth_bytes_per_s for p in profiles),
        intra_step_latency_s=max(p.intra_step_latency_s for p in profiles),
        inter_bandwidth_bytes_per_s=min(p.inter_bandwidth_bytes_per_s for p in profiles),
        inter_step_latency_s=max(p.inter_step_latency_s for p in profiles),
        all_to_all_s_per_byte=max(p.all_to_all_s_per_byte for p in profiles))


def parse_pool_list(raw: Any, where: str) -> list[Mapping[str, Any]]:
    """The ``pools:`` entry of a cluster file: a non-empty list of mappings."""
    if not isinstance(raw, list) or not raw:
        raise ClusterError(f"{where}: pools must be a non-empty list of cluster descriptions, "
                           f"e.g. [{{preset: dgx-a100-80gb, num_nodes: 4}}, {{preset: dgx-h100, "
                           f"num_nodes: 4}}]; got {raw!r:.80}")
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise ClusterError(f"{where}: pools[{i}] must be a mapping (a cluster description "
                               f"such as {{preset: dgx-h100, num_nodes: 2}}), got {entry!r:.80}")
    return raw


def split_spec(spec: str) -> list[str]:
    """``"a:4+b:2"`` -> ``["a:4", "b:2"]``, refusing empty parts."""
    parts = [p.strip() for p in spec.split("+")]
    if any(not p for p in parts):
        raise ClusterError(f"cluster spec {spec!r} has an empty part around '+'; write "
                           "PRESET:NODES+PRESET:NODES, e.g. dgx-a100-80gb:4+dgx-h100:4")
    return parts


def from_pools_dict(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    """A ``pools:`` description (``cls``: Cluster): each entry a homogeneous description."""
    check_keys(data, POOL_TOP_KEYS, f"{where} (with pools: only these keys at the top; "
               "put device, node and fabric inside each pool)")
    raw = parse_pool_list(data["pools"], where)
    name = text(data.get("name", "heterogeneous"), "name", where)
    members = [cls.from_dict({"name": f"pool{i}", **entry} if "name" not in entry
                             and "preset" not in entry else entry,
                             where=f"{where}: pools[{i}]") for i, entry in enumerate(raw)]
    return join(cls, members, name=name,
                description=text(data.get("description", ""), "description", where,
                                 allow_empty=True),
                source=text(data.get("source", ""), "source", where, allow_empty=True))


def join(cls: Any, pools: Sequence[Any], *, name: str, description: str = "",
         source: str = "", merge: bool = True) -> Any:
    """``Cluster.heterogeneous``: the pools as one Cluster whose own description is the
    slowest pool's node type over all the nodes; one pool, or (``merge``) pools of one node
    type, give the homogeneous cluster of all their nodes."""
    where = f"heterogeneous cluster {name!r}"
    check_pools(pools, where)
    if len(pools) == 1:
        return pools[0]
    if merge and len({_node_type(p) for p in pools}) == 1:
        whole = pools[0].to_dict()
        whole["num_nodes"] = sum(p.num_nodes for p in pools)
        return cls.from_dict({**whole, "name": name}, where=where)
    world = sum(p.world_size for p in pools)
    if world > values.MAX_WORLD_SIZE:
        raise ClusterError(f"{where}: {world:,} devices, over autoplan's limit of "
                           f"{values.MAX_WORLD_SIZE:,}")
    base = {**slowest_dict(pools, name), "description": description, "source": source}
    slow = cls.from_dict(base, where=where)
    kw = {k: getattr(slow, k) for k in ("num_nodes", "devices_per_node", "device", "host",
                                        "backend", "fabric", "unseen")}
    return cls(name=name, node=slow.node_topology, links=dict(slow.links),
               description=description, source=source, pools=tuple(pools), **kw)


def _node_type(cluster: Any) -> str:
    """A pool's description without its words, name and node count: equal for pools of one
    node type."""
    d = {k: v for k, v in cluster.to_dict().items()
         if k not in ("name", "num_nodes", "description", "source", "notes")}
    return json.dumps(d, sort_keys=True)


def describe_pools(cluster: Any) -> list[str]:
    """Lines for ``cluster show``: each pool, its ranks, device and rate, and what crosses."""
    lines = [f"Heterogeneous: {len(cluster.pools)} pools, ranks numbered pool after pool "
             "(pipeline stages, and with pp = 1 data-parallel replicas, fall on them in order)"]
    slow = slowest_index([p.cluster for p in cluster.pools])
    for i, p in enumerate(cluster.pools):
        d, c = p.device, p.cluster
        nic = c.fabric.link if c.fabric is not None else "-"
        lines.append(
            f"  pool {i}: {p.label():<22} ranks {p.first_rank}-{p.first_rank + p.num_ranks - 1}"
            f"  {d.name}, {d.memory_bytes / (1 << 30):.0f} GiB, "
            f"{device_speed_flops(d) / 1e12:,.0f} TFLOP/s peak, fabric {nic}"
            + ("  (slowest)" if i == slow else ""))
    lines.append("  Groups inside one pool are priced on that pool's nodes and NICs; groups "
                 "crossing pools on the slower of them. Every other figure below: the cluster "
                 "as its slowest pool's node type.")
    return lines


__all__ = ["MAX_POOLS", "POOL_TOP_KEYS", "Pool", "check_pools", "describe_pools",
           "device_speed_flops", "from_pools_dict", "join", "parse_pool_list", "place",
           "pool_of_rank", "slowest_dict",
           "slowest_index", "split_spec", "worst_profile"]
