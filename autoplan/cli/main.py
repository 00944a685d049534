"""The `autoplan` command line. Each sub-command lives in its own module; this one wires them."""

from __future__ import annotations

import argparse
import sys

from autoplan.version import __version__
from autoplan.errors import AutoplanError

_COMMANDS = ("demo_cmd", "trace_cmd", "cluster_cmd", "profile_cmd", "estimate_cmd", "plan_cmd",
             "inspect_cmd", "diff_cmd", "run_cmd", "export_cmd", "verify_cmd",
             "calibrate_cmd")


def build_parser() -> argparse.ArgumentParser:
    import importlib
    parser = argparse.ArgumentParser(
        prog="autoplan",
        description="Automatic parallelization planner for PyTorch training: trace a model, "
                    "describe a cluster, profile ops, estimate a configuration, search and "
                    "save the best plan, inspect and compare plans.")
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"autoplan.cli.{name}")
        before = set(sub.choices)
        module.add_parser(sub)
        for cmd in set(sub.choices) - before:   # modules that do not set func themselves
            if sub.choices[cmd].get_default("func") is None:
                sub.choices[cmd].set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AutoplanError as e:
        print(f"autoplan {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
