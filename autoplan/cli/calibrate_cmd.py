"""`autoplan calibrate PLAN --model M`: measure a plan here, compare with its prediction phase by
phase, refit the machine's coefficients, and save them as this machine's profile.

Runs the plan under torchrun on this machine (a plan for `--cluster local:N`), a few warm-up
steps, then `--steps` steps under torch.profiler on every rank. The measured time is split into
the estimate's phases (compute by kind, each collective, p2p, optimizer, the rest) and printed
next to the prediction. Then, by least squares over the measured events: the achieved matmul
rate (over the matrix products, FLOPs from their shapes), memory bandwidth and per-op launch cost
(over the memory-bound kernels), the optimizer's cost per parameter, and the loopback link's
bandwidth and latency (over the transfers, through the cost model's own collective formulas).
They are written to this CPU's profile (merged with its measured ops), which later `plan`,
`estimate` and `Cluster.local()` pick up; the plan is then re-estimated with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure a plan here, compare per phase, refit the "
                       "machine's coefficients into its profile", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="a plan for this machine (autoplan plan ... --cluster local:N)")
    p.add_argument("--model", required=True, help="the example model the plan was made for")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (5)")
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling (4)")
    p.add_argument("-o", "--output", default=None,
                   help="profile file to write (default: this CPU's profile on the search path)")
    p.add_argument("--dry-run", action="store_true", help="print the fits, write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.errors import PlanError
    from autoplan.planner.planfile import plan_from_file
    if args.steps < 2 or args.warmup < 1:
        raise PlanError("--steps takes at least 2 (a fit needs a spread), --warmup at least 1")
    plan = plan_from_file(args.plan)
    if plan.cluster.name != "local":
        raise PlanError(f"the plan is for cluster {plan.cluster.name!r}; calibrate measures this "
                        "machine: plan with --cluster local:N")
    world = plan.config.world_size
    import torch
    if torch.cuda.is_available():
        raise PlanError("calibrate measures CPU ranks so far: on GPUs the kernels run on CUDA "
                        "streams, which its attribution does not read yet; use `autoplan "
                        "profile --device cuda` for the device figures")
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        from autoplan.cli.demo_cmd import _free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={_free_port()}", "-m", "autoplan.runtime.worker", "--plan",
               args.plan, "--model", args.model, "--steps", str(args.warmup),
               "--profile-dir", tmp, "--profile-steps", str(args.steps),
               "--json", os.path.join(tmp, "steps.json")]
        print(f"calibrate: {world} rank(s), {args.warmup} warm-up step(s), then {args.steps} "
              "profiled", flush=True)
        code = subprocess.call(cmd, stdout=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
        records = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                print(f"calibrate: the run failed (exit {code}; no events from rank {r})",
                      file=sys.stderr)
                return 2
            with open(path) as f:
                records.append(json.load(f))
        with open(os.path.join(tmp, "steps.json")) as f:
            unprofiled_s = json.load(f)["measured_s"]
    return report_and_refit(plan, records, output=args.output, dry_run=args.dry_run,
                            unprofiled_s=unprofiled_s)


def report_and_refit(plan: Any, records: list[dict[str, Any]], *, output: str | None,
                     dry_run: bool, unprofiled_s: float | None = None) -> int:
    from autoplan.estimate.attribution import (attribute, main_thread, measured_summary,
                                               predicted_phases)
    phases = [attribute(r["events"], r["step_s"]) for r in records]
    slowest = max(range(len(phases)), key=lambda i: phases[i].step_s)
    measured = measured_summary(phases[slowest])
    predicted = predicted_phases(plan.predicted)
    print(f"\n  phase (rank {slowest}, per step)   predicted    measured   measured/predicted")
    for k in ("compute", "collectives", "p2p", "optimizer", "other", "step"):
        p, m = predicted[k], measured[k]
        ratio = f"{m / p:8.2f}" if p > 0 else "       -"
        print(f"  {k:<28} {p * 1e3:9.2f} ms {m * 1e3:8.2f} ms   {ratio}")
    detail = phases[slowest].seconds
    print("  measured detail: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in detail.items()
                                            if v > 0))
    if unprofiled_s:
        print(f"  (the same steps without the profiler: {unprofiled_s * 1e3:.2f} ms)")
    fits = refit(plan, records, [main_thread(r["events"]) for r in records],
                 optimizer_s=max(p.seconds["optimizer"] for p in phases))
    fits["framework_s_per_op"] = 0.0
    if dry_run:
        _print_fits(fits)
        return 0
    path = write_profile(fits, output)
    # the eager framework's time per op (Python, autograd, hooks, DTensor dispatch): what the
    # unprofiled step spends beyond everything the refit prices (the profiled steps are slower
    # by the profiler's own cost)
    step_s = unprofiled_s or measured["step"]
    priced_s = _estimate_here(plan)
    if priced_s is not None:
        # at least what the quick calibration's net of tiny layers measured: the residual also
        # carries the measurement's noise, and the profiled transfers' waits run long
        from autoplan.cost.profile_db import ProfileDB
        floor = ProfileDB.load(path).calibration.framework_s_per_op
        fits["framework_s_per_op"] = max(floor, _per_op(plan, step_s - priced_s) * fits["share"])
        path = write_profile(fits, output)
    _print_fits(fits)
    print(f"\nwrote {path}: later plans and estimates on this machine use it (plans made "
          "for local:N before it describe other figures: re-plan them)")
    now_s = _estimate_here(plan)
    if now_s is not None:
        print(f"re-estimated with the refit: {now_s * 1e3:.2f} ms per step, measured "
              f"{step_s * 1e3:.2f} ms (measured/predicted {step_s / now_s:.2f})")
    return 0


def _per_op(plan: Any, framework_s: float) -> float:
    """``framework_s`` per forward and backward of every op of the rank's stage and
    micro-batch (how the estimate prices ``Calibration.framework_s_per_op``)."""
    stages = plan.predicted.get("stages", [])
    ops = max((int(st.get("num_ops", 0)) for st in stages), default=0)
    m = int(plan.predicted.get("num_microbatches", 1) or 1)
    return max(0.0, framework_s) / (2 * ops * m) if ops else 0.0


def refit(plan: Any, records: list[dict[str, Any]], threads: list[int], *,
          optimizer_s: float | None = None) -> dict[str, Any]:
    """The compute, optimizer and loopback-link fits of all ranks' events."""
    from autoplan.cluster.local import unit_terms
    from autoplan.cost.refit import refit_compute, refit_link
    from autoplan.estimate.attribution import collective_kind
    events = []
    for rec, thread in zip(records, threads):
        events += [dict(e, thread=("main" if e["thread"] == thread else e["thread"]))
                   for e in rec["events"]]
    compute = refit_compute(events, "main")
    cfg = plan.config
    samples = []
    for e in events:
        kind = collective_kind(e["name"])
        if kind is None or kind == "p2p" or not e.get("shapes"):
            continue
        nbytes = 4.0 * sum(_numel(s) for s in e["shapes"][:1])
        if kind == "all_gather":
            nbytes *= _group(kind, cfg)           # priced by the gathered output
        if _group(kind, cfg) < 2:
            continue
        samples.append((*unit_terms(kind, nbytes, _group(kind, cfg)), e["dur_s"]))
    link = refit_link(samples)
    # ranks that outnumber the cores ran at a share of a core: the profile keeps whole-core
    # figures (Cluster.local scales them by the share of the run it describes)
    rank_threads = max(1, int(records[0].get("threads", 1)))
    share = min(1.0, (os.cpu_count() or 1) / (cfg.world_size * rank_threads))
    if link is not None:
        link = dataclasses.replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / share,
                                   latency_s=link.latency_s * share, wait_s=link.wait_s * share)
    if share < 1.0:
        compute = dataclasses.replace(compute, **{
            k: (getattr(compute, k) / share if k != "launch_s" else getattr(compute, k) * share)
            for k in ("matmul_flops_per_s", "memory_bandwidth_bytes_per_s", "launch_s")
            if getattr(compute, k)})
        optimizer_s = optimizer_s * share if optimizer_s else optimizer_s
    params = sum(int(p.get("params_per_device", 0)) for p in plan.predicted.get("stages", [])[:1])
    return {"compute": compute, "link": link, "optimizer_s": optimizer_s,
            "params_per_device": params, "threads": rank_threads, "share": share}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group(kind: str, cfg: Any) -> int:
    """The group a collective of this kind most likely ran on: the tensor-parallel axis for
    gathers and reduce-scatters when there is one, the data-parallel axis otherwise."""
    if kind in ("all_gather", "reduce_scatter"):
        return cfg.tp if cfg.tp > 1 else cfg.dp
    return cfg.dp if cfg.dp > 1 else cfg.tp


def _print_fits(fits: dict[str, Any]) -> None:
    c, link = fits["compute"], fits["link"]

    def show(x: float | None, scale: float, unit: str) -> str:
        return f"{x / scale:.3g} {unit}" if x is not None else "not fitted (too few sizes)"
    print("\n  refit (least squares over the measured events):")
    print(f"    matmul rate        {show(c.matmul_flops_per_s, 1e9, 'GFLOP/s')} "
          f"({c.points['matmul']} kernels)")
    print(f"    memory bandwidth   {show(c.memory_bandwidth_bytes_per_s, 1e9, 'GB/s')} "
          f"({c.points['memory']} kernels)")
    print(f"    op launch          {show(c.launch_s, 1e-6, 'us')} per kernel")
    print(f"    framework          {fits.get('framework_s_per_op', 0.0) * 1e6:.3g} us per op "
          "and pass (eager time outside the kernels: Python, autograd, hooks)")
    if fits.get("share", 1.0) < 1.0:
        print(f"    (the ranks had {fits['share']:.2f} of a core each: the figures above are per "
              "whole core)")
    if link is not None:
        print(f"    loopback link      {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, latency "
              f"{link.latency_s * 1e6:.3g} us, of which {link.wait_s * 1e6:.3g} us waiting for "
              f"the latest peer ({link.points} transfers)")
    else:
        print("    loopback link      not fitted (no collectives of two or more sizes)")


def write_profile(fits: dict[str, Any], output: str | None) -> str:
    """This CPU's profile with the refit figures (its measured ops kept)."""

    from autoplan.cluster.local import (auto_calibration, local_cpu_device_name,
                                        rank_calibration_db)
    from autoplan.cost.profile_db import PROFILE_DIR_ENV, ProfileDB, default_cache_dir
    device = local_cpu_device_name()
    base = ProfileDB.find(device)
    if base is None:
        auto_calibration(device)
        base = ProfileDB.find(device)
    if base is None:
        base = rank_calibration_db(device)
    if base.threads != fits["threads"]:
        # the refit describes ranks of fits["threads"] thread(s); the ops measured with
        # another count would be scaled wrongly beside it
        if base.entries:
            print(f"calibrate: this CPU's profile holds ops measured with {base.threads} "
                  f"thread(s), the ranks ran {fits['threads']}: they are left out of the new "
                  "profile (re-measure them with `autoplan profile`)", file=sys.stderr)
        base = dataclasses.replace(base, threads=fits["threads"], entries={})
    c = fits["compute"]
    cal = base.calibration
    changes: dict[str, float] = {}
    if c.matmul_flops_per_s:
        changes["matmul_flops_per_s"] = c.matmul_flops_per_s
    if c.memory_bandwidth_bytes_per_s:
        changes["memory_bandwidth_bytes_per_s"] = c.memory_bandwidth_bytes_per_s
    if c.launch_s:
        changes["launch_s"] = c.launch_s
    if fits.get("framework_s_per_op"):
        changes["framework_s_per_op"] = fits["framework_s_per_op"]
    params = fits["params_per_device"]
    if fits["optimizer_s"] and params:
        changes["optimizer_s_per_param"] = max(1e-12, fits["optimizer_s"] / params)
    links = dict(base.links)
    if fits["link"] is not None:
        links["loopback"] = {"bandwidth_bytes_per_s": fits["link"].bandwidth_bytes_per_s,
                             "latency_s": fits["link"].latency_s}
    db = dataclasses.replace(base, calibration=dataclasses.replace(cal, **changes),
                             links=links,
                             sources=tuple(base.sources) + ("autoplan calibrate",))
    folders = [f for f in os.environ.get(PROFILE_DIR_ENV, "").split(os.pathsep) if f]
    path = output or (os.path.join(os.path.expanduser(folders[0]), f"{device}.json")
                      if folders else str(default_cache_dir() / f"{device}.json"))
    db.save(path)
    return path


def _estimate_here(plan: Any) -> float | None:
    """The plan's step time estimated again with this machine's profile as it is now (None for
    a model that is not an example name)."""
    from autoplan.cluster import Cluster
    from autoplan.estimate import estimate
    from autoplan.graph import trace
    from autoplan.models import build_example
    try:
        ex = build_example(plan.model.name, batch_size=1)
    except ValueError:
        return None
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    sharding = None
    if plan.config.tp > 1:          # the plan's own per-op strategies, not the default ones
        from autoplan.estimate.partition import pipeline_units
        from autoplan.planner.shrink import transfer_sharding
        sharding, _ = transfer_sharding(plan.op_strategies, len(pipeline_units(g)), g,
                                        plan.config.tp)
    est = estimate(g, Cluster.local(plan.config.world_size), config=plan.config,
                   global_batch_size=plan.training.global_batch_size, profile="auto",
                   sharding=sharding)
    return est.step_time_s
