"""The :class:`Cluster`: devices, hosts, topology graph and collective costs.

A cluster is ``num_nodes`` identical nodes of ``devices_per_node`` devices. Rank order is
node-major: ``rank = node * devices_per_node + local``. Descriptions come from presets
(``cost_models/clusters.yaml``), files (YAML or JSON, same schema as :meth:`Cluster.to_dict`),
or the local machine (:meth:`Cluster.local`).

Queries are answered on a contracted view: a group of ranks is reduced to, per node, the set of
local ranks it holds; the node-internal part is computed once per such set on a template node
(``topology.NodeModel``), the inter-node part from the devices' NIC shares and the fat tree.
Both are cached, so pricing a collective over 1,024 GPUs costs microseconds after the first call.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import operator
import os
import types
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autoplan.cluster import specs, values
from autoplan.cluster.hardware import UNSEEN_ASPECTS, Hardware
from autoplan.cluster.collectives import (
    COLLECTIVE_KINDS,
    STEP_OVERHEAD_S,
    CollectiveEstimate,
    GroupProfile,
    check_kind,
    estimate,
    estimate_time_s,
)
from autoplan.cluster.collectives import collective_bytes_per_rank as _bytes_per_rank
from autoplan.cluster.economics import check_overrides
from autoplan.cluster.pools import (from_pools_dict, join, place, pool_of_rank,
                                    slowest_dict, split_spec, worst_profile)
from autoplan.cluster.local import job_shape, local_cluster_dict
from autoplan.cluster.specs import DeviceSpec, HostSpec, LinkSpec
from autoplan.cluster.summary import describe
from autoplan.cluster.values import check_keys, integer, text
from autoplan.cluster.topology import (
    FabricSpec,
    NodeModel,
    NodeTopology,
    build_graph,
    parse_fabric,
    parse_node_topology,
)
from autoplan.errors import ClusterError
from autoplan import safe_io
from autoplan.safe_io import Limits

BACKENDS = ("nccl", "gloo")
TOP_KEYS = ("schema_version", "name", "description", "preset", "num_nodes", "devices_per_node", "backend",
            "device", "host", "links", "node", "fabric", "unseen", "source", "economics", "pools")
# left out of the fingerprint: words, and the prices and power the cost and energy objectives
# read (cluster/economics.py), which change no step time
_DESCRIPTIVE_KEYS = ("description", "source", "notes", "economics")


# a cluster file is a few kilobytes: a large one is a mistake (or an attack), refused early
FILE_LIMITS = Limits(max_bytes=4 << 20, max_depth=32, max_string_chars=64 << 10,
                      max_aliases=256, max_nodes=200_000)


class Cluster:
    """An immutable cluster description with a topology graph and a collective cost model."""

    __slots__ = ("name", "num_nodes", "devices_per_node", "device", "host", "backend", "graph", "links",
                 "node_topology", "fabric", "description", "source", "unseen", "_node", "_leaves", "_names",
                 "_group_cache", "_profile", "_fingerprint", "_device_names", "economics", "pools",
                 "_views", "_time_cache")

    def __init__(self, *, name: str, num_nodes: int, devices_per_node: int, device: DeviceSpec, host: HostSpec,
                 backend: str, node: NodeTopology, links: Mapping[str, LinkSpec], fabric: FabricSpec | None = None,
                 description: str = "", source: str = "", unseen: Sequence[str] = (),
                 economics: Mapping[str, float] | None = None, pools: Sequence[Cluster] = ()) -> None:
        where = f"cluster {name!r}"
        set_ = functools.partial(object.__setattr__, self)
        # heterogeneous: the pools with their ranks; this object's own description is the
        # slowest pool's node type over all their nodes (cluster/pools.py)
        set_("pools", place(pools) if pools else ())
        set_("_views", {})
        set_("name", text(name, "name", "cluster"))
        set_("num_nodes", integer(num_nodes, "num_nodes (nodes)", where))
        set_("devices_per_node", integer(devices_per_node, "devices_per_node", where))
        if backend not in BACKENDS:
            raise ClusterError(f"{where}: backend {backend!r} unknown; use one of {', '.join(BACKENDS)}")
        used = set(node.link_names()) | ({fabric.link} if fabric else set())
        missing = sorted(used - set(links))
        if missing:
            raise ClusterError(f"{where}: link type(s) {', '.join(missing)} used but not defined; add them under links")
        if self.num_nodes > 1 and fabric is None:
            raise ClusterError(f"{where}: {self.num_nodes} nodes need a 'fabric' (link, leaf_ports) joining them; add one")
        nics = [c for c, kind in node.components if kind == "nic"]
        if self.num_nodes > 1 and not nics:
            raise ClusterError(f"{where}: {self.num_nodes} nodes but the node has no 'nic' component; "
                               "add one (components: {nic0: nic}) and link it to a switch or socket")
        bad = [u for u in unseen if u not in UNSEEN_ASPECTS] if isinstance(unseen, (list, tuple)) else [unseen]
        if bad:
            raise ClusterError(f"{where}: unseen lists what discovery could not see, any of "
                               f"{', '.join(UNSEEN_ASPECTS)}; got {bad[0]!r:.80}")
        for attr, value in (("device", device), ("host", host), ("backend", backend), ("node_topology", node),
                            ("fabric", fabric), ("description", description), ("source", source),
                            ("unseen", tuple(sorted(set(unseen)))),
                            ("economics", types.MappingProxyType(dict(check_overrides(
                                economics, f"{where}: economics"))) if economics else None)):
            set_(attr, value)
        set_("links", types.MappingProxyType({k: links[k] for k in sorted(used)}))
        set_("_names", tuple(f"{device.kind}{i}" for i in range(self.devices_per_node)))
        fabric_link = self.links[fabric.link] if fabric else None
        set_("_node", NodeModel(node, self._names, self.links, nic_link=fabric_link, where=f"{where}: node"))
        graph, leaves = build_graph(name=self.name, num_nodes=self.num_nodes, device_names=self._names,
                                    device_kind=device.kind, topology=node, links=self.links, fabric=fabric)
        set_("graph", graph)
        set_("_leaves", leaves)
        set_("_group_cache", {})
        set_("_time_cache", {})
        set_("_profile", functools.lru_cache(maxsize=4096)(self._compute_profile))
        set_("_fingerprint", None)
        set_("_device_names", tuple(f"n{n}.{d}" for n in range(self.num_nodes) for d in self._names))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Cluster is immutable; cannot set {key!r} (build a new one with from_dict)")

    def __repr__(self) -> str:
        return (f"Cluster(name={self.name!r}, num_nodes={self.num_nodes}, devices_per_node={self.devices_per_node}, "
                f"device={self.device.name!r}, backend={self.backend!r})")

    def __reduce__(self):
        # pickle / deepcopy through the description: caches are rebuilt, not copied
        return (Cluster.from_dict, (self.to_dict(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    # ------------------------------------------------------------------ ranks
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def device_names(self) -> tuple[str, ...]:
        """Graph vertex of each rank, in rank order (node-major)."""
        return self._device_names

    @property
    def node_model(self) -> NodeModel:
        """The analysis of one (template) node: paths, rings, nearest NICs."""
        return self._node

    def leaves_of_node(self, node: int) -> tuple[int, int]:
        """The first and last fabric leaf node ``node``'s NICs attach to ((0, 0) without one)."""
        return self._leaves[node]

    def node_of(self, rank: int) -> int:
        return self._check_rank(rank) // self.devices_per_node

    def _check_rank(self, rank: Any) -> int:
        """The rank as an int (numpy integers accepted), or ClusterError."""
        try:
            value = None if isinstance(rank, bool) else operator.index(rank)
        except TypeError:
            value = None
        if value is None or not 0 <= value < self.world_size:
            raise ClusterError(f"rank {rank!r} is not in this cluster (world size {self.world_size}: ranks 0.."
                               f"{self.world_size - 1})")
        return value

    # ------------------------------------------------------------------ collectives
    @staticmethod
    def collective_bytes_per_rank(kind: str, nbytes: float, n: int) -> float:
        """Bytes each rank sends on the wire (see :func:`collectives.collective_bytes_per_rank`)."""
        return _bytes_per_rank(kind, nbytes, n)

    def collective_time_s(self, kind: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Seconds for one collective over ``ranks`` (``nbytes``: the full buffer on each rank);
        kept per (kind, bytes, group profile): the planner asks the same again and again."""
        profile = self.group_profile(ranks)
        return self._kept((kind, type(nbytes), nbytes, id(profile)), profile, lambda: estimate_time_s(
            kind, nbytes, profile, step_overhead_s=STEP_OVERHEAD_S[self.backend]))

    def _kept(self, key: tuple, owner: Any, make: Any) -> float:
        """``make()``, kept under ``key`` with ``owner`` (checked by identity where the key holds
        its id); arguments that cannot be a key (not numbers) are not kept: ``make`` says why."""
        try:
            hit = self._time_cache.get(key)
        except TypeError:
            return make()
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = make()
        if len(self._time_cache) >= 65536:
            self._time_cache.clear()
        self._time_cache[key] = (owner, value)
        return value

    def collective_estimate(self, kind: str, nbytes: float, ranks: Sequence[int]) -> CollectiveEstimate:
        """Like :meth:`collective_time_s` but with the algorithm chosen and the alternatives."""
        check_kind(kind)
        return estimate(kind, nbytes, self.group_profile(ranks), step_overhead_s=STEP_OVERHEAD_S[self.backend])

    def group_bandwidth_bytes_per_s(self, ranks: Sequence[int]) -> float:
        """Per-rank bandwidth a (multi-channel) ring over ``ranks`` gets; inf for one rank."""
        return self.group_profile(ranks).ring_bandwidth_bytes_per_s

    def p2p_time_s(self, nbytes: float, src_rank: int, dst_rank: int) -> float:
        """Seconds to send ``nbytes`` from one rank to another (path bandwidth + path latency);
        kept per (bytes, ranks), the arguments' types included."""
        return self._kept(("p2p", type(nbytes), nbytes, type(src_rank), src_rank, type(dst_rank),
                           dst_rank), None, lambda: self._p2p_time_s(nbytes, src_rank, dst_rank))

    def _p2p_time_s(self, nbytes: float, src_rank: int, dst_rank: int) -> float:
        src_rank, dst_rank = self._check_rank(src_rank), self._check_rank(dst_rank)
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not 0 <= nbytes < math.inf:
            raise ClusterError(f"nbytes must be a number >= 0, got {nbytes!r}")
        if src_rank == dst_rank:
            return 0.0
        if self.pools:
            return max(self.pool_view(i).p2p_time_s(nbytes, src_rank, dst_rank)
                       for i in sorted({self.pool_of(src_rank), self.pool_of(dst_rank)}))
        bw, lat = self._p2p(src_rank, dst_rank)
        return nbytes / bw + lat + STEP_OVERHEAD_S[self.backend]

    def p2p_bandwidth_bytes_per_s(self, src_rank: int, dst_rank: int) -> float:
        """Effective bandwidth of a send from one rank to another; inf to itself."""
        src_rank, dst_rank = self._check_rank(src_rank), self._check_rank(dst_rank)
        if self.pools and src_rank != dst_rank:
            return min(self.pool_view(i).p2p_bandwidth_bytes_per_s(src_rank, dst_rank)
                       for i in sorted({self.pool_of(src_rank), self.pool_of(dst_rank)}))
        return math.inf if src_rank == dst_rank else self._p2p(src_rank, dst_rank)[0]

    def _p2p(self, src_rank: int, dst_rank: int) -> tuple[float, float]:
        """(bandwidth, latency) of the path between two different ranks."""
        (n_src, l_src), (n_dst, l_dst) = divmod(src_rank, self.devices_per_node), divmod(dst_rank, self.devices_per_node)
        if n_src == n_dst:
            return self._node.p2p(l_src, l_dst)
        spans = self._spans_leaves((n_src, n_dst))
        shares = self._node.nic_share_bytes_per_s
        bw = min(shares[l_src], shares[l_dst]) * self._fabric_factor(spans)
        lat = self._node.nic_latency_s[l_src] + self._node.nic_latency_s[l_dst] + self._fabric_latency_s(spans)
        return bw, lat

    def group_profile(self, ranks: Sequence[int]) -> GroupProfile:
        """The contracted view of a group: bandwidths and per-step latencies (cached)."""
        # the planner asks again and again with the same (memoized) group object: found by
        # its identity before hashing every rank of it
        by_id = self._group_cache.get(("id", id(ranks)))
        if by_id is not None and by_id[0] is ranks:
            return by_id[1]
        key = tuple(ranks)
        cached = self._group_cache.get(key)
        if cached is not None:
            if isinstance(ranks, tuple):
                self._group_cache[("id", id(ranks))] = (ranks, cached)
            return cached
        if not key:
            raise ClusterError("a collective needs at least one rank, got an empty group")
        by_node: dict[int, list[int]] = {}
        for rank in key:
            node, local = divmod(self._check_rank(rank), self.devices_per_node)
            by_node.setdefault(node, []).append(local)
        if sum(len(v) for v in by_node.values()) != len(set(key)):
            dupes = sorted(r for r, c in Counter(key).items() if c > 1)
            raise ClusterError(f"ranks {dupes} appear more than once in the group; list each rank once")
        if self.pools:      # on the pools it touches, at the pace of the slowest
            profile = worst_profile([self.pool_view(i).group_profile(key)
                                     for i in sorted({self.pool_of(r) for r in key})])
        else:
            signature = tuple(sorted(Counter(tuple(sorted(v)) for v in by_node.values()).items()))
            profile = self._profile(signature, self._spans_leaves(by_node))
        if len(self._group_cache) >= 8192:
            self._group_cache.clear()
        self._group_cache[key] = profile
        return profile

    def _spans_leaves(self, nodes) -> bool:
        if self.fabric is None:
            return False
        first = min(self._leaves[n][0] for n in nodes)
        last = max(self._leaves[n][1] for n in nodes)
        return first != last

    def _fabric_factor(self, spans: bool) -> float:
        return 1.0 / self.fabric.oversubscription if spans and self.fabric else 1.0

    def _fabric_latency_s(self, spans: bool) -> float:
        hop = self.links[self.fabric.link].latency_s
        return hop * (4 if spans else 2)

    def _compute_profile(self, signature: tuple[tuple[tuple[int, ...], int], ...], spans: bool) -> GroupProfile:
        num_ranks = sum(len(s) * c for s, c in signature)
        num_nodes = sum(c for _, c in signature)
        sizes = {len(s) for s, _ in signature}
        intra_bw, intra_lat = math.inf, 0.0
        for subset, _ in signature:
            bw, lat = self._node.ring(subset)
            intra_bw, intra_lat = min(intra_bw, bw), max(intra_lat, lat)
        a2a = max(self._node.all_to_all_load(s) for s, _ in signature) / num_ranks
        if num_nodes == 1:
            return GroupProfile(
                num_ranks=num_ranks, num_nodes=1, ranks_per_node=num_ranks, ring_bandwidth_bytes_per_s=intra_bw,
                ring_step_latency_s=intra_lat, intra_bandwidth_bytes_per_s=intra_bw, intra_step_latency_s=intra_lat,
                inter_bandwidth_bytes_per_s=math.inf, inter_step_latency_s=0.0, all_to_all_s_per_byte=a2a)
        factor = self._fabric_factor(spans)
        shares, nic_lat = self._node.nic_share_bytes_per_s, self._node.nic_latency_s
        crossing = min(sum(shares[i] for i in s) for s, _ in signature) * factor
        per_rank = min(shares[i] for s, _ in signature for i in s) * factor
        inter_lat = 2 * max(nic_lat[i] for s, _ in signature for i in s) + self._fabric_latency_s(spans)
        for subset, _ in signature:
            k = len(subset)
            a2a = max(a2a, k * (num_ranks - k) / num_ranks / (sum(shares[i] for i in subset) * factor))
        return GroupProfile(
            num_ranks=num_ranks, num_nodes=num_nodes, ranks_per_node=sizes.pop() if len(sizes) == 1 else 0,
            ring_bandwidth_bytes_per_s=min(intra_bw, crossing), ring_step_latency_s=max(intra_lat, inter_lat),
            intra_bandwidth_bytes_per_s=intra_bw, intra_step_latency_s=intra_lat,
            inter_bandwidth_bytes_per_s=per_rank, inter_step_latency_s=inter_lat, all_to_all_s_per_byte=a2a)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Self-contained description (device, host and link specs inlined); from_dict reads it back."""
        if self.pools:
            return {"schema_version": specs.SCHEMA_VERSION, "name": self.name,
                    "description": self.description,
                    "pools": [p.cluster.to_dict() for p in self.pools], "source": self.source}
        return {
            "schema_version": specs.SCHEMA_VERSION, "name": self.name, "description": self.description,
            "num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node, "backend": self.backend,
            "device": self.device.to_dict(), "host": self.host.to_dict(),
            "links": {name: link.to_dict() for name, link in self.links.items()},
            "node": self.node_topology.to_dict(), "fabric": self.fabric.to_dict() if self.fabric else None,
            **({"unseen": list(self.unseen)} if self.unseen else {}),
            **({"economics": dict(self.economics)} if self.economics else {}),
            "source": self.source,
        }

    def hardware(self) -> Hardware:
        """What plans are matched by: device model, kind and memory, backend, nodes, devices per
        node, the links at a device and the network (``cluster/hardware.py``); not the name."""
        return Hardware.of(self)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of :meth:`to_dict`, without the purely descriptive fields
        (description, source): this exact description, name and calibrated figures included
        (plans are matched to clusters by :meth:`hardware`, not by this)."""
        if self._fingerprint is None:
            canonical = json.dumps(_strip_descriptive(self.to_dict()), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_fingerprint", hashlib.sha256(canonical.encode()).hexdigest())
        return self._fingerprint

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "cluster") -> Cluster:
        """Build from a mapping (the to_dict / clusters.yaml schema). ``preset: NAME`` starts from a
        preset and overrides its keys (``host`` and ``fabric`` key by key)."""
        check_keys(data, TOP_KEYS, where)
        if "schema_version" in data and data["schema_version"] != specs.SCHEMA_VERSION:
            raise ClusterError(f"{where}: schema_version {data['schema_version']!r} unsupported; "
                               f"this autoplan reads version {specs.SCHEMA_VERSION}")
        data = dict(data)
        if "pools" in data:
            return from_pools_dict(cls, data, where)
        if "preset" in data:
            base_name = text(data.pop("preset"), "preset", where)
            base = specs.preset_entry(base_name)
            for key in ("host", "fabric"):
                if isinstance(base.get(key), Mapping) and isinstance(data.get(key), Mapping):
                    data[key] = {**base[key], **data[key]}
            data = {"name": base_name, **base, **data}
        check_keys(data, TOP_KEYS, where, required=("name", "devices_per_node", "device", "host", "node"))
        name = text(data["name"], "name", where)
        where = f"{where} {name!r}" if where == "cluster" else where
        links = dict(_file_links(data.get("links"), where))
        known = tuple(dict.fromkeys([*links, *specs.link_names()]))
        device_raw = data["device"]
        if isinstance(device_raw, str):
            device = specs.load_device(device_raw)
        else:
            device = DeviceSpec.from_dict(device_raw, where=f"{where}: device")
        per_node = integer(data["devices_per_node"], "devices_per_node", where,
                           maximum=values.MAX_DEVICES_PER_NODE)
        num_nodes = integer(data.get("num_nodes", 1), "num_nodes (nodes)", where,
                            maximum=values.MAX_NODES)
        if num_nodes * per_node > values.MAX_WORLD_SIZE:
            raise ClusterError(f"{where}: {num_nodes:,} nodes x {per_node} devices is "
                               f"{num_nodes * per_node:,} devices, over autoplan's limit of "
                               f"{values.MAX_WORLD_SIZE:,}")
        names = [f"{device.kind}{i}" for i in range(per_node)]
        node = parse_node_topology(data["node"], device_names=names, known_links=known, where=f"{where}: node")
        fabric = None
        if data.get("fabric") is not None:
            fabric = parse_fabric(data["fabric"], known_links=known, where=f"{where}: fabric")
        for link_name in set(node.link_names()) | ({fabric.link} if fabric else set()):
            if link_name not in links:
                links[link_name] = specs.load_link(link_name)
        return cls(
            name=name, num_nodes=num_nodes,
            devices_per_node=per_node, device=device,
            host=HostSpec.from_dict(data["host"], where=f"{where}: host"),
            backend=data.get("backend", "nccl" if device.kind == "gpu" else "gloo"),
            node=node, links=links, fabric=fabric,
            description=text(data.get("description", ""), "description", where, allow_empty=True),
            source=text(data.get("source", ""), "source", where, allow_empty=True),
            unseen=data.get("unseen") or (),
            economics=data.get("economics"),
        )

    @classmethod
    def heterogeneous(cls, pools: Sequence[Cluster], *, name: str, description: str = "",
                      source: str = "", merge: bool = True) -> Cluster:
        """Pools of homogeneous nodes, ranks numbered pool after pool. One pool, or (with
        ``merge``) pools of one node type: the homogeneous cluster of all their nodes, which
        plans as it always did (``pools.join``)."""
        return join(cls, pools, name=name, description=description, source=source, merge=merge)

    # ------------------------------------------------------------------ pools
    @property
    def is_heterogeneous(self) -> bool:
        return bool(self.pools)

    def pool_of(self, rank: int) -> int:
        """The index of the pool holding ``rank`` (0 on a homogeneous cluster)."""
        rank = self._check_rank(rank)
        return pool_of_rank(self.pools, rank) if self.pools else 0

    def device_of(self, rank: int) -> DeviceSpec:
        """The device spec of ``rank``."""
        return self.pools[self.pool_of(rank)].device if self.pools else self.device

    def pool_view(self, index: int) -> Cluster:
        """The whole cluster as if every node were pool ``index``'s type (homogeneous; the
        cluster itself when it has no pools)."""
        if not self.pools:
            return self
        view = self._views.get(index)
        if view is None:
            entry = self.pools[index].cluster.to_dict()
            entry["num_nodes"] = self.num_nodes
            entry.pop("economics", None)
            view = self._views[index] = Cluster.from_dict(entry, where=f"{self.name}: pool {index}")
        return view

    def slowest(self) -> Cluster:
        """The cluster as its slowest pool's node type over all the nodes (itself when
        homogeneous): the baseline a heterogeneous plan is compared with."""
        if not self.pools:
            return self
        return Cluster.from_dict(slowest_dict([p.cluster for p in self.pools],
                                              f"{self.name} as slowest"), where=self.name)

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A preset from ``cost_models/clusters.yaml`` with ``nodes`` nodes; ``"NAME/K"``: its
        nodes with only their first ``K`` devices (``cluster/node_part.py``)."""
        entry = specs.preset_entry(name)
        entry["num_nodes"] = integer(nodes, "nodes", f"preset {name!r}", maximum=values.MAX_NODES)
        return cls.from_dict({"name": name, **entry}, where=f"preset {name!r}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a YAML (``.yaml``/``.yml``) or JSON cluster file."""
        file = Path(path)
        what = f"cluster file {str(file)!r}"
        body = safe_io.read_text(file, what="cluster file", error=ClusterError, limits=FILE_LIMITS)
        parse = safe_io.parse_json if file.suffix.lower() == ".json" else safe_io.parse_yaml
        data = parse(body, what=what, error=ClusterError, limits=FILE_LIMITS)
        if not isinstance(data, Mapping):
            raise ClusterError(f"cluster file {str(file)!r} must hold a mapping at the top level, "
                               f"got {type(data).__name__}")
        if "name" not in data and "preset" not in data:
            data = {"name": file.stem, **data}
        return cls.from_dict(data, where=f"cluster file {str(file)!r}")

    @classmethod
    def local(cls, nproc: int | None = None, *, nodes: int = 1,
              calibration: Mapping[str, float] | None = None) -> Cluster:
        """This machine: its GPUs (NCCL) if CUDA is present, else ``nproc`` CPU rank processes
        (gloo); with ``nodes`` > 1, that many nodes like it (the network between them is not
        seen: listed in ``unseen``)."""
        return cls.from_dict(local_cluster_dict(nproc, nodes=nodes, calibration=calibration),
                             where="local cluster")

    @classmethod
    def local_job(cls, *, calibration: Mapping[str, float] | None = None) -> Cluster:
        """The machines of this ``torchrun`` job: ``LOCAL_WORLD_SIZE`` ranks on each of
        ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes like this one (one process outside a job)."""
        nproc, nodes = job_shape()
        return cls.local(nproc, nodes=nodes, calibration=calibration)

    @classmethod
    def from_spec(cls, spec: str) -> Cluster:
        """CLI helper: ``"dgx-a100-80gb:4"`` (preset:nodes), a preset name, ``"dgx-h100/1"`` (one
        node with only its first GPU; ``"dgx-h100/2:4"``: four such nodes of two GPUs),
        ``"local"``, ``"local:4"``, or a path to a cluster file."""
        spec = text(spec, "cluster spec", "cluster spec").strip()
        if os.path.exists(spec):
            return cls.from_file(spec)
        if "+" in spec:        # pools, e.g. dgx-a100-80gb:4+dgx-h100:4
            parts = split_spec(spec)
            if any(p.partition(":")[0] == "local" for p in parts):
                raise ClusterError(f"cluster spec {spec!r}: 'local' cannot be a pool; join "
                                   "presets (PRESET:NODES+PRESET:NODES) or write a cluster file "
                                   "with pools:")
            return cls.heterogeneous([cls.from_spec(p) for p in parts], name=spec)
        head, sep, tail = spec.partition(":")
        count = None
        if sep:
            try:
                count = int(tail)
            except ValueError:
                raise ClusterError(f"cluster spec {spec!r}: {tail!r} after ':' is not a whole number "
                                   "(write NAME:NODES, e.g. dgx-a100-80gb:4, or local:NPROC)") from None
        if head == "local":
            return cls.local(count)
        if specs.is_preset(head):
            return cls.preset(head, count if count is not None else 1)
        raise ClusterError(f"cluster spec {spec!r} is neither a file nor a preset; presets: "
                           f"{', '.join(specs.preset_names())} (PRESET/K: the node's first K "
                           "devices, e.g. dgx-h100/1); or 'local', 'local:NPROC', or a .yaml/.json path")

    # ------------------------------------------------------------------ summary
    def describe(self) -> str:
        """A multi-line human summary (for ``autoplan cluster show``; ``cluster/summary.py``)."""
        return describe(self)


def _strip_descriptive(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _strip_descriptive(v) for k, v in value.items() if k not in _DESCRIPTIVE_KEYS}
    if isinstance(value, list):
        return [_strip_descriptive(v) for v in value]
    return value


def _file_links(raw: Any, where: str) -> dict[str, LinkSpec]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{where}: links must be a mapping link name -> link spec, got {raw!r}")
    return {name: LinkSpec.from_dict(entry, name=name, where=f"{where}: links.{name}") for name, entry in raw.items()}


__all__ = ["BACKENDS", "COLLECTIVE_KINDS", "Cluster", "CollectiveEstimate", "GroupProfile"]
