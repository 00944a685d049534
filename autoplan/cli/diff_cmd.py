"""`autoplan diff A B`: what changed from plan A to plan B, and the predicted effect."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", help="compare two plan files",
        description="Compare plan A with plan B: model and cluster fingerprints, mesh, every "
                    "ParallelConfig field, module styles, parameter placements, recomputation "
                    "and offload, then the predicted step time, peak memory and MFU of each.")
    p.add_argument("a", metavar="A", help="the first plan JSON file (the baseline)")
    p.add_argument("b", metavar="B", help="the second plan JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.planner.plan_diff import diff_plans
    from autoplan.planner.planfile import plan_from_file
    sys.stdout.write(diff_plans(plan_from_file(args.a), plan_from_file(args.b)))
    return 0
