"""`autoplan cluster show SPEC`: describe a cluster (preset, preset:nodes, local, or a file)."""

from __future__ import annotations

import argparse
import json
import sys

from autoplan.errors import ClusterError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="describe a cluster: devices, topology, bandwidths, collective times",
                       description="Cluster descriptions. Presets live in cost_models/clusters.yaml.")
    actions = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    show = actions.add_parser(
        "show", help="print a cluster's summary (or its JSON description)",
        description="Print devices, links, fabric, per-group ring bandwidths and collective times.")
    show.add_argument("spec", metavar="SPEC",
                      help="a preset name (e.g. dgx-a100-80gb), PRESET:NODES, PRESET/GPUS[:NODES] (the "
                           "node's first GPUS devices, e.g. dgx-h100/1), 'local', 'local:NPROC', "
                           "or a cluster file (.yaml/.yml/.json)")
    show.add_argument("--nodes", type=int, default=None, metavar="N",
                      help="number of nodes for a preset (same as PRESET:N), or ranks for 'local'")
    show.add_argument("--json", action="store_true", help="print the full description (to_dict) as JSON")
    show.add_argument("--png", metavar="FILE", default=None,
                      help="also draw the topology to this image file (PNG, SVG or PDF by its "
                           "suffix; needs matplotlib): nodes with their GPUs, NVSwitches, PCIe "
                           "switches, CPU sockets and NICs, the fabric's leaf and spine "
                           "switches; a large cluster keeps 3 nodes in detail")
    p.set_defaults(func=run, cluster_parser=p)


def run(args: argparse.Namespace) -> int:
    from autoplan.cli.common import figure_suffixes, output_arg
    from autoplan.cluster import Cluster
    from autoplan.cluster.specs import is_preset

    if getattr(args, "cluster_command", None) != "show":
        args.cluster_parser.print_help()
        return 2
    if args.png is not None:
        output_arg(args.png, "--png", figure_suffixes())
    spec = args.spec
    if args.nodes is not None:
        head, sep, tail = spec.partition(":")
        if sep and tail != str(args.nodes):
            raise ClusterError(f"cluster spec {spec!r} says {tail} but --nodes says {args.nodes}; give one of them")
        if head != "local" and not is_preset(head):
            raise ClusterError(f"--nodes applies to a preset or 'local', not to {spec!r}; "
                               "set num_nodes in the cluster file instead")
        spec = f"{head}:{args.nodes}"
    cluster = Cluster.from_spec(spec)
    if args.json:
        print(json.dumps(cluster.to_dict(), indent=2))
    else:
        print(cluster.describe())
        print(f"fingerprint {cluster.fingerprint()[:16]}")
    if args.png is not None:
        # matplotlib (an optional dependency) loads only when a picture is drawn
        from autoplan.cluster.topology_draw import draw_topology
        shown = draw_topology(cluster, args.png)
        print(f"wrote {args.png} (nodes drawn in detail: {', '.join(map(str, shown))})",
              file=sys.stderr if args.json else sys.stdout)
    return 0
