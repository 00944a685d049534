"""`autoplan calibrate` on GPUs: the refit over the profiled CUDA kernels of the plans' runs,
and this GPU's profile it is written to (``calibrate_cmd`` measures and reports; see there).

The profile's figures are what planning for this GPU prices with in place of the datasheet
(``cost.compute.Throughput.from_device``). Where this GPU has no profile yet, its device figures
are measured first (``machine.calibration.calibrate("cuda")``, as ``autoplan profile --device
cuda --calibrate-only`` does): the refit keeps that profile's size curve, matmul dtype and
element-wise rates, and replaces the products' rate, the copy bandwidth, the kernel's fixed
time, the optimizer's time per parameter and the framework's residual per op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def cuda_profile() -> tuple[str, Any]:
    """(this GPU's profile name, its profile): the installed one, else one measured now."""
    from autoplan.cluster.profile_db import ProfileDB
    from autoplan.machine.profiler import local_device_name
    name = local_device_name("cuda")
    db = ProfileDB.find(name)
    if db is None:
        from autoplan.machine.calibration import calibrate
        from autoplan.machine.profiler import build_db
        print(f"calibrate: {name} has no profile yet; measuring its device figures first "
              "(as `autoplan profile --device cuda --calibrate-only`)", flush=True)
        db = build_db({}, calibrate("cuda"), device="cuda", device_name=name,
                      sources=("autoplan calibrate: device figures",))
    return name, db


def elementwise_share(config: Any) -> float:
    """The share of the copy bandwidth the plan's memory-bound kernels were priced at."""
    from autoplan.cost.compute import eager_elementwise_share
    from autoplan.cost.dtypes import autocast_on
    return eager_elementwise_share("gpu", bool(config.compiled),
                                   autocast_on(config.precision, config.mixed_precision))


def refit_cuda(runs: Sequence[Any], optimizer_s: Sequence[float]) -> dict[str, Any]:
    """The fits over every rank's kernels of every plan (``calibrate_cmd.refit``'s keys, and
    ``base``: the profile they refit, ``device``: its name)."""
    from autoplan.cost.refit import refit_device
    name, base = cuda_profile()
    shares = {elementwise_share(m.plan.config) for m in runs}
    if len(shares) > 1:
        from autoplan.errors import PlanError
        raise PlanError("calibrate: the plans price their element-wise kernels at different "
                        "shares of the bandwidth (compiled and eager, or autocast and not): "
                        "calibrate them in separate runs")
    kernels = [k for m in runs for rec in m.records for k in rec["kernels"]]
    cal = base.calibration
    compute = refit_device(kernels, cal.matmul_size_efficiency, cal.matmul_dtype, shares.pop())
    per_param = [o / p for m, o in zip(runs, optimizer_s) if (p := _params(m.plan)) and o]
    return {"compute": compute, "link": None, "threads": base.threads, "base": base,
            "device": name,
            "optimizer_s_per_param": sum(per_param) / len(per_param) if per_param else None,
            "framework_s_per_op": 0.0, "peak_flops_per_s": _peak(name, cal.matmul_dtype)}


def _params(plan: Any) -> int:
    return sum(int(p.get("params_per_device", 0)) for p in plan.predicted.get("stages", [])[:1])


def _peak(device: str, dtype: str) -> float | None:
    """The datasheet's dense peak for ``dtype`` products (None for a GPU not in it)."""
    from autoplan.cluster import specs
    from autoplan.errors import ClusterError
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype)
    try:
        spec = specs.load_device(device)
    except ClusterError:
        return None
    return spec.peak_flops_for(precision) if precision else None


def print_cuda_fits(fits: dict[str, Any]) -> None:
    c = fits["compute"]
    dtype = fits["base"].calibration.matmul_dtype

    def show(x: float | None, scale: float, unit: str) -> str:
        return f"{x / scale:.4g} {unit}" if x is not None else "not fitted (too few sizes)"
    peak = fits.get("peak_flops_per_s")
    of_peak = (f", {c.matmul_flops_per_s / peak:.2f} of the datasheet {dtype} peak"
               if peak and c.matmul_flops_per_s else "")
    print(f"\n  refit of {fits['device']} (least squares over the GPU's kernels):")
    print(f"    matmul rate        {show(c.matmul_flops_per_s, 1e12, 'TFLOP/s')} "
          f"({c.points['matmul']} {dtype} product kernels{of_peak})")
    print(f"    memory bandwidth   {show(c.memory_bandwidth_bytes_per_s, 1e9, 'GB/s')} as a "
          f"large copy's ({c.points['memory']} memory-bound kernels)")
    print(f"    kernel fixed time  {show(c.launch_s, 1e-6, 'us')} per kernel")
    print(f"    framework          {fits.get('framework_s_per_op', 0.0) * 1e6:.3g} us per op "
          "and pass (what the steps spend beyond the priced kernels)")
    if fits.get("optimizer_s_per_param"):
        print(f"    optimizer          {fits['optimizer_s_per_param'] * 1e12:.3g} ps per "
              "parameter")
    print("    NCCL links         not refitted (cost_models/links.yaml)")


def write_cuda_profile(fits: dict[str, Any], output: str | None) -> str:
    """This GPU's profile with the refit figures (its measured ops and the rest kept)."""
    from autoplan.cluster.profile_db import ProfileDB
    from autoplan.cost.refit import calibration_changes
    base = fits["base"]
    changes = calibration_changes(fits, optimizer_floor_s_per_param=1e-15)
    sources = tuple(base.sources)
    if "autoplan calibrate" not in sources:
        sources += ("autoplan calibrate",)
    db = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, **changes),
                             sources=sources)
    path = output or ProfileDB.write_path(fits["device"])
    db.save(path)
    return path
