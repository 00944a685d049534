"""`autoplan calibrate PLAN [PLAN ...] --model M`: measure plans here, compare with their
predictions phase by phase, refit the machine's coefficients, and save them as its profile.

Runs each plan under torchrun on this machine (plans for `--cluster local:N`), a few warm-up
steps, then `--steps` steps under torch.profiler on every rank. The measured time is split into
the estimate's phases (compute by kind, each collective, p2p, optimizer, the rest) and printed
next to the prediction. Then, over all the plans' events:

- least squares over the kernels: the achieved matmul rate (FLOPs from the shapes), memory
  bandwidth and per-op launch cost, and the optimizer's cost per parameter;
- the loopback link's bandwidth and latency over the transfers (lower envelope of each size,
  through the cost model's own collective formulas);
- what the unprofiled steps spend beyond all that: the eager framework's time per op and pass
  (Python, autograd, hooks) and the wait for the latest peer per transfer step. The framework's
  time is the one the first-use calibration measured directly (a network of tiny layers); with
  two or more plans the waits are least squares over the rest of the plans' steps. (Fitting
  both to two plans was ill-conditioned: on this 2-core machine, runs of the same two plans
  gave 5.5 to 80 us per op, the waits moving the other way.) Without a measured framework time
  (an older profile) both are fitted; with one plan, the wait comes from the profiled transfers
  and the framework time from the rest.

Ranks that outnumber the cores ran with a share of a core: the figures are kept per whole core
(``Cluster.local`` scales them by the share of the run it describes). They are written to this
CPU's profile, which later `plan`, `estimate` and `Cluster.local()` pick up; the plans are then
re-estimated with them.

On a machine with CUDA the plans are for its GPUs (``--cluster local:N``, one GPU a rank) and
what is read is the GPUs' own timeline: the profiled CUDA kernels, each attributed to the CPU
op that launched it (``runtime/step_trace.py``). The phases are the GPU's time (``other``: where
it waited), and the refit is over the kernels (``cost.refit.refit_device``): the products' rate
in the profile's matmul dtype (its fraction of the datasheet peak is printed), the bandwidth the
eager element-wise kernels reach, as a large copy's (divided by the share the plan priced them
at), a kernel's fixed time on the device, the optimizer's GPU time per parameter, and the
residual per op and pass. NCCL's links are not refitted (they come from ``cost_models/links.yaml``;
with one GPU there are none). The figures go to this GPU's profile (``autoplan profile --device
cuda`` makes one; without one its device figures are measured first), which planning for this
GPU then prices with in place of the datasheet.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

DELTA_LATENCY_S = 1e-4        # the step for the numerical slope of a step in the link latency


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure plans here, compare per phase, refit the "
                       "machine's coefficients into its profile", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="+", metavar="plan",
                   help="plans for this machine (autoplan plan ... --cluster local:N); two of "
                        "different make-up (e.g. dp2 and tp2) fit the framework time and the "
                        "transfers' waits apart")
    p.add_argument("--model", required=True, help="the example model the plans were made for")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (5)")
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling (4)")
    p.add_argument("-o", "--output", default=None,
                   help="profile file to write (default: this CPU's profile on the search path)")
    p.add_argument("--dry-run", action="store_true", help="print the fits, write nothing")
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One plan's run: the plan, every rank's profiled events, the unprofiled step time."""

    plan: Any
    records: list[dict[str, Any]]
    unprofiled_s: float | None

    @property
    def cuda(self) -> bool:
        """Whether the ranks ran on GPUs (their records hold the kernels)."""
        return self.records[0].get("device") == "cuda"

    @property
    def share(self) -> float:
        """The share of a core each rank had (a whole GPU each on CUDA)."""
        if self.cuda:
            return 1.0
        threads = max(1, int(self.records[0].get("threads", 1)))
        return min(1.0, (os.cpu_count() or 1) / (self.plan.config.world_size * threads))


def run(args: argparse.Namespace) -> int:
    from autoplan.errors import PlanError
    from autoplan.planner.planfile import plan_from_file
    if args.steps < 2 or args.warmup < 1:
        raise PlanError("--steps takes at least 2 (a fit needs a spread), --warmup at least 1")
    from autoplan.cli.common import output_arg
    output_arg(args.output, "-o")             # before the runs, which take minutes
    runs = []
    plans = [(path, plan_from_file(path)) for path in args.plans]   # all read before any run
    for path, plan in plans:
        if plan.cluster.name != "local":
            raise PlanError(f"{path}: the plan is for cluster {plan.cluster.name!r}; calibrate "
                            "measures this machine: plan with --cluster local:N")
    for path, plan in plans:
        measured = _measure(path, plan, args)
        if measured is None:
            return 2
        runs.append(measured)
    return report_and_refit(runs, output=args.output, dry_run=args.dry_run)


def _measure(path: str, plan: Any, args: argparse.Namespace) -> Measured | None:
    world = plan.config.world_size
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        from autoplan.cli.demo_cmd import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", "-m", "autoplan.runtime.worker", "--plan",
               path, "--model", args.model, "--steps", str(args.warmup),
               "--profile-dir", tmp, "--profile-steps", str(args.steps),
               "--json", os.path.join(tmp, "steps.json")]
        print(f"calibrate {path}: {world} rank(s), {args.warmup} warm-up step(s), then "
              f"{args.steps} profiled", flush=True)
        from autoplan.cli.demo_cmd import rank_env
        code = subprocess.call(cmd, stdout=subprocess.DEVNULL,
                               env={**rank_env(), "PYTHONWARNINGS": "ignore"})
        records = []
        for r in range(world):
            rank_path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(rank_path):
                print(f"calibrate: the run failed (exit {code}; no events from rank {r})",
                      file=sys.stderr)
                return None
            with open(rank_path) as f:
                records.append(json.load(f))
        with open(os.path.join(tmp, "steps.json")) as f:
            unprofiled_s = json.load(f)["measured_s"]
    return Measured(plan, records, unprofiled_s)


def _report(m: Measured) -> dict[str, float]:
    """Print one plan's phases, predicted next to measured; the measured ones."""
    from autoplan.estimate.attribution import attribute, measured_summary, predicted_phases
    phases = [attribute(timeline(r), r["step_s"]) for r in m.records]
    slowest = max(range(len(phases)), key=lambda i: phases[i].step_s)
    measured = measured_summary(phases[slowest])
    predicted = predicted_phases(m.plan.predicted)
    cfg = m.plan.config
    each = "one GPU each, its kernels" if m.cuda else f"{m.share:.2f} of a core each"
    print(f"\n  dp{cfg.dp} tp{cfg.tp} pp{cfg.pp} zero{cfg.zero_stage} mbs{cfg.micro_batch_size} "
          f"on {cfg.world_size} rank(s), {each}")
    print(f"  phase (rank {slowest}, per step)   predicted    measured   measured/predicted")
    for k in ("compute", "collectives", "p2p", "optimizer", "other", "step"):
        p, x = predicted[k], measured[k]
        ratio = f"{x / p:8.2f}" if p > 0 else "       -"
        print(f"  {k:<28} {p * 1e3:9.2f} ms {x * 1e3:8.2f} ms   {ratio}")
    detail = phases[slowest].seconds
    print("  measured detail: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in detail.items()
                                            if v > 0))
    if m.unprofiled_s:
        print(f"  (the same steps without the profiler: {m.unprofiled_s * 1e3:.2f} ms)")
    measured["optimizer_max"] = max(p.seconds["optimizer"] for p in phases)
    return measured


def timeline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The events a rank's phases are read from: its GPU's kernels on CUDA, else its ops."""
    return record["kernels"] if record.get("device") == "cuda" else record["events"]


def report_and_refit(runs: list[Measured], *, output: str | None, dry_run: bool) -> int:
    from autoplan.errors import PlanError
    if len({m.cuda for m in runs}) > 1:
        raise PlanError("calibrate: some plans ran on GPUs and some on CPU ranks; give plans "
                        "for one kind of device at a time")
    summaries = [_report(m) for m in runs]
    optimizer_s = [s["optimizer_max"] for s in summaries]
    if runs[0].cuda:
        from autoplan.cli.calibrate_cuda import refit_cuda
        fits = refit_cuda(runs, optimizer_s)
    else:
        fits = refit(runs, optimizer_s, _current_size_curve())
    if dry_run:
        _print_fits(fits)
        return 0
    steps = [m.unprofiled_s or s["step"] for m, s in zip(runs, summaries)]
    link, profiled_wait = fits["link"], (fits["link"].wait_s if fits["link"] else 0.0)
    if link is not None:     # the link itself first; the waits come from the steps below
        fits["link"] = dataclasses.replace(link, latency_s=link.latency_s - link.wait_s,
                                           wait_s=0.0)
    # the first-use measurement, if any (a GPU has none: a calibration's residual from an
    # earlier run is refitted, not kept as a floor)
    floor = 0.0 if "base" in fits else _current_framework_s_per_op()
    path = write_profile(fits, output)
    base = [_estimate_here(m.plan) for m in runs]
    if all(b is not None for b in base):
        per_op = [_ops_passes(m.plan) / m.share for m in runs]   # priced framework per 1 s/op
        resid = [s - b for s, b in zip(steps, base)]
        framework, wait = None, profiled_wait
        if link is not None and len(runs) >= 2:
            fits["link"] = dataclasses.replace(fits["link"], latency_s=fits["link"].latency_s
                                               + DELTA_LATENCY_S)
            write_profile(fits, output)
            slope = [(_estimate_here(m.plan) - b) / DELTA_LATENCY_S for m, b in zip(runs, base)]
            if floor > 0:                # measured: the waits are what is left
                framework = floor
                wait = _waits(slope, [r - p * floor for r, p in zip(resid, per_op)], wait)
            else:
                from autoplan.cost.refit import fit_two
                both = fit_two(per_op, slope, resid)
                if both is not None:
                    framework, wait = both
        if framework is None:          # one plan: the profiled waits, the framework the rest
            if link is not None:
                fits["link"] = dataclasses.replace(fits["link"], latency_s=link.latency_s)
                write_profile(fits, output)
            framework = max(0.0, steps[0] - _estimate_here(runs[0].plan)) / per_op[0]
            wait = profiled_wait
        fits["framework_s_per_op"] = max(floor, framework)
        if link is not None:
            fits["link"] = dataclasses.replace(link, latency_s=link.latency_s - link.wait_s
                                               + wait, wait_s=wait)
        path = write_profile(fits, output)
    _print_fits(fits)
    print(f"\nwrote {path}: later plans and estimates on this machine use it (plans made "
          "for local:N before it describe other figures: re-plan them)")
    for m, step_s in zip(runs, steps):
        now_s = _estimate_here(m.plan)
        if now_s is not None:
            print(f"re-estimated with the refit: {now_s * 1e3:.2f} ms per step, measured "
                  f"{step_s * 1e3:.2f} ms (measured/predicted {step_s / now_s:.2f})")
    return 0


def _waits(slope: Sequence[float], rest: Sequence[float], profiled: float) -> float:
    """Least squares of ``rest = slope * wait`` (seconds of step per second of latency, the
    steps' residuals), at least 0; ``profiled`` where the plans make no transfer."""
    sxx = sum(x * x for x in slope)
    if sxx <= 0:
        return profiled
    return max(0.0, sum(x * y for x, y in zip(slope, rest)) / sxx)


def _current_loopback_bandwidth() -> float:
    """This machine's loopback bandwidth as planning prices it now (profile or default, per
    whole core): kept when a run's transfers do not determine it."""
    from autoplan.cluster import specs
    from autoplan.cluster.local import local_cpu_device_name, profiled_links
    fitted = profiled_links(local_cpu_device_name()).get("loopback")
    if fitted is not None:
        return float(fitted["bandwidth_bytes_per_s"])
    return float(specs.load_link("loopback").to_dict()["bandwidth_bytes_per_s"])


def _current_size_curve() -> tuple[tuple[float, float], ...]:
    """The size curve of this CPU's profile (first-use calibration measures it): the refit
    keeps its shape and fits the rate it is relative to."""
    from autoplan.cluster.local import local_cpu_device_name
    from autoplan.cluster.profile_db import ProfileDB
    db = ProfileDB.find(local_cpu_device_name())
    return db.calibration.matmul_size_efficiency if db is not None else ()


def _current_framework_s_per_op() -> float:
    """The profile's framework time per op (first use measures it); measured here, as first
    use does, for a profile made before first use took it (a shipped one): fitted jointly
    with the waits from two plans, it absorbed whatever else the steps spent (204 us per op
    where 6 us was measured)."""
    from autoplan.cluster.local import RANK_THREADS, local_cpu_device_name
    from autoplan.cluster.profile_db import ProfileDB
    db = ProfileDB.find(local_cpu_device_name())
    measured = db.calibration.framework_s_per_op if db is not None else 0.0
    if measured > 0:
        return measured
    from autoplan.machine.calibration import framework_s_per_op
    return framework_s_per_op(RANK_THREADS)


def _ops_passes(plan: Any) -> float:
    """Forward and backward passes of every op of the rank's stage and micro-batch (what the
    estimate multiplies ``Calibration.framework_s_per_op`` by, before the share)."""
    stages = plan.predicted.get("stages", [])
    ops = max((int(st.get("num_ops", 0)) for st in stages), default=0)
    m = int(plan.predicted.get("num_microbatches", 1) or 1)
    return float(2 * ops * m)


def refit(runs: list[Measured], optimizer_s: list[float],
          size_curve: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The compute, optimizer and loopback-link fits over all plans' events, per whole core
    (the matmul rate on the profile's ``size_curve``)."""
    from autoplan.machine.first_use import unit_terms
    from autoplan.cost.refit import refit_compute, refit_link
    from autoplan.estimate.attribution import collective_kind, main_thread
    events, samples = [], []
    for m in runs:
        cfg = m.plan.config
        for rec in m.records:
            thread = main_thread(rec["events"])
            for e in rec["events"]:       # a share of a core ran everything 1/share as long
                e = dict(e, dur_s=e["dur_s"] * m.share,
                         thread=("main" if e["thread"] == thread else e["thread"]))
                events.append(e)
                kind = collective_kind(e["name"])
                if kind is None or kind == "p2p" or not e.get("shapes"):
                    continue
                group = _group(kind, cfg)
                if group < 2:
                    continue
                nbytes = 4.0 * sum(math.prod(s) for s in e["shapes"][:1])
                if kind == "all_gather":
                    nbytes *= group                # priced by the gathered output
                samples.append((*unit_terms(kind, nbytes, group), e["dur_s"]))
    compute = refit_compute(events, "main", size_curve)
    link = refit_link(samples, _current_loopback_bandwidth())
    # the optimizer: its time per parameter, per whole core, over the plans
    per_param = [o * m.share / p for m, o in zip(runs, optimizer_s)
                 if (p := _params(m.plan)) and o]
    threads = max(1, int(runs[0].records[0].get("threads", 1)))
    return {"compute": compute, "link": link, "threads": threads,
            "optimizer_s_per_param": sum(per_param) / len(per_param) if per_param else None,
            "framework_s_per_op": 0.0}


def _params(plan: Any) -> int:
    return sum(int(p.get("params_per_device", 0)) for p in plan.predicted.get("stages", [])[:1])


def _group(kind: str, cfg: Any) -> int:
    """The group a collective of this kind most likely ran on: the tensor-parallel axis for
    gathers and reduce-scatters when there is one, the data-parallel axis otherwise."""
    if kind in ("all_gather", "reduce_scatter"):
        return cfg.tp if cfg.tp > 1 else cfg.dp
    return cfg.dp if cfg.dp > 1 else cfg.tp


def _print_fits(fits: dict[str, Any]) -> None:
    if "base" in fits:
        from autoplan.cli.calibrate_cuda import print_cuda_fits
        print_cuda_fits(fits)
        return
    c, link = fits["compute"], fits["link"]

    def show(x: float | None, scale: float, unit: str) -> str:
        return f"{x / scale:.3g} {unit}" if x is not None else "not fitted (too few sizes)"
    print("\n  refit (least squares over the measured events; per whole core):")
    print(f"    matmul rate        {show(c.matmul_flops_per_s, 1e9, 'GFLOP/s')} "
          f"({c.points['matmul']} kernels)")
    print(f"    memory bandwidth   {show(c.memory_bandwidth_bytes_per_s, 1e9, 'GB/s')} "
          f"({c.points['memory']} kernels)")
    print(f"    op launch          {show(c.launch_s, 1e-6, 'us')} per kernel")
    print(f"    framework          {fits.get('framework_s_per_op', 0.0) * 1e6:.3g} us per op "
          "and pass (eager time outside the kernels: Python, autograd, hooks)")
    if fits.get("optimizer_s_per_param"):
        print(f"    optimizer          {fits['optimizer_s_per_param'] * 1e9:.3g} ns per parameter")
    if link is not None:
        print(f"    loopback link      {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, latency "
              f"{link.latency_s * 1e6:.3g} us, of which {link.wait_s * 1e6:.3g} us waiting for "
              f"the latest peer ({link.points} transfers"
              + ("; their sizes did not determine the bandwidth: the profile's is kept)"
                 if link.bandwidth_kept else ")"))
    else:
        print("    loopback link      not fitted (no collectives)")


def write_profile(fits: dict[str, Any], output: str | None) -> str:
    """This CPU's profile with the refit figures (its measured ops kept); this GPU's where
    the fits are a GPU's."""
    if "base" in fits:
        from autoplan.cli.calibrate_cuda import write_cuda_profile
        return write_cuda_profile(fits, output)

    from autoplan.cluster.local import auto_calibration, local_cpu_device_name
    from autoplan.machine.first_use import rank_calibration_db
    from autoplan.cluster.profile_db import ProfileDB
    from autoplan.cost.refit import calibration_changes
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
    cal = base.calibration
    changes = calibration_changes(fits, optimizer_floor_s_per_param=1e-12)
    links = dict(base.links)
    if fits["link"] is not None:
        links["loopback"] = {"bandwidth_bytes_per_s": fits["link"].bandwidth_bytes_per_s,
                             "latency_s": fits["link"].latency_s}
    db = dataclasses.replace(base, calibration=dataclasses.replace(cal, **changes),
                             links=links,
                             sources=tuple(base.sources) + ("autoplan calibrate",))
    path = output or ProfileDB.write_path(device)
    db.save(path)
    return path


@functools.lru_cache(maxsize=4)
def _example_graph(name: str) -> Any:
    """The traced example model (None for a name that is not one), once per calibration: its
    plans are re-estimated several times as the fit goes."""
    from autoplan.graph import trace
    from autoplan.models import build_example
    try:
        ex = build_example(name, batch_size=1)
    except ValueError:
        return None
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def _estimate_here(plan: Any) -> float | None:
    """The plan's step time estimated again with this machine's profile as it is now (None for
    a model that is not an example name)."""
    from autoplan.cluster import Cluster
    from autoplan.estimate import estimate
    g = _example_graph(plan.model.name)
    if g is None:
        return None
    sharding = None
    if plan.config.tp > 1:          # the plan's own per-op strategies, not the default ones
        from autoplan.estimate.partition import pipeline_units
        from autoplan.planner.shrink import transfer_sharding
        sharding, _ = transfer_sharding(plan.op_strategies, len(pipeline_units(g)), g,
                                        plan.config.tp)
    est = estimate(g, Cluster.local(plan.config.world_size), config=plan.config,
                   global_batch_size=plan.training.global_batch_size, profile="auto",
                   sharding=sharding,
                   expert_capacity_factor=plan.training.expert_capacity_factor,
                   seq_lengths=plan.training.length_histogram())
    return est.step_time_s
