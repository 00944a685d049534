"""A picture of the cluster's topology (matplotlib): nodes with their devices, NVSwitches, PCIe
switches, CPU sockets and NICs, the fabric's leaf and spine switches, and, for a plan, the mesh
axes mapped onto them (``topology_view.AxisGroup``: rank 0's group on each axis outlined in the
axis's colour, a coloured bus under the nodes where a group spans nodes, and a legend with each
axis's size, ranks, links and bandwidth).

What is drawn is decided in ``topology_view``; the node's inside is laid out here, by rows:
NVSwitch, devices, PCIe switches, sockets, NICs, each component under the mean position of
the components above it that it links to. Large clusters keep a few nodes in detail
(``topology_view.shown_nodes``) and one box for the rest. On a heterogeneous cluster each
node is drawn as its pool's node type (``Cluster.pool_view``), labelled with its device, and
the first node of every pool is among those drawn.

matplotlib is imported inside the functions: it is an optional dependency
(``pip install 'autoplan[plot]'``), and importing the cluster must not need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cluster.topology_view import (KIND_NAMES, AxisGroup, edge_use, fmt_ranks, gbps,
                                            shown_nodes)
from autoplan import plotting
from autoplan.errors import ClusterError

UNIT_IN = 0.42                      # inches per layout unit (one device slot)
ROW = 1.15                          # layout units between rows of a node
BOX_W, BOX_H = 0.74, 0.56           # a device or component box
NODE_GAP = 0.9
SUMMARY_W = 3.4
MIN_NODE_W = 3.4
POOL_ROW = 0.3                      # a heterogeneous cluster's nodes: room for the pool's line
ROWS = ("nvswitch", "device", "pcie_switch", "socket", "nic")
AXIS_COLORS = {"tp": "#E15759", "cp": "#F28E2B", "ep": "#B07AA1", "dp": "#4E79A7",
               "pp": "#59A14F"}
FACE = {"device": "#FFFFFF", "nvswitch": "#DCE9C8", "pcie_switch": "#E4E4E4",
        "socket": "#EFE6D6", "nic": "#D9E4F0", "leaf": "#D9E4F0", "spine": "#D9E4F0"}
SHORT = {"nvswitch": "NVSwitch", "pcie_switch": "PCIe", "socket": "CPU", "nic": "NIC"}


def _pyplot() -> Any:
    return plotting.pyplot(ClusterError)


@dataclass(frozen=True)
class _Layout:
    """One node's inside: vertex -> (x, row), the rows used, the node's width."""

    pos: dict[str, tuple[float, int]]
    width: float


def node_layout(cluster: Any) -> _Layout:
    """Positions of the template node's vertices (local names): devices one unit apart, each
    other component under (or over) the mean x of its already placed neighbours, siblings of
    one position spread one unit apart."""
    kinds = dict(cluster.node_topology.components)
    devices = cluster.node_model.devices
    adj = cluster.node_model.adj
    # GPU-GPU links arc over the devices: they need the row above them free
    arcs = any(li.a in devices and li.b in devices for li in cluster.node_topology.links)
    rows_used = [r for r in ROWS if r == "device" or r in kinds.values()
                 or (r == "nvswitch" and arcs)]
    pos: dict[str, tuple[float, int]] = {d: (float(i), rows_used.index("device"))
                                         for i, d in enumerate(devices)}
    for row in ("nvswitch", "pcie_switch", "socket", "nic"):
        names = [n for n, k in kinds.items() if k == row]
        want = {}
        for n in names:
            xs = [pos[m][0] for m in adj[n] if m in pos]
            want[n] = sum(xs) / len(xs) if xs else 0.0
        for n, x in _spread(want).items():
            pos[n] = (x, rows_used.index(row))
    xs = [x for x, _ in pos.values()]
    width = max(max(xs) - min(xs), MIN_NODE_W)   # room for the node's title
    shift = (width - (max(xs) - min(xs))) / 2 - min(xs)
    pos = {n: (x + shift, r) for n, (x, r) in pos.items()}
    return _Layout(pos=pos, width=width)


def _spread(want: dict[str, float]) -> dict[str, float]:
    """Place names at their wanted x, those wanting the same x spread around it, then pushed
    apart to one unit at least."""
    groups: dict[float, list[str]] = {}
    for n, x in want.items():
        groups.setdefault(round(x, 6), []).append(n)
    out = {}
    for x, names in groups.items():
        for i, n in enumerate(names):
            out[n] = x + i - (len(names) - 1) / 2
    last = None
    for n in sorted(out, key=out.__getitem__):
        if last is not None and out[n] < last + 1.0:
            out[n] = last + 1.0
        last = out[n]
    return out


def _link_style(cluster: Any, link: str, lanes: float = 1) -> dict[str, Any]:
    fabric = cluster.fabric.link if cluster.fabric else None
    if link.startswith("nvlink"):
        return dict(color="#3B3B3B", lw=1.1 if lanes <= 1 else 2.2, ls="-")
    if link == fabric:
        return dict(color="#6A6A9A", lw=0.8, ls=":")
    if link.startswith("pcie"):
        return dict(color="#8C8C8C", lw=1.0, ls="-")
    return dict(color="#8C6D46", lw=1.2, ls="--")


# ---------------------------------------------------------------- one node
def _box(ax: Any, x: float, y: float, w: float, h: float, face: str, text: str = "", *,
         size: float = 6.0, weight: str = "normal", lw: float = 0.7, z: float = 3) -> None:
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                                fc=face, ec="#444444", lw=lw, zorder=z))
    if text:
        ax.text(x, y, text, ha="center", va="center", fontsize=size, weight=weight, zorder=z + 1)


def _draw_node(ax: Any, cluster: Any, lay: _Layout, node: int, x0: float,
               members: dict[str, set[int]], pool: str = "") -> None:
    """Node ``node`` with its left device at ``x0``; ``members``: axis -> ranks to outline;
    ``pool``: its pool and device type, on a heterogeneous cluster."""
    kinds = dict(cluster.node_topology.components)
    nrows = max(r for _, r in lay.pos.values()) + 1
    per = cluster.devices_per_node
    top, bottom = 0.85 + (POOL_ROW if pool else 0.0), -(nrows - 1) * ROW - 0.55
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x0 - 0.6, bottom), lay.width + 1.2, top - bottom,
                                boxstyle="round,pad=0,rounding_size=0.15", fc="#FAFAFA",
                                ec="#777777", lw=1.0, zorder=1))
    ax.text(x0 - 0.45, top - 0.2, f"node {node}   ranks {node * per}-{node * per + per - 1}",
            ha="left", va="center", fontsize=7.5, weight="bold", zorder=4)
    if pool:
        ax.text(x0 - 0.45, top - 0.5, pool, ha="left", va="center", fontsize=6.5,
                color="#8B2252", weight="bold", zorder=4)

    def xy(name: str) -> tuple[float, float]:
        x, r = lay.pos[name]
        return x0 + x, -r * ROW

    _draw_links(ax, cluster, lay, xy)
    for name, kind in kinds.items():
        x, y = xy(name)
        if kind == "nvswitch":
            xs = [xy(m)[0] for m in cluster.node_model.adj[name] if m in cluster.node_model.devices]
            _box(ax, (min(xs) + max(xs)) / 2, y, max(xs) - min(xs) + BOX_W, 0.42, FACE[kind],
                 "NVSwitch", size=7)
        else:
            short = "skt" if kind == "socket" and cluster.device.kind == "cpu" else SHORT[kind]
            _box(ax, x, y, BOX_W, BOX_H, FACE[kind], f"{short}{_index(name)}")
    for i, dev in enumerate(cluster.node_model.devices):
        x, y = xy(dev)
        _box(ax, x, y, BOX_W, BOX_H, FACE["device"], z=5)
        ax.text(x, y + 0.08, f"r{node * per + i}", ha="center", va="center", fontsize=6.5,
                weight="bold", zorder=6)
        ax.text(x, y - 0.15, dev, ha="center", va="center", fontsize=5, color="#555555",
                zorder=6)
    _outline_groups(ax, cluster, node, xy, members)


def _index(name: str) -> str:
    digits = name[len(name.rstrip("0123456789")):]
    return digits


def _draw_links(ax: Any, cluster: Any, lay: _Layout, xy: Any) -> None:
    """Every link of the node: between rows a straight line from box to box, inside a row an
    arc over the boxes (NVLink between GPUs, the link between sockets)."""
    kinds = dict(cluster.node_topology.components)
    from matplotlib.patches import FancyArrowPatch
    for li in cluster.node_topology.links:
        style = _link_style(cluster, li.link, li.lanes)
        (xa, ya), (xb, yb) = xy(li.a), xy(li.b)
        if "nvswitch" in (kinds.get(li.a), kinds.get(li.b)):
            dev_x = xa if kinds.get(li.a) != "nvswitch" else xb
            ya, yb = sorted((ya, yb))
            ax.plot([dev_x, dev_x], [ya, yb], zorder=2, **style)
        elif abs(ya - yb) < 1e-9:
            rad = -0.3 if xa < xb else 0.3
            # each end leaves the box's top towards the other end: the arcs fan out
            off = max(-0.3, min(0.3, 0.08 * (xb - xa)))
            ax.add_patch(FancyArrowPatch((xa + off, ya + BOX_H / 2), (xb - off, yb + BOX_H / 2),
                                         connectionstyle=f"arc3,rad={rad}", arrowstyle="-",
                                         zorder=2, color=style["color"], lw=style["lw"],
                                         ls=style["ls"]))
        else:
            ax.plot([xa, xb], [ya, yb], zorder=2, **style)


def _outline_groups(ax: Any, cluster: Any, node: int, xy: Any,
                    members: dict[str, set[int]]) -> None:
    """Each axis's example group: an outline, in the axis's colour, around each run of
    neighbouring member devices of this node, one padding per axis so they nest."""
    from matplotlib.patches import FancyBboxPatch
    per = cluster.devices_per_node
    devices = cluster.node_model.devices
    for k, (axis, ranks) in enumerate(members.items()):
        runs = _runs(sorted(r - node * per for r in ranks if r // per == node))
        pad = 0.05 + 0.055 * k
        for run in runs:
            (xa, y), (xb, _) = xy(devices[run[0]]), xy(devices[run[-1]])
            ax.add_patch(FancyBboxPatch(
                (xa - BOX_W / 2 - pad, y - BOX_H / 2 - pad), xb - xa + BOX_W + 2 * pad,
                BOX_H + 2 * pad, boxstyle="round,pad=0,rounding_size=0.1", fill=False,
                ec=AXIS_COLORS[axis], lw=1.8, zorder=7))


# ---------------------------------------------------------------- the cluster
def _plan_columns(cluster: Any, shown: Sequence[int], lays: dict[int, _Layout]
                  ) -> list[tuple[Any, float]]:
    """Left to right: (node index, or None for the summary box, its left x)."""
    hidden = cluster.num_nodes - len(shown)
    order: list[Any] = list(shown)
    if hidden:
        gap = next((i + 1 for i, (a, b) in enumerate(zip(shown, shown[1:])) if b != a + 1),
                   len(shown))
        order.insert(gap, None)
    out, x = [], 0.0
    for item in order:
        out.append((item, x))
        x += (SUMMARY_W if item is None else lays[item].width + 1.2) + NODE_GAP
    return out


def _summary(ax: Any, cluster: Any, shown: Sequence[int], x: float, bottom: float,
             groups: Sequence[AxisGroup]) -> None:
    from matplotlib.patches import FancyBboxPatch
    hidden = [n for n in range(cluster.num_nodes) if n not in set(shown)]
    ax.add_patch(FancyBboxPatch((x, bottom), SUMMARY_W, 0.85 - bottom,
                                boxstyle="round,pad=0,rounding_size=0.15", fc="#F0F0F0",
                                ec="#777777", lw=1.0, ls="--", zorder=1))
    per = cluster.devices_per_node
    lines = [f"... {len(hidden):,} more node{'s' * (len(hidden) != 1)}",
             f"({_node_ranges(hidden)})"]
    if cluster.pools:              # per pool: how many hidden, like which drawn node
        for i, p in enumerate(cluster.pools):
            mine = [n for n in hidden if cluster.pool_of(n * per) == i]
            like = next(n for n in shown if cluster.pool_of(n * per) == i)
            if mine:
                lines.append(f"{len(mine):,} of pool {i}, each like node {like}")
    else:
        lines.append(f"each like node {shown[0]}")
    inside = {g.axis: sum(1 for r in g.example if r // per in set(hidden)) for g in groups}
    if any(inside.values()):
        lines += ["", "rank 0's groups here:"]
        lines += [f"{a}: {n:,} rank{'s' * (n != 1)}" for a, n in inside.items() if n]
    ax.text(x + SUMMARY_W / 2, (0.85 + bottom) / 2, "\n".join(lines), ha="center",
            va="center", fontsize=7, zorder=4)


def _runs(values: Sequence[int]) -> list[list[int]]:
    """``values`` (ascending) cut into runs of consecutive numbers: [0, 1, 2, 5] -> [[0, 1, 2],
    [5]]."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs


def _node_ranges(nodes: Sequence[int]) -> str:
    runs = _runs(nodes)
    text = ", ".join(f"n{r[0]}" if len(r) == 1 else f"n{r[0]}-n{r[-1]}" for r in runs[:3])
    return text + (", ..." if len(runs) > 3 else "")


def _fabric(ax: Any, cluster: Any, lays: dict[int, _Layout], columns: list[tuple[Any, float]],
            bottom: float, groups: Sequence[AxisGroup]) -> float:
    """Under the nodes: a bus per axis whose example spans nodes, the leaf switches the shown
    nodes' NICs plug into, and the spine tier. Returns the lowest y drawn."""
    multi = [g for g in groups if len(g.nodes) > 1]
    shown = {item for item, _ in columns if item is not None}
    for k, g in enumerate(multi):
        y = bottom - 0.45 - 0.38 * k
        xs = []
        for item, x in columns:
            involved = (item in g.nodes) if item is not None else any(
                n not in shown for n in g.nodes)
            if involved:
                centre = x + (SUMMARY_W if item is None else lays[item].width + 1.2) / 2
                cx = centre + (k - (len(multi) - 1) / 2) * 0.5
                ax.plot([cx, cx], [bottom, y], color=AXIS_COLORS[g.axis], lw=2.0, zorder=8)
                xs.append(cx)
        ax.plot([min(xs), max(xs)], [y, y], color=AXIS_COLORS[g.axis], lw=2.4, zorder=8,
                solid_capstyle="round")
        ax.text(min(xs) - 0.15, y, g.axis, ha="right", va="center", fontsize=7.5,
                weight="bold", color=AXIS_COLORS[g.axis], zorder=8)
    if cluster.num_nodes < 2 or cluster.fabric is None:
        return bottom - 0.45 - 0.38 * len(multi)
    leaf_y = bottom - 0.45 - 0.38 * len(multi) - 0.75
    return _switches(ax, cluster, lays, columns, leaf_y)


def _switches(ax: Any, cluster: Any, lays: dict[int, _Layout], columns: list[tuple[Any, float]],
              leaf_y: float) -> float:
    """The leaves the shown nodes' NICs plug into (NIC-leaf cables drawn, each in its pool's
    NIC link on a heterogeneous cluster), one box for the other leaves, and the spine tier
    under them."""
    g = cluster.graph
    style = _link_style(cluster, cluster.fabric.link)
    leaves: dict[str, list[tuple[float, float, dict[str, Any]]]] = {}
    for item, x in columns:
        if item is None:
            continue
        node = node_cluster(cluster, item)
        lay = lays[item]
        nic_row = max(r for _, r in lay.pos.values())
        cable = (_link_style(node, node.fabric.link) if node.fabric is not None else style)
        for nic in (n for n, k in node.node_topology.components if k == "nic"):
            gn = node.graph
            leaf = next(v for v in gn.neighbors(f"n{item}.{nic}") if gn.nodes[v]["kind"] == "leaf")
            leaves.setdefault(leaf, []).append((x + 0.6 + lay.pos[nic][0], nic_row, cable))
    boxes = []
    for leaf, ends in leaves.items():
        cx = sum(x for x, _, _ in ends) / len(ends)
        for x, nic_row, cable in ends:
            ax.plot([x, cx], [-nic_row * ROW - BOX_H / 2, leaf_y + 0.22], zorder=2, **cable)
        _box(ax, cx, leaf_y, 2.2, 0.44, FACE["leaf"], f"leaf switch {_index(leaf)}", size=6.5)
        boxes.append(cx)
    num_leaves = sum(1 for v in g if g.nodes[v]["kind"] == "leaf")
    more = num_leaves - len(leaves)
    summary = [x + SUMMARY_W / 2 for item, x in columns if item is None]
    if more and summary:
        _box(ax, summary[0], leaf_y, 2.6, 0.44, "#F0F0F0",
             f"{more:,} more leaf switch{'es' * (more != 1)}", size=6.5)
        boxes.append(summary[0])
    spines = sum(1 for v in g if g.nodes[v]["kind"] == "spine")
    if not spines:
        return leaf_y - 0.3
    y = leaf_y - 1.05
    for cx in boxes:
        ax.plot([cx, cx], [leaf_y - 0.22, y + 0.22], zorder=2, **style)
    lo, hi = min(boxes) - 1.3, max(boxes) + 1.3
    f = cluster.fabric
    _box(ax, (lo + hi) / 2, y, max(hi - lo, 6.0), 0.44, FACE["spine"],
         f"{spines:,} spine switch{'es' * (spines != 1)}, every leaf cabled to each "
         f"({'non-blocking' if f.oversubscription == 1 else f'oversubscribed {f.oversubscription:g}:1'})",
         size=6.5)
    return y - 0.3


# ---------------------------------------------------------------- legends and entry point
def _link_entries(cluster: Any) -> list[tuple[dict[str, Any], str]]:
    """(line style, label) per link type and lane count: where it is, its peak bandwidth;
    on a heterogeneous cluster, those of every pool's node type."""
    if cluster.pools:
        out: dict[str, dict[str, Any]] = {}
        for i in range(len(cluster.pools)):
            for style, label in _link_entries(cluster.pool_view(i)):
                out.setdefault(label, style)
        return [(style, label) for label, style in out.items()]
    edges = [(f"n0.{li.a}", f"n0.{li.b}") for li in cluster.node_topology.links]
    g = cluster.graph
    if cluster.num_nodes > 1 and cluster.fabric is not None:
        nic = next(f"n0.{n}" for n, k in cluster.node_topology.components if k == "nic")
        edges.append((nic, next(v for v in g.neighbors(nic) if g.nodes[v]["kind"] == "leaf")))
        if "spine0" in g:
            edges.append(("leaf0", "spine0"))
    joined: dict[tuple[str, float, float], list[str]] = {}
    for u, v in edges:
        use = edge_use(cluster, u, v)
        key = (use.link, use.lanes, use.bandwidth_bytes_per_s)
        if use.joins not in joined.setdefault(key, []):
            joined[key].append(use.joins)
    out = []
    for (link, lanes, bw), joins in sorted(joined.items(), key=lambda kv: -kv[0][2]):
        lane = f" x{lanes:g}" if lanes != 1 else ""
        out.append((_link_style(cluster, link, lanes),
                    f"{link}{lane}: {gbps(bw)} ({', '.join(joins)})"))
    return out


def _axis_label(g: AxisGroup) -> str:
    links = ", ".join(dict.fromkeys(u.link for u in g.links))
    per = "each send" if g.pattern == "p2p" else "per rank"
    return (f"{g.axis}: {g.size:,} ranks x {g.num_groups:,} group{'s' * (g.num_groups != 1)};"
            f" rank 0's: {fmt_ranks(g.example)}\n"
            f"     over {links}: {gbps(g.bandwidth_bytes_per_s)} {per}")


def _legends(fig: Any, cluster: Any, groups: Sequence[AxisGroup], top_in: float) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    h = fig.get_figheight()
    links = _link_entries(cluster)
    fig.legend([Line2D([], [], **s) for s, _ in links], [t for _, t in links],
               loc="upper left", bbox_to_anchor=(0.02, top_in / h), fontsize=7, frameon=False,
               title="links (peak bandwidth per direction, lanes included)", title_fontsize=7.5,
               alignment="left")
    if groups:
        fig.legend([Patch(fill=False, ec=AXIS_COLORS[g.axis], lw=1.8) for g in groups],
                   [_axis_label(g) for g in groups], loc="upper left",
                   bbox_to_anchor=(0.5, top_in / h), fontsize=7, frameon=False,
                   title="mesh axes: rank 0's group outlined (bandwidth effective, as priced)",
                   title_fontsize=7.5, alignment="left", labelspacing=0.7)


def draw_topology(cluster: Any, path: str, *, groups: Sequence[AxisGroup] = (),
                  title: str | None = None, max_nodes: int = 3) -> tuple[int, ...]:
    """Draw ``cluster`` (and ``groups``, the mesh axes on it) to ``path`` (PNG, SVG or PDF
    by its suffix); returns the nodes drawn in detail."""
    plt = _pyplot()
    shown = _shown(cluster, groups, max_nodes)
    by_type: dict[int, _Layout] = {}        # one layout per node type (pool)
    lays = {n: by_type.setdefault(_pool(cluster, n), node_layout(node_cluster(cluster, n)))
            for n in shown}
    columns = _plan_columns(cluster, shown, lays)
    members = {g.axis: set(g.example) for g in groups}
    nrows = max(r for lay in lays.values() for _, r in lay.pos.values()) + 1
    bottom = -(nrows - 1) * ROW - 0.55
    right = columns[-1][1] + (SUMMARY_W if columns[-1][0] is None
                              else lays[columns[-1][0]].width + 1.2)
    fig = plt.figure()
    ax = fig.add_axes((0, 0, 1, 1))
    for item, x in columns:
        if item is None:
            _summary(ax, cluster, shown, x, bottom, groups)
        else:
            _draw_node(ax, node_cluster(cluster, item), lays[item], item, x + 0.6, members,
                       _pool_label(cluster, item))
    low = _fabric(ax, cluster, lays, columns, bottom, groups)
    left = -0.9 if not any(len(g.nodes) > 1 for g in groups) else -1.3
    top = 1.1 + (POOL_ROW if cluster.pools else 0.0)
    width_in, height_in = (right - left + 0.3) * UNIT_IN, (top - low) * UNIT_IN
    link_rows = len(_link_entries(cluster))
    legend_in = 0.4 + 0.17 * max(link_rows, 2.5 * len(groups))
    fig_w = max(width_in + 0.3, 11.0)
    fig.set_size_inches(fig_w, height_in + legend_in + 0.45)
    fig_h = fig.get_figheight()
    ax.set_position(((fig_w - width_in) / 2 / fig_w, legend_in / fig_h, width_in / fig_w,
                     height_in / fig_h))
    ax.set_xlim(left, right + 0.3)
    ax.set_ylim(low, top)
    ax.set_axis_off()
    fig.suptitle(title or _title(cluster), fontsize=10, y=1 - 0.12 / fig_h, va="top")
    _legends(fig, cluster, groups, legend_in)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return shown


def node_cluster(cluster: Any, node: int) -> Any:
    """The cluster as node ``node``'s type: its pool's view on a heterogeneous cluster."""
    return cluster.pool_view(_pool(cluster, node)) if cluster.pools else cluster


def _pool(cluster: Any, node: int) -> int:
    return cluster.pool_of(node * cluster.devices_per_node) if cluster.pools else 0


def _pool_label(cluster: Any, node: int) -> str:
    if not cluster.pools:
        return ""
    i = _pool(cluster, node)
    return f"pool {i}: {cluster.pools[i].device.name}"


def _shown(cluster: Any, groups: Sequence[AxisGroup], limit: int) -> tuple[int, ...]:
    """``shown_nodes``, and on a heterogeneous cluster the first node of every pool too."""
    shown = shown_nodes(cluster.num_nodes, groups, limit=limit)
    if not cluster.pools:
        return shown
    per = cluster.devices_per_node
    return tuple(sorted(set(shown) | {p.first_rank // per for p in cluster.pools}))


def _title(cluster: Any) -> str:
    if cluster.pools:
        return (f"{cluster.name}: {cluster.num_nodes:,} nodes x {cluster.devices_per_node} "
                f"devices in {len(cluster.pools)} pools ("
                + " + ".join(f"{p.cluster.num_nodes} x {p.device.name}" for p in cluster.pools)
                + f") = {cluster.world_size:,} devices")
    kinds = ", ".join(_plural(KIND_NAMES.get(k, k)) for k in dict.fromkeys(
        k for _, k in cluster.node_topology.components))
    return (f"{cluster.name}: {cluster.num_nodes:,} node{'s' * (cluster.num_nodes != 1)} x "
            f"{cluster.devices_per_node} {cluster.device.name} = {cluster.world_size:,} devices"
            + (f" ({kinds})" if kinds else ""))


def _plural(name: str) -> str:
    return name + ("es" if name.endswith(("ch", "sh", "s")) else "s")
