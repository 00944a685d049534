"""``autoplan profile``: measure the ops of example models on this machine into a ProfileDB.

    autoplan profile gpt-tiny mlp --batch-size 4            # -> ~/.cache/autoplan/profiles/
    autoplan profile gpt-tiny@4 mlp@64 resnet-tiny@16       # a batch size per model
    autoplan profile resnet-tiny -o profiles/cpu-x.json     # into a chosen file
    autoplan profile --calibrate-only                       # refresh the device figures only

Order of work: trace and profile every model first (the long part), then calibrate (so the
calibration reflects the same warm process), then merge into the existing database for this
device and write it. Measurements taken with a different thread count or on another device are
not mixed in: the existing file is then replaced, and the summary says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from autoplan.errors import AutoplanError

_MAX_FAILURES_SHOWN = 8


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile", help="measure op timings of example models on this machine",
        description="Trace example models (with their loss), time every distinct op forward "
                    "and backward on this device, calibrate the device, and merge the result "
                    "into the profile database for this device.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="example model names, e.g. gpt-tiny mlp; MODEL@N traces that model at "
                        "batch size N (e.g. gpt-tiny@4 mlp@64)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="batch size to trace each model at (default: the example's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="device to measure on (default: cpu)")
    p.add_argument("--repeats", type=int, default=15, metavar="N",
                   help="timed samples per op and direction; the median is kept (default: 15)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed calls before timing (default: 3)")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="database file to merge into and write "
                        "(default: ~/.cache/autoplan/profiles/<device>.json)")
    p.add_argument("--calibrate-only", action="store_true",
                   help="only measure the device figures (GEMM, bandwidth, launch, optimizer)")
    p.set_defaults(run=run)
    return p


def _say(text: str = "") -> None:
    print(text, flush=True)


def _warn_if_busy() -> None:
    """Other processes on the CPU inflate every timing (CPU ops wait for their threads)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return
    cores = os.cpu_count() or 1
    if load > 0.75 * cores:
        _say(f"note: load average {load:.1f} on {cores} cores: other processes compete for the "
             "CPU and inflate timings; profile on an idle machine for a profile to keep")


def _model_spec(spec: str, default_batch: int | None) -> tuple[str, int | None]:
    """"gpt-tiny@4" -> ("gpt-tiny", 4); "gpt-tiny" -> ("gpt-tiny", --batch-size)."""
    name, sep, batch = spec.rpartition("@")
    if not sep:
        return spec, default_batch
    if not batch.isdigit() or int(batch) < 1 or not name:
        raise AutoplanError(f"model {spec!r}: write MODEL or MODEL@BATCH with a positive "
                            "integer batch size, e.g. gpt-tiny@4")
    return name, int(batch)


def _existing_db(path: Path, device_name: str):
    """The database to merge into: the output file if it exists, else the one found for the
    device (cache or packaged). Returns (db or None, where it came from)."""
    from autoplan.cluster.profile_db import ProfileDB

    if path.exists():
        return ProfileDB.load(path), str(path)
    found = ProfileDB.find(device_name)
    if found is None:
        return None, ""
    where = next((str(c) for c in ProfileDB.search_paths(device_name) if c.is_file()), "?")
    return found, where


def _profile_models(args: argparse.Namespace, device: str):
    """Trace and profile each model; returns (timings, sources, graphs, total failures)."""
    from autoplan.graph import trace
    from autoplan.machine.profiler import profile_graph
    from autoplan.models import build_example

    timings: dict = {}
    sources: list[str] = []
    graphs = []
    failures = 0
    for spec in args.models:
        name, batch_size = _model_spec(spec, args.batch_size)
        kw = {} if batch_size is None else {"batch_size": batch_size}
        t0 = time.perf_counter()
        try:
            ex = build_example(name, device="cpu", **kw)
        except (ValueError, TypeError) as e:
            raise AutoplanError(f"cannot build example model {name!r}: {e}") from e
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no rule for op" warnings: not this command's topic
            loss_fn = ex.loss_fn if ex.targets is not None else None
            graph = trace(ex.model, ex.example_inputs, loss_fn=loss_fn, targets=ex.targets,
                          name=name)
        trace_s = time.perf_counter() - t0
        batch = graph.batch_size
        prof = profile_graph(graph, device=device, warmup=args.warmup, repeats=args.repeats,
                             skip=timings.keys())
        timings.update(prof.timings)
        failures += len(prof.failures)
        sources.append(f"{name}@{batch}")
        graphs.append((name, graph))
        _say(f"{name} (batch {batch}): {prof.num_ops} ops, {prof.num_keys} distinct, "
             f"{len(prof.timings)} profiled, {prof.skipped} already measured, "
             f"{len(prof.failures)} failed; traced in {trace_s:.1f} s, "
             f"profiled in {prof.elapsed_s:.1f} s (autograd.grad call overhead "
             f"{prof.autograd_overhead_s * 1e6:.0f} us, subtracted from each backward)")
        for reason in list(prof.failures.values())[:_MAX_FAILURES_SHOWN]:
            _say(f"    could not replay {reason}")
        if len(prof.failures) > _MAX_FAILURES_SHOWN:
            _say(f"    ... and {len(prof.failures) - _MAX_FAILURES_SHOWN} more")
        del ex
    return timings, sources, graphs, failures


def run(args: argparse.Namespace) -> int:
    """Run ``autoplan profile``; returns the exit status (0 ok, 2 bad input)."""
    import torch

    from autoplan.cluster.profile_db import default_cache_dir
    from autoplan.machine.calibration import calibrate
    from autoplan.machine.profiler import build_db, local_device_name

    if not args.models and not args.calibrate_only:
        print("autoplan profile: give at least one MODEL (or --calibrate-only)", file=sys.stderr)
        return 2
    if args.calibrate_only and args.models:
        print("autoplan profile: --calibrate-only takes no MODEL", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.warmup < 0 or (args.batch_size is not None and args.batch_size < 1):
        print(f"autoplan profile: need --repeats >= 1, --warmup >= 0, --batch-size >= 1; got "
              f"{args.repeats}, {args.warmup}, {args.batch_size}", file=sys.stderr)
        return 2
    try:
        if args.output:
            from autoplan.cli.common import output_arg
            output_arg(args.output, "-o")      # before the profile, which takes minutes
        device_name = local_device_name(args.device)
        out = Path(args.output).expanduser() if args.output else \
            default_cache_dir() / f"{device_name}.json"
        existing, existing_from = _existing_db(out, device_name)
        _say(f"profiling on {device_name} ({args.device}, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__})")
        _warn_if_busy()

        t0 = time.perf_counter()
        timings, sources, graphs, failures = ({}, [], [], 0)
        if not args.calibrate_only:
            timings, sources, graphs, failures = _profile_models(args, args.device)
        cal = calibrate(args.device)
        new = build_db(timings, cal, device=args.device, device_name=device_name,
                       sources=sources)

        db = new
        if existing is not None:
            why = existing.compatible_with(new)
            if why is None:
                db = existing.merged(new)
                _say(f"merged into {existing_from} ({len(existing.entries)} entries before)")
            else:
                _say(f"not merging {existing_from}: it was {why}; writing a new database")
        db.save(out)
    except AutoplanError as e:
        print(f"autoplan profile: {e}", file=sys.stderr)
        return 2

    _say(f"calibration: matmul {cal.matmul_flops_per_s / 1e9:,.1f} GFLOP/s ({cal.matmul_dtype}), "
         f"memory {cal.memory_bandwidth_bytes_per_s / 1e9:,.1f} GB/s, "
         f"launch {cal.launch_s * 1e6:.2f} us, "
         f"AdamW {cal.optimizer_s_per_param * 1e9:.2f} ns/param + "
         f"{cal.optimizer_s_per_tensor * 1e6:.1f} us/tensor, "
         f"step overhead {cal.step_overhead_s * 1e6:.1f} us")
    for name, graph in graphs:
        found = [db.lookup(graph, op) for op in graph.ops]
        fwd = sum(t.fwd_s for t in found if t is not None)
        bwd = sum(t.bwd_s for t in found if t is not None)
        covered = sum(t is not None for t in found)
        _say(f"{name}: sum of op medians fwd {fwd * 1e3:.2f} ms, bwd {bwd * 1e3:.2f} ms "
             f"({covered}/{len(graph.ops)} ops measured)")
    _say(f"{len(timings)} op keys profiled, {failures} failed, "
         f"{time.perf_counter() - t0:.1f} s; wrote {len(db.entries)} entries to {out} "
         f"({os.path.getsize(out) / 1e3:.0f} kB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m autoplan.cli.profile_cmd MODEL ...``."""
    parser = argparse.ArgumentParser(prog="autoplan")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
