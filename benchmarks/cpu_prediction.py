"""Predicted vs measured step time (forward, backward, AdamW) on this CPU.

    python benchmarks/cpu_prediction.py                  # every case, 3 attempts each
    python benchmarks/cpu_prediction.py --case mlp --attempts 1

Each attempt calibrates the device and profiles the model's ops in this process (what
`autoplan profile` does), predicts with `estimate`, then times real training steps. Both are
measured in the same run, so the figure is a ratio, not an absolute time. The loop runs with
freed host memory kept in the process (`keep_freed_host_memory`), the regime the cost model
describes. It prints predicted/measured per attempt with a per-phase breakdown and the best
ratio per case. The ratio depends on the CPU and on what else the machine runs, which is why it
is a benchmark and not a test (the test suite asserts no wall-clock time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autoplan import Cluster, ParallelConfig, estimate
from autoplan.cost.host_allocator import keep_freed_host_memory
from autoplan.machine.calibration import calibrate
from autoplan.machine.profiler import build_db, profile_model
from autoplan.models import build_example

# Batches where the ops' own work, not Python's per-op overhead (which the cost model does not
# price yet), dominates a step: the tiny configs at small batches are mostly overhead.
CASES = {"mlp": 64, "gpt-small-cpu": 4, "resnet-tiny": 32, "dlrm-tiny": 2048}


def measured_step_s(ex, steps: int = 15, warmup: int = 3) -> dict[str, float]:
    """Median seconds of forward, backward, optimizer (step + zero_grad) and the whole step."""
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-4)
    phases: dict[str, list[float]] = {"fwd": [], "bwd": [], "opt": [], "step": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = ex.loss_fn(ex.model(*ex.example_inputs), ex.targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= warmup:
            for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("step", t3 - t0)):
                phases[k].append(v)
    return {k: statistics.median(v) for k, v in phases.items()}


def predicted(ex, batch: int, *, repeats: int = 9):
    """`estimate` of one fp32 device step, from a profile and a calibration measured now."""
    calibration = calibrate("cpu")
    graph, prof = profile_model(ex, repeats=repeats, warmup=2)
    db = build_db(prof.timings, calibration)
    cluster = Cluster.local(calibration={
        "matmul_flops_per_s": calibration.matmul_flops_per_s,
        "memory_bandwidth_bytes_per_s": calibration.memory_bandwidth_bytes_per_s,
        "launch_s": calibration.launch_s})
    return estimate(graph, cluster, config=ParallelConfig(micro_batch_size=batch, precision="fp32"),
                    global_batch_size=batch, profile=db)


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def run_case(name: str, batch: int, attempts: int, *, repeats: int = 9, steps: int = 15) -> list[float]:
    """Predicted/measured ratios, one per attempt; prints each attempt's breakdown."""
    ex = build_example(name, batch_size=batch)
    ratios = []
    for attempt in range(attempts):
        est = predicted(ex, batch, repeats=repeats)
        measured = measured_step_s(ex, steps=steps)
        ratios.append(est.step_time_s / measured["step"])
        stage = est.stages[0]
        print(f"{name:>14} b={batch:<5} attempt {attempt + 1}: predicted/measured {ratios[-1]:.2f}  "
              f"(predicted fwd {_ms(stage.fwd_s)} bwd {_ms(stage.bwd_s)} "
              f"opt {_ms(est.time.optimizer_s)} overhead {_ms(est.time.overhead_s)}; measured "
              + " ".join(f"{k} {_ms(v)}" for k, v in measured.items()) + ")", flush=True)
    return ratios


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append",
                    help="a case to run (repeatable; default: all)")
    ap.add_argument("--attempts", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_host_memory()   # a no-op off glibc
    summary = []
    for name in args.case or list(CASES):
        ratios = run_case(name, CASES[name], args.attempts)
        best = min(ratios, key=lambda r: abs(r - 1))
        summary.append((name, best, ratios))
    print("\ncase            best predicted/measured   all attempts")
    for name, best, ratios in summary:
        print(f"{name:<15} {best:>6.2f}                    " + " ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
