"""`autoplan inspect PLAN`: explain a saved plan file (or print it as normalized JSON)."""

from __future__ import annotations

import argparse
import sys


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
    p.set_defaults(func=run)


def _add_figure_args(p: argparse.ArgumentParser) -> None:
    """Options that draw the plan to image files (matplotlib)."""
    p.add_argument("--timeline", metavar="PNG",
                   help="draw the per-rank pipeline timeline (Gantt chart) to this file")
    p.add_argument("--memory", metavar="PNG",
                   help="draw memory per pipeline rank over one step to this file")


def run(args: argparse.Namespace) -> int:
    from autoplan.planner.planfile import plan_from_file
    plan = plan_from_file(args.plan)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        from autoplan.planner.explain import explain_plan
        sys.stdout.write(explain_plan(plan))
    _write_figures(args, plan)
    return 0


def _write_figures(args: argparse.Namespace, plan) -> None:
    from autoplan.planner import figures
    if args.timeline:
        figures.draw_timeline(plan, args.timeline)
        print(f"wrote {args.timeline}")
    if args.memory:
        figures.draw_memory(plan, args.memory)
        print(f"wrote {args.memory}")
