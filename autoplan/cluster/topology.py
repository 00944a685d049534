"""Cluster topology: parse a node/fabric description, build the networkx graph, and analyse one
node on a small contracted view.

The model (why it is shaped like this):

* All nodes are identical, so everything about the inside of a node is computed once, on a
  *template* node graph of a few dozen vertices (``NodeModel``), and cached per set of local
  ranks. The full graph (up to thousands of vertices) is built for inspection and export only;
  no query walks it.
* Devices are endpoints, never routers: a path between two GPUs may cross switches, sockets and
  NICs but not a third GPU (NCCL does not forward ring traffic through a bystander GPU either).
* Link capacities are per direction and *effective* (peak x efficiency). A ring sends in one
  direction, so a ring hop loads each directed edge of its path; when several hops of a ring
  cross the same directed edge (a PCIe switch uplink, the inter-socket link) they share it.
* Collective libraries run several rings at once (NCCL "channels"). ``NodeModel.ring`` packs
  rings greedily: find the best ring on the residual capacities, subtract what it uses, repeat
  while a new ring adds at least a quarter of the first ring's bandwidth, using only the link
  types of the first ring. On an NVSwitch node the
  first ring already saturates every GPU's links; on the DGX-1 hybrid cube-mesh the packing finds
  the NVLink rings in both directions (all six links per GPU).
* Traffic leaving a node goes through the NICs nearest to each device (fewest hops, ties split).
  A device's *NIC share* is its fair part of those NICs when every device of the node is busy,
  which is how parallel groups run (sibling groups tile the rest of the mesh).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from autoplan.cluster.specs import LinkSpec
from autoplan.cluster.values import check_keys, integer, number, text
from autoplan.errors import ClusterError

COMPONENT_KINDS = ("nvswitch", "pcie_switch", "socket", "nic")
NODE_KEYS = ("components", "links")
LINK_KEYS = ("a", "b", "link", "lanes")
FABRIC_KEYS = ("link", "leaf_ports", "oversubscription", "spines", "source", "notes")
MAX_RING_ROUNDS = 16
MIN_RING_FRACTION = 0.25  # stop packing rings once a new ring adds less than this of the first
MAX_HAMILTONIAN_MEMBERS = 8
MAX_HAMILTONIAN_CYCLES = 2000


@dataclass(frozen=True, kw_only=True)
class LinkInstance:
    """One cable (or bundle of ``lanes`` identical cables) between two vertices of a node."""

    a: str
    b: str
    link: str
    lanes: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "link": self.link, "lanes": self.lanes}


@dataclass(frozen=True, kw_only=True)
class NodeTopology:
    """The inside of one node: non-device components (name -> kind) and the links."""

    components: tuple[tuple[str, str], ...]
    links: tuple[LinkInstance, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"components": dict(self.components), "links": [link.to_dict() for link in self.links]}

    def link_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(link.link for link in self.links))


@dataclass(frozen=True, kw_only=True)
class FabricSpec:
    """Two-level fat tree (leaf/spine) joining the nodes' NICs.

    NIC ports attach to leaves in order (``leaf_ports`` per leaf). Each leaf has
    ``leaf_ports * port bandwidth / oversubscription`` of uplink, split over ``spines`` spines
    (default ``ceil(leaf_ports / oversubscription)``: one cable per spine, as in a real two-level
    fat tree). ``oversubscription`` 1.0 is non-blocking.
    """

    link: str
    leaf_ports: int
    oversubscription: float = 1.0
    spines: int | None = None
    source: str = "not given"

    @property
    def num_spines(self) -> int:
        if self.spines is not None:
            return self.spines
        return max(1, math.ceil(self.leaf_ports / self.oversubscription))

    def to_dict(self) -> dict[str, Any]:
        return {"link": self.link, "leaf_ports": self.leaf_ports, "oversubscription": self.oversubscription,
                "spines": self.spines, "source": self.source}


# --------------------------------------------------------------------------- parsing
def _names(value: Any, what: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ClusterError(f"{where}: {what} must be a name or a non-empty list of names, got {value!r}")


def parse_node_topology(raw: Any, *, device_names: Sequence[str], known_links: Sequence[str],
                        where: str) -> NodeTopology:
    """Validate a ``node:`` mapping. ``a``/``b`` may be lists: they are zipped (a single name is
    repeated), so ``{a: [gpu0, gpu1], b: nvswitch, link: nvlink3, lanes: 12}`` is two links."""
    check_keys(raw, NODE_KEYS, where, required=("links",))
    components_raw = raw.get("components") or {}
    if not isinstance(components_raw, Mapping):
        raise ClusterError(f"{where}.components: expected a mapping name -> kind, got {components_raw!r}")
    devices = set(device_names)
    components: list[tuple[str, str]] = []
    for name, kind in components_raw.items():
        text(name, "component name", f"{where}.components")
        if name in devices or "." in name:
            raise ClusterError(
                f"{where}.components: name {name!r} is reserved or invalid (device names are "
                f"{device_names[0]}..{device_names[-1]}; names may not contain '.'); rename it")
        if kind not in COMPONENT_KINDS:
            raise ClusterError(f"{where}.components.{name}: kind {kind!r} unknown; allowed: {', '.join(COMPONENT_KINDS)}")
        components.append((name, kind))
    vertices = devices | {name for name, _ in components}
    links_raw = raw["links"]
    if not isinstance(links_raw, list):
        raise ClusterError(f"{where}.links: expected a list of links, got {links_raw!r}")
    links: list[LinkInstance] = []
    seen: dict[frozenset[str], str] = {}
    for index, entry in enumerate(links_raw):
        at = f"{where}.links[{index}]"
        check_keys(entry, LINK_KEYS, at, required=("a", "b", "link"))
        ends_a, ends_b = _names(entry["a"], "a", at), _names(entry["b"], "b", at)
        if len(ends_a) > 1 and len(ends_b) > 1 and len(ends_a) != len(ends_b):
            raise ClusterError(f"{at}: lists a ({len(ends_a)} names) and b ({len(ends_b)} names) must have the same length")
        count = max(len(ends_a), len(ends_b))
        ends_a = ends_a * count if len(ends_a) == 1 else ends_a
        ends_b = ends_b * count if len(ends_b) == 1 else ends_b
        link_name = text(entry["link"], "link", at)
        if link_name not in known_links:
            raise ClusterError(f"{at}: unknown link type {link_name!r}; known link types: {', '.join(known_links)} "
                               "(or define it under 'links:' in the cluster file)")
        lanes = integer(entry.get("lanes", 1), "lanes", at)
        for a, b in zip(ends_a, ends_b):
            for end in (a, b):
                if end not in vertices:
                    declared = ", ".join(n for n, _ in components) or "none"
                    raise ClusterError(f"{at}: endpoint {end!r} is neither a device ({device_names[0]}.."
                                       f"{device_names[-1]}) nor a component ({declared}); "
                                       "declare it under components or fix the name")
            if a == b:
                raise ClusterError(f"{at}: link from {a!r} to itself; remove it")
            pair = frozenset((a, b))
            if pair in seen:
                raise ClusterError(f"{at}: link {a} <-> {b} is listed twice (also in {seen[pair]}); "
                                   "merge them into one entry with lanes")
            seen[pair] = at
            links.append(LinkInstance(a=a, b=b, link=link_name, lanes=lanes))
    return NodeTopology(components=tuple(components), links=tuple(links))


def parse_fabric(raw: Any, *, known_links: Sequence[str], where: str) -> FabricSpec:
    check_keys(raw, FABRIC_KEYS, where, required=("link", "leaf_ports"))
    link = text(raw["link"], "link", where)
    if link not in known_links:
        raise ClusterError(f"{where}: unknown link type {link!r}; known link types: {', '.join(known_links)}")
    spines = raw.get("spines")
    return FabricSpec(
        link=link,
        leaf_ports=integer(raw["leaf_ports"], "leaf_ports", where),
        oversubscription=number(raw.get("oversubscription", 1.0), "oversubscription", where),
        spines=None if spines is None else integer(spines, "spines", where),
        source=text(raw.get("source", "not given"), "source", where),
    )


# --------------------------------------------------------------------------- node analysis
class NodeModel:
    """Bandwidth and latency questions about the inside of one (template) node."""

    def __init__(self, topology: NodeTopology, device_names: Sequence[str], links: Mapping[str, LinkSpec],
                 *, nic_link: LinkSpec | None, where: str) -> None:
        self.devices = tuple(device_names)
        self._device_set = frozenset(self.devices)
        self.kinds = {name: kind for name, kind in topology.components}
        self.adj: dict[str, list[str]] = {d: [] for d in self.devices}
        self.adj.update({name: [] for name, _ in topology.components})
        self.cap: dict[tuple[str, str], float] = {}
        self.lat: dict[tuple[str, str], float] = {}
        self.link_of: dict[tuple[str, str], str] = {}
        for li in topology.links:
            spec = links[li.link]
            for u, v in ((li.a, li.b), (li.b, li.a)):
                self.adj[u].append(v)
                self.cap[(u, v)] = spec.effective_bandwidth_bytes_per_s * li.lanes
                self.lat[(u, v)] = spec.latency_s
                self.link_of[(u, v)] = li.link
        self._eps = 1e-9 * max(self.cap.values(), default=1.0)
        self._full = {d: self._widest(d, self.cap) for d in self.devices}
        self._check_connected(where)
        self._order = self._dfs_order()
        self._ring_cache: dict[tuple[int, ...], tuple[float, float]] = {}
        self._a2a_cache: dict[tuple[int, ...], float] = {}
        self.nics = tuple(name for name, kind in topology.components if kind == "nic")
        self.nic_share_bytes_per_s: tuple[float, ...] = ()
        self.nic_latency_s: tuple[float, ...] = ()
        self.nearest_nics: tuple[tuple[str, ...], ...] = ()   # per local device, ties kept
        if nic_link is not None and self.nics:
            self._nic_shares(nic_link, where)

    # -- paths
    def _widest(self, src: str, caps: Mapping[tuple[str, str], float]) -> dict[str, tuple[float, float, str | None]]:
        """Widest (max bottleneck) paths from ``src``; ties broken by lower latency. Returns
        ``vertex -> (bandwidth, latency, predecessor)``. Devices other than ``src`` end paths."""
        best: dict[str, tuple[float, float, str | None]] = {src: (math.inf, 0.0, None)}
        heap = [(-math.inf, 0.0, src)]
        done: set[str] = set()
        while heap:
            neg_bw, lat, u = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u != src and u in self._device_set:
                continue
            for v in self.adj[u]:
                capacity = caps[(u, v)]
                if capacity <= self._eps or v in done:
                    continue
                bw, new_lat = min(-neg_bw, capacity), lat + self.lat[(u, v)]
                old = best.get(v)
                if old is None or bw > old[0] * (1 + 1e-12) or (bw >= old[0] * (1 - 1e-12) and new_lat < old[1]):
                    best[v] = (bw, new_lat, u)
                    heapq.heappush(heap, (-bw, new_lat, v))
        return best

    def path_edges(self, src: int, dst: int | str) -> list[tuple[str, str]]:
        """The directed edges of the widest path from local device ``src`` to local device
        ``dst`` (an index) or to a component (a name, e.g. a NIC), source end first."""
        target = self.devices[dst] if isinstance(dst, int) else dst
        return self._edges(self._full[self.devices[src]], target)[::-1]

    @staticmethod
    def _edges(tree: Mapping[str, tuple[float, float, str | None]], dst: str) -> list[tuple[str, str]]:
        edges, v = [], dst
        while tree[v][2] is not None:
            u = tree[v][2]
            edges.append((u, v))
            v = u
        return edges

    def _check_connected(self, where: str) -> None:
        first = self.devices[0]
        for dev in self.devices[1:]:
            if dev not in self._full[first]:
                raise ClusterError(
                    f"{where}: device {dev!r} is not connected to the rest of the node (no path from "
                    f"{first!r} that avoids other devices); add a link from {dev!r} to a switch or socket")
        reach = set().union(*(set(tree) for tree in self._full.values()))
        for name in self.kinds:
            if name not in reach:
                raise ClusterError(f"{where}: component {name!r} is not connected to any device; link it or remove it")

    def _dfs_order(self) -> dict[str, int]:
        """Device positions in a depth-first walk from the first component: devices under the same
        switch end up adjacent, which is the best ring order on tree-shaped nodes."""
        start = next(iter(self.kinds), self.devices[0])
        order: dict[str, int] = {}
        stack, seen = [start], {start}
        while stack:
            u = stack.pop()
            if u in self._device_set:
                order[u] = len(order)
                continue
            for v in reversed(self.adj[u]):
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        for dev in self.devices:  # devices reachable only through other devices
            order.setdefault(dev, len(order))
        return order

    # -- point to point
    def p2p(self, src: int, dst: int) -> tuple[float, float]:
        """(bandwidth, latency) of the widest path between two local devices."""
        bw, lat, _ = self._full[self.devices[src]][self.devices[dst]]
        return bw, lat

    # -- rings
    def ring(self, members: tuple[int, ...]) -> tuple[float, float]:
        """(per-rank bandwidth, per-step latency) of ring collectives over local devices ``members``."""
        if len(members) < 2:
            return math.inf, 0.0
        if members not in self._ring_cache:
            self._ring_cache[members] = self._pack_rings([self.devices[i] for i in members])
        return self._ring_cache[members]

    def _pack_rings(self, members: list[str]) -> tuple[float, float]:
        caps = dict(self.cap)
        total, first, alpha = 0.0, 0.0, 0.0
        for _ in range(MAX_RING_ROUNDS):
            trees = {m: self._widest(m, caps) for m in members}
            best = (0.0, 0.0, None)
            for order in self._candidate_rings(members, caps):
                result = self._eval_ring(order, trees, caps)
                if result[0] > best[0]:
                    best = result
            bw, ring_alpha, usage = best
            if usage is None or bw <= self._eps or bw < MIN_RING_FRACTION * first:
                break
            if not first:
                # Later rings may only use the link types of the first (NCCL does not mix NVLink
                # and PCIe channels): close every other link.
                kinds = {self.link_of[e] for e in usage}
                caps = {e: (c if self.link_of[e] in kinds else 0.0) for e, c in caps.items()}
                first = bw
            total += bw
            alpha = max(alpha, ring_alpha)
            for edge, count in usage.items():
                caps[edge] = max(0.0, caps[edge] - bw * count)
        return total, alpha

    def _candidate_rings(self, members: list[str], caps: Mapping[tuple[str, str], float]):
        yield sorted(members, key=self._order.__getitem__)
        yield list(members)
        if len(members) > MAX_HAMILTONIAN_MEMBERS:
            return
        direct = {m: [v for v in self.adj[m] if v in members and caps[(m, v)] > self._eps] for m in members}
        if not any(direct.values()):
            return
        yield from itertools.islice(self._hamiltonian_cycles(members, direct), MAX_HAMILTONIAN_CYCLES)

    @staticmethod
    def _hamiltonian_cycles(members: list[str], direct: Mapping[str, list[str]]):
        start, size = members[0], len(members)
        path, used = [start], {start}

        def extend():
            u = path[-1]
            if len(path) == size:
                if start in direct[u] or size == 2:
                    yield list(path)
                return
            for v in direct[u]:
                if v not in used:
                    used.add(v)
                    path.append(v)
                    yield from extend()
                    path.pop()
                    used.discard(v)

        yield from extend()

    def _eval_ring(self, order, trees, caps):
        usage: Counter[tuple[str, str]] = Counter()
        alpha = 0.0
        for i, u in enumerate(order):
            v = order[(i + 1) % len(order)]
            tree = trees[u]
            if v not in tree:
                return 0.0, 0.0, None
            usage.update(self._edges(tree, v))
            alpha = max(alpha, tree[v][1])
        bw = min(caps[e] / count for e, count in usage.items())
        return bw, alpha, usage

    # -- all-to-all
    def all_to_all_load(self, members: tuple[int, ...]) -> float:
        """max over directed edges of (pairs routed over the edge / capacity): an all-to-all where
        every ordered pair exchanges ``c`` bytes takes ``c * load`` seconds inside this node."""
        if len(members) < 2:
            return 0.0
        if members not in self._a2a_cache:
            usage: Counter[tuple[str, str]] = Counter()
            for i in members:
                tree = self._full[self.devices[i]]
                for j in members:
                    if i != j:
                        usage.update(self._edges(tree, self.devices[j]))
            self._a2a_cache[members] = max(count / self.cap[e] for e, count in usage.items())
        return self._a2a_cache[members]

    # -- NICs
    def _nic_shares(self, nic_link: LinkSpec, where: str) -> None:
        nearest: dict[str, list[str]] = {}
        for dev in self.devices:
            hops = self._hops(dev)
            reachable = [nic for nic in self.nics if nic in hops]
            if not reachable:
                raise ClusterError(f"{where}: device {dev!r} cannot reach any NIC ({', '.join(self.nics)}); "
                                   "link it to a switch or socket that leads to a NIC")
            closest = min(hops[nic] for nic in reachable)
            nearest[dev] = [nic for nic in reachable if hops[nic] == closest]
        sharers = Counter(nic for nics in nearest.values() for nic in nics)
        port = nic_link.effective_bandwidth_bytes_per_s
        shares, latencies = [], []
        for dev in self.devices:
            tree = self._full[dev]
            # the paths to several NICs share the device's own link: no more than the widest one
            total = sum(min(tree[nic][0], port) / sharers[nic] for nic in nearest[dev])
            shares.append(min(total, max(tree[nic][0] for nic in nearest[dev])))
            latencies.append(min(tree[nic][1] for nic in nearest[dev]))
        self.nic_share_bytes_per_s = tuple(shares)
        self.nic_latency_s = tuple(latencies)
        self.nearest_nics = tuple(tuple(nearest[dev]) for dev in self.devices)

    def _hops(self, src: str) -> dict[str, int]:
        hops, queue = {src: 0}, deque([src])
        while queue:
            u = queue.popleft()
            if u != src and u in self._device_set:
                continue
            for v in self.adj[u]:
                if v not in hops:
                    hops[v] = hops[u] + 1
                    queue.append(v)
        return hops


# --------------------------------------------------------------------------- full graph
def build_graph(*, name: str, num_nodes: int, device_names: Sequence[str], device_kind: str,
                topology: NodeTopology, links: Mapping[str, LinkSpec], fabric: FabricSpec | None,
                ) -> tuple[nx.Graph, tuple[tuple[int, int], ...]]:
    """Build the cluster graph. Returns it (frozen) and, per node, the (first, last) leaf its NICs
    attach to (``(0, 0)`` without a fabric)."""
    graph = nx.Graph(name=name)
    nics = [c for c, kind in topology.components if kind == "nic"]
    edge_attrs = []
    for li in topology.links:
        spec = links[li.link]
        edge_attrs.append((li.a, li.b, {
            "bandwidth_bytes_per_s": spec.bandwidth_bytes_per_s * li.lanes, "latency_s": spec.latency_s,
            "link": li.link, "lanes": li.lanes, "efficiency": spec.efficiency}))
    for n in range(num_nodes):
        prefix = f"n{n}."
        graph.add_nodes_from((prefix + d, {"kind": device_kind, "node": n, "local_rank": i})
                             for i, d in enumerate(device_names))
        graph.add_nodes_from((prefix + c, {"kind": kind, "node": n}) for c, kind in topology.components)
        graph.add_edges_from((prefix + a, prefix + b, dict(attrs)) for a, b, attrs in edge_attrs)
    leaves_of_node = tuple((0, 0) for _ in range(num_nodes))
    if fabric is not None and nics:
        port = links[fabric.link]
        total = num_nodes * len(nics)
        num_leaves = math.ceil(total / fabric.leaf_ports)
        graph.add_nodes_from((f"leaf{j}", {"kind": "leaf"}) for j in range(num_leaves))
        nic_edge = {"bandwidth_bytes_per_s": port.bandwidth_bytes_per_s, "latency_s": port.latency_s,
                    "link": fabric.link, "lanes": 1, "efficiency": port.efficiency}
        graph.add_edges_from((f"n{g // len(nics)}.{nics[g % len(nics)]}", f"leaf{g // fabric.leaf_ports}", dict(nic_edge))
                             for g in range(total))
        leaves_of_node = tuple((n * len(nics) // fabric.leaf_ports, ((n + 1) * len(nics) - 1) // fabric.leaf_ports)
                               for n in range(num_nodes))
        if num_leaves > 1:
            spines = fabric.num_spines
            uplink = fabric.leaf_ports * port.bandwidth_bytes_per_s / fabric.oversubscription / spines
            graph.add_nodes_from((f"spine{s}", {"kind": "spine"}) for s in range(spines))
            spine_edge = {"bandwidth_bytes_per_s": uplink, "latency_s": port.latency_s, "link": fabric.link,
                          "lanes": uplink / port.bandwidth_bytes_per_s, "efficiency": port.efficiency}
            graph.add_edges_from((f"leaf{j}", f"spine{s}", dict(spine_edge))
                                 for j in range(num_leaves) for s in range(spines))
    return nx.freeze(graph), leaves_of_node
