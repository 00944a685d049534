"""`autoplan inspect PLAN`: explain a saved plan file (or print it as normalized JSON)."""

from __future__ import annotations

import argparse
import sys

from autoplan.cli.common import add_model_args, figure_suffixes, graph_from_args, output_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="explain a saved plan file",
        description="Read and validate PLAN (written by `autoplan plan -o` or Plan.save) and "
                    "explain it: the mesh on the topology, the chosen configuration, per-block "
                    "styles and recomputation, memory and time per device, the alternatives "
                    "and why they lost, and the solver report.")
    p.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    p.add_argument("--json", action="store_true",
                   help="print the validated plan as canonical JSON instead of the explanation")
    _add_figure_args(p)
    g = p.add_argument_group(
        "comparison with Megatron-LM (needs the model)",
        "With --model (built as for `autoplan plan`), the plan's per-op sharding is set next to "
        "Megatron-LM's rule for the same tp degree: the parameters and ops placed differently "
        "and both predicted step times under the plan's configuration.")
    add_model_args(g, flag=True)
    g.add_argument("--cluster", default=None,
                   help="the plan's cluster (preset[:nodes] or a file), for the comparison "
                        "and for --topology; default: the plan's preset")
    g.add_argument("--no-profile", action="store_true",
                   help="roofline only (the measured profile of the device type otherwise)")
    p.set_defaults(func=run)


def _add_figure_args(p: argparse.ArgumentParser) -> None:
    """Options that draw the plan to image files (matplotlib)."""
    p.add_argument("--timeline", metavar="PNG",
                   help="draw the per-rank pipeline timeline (Gantt chart) to this file")
    p.add_argument("--memory", metavar="PNG",
                   help="draw memory per pipeline rank over one step to this file")
    p.add_argument("--topology", metavar="PNG",
                   help="draw the cluster's topology with the mesh axes on it to this file "
                        "(rank 0's TP, CP, EP, DP and PP groups outlined, the links they "
                        "cross), and print per axis the group size, rank 0's group, the links "
                        "and their bandwidth; the cluster is the plan's preset or --cluster")
    p.add_argument("--pareto", metavar="PNG",
                   help="draw the plan's objectives search (run time against cost and against "
                        "energy, one point per device count, the Pareto front filled) to this "
                        "file; the plan must come from `autoplan plan` with --objective cost or "
                        "energy, --max-gpus, --tokens, --deadline or --budget-usd")


def run(args: argparse.Namespace) -> int:
    from autoplan.errors import AutoplanError
    from autoplan.planner.planfile import plan_from_file
    for flag, path in (("--timeline", args.timeline), ("--memory", args.memory),
                       ("--topology", args.topology), ("--pareto", args.pareto)):
        if path is not None:
            output_arg(path, flag, figure_suffixes())
    if args.cluster and not (args.model or args.topology):
        raise AutoplanError("--cluster is the plan's cluster for the comparison with "
                            "Megatron-LM or for --topology: give --model or --topology too")
    plan = plan_from_file(args.plan)
    if args.pareto and plan.objectives is None:
        from autoplan.errors import PlanError
        raise PlanError(f"{args.plan} holds no objectives search to draw: plan it with "
                        "`autoplan plan ... --objective cost` (or energy, or with --max-gpus, "
                        "--tokens/--deadline, --budget-usd), then inspect that plan")
    cluster = _plan_cluster(args, plan) if args.topology else None
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        from autoplan.planner.explain import explain_plan
        sys.stdout.write(explain_plan(plan))
        if args.model:
            sys.stdout.write("\n" + _vs_megatron(args, plan))
    _write_figures(args, plan)
    if cluster is not None:
        _write_topology(args, plan, cluster)
    return 0


def _write_topology(args: argparse.Namespace, plan, cluster) -> None:
    """The mesh axes on the cluster: their text (not under --json) and the picture."""
    from autoplan.cluster.topology_draw import draw_topology
    from autoplan.cluster.topology_view import axis_groups_text, mesh_axis_groups
    from autoplan.errors import PlanError
    if tuple(plan.mesh.rank_to_device) != tuple(cluster.device_names):
        raise PlanError("the plan places its ranks on other devices than rank r on the "
                        "cluster's r-th device; --topology draws that layout only")
    groups = mesh_axis_groups(cluster, plan.config.dims)
    if not args.json:
        print("\n" + axis_groups_text(cluster, groups))
    devices = (f"devices: {cluster.hardware().device}" if cluster.pools
               else cluster.device.name)
    title = (f"{plan.model.name} on {cluster.name} ({cluster.num_nodes:,} x "
             f"{cluster.devices_per_node} {devices}): {plan.config.short()}")
    shown = draw_topology(cluster, args.topology, groups=groups, title=title)
    print(f"wrote {args.topology} (nodes drawn in detail: {', '.join(map(str, shown))})",
          file=sys.stderr if args.json else sys.stdout)


def _plan_cluster(args: argparse.Namespace, plan):
    """The plan's cluster: --cluster, or the plan's preset (presets joined by '+' for a
    plan on pools), checked by fingerprint."""
    from autoplan.cluster import Cluster
    from autoplan.errors import AutoplanError, PlanError
    if args.cluster:
        cluster = Cluster.from_spec(args.cluster)
    else:
        try:
            name = plan.cluster.name
            cluster = Cluster.from_spec(name if plan.hetero is not None and "+" in name
                                        else f"{name}:{plan.cluster.num_nodes}")
        except AutoplanError:
            raise PlanError(f"the plan's cluster {plan.cluster.name!r} is not a preset: pass "
                            "the cluster with --cluster") from None
    if cluster.fingerprint() != plan.cluster.fingerprint:
        given = "--cluster" if args.cluster else f"the preset {plan.cluster.name!r} today"
        raise PlanError(f"{given} is not the plan's cluster (fingerprint "
                        f"{cluster.fingerprint()[:12]}, the plan's "
                        f"{plan.cluster.fingerprint[:12]})")
    return cluster


def _vs_megatron(args: argparse.Namespace, plan) -> str:
    from autoplan.planner.compare import explain_comparison, vs_megatron
    graph = graph_from_args(args)
    cluster = _plan_cluster(args, plan)
    cmp = vs_megatron(plan, graph, cluster, profile=None if args.no_profile else "auto")
    return explain_comparison(plan, cmp)


def _write_figures(args: argparse.Namespace, plan) -> None:
    # matplotlib (an optional dependency) loads only when a picture is drawn
    from autoplan.planner import figures_draw as figures
    if args.timeline:
        figures.draw_timeline(plan, args.timeline)
        print(f"wrote {args.timeline}")
    if args.memory:
        figures.draw_memory(plan, args.memory)
        print(f"wrote {args.memory}")
    if args.pareto:
        from autoplan.planner.objectives_figure import draw_front
        draw_front(plan.objectives, args.pareto)
        print(f"wrote {args.pareto}")
