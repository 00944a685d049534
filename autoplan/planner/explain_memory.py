"""The memory and time sections of ``autoplan inspect`` (split from ``explain.py``).

Like the rest of the explanation they read a :class:`~autoplan.planner.planfile.Plan` only: the
predicted bytes per device of the fullest pipeline stage (with what is offloaded to host memory
or NVMe, and which layers' activations go there) and the slowest stage's time per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.planner.planfile import Plan
from autoplan.planner.text_format import fmt_bytes, fmt_pct, fmt_s

_MEMORY_ITEMS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                 "transient_bytes", "margin_bytes")


def stage_total(st: Mapping[str, Any]) -> float:
    """One stage's predicted bytes per device, every kind in ``_MEMORY_ITEMS`` summed."""
    return sum(st["memory"][k] for k in _MEMORY_ITEMS)


def memory_text(plan: Plan) -> str:
    """The memory section of ``autoplan inspect``: the fullest stage's bytes per device by kind,
    against the device's memory, what is offloaded, and each stage's total."""
    p = plan.predicted
    stages = p.get("stages", ())
    if not stages:
        return f"memory   peak {fmt_bytes(p['peak_memory_bytes'])} of {fmt_bytes(p['device_memory_bytes'])}"
    worst = max(stages, key=stage_total)
    mem = worst["memory"]
    device = p["device_memory_bytes"]
    which = f" (stage {worst['index']}, the fullest of {len(stages)})" if len(stages) > 1 else ""
    lines = [f"memory per device{which}"]
    for key in _MEMORY_ITEMS:
        mbs = worst["microbatches_in_flight"]
        count = f"{mbs:g}" if float(mbs).is_integer() else f"about {mbs:.1f}"
        extra = (f"   ({count} micro-batch{'es' * (mbs != 1)} in flight)"
                 if key == "activations_bytes" else "")
        lines.append(f"  {key[:-6]:<12} {fmt_bytes(mem[key]):>12}{extra}")
    total = stage_total(worst)
    lines.append(f"  {'= total':<12} {fmt_bytes(total):>12}   of {fmt_bytes(device)} "
                 f"({fmt_pct(total / device if device else 0.0)}): "
                 + ("fits" if total <= device else "DOES NOT FIT"))
    if mem.get("offloaded_bytes"):
        lines.append(f"  offloaded to host memory: {fmt_bytes(mem['offloaded_bytes'])}"
                     + ("   (buffers streaming to NVMe)" if mem.get("nvme_bytes") else ""))
    if mem.get("nvme_bytes"):
        lines.append(f"  offloaded to NVMe:        {fmt_bytes(mem['nvme_bytes'])}   of "
                     f"{fmt_bytes(p.get('nvme_per_device_bytes', 0.0))} (a device's share of "
                     f"its node's drives)")
    lines += _activation_offload(plan)
    if len(stages) > 1:
        lines.append("  per stage: " + ", ".join(f"{st['index']}: {fmt_bytes(stage_total(st))}"
                                               for st in stages[:8])
                     + (" ..." if len(stages) > 8 else ""))
    return "\n".join(lines)


def _activation_offload(plan: Plan) -> list[str]:
    """Which layers send their saved activations to host memory, the bytes per micro-batch
    each way per stage, the host memory they hold and the seconds the copies expose."""
    layers = plan.offload.get("activations")
    if not layers:
        return []
    p = plan.predicted
    per_stage = [st.get("offloaded_activation_bytes_per_microbatch", 0.0) for st in p["stages"]]
    held = max(b * st["microbatches_in_flight"] for b, st in zip(per_stage, p["stages"]))
    exposed = p["time"]["comm_exposed_s"].get("activation_offload", 0.0)
    shown = ", ".join(layers[:6]) + (f" ... ({len(layers)} layers)" if len(layers) > 6 else "")
    rule = (f"{plan.config.offload_activations} per chunk" if plan.config.offload_activations
            else f"chosen per layer: {len(layers)} of {len(plan.config.layer_offload or ())}")
    return [f"  activation offload ({rule}): {shown}",
            "    per micro-batch each way: " + ", ".join(
                f"stage {i}: {fmt_bytes(b)}" for i, b in enumerate(per_stage[:8])),
            f"    host memory held: {fmt_bytes(held)}; copies exposed {fmt_s(exposed)} per step"]


def time_text(plan: Plan) -> str:
    """The time section of ``autoplan inspect``: the slowest stage's step split into compute,
    recomputation, exposed communication, bubble, optimizer and overhead."""
    t = plan.predicted["time"]
    step = plan.predicted["step_time_s"]
    items = [("compute", t["compute_s"]), ("recompute", t["recompute_s"])]
    items += [(f"comm {k}", v) for k, v in sorted(t["comm_exposed_s"].items()) if v > 0]
    items += [("bubble", t["bubble_s"]), ("optimizer", t["optimizer_s"]),
              ("overhead", t["overhead_s"])]
    lines = ["time per step (slowest stage; comm = exposed communication, not hidden by compute)"]
    for name, v in items:
        share = f"{v / step * 100:5.1f}%" if step > 0 else ""
        lines.append(f"  {name:<22} {fmt_s(v):>10}  {share}")
    lines.append(f"  {'= step time':<22} {fmt_s(step):>10}")
    return "\n".join(lines)


__all__ = ["memory_text", "stage_total", "time_text"]
