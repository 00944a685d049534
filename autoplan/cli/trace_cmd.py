"""`autoplan trace MODEL`: trace a model to an OpGraph, print a summary, optionally save it."""

from __future__ import annotations

import argparse

from autoplan.cli.common import add_model_args, graph_from_args, output_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="trace a model into an operator graph",
                       description="Trace MODEL with torch.export into autoplan's operator graph "
                                   "(ops, shapes, FLOPs, bytes, parameters, repeated blocks).")
    add_model_args(p, optional=True)      # --list needs none
    p.add_argument("-o", "--output", help="write the OpGraph as JSON to this file")
    p.add_argument("--ops", type=int, default=0, metavar="N", help="also list the first N ops")
    p.add_argument("--list", action="store_true", help="list the example model names and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list:
        from autoplan.models import example_family, list_examples
        for name in list_examples():
            print(f"{name:20s} {example_family(name)}")
        return 0
    if args.model is None:
        import sys
        print("autoplan trace: give a MODEL (an example name: see `autoplan trace --list`)",
              file=sys.stderr)
        return 2
    from autoplan.errors import AutoplanError
    if args.ops < 0:
        raise AutoplanError(f"--ops takes a count >= 0 (ops to list), got {args.ops}")
    output_arg(args.output, "-o")                 # before the trace, which may take minutes
    graph = graph_from_args(args)
    print(graph.summary())
    if args.ops:
        print(f"{'op':28s} {'kind':10s} {'GFLOP':>10s} {'MB out':>10s}  module")
        for op in graph.ops[: args.ops]:
            out_mb = op.bytes_written / 1e6
            print(f"{op.name[:28]:28s} {op.kind:10s} {op.fwd_flops / 1e9:10.3f} "
                  f"{out_mb:10.2f}  {op.module_path}")
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(graph.to_json(indent=1))
        except OSError as e:
            raise AutoplanError(f"cannot write {args.output!r}: {e.strerror or e}") from None
        print(f"wrote {args.output} (fingerprint {graph.fingerprint()[:16]})")
    return 0
