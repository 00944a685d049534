"""Measured step time split into the estimate's own phases, for `autoplan calibrate`.

Input: the events of profiled steps on one rank (``runtime/step_trace.py``: plain dicts with
name, thread, start, duration, leaf flag). Per step, on the rank's main thread:

- ``compute``: the leaf ``aten`` ops (the kernels that do the work), by kind: ``matmul``
  (mm, addmm, bmm, baddbmm and the fused attention kernels) and ``other`` (memory-bound ops);
- each collective kind (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
  ``all_to_all``) and ``p2p`` (send/recv): the time the backend's transfers do not overlap the
  compute or the optimizer (exposed), split between kinds in proportion to their own exposed
  time;
- ``optimizer``: ``Optimizer.step`` of whatever optimizer ran;
- ``other``: the rest of the measured step (framework overhead, waiting on a pipeline's
  neighbour: the bubble, Python), so that the phases add up to the step.

On a CUDA rank the events are the GPU's kernels (``step_trace.device_kernels``: one timeline,
each kernel named for the op that launched it, ``kind`` saying whether it is a product's), so the
phases are the GPU's time: ``other`` is then where the GPU waited (for the host to launch, for
a pipeline's neighbour).

``predicted_phases`` maps a plan's ``predicted.time`` onto the same phases.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                        "aten::_scaled_dot_product_flash_attention_for_cpu",
                        "aten::_scaled_dot_product_flash_attention",
                        "aten::_scaled_dot_product_efficient_attention",
                        "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution"})
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_BACKEND_NAMES = {"all_reduce": "all_reduce", "allreduce": "all_reduce",
                  "all_gather": "all_gather", "allgather": "all_gather",
                  "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather",
                  "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
                  "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast",
                  "all_to_all": "all_to_all", "alltoall": "all_to_all",
                  "alltoall_base": "all_to_all", "send": "p2p", "recv": "p2p"}
PHASES = ("compute.matmul", "compute.other", *(f"comm.{k}" for k in COLLECTIVES), "p2p",
          "optimizer", "other")


def collective_kind(name: str) -> str | None:
    """``"gloo:all_reduce"`` -> ``"all_reduce"``; None for anything that is not a backend's
    transfer event."""
    backend, sep, op = name.partition(":")
    if not sep or backend not in ("gloo", "nccl", "mpi", "ucc"):
        return None
    return _BACKEND_NAMES.get(op.strip())


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
           ) -> list[tuple[float, float]]:
    """The parts of union ``a`` outside union ``b`` (both sorted, disjoint)."""
    out = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


@dataclass(frozen=True)
class Phases:
    """Seconds per step in each phase (``PHASES``); they add up to ``step_s``."""

    step_s: float
    seconds: Mapping[str, float] = field(default_factory=dict)

    def total_s(self) -> float:
        return sum(self.seconds.values())


def main_thread(events: Sequence[Mapping[str, Any]]) -> int:
    """The thread that ran the step (the optimizer's, else the one with the most leaf ops)."""
    for e in events:
        if e["name"].startswith("Optimizer.step"):
            return e["thread"]
    counts: dict[int, int] = {}
    for e in events:
        if e.get("leaf"):
            counts[e["thread"]] = counts.get(e["thread"], 0) + 1
    return max(counts, key=lambda t: counts[t]) if counts else 0


def attribute(events: Sequence[Mapping[str, Any]], step_s: Sequence[float]) -> Phases:
    """The measured steps' time per phase, per step (see the module doc)."""
    steps = max(1, len(step_s))
    total = sum(step_s) / steps
    main = main_thread(events)
    opt = _union((e["start_s"], e["start_s"] + e["dur_s"]) for e in events
                 if e["thread"] == main and e["name"].startswith("Optimizer.step"))
    compute: dict[str, list[tuple[float, float]]] = {"matmul": [], "other": []}
    comm: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        iv = (e["start_s"], e["start_s"] + e["dur_s"])
        kind = collective_kind(e["name"])
        if kind is not None:
            comm.setdefault(kind, []).append(iv)
        elif e.get("leaf") and e["thread"] == main:
            matmul = e["kind"] == "matmul" if "kind" in e else e["name"] in MATMUL_OPS
            compute["matmul" if matmul else "other"].append(iv)
    opt_u = _union(opt)
    comp_u = {k: _minus(_union(v), opt_u) for k, v in compute.items()}
    busy = _union([iv for v in comp_u.values() for iv in v] + opt_u)
    seconds = {p: 0.0 for p in PHASES}
    seconds["compute.matmul"] = _length(comp_u["matmul"]) / steps
    seconds["compute.other"] = _length(comp_u["other"]) / steps
    seconds["optimizer"] = _length(opt_u) / steps
    all_comm = _union([iv for v in comm.values() for iv in v])
    exposed_all = _length(_minus(all_comm, busy)) / steps
    own = {k: _length(_minus(_union(v), busy)) for k, v in comm.items()}
    share = sum(own.values())
    for k, s in own.items():
        name = "p2p" if k == "p2p" else f"comm.{k}"
        seconds[name] += exposed_all * (s / share if share > 0 else 0.0)
    used = sum(seconds.values())
    seconds["other"] = max(0.0, total - used)
    return Phases(step_s=max(total, used), seconds=seconds)


def predicted_phases(predicted: Mapping[str, Any]) -> dict[str, float]:
    """A plan's ``predicted.time`` on the same phases: compute (with recompute) in one,
    tensor-parallel and data-parallel traffic by their collectives' family, the bubble and the
    fixed overhead in ``other``."""
    t = predicted.get("time", {})
    comm = t.get("comm_exposed_s", {})
    return {"compute": t.get("compute_s", 0.0) + t.get("recompute_s", 0.0),
            "collectives": (comm.get("tp", 0.0) + comm.get("dp_grad_sync", 0.0)
                            + comm.get("zero_param_gather", 0.0)
                            + comm.get("ep_all_to_all", 0.0)),
            # ring attention passes its blocks with send/recv, as the pipeline does
            "p2p": comm.get("pp_p2p", 0.0) + comm.get("cp_ring", 0.0),
            "optimizer": t.get("optimizer_s", 0.0) + comm.get("offload", 0.0),
            "other": t.get("bubble_s", 0.0) + t.get("overhead_s", 0.0),
            "step": predicted.get("step_time_s", 0.0)}


def measured_summary(ph: Phases) -> dict[str, float]:
    """The measured phases grouped as ``predicted_phases`` groups the prediction."""
    s = ph.seconds
    return {"compute": s["compute.matmul"] + s["compute.other"],
            "collectives": sum(s[f"comm.{k}"] for k in COLLECTIVES),
            "p2p": s["p2p"], "optimizer": s["optimizer"], "other": s["other"],
            "step": ph.step_s}
