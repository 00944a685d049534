"""Compute time of one op on one device: a measured profile when there is one, else a roofline.

Roofline (Williams et al. 2009): time = max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s)
plus a fixed launch overhead. "Achieved" is the datasheet peak times a calibrated efficiency
(``DeviceSpec.matmul_efficiency`` / ``memory_efficiency``); on a device with a measured profile
the calibration's own figures (a large GEMM's FLOP/s, a large copy's bytes/s, a tiny op's
latency) replace them. Backward: the op rule's backward FLOPs, and about twice the forward's
bytes (read the output gradient and what was saved, write the input gradients).

A profile entry is used as measured when the op runs at its traced shape and dtype; when the
planner scales the work (another micro-batch size, a TP shard) the measured time above the
launch overhead scales linearly with the work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from autoplan.cost.memory import PRECISION_BYTES
from autoplan.graph.opgraph import Op, OpGraph

_PRODUCT_KINDS = frozenset({"matmul", "conv", "attention"})
_FREE_KINDS = frozenset({"view"})            # metadata only: no kernel on GPU
# Non-matmul arithmetic runs on vector units: this fraction of the matmul peak bounds it.
_VECTOR_FRACTION = 0.25


@dataclass(frozen=True)
class OpCost:
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """What the device achieves: the numbers the roofline divides by."""

    matmul_flops_per_s: float
    memory_bytes_per_s: float
    launch_s: float
    device_kind: str

    @staticmethod
    def from_device(device: Any, precision: str, calibration: Any = None) -> Throughput:
        if calibration is not None:
            return Throughput(matmul_flops_per_s=calibration.matmul_flops_per_s,
                              memory_bytes_per_s=calibration.memory_bandwidth_bytes_per_s,
                              launch_s=calibration.launch_s, device_kind=device.kind)
        return Throughput(
            matmul_flops_per_s=device.peak_flops_for(precision) * device.matmul_efficiency,
            memory_bytes_per_s=device.memory_bandwidth_bytes_per_s * device.memory_efficiency,
            launch_s=device.kernel_launch_s, device_kind=device.kind)


def compute_model(graph: OpGraph, device: Any, precision: str, profile: Any = None) -> ComputeModel:
    """The ComputeModel for (graph, device, precision, profile), built once and kept on the
    graph: the planner costs hundreds of configurations of one graph."""
    cache = graph.__dict__.setdefault("_autoplan_compute", {})
    key = (device.name, precision, id(profile))
    model = cache.get(key)
    if model is None or model.profile is not profile:
        model = ComputeModel(graph, device, precision, profile)
        cache[key] = model
    return model


class ComputeModel:
    """Op times for one (device, precision), optionally backed by a measured ProfileDB."""

    def __init__(self, graph: OpGraph, device: Any, precision: str, profile: Any = None):
        if precision not in PRECISION_BYTES:
            raise ValueError(f"precision {precision!r} not in {sorted(PRECISION_BYTES)}")
        self.graph = graph
        self.precision = precision
        calibration = getattr(profile, "calibration", None)
        self.tput = Throughput.from_device(device, precision, calibration)
        self.profile = profile
        # devices that share a machine's cores run its measured times this much slower
        self.slowdown = 1.0 / getattr(device, "compute_share", 1.0)
        self._cache: dict[int, OpCost] = {}

    def _byte_scale(self, op: Op) -> float:
        """Traced float tensors become training-precision tensors."""
        metas = [self.graph.value(n).meta for n in op.inputs + op.outputs]
        floats = [m for m in metas if m.is_float]
        if not floats:
            return 1.0
        return PRECISION_BYTES[self.precision] / floats[0].itemsize

    def _measured(self, op: Op) -> OpCost | None:
        if self.profile is None or self._byte_scale(op) != 1.0:
            return None
        t = self.profile.lookup(self.graph, op)
        if t is None:
            return None
        return OpCost(fwd_s=t.fwd_s, bwd_s=t.bwd_s if op.differentiable else 0.0)

    def _roofline(self, op: Op) -> OpCost:
        tp = self.tput
        if op.kind in _FREE_KINDS or op.kind == "dropout" and _identity_dropout(op):
            # a view is a few microseconds of dispatch on CPU, nothing on a GPU
            t = tp.launch_s * 0.25 if tp.device_kind == "cpu" else 0.0
            return OpCost(fwd_s=t, bwd_s=0.0)
        flops_per_s = tp.matmul_flops_per_s * (1.0 if op.kind in _PRODUCT_KINDS
                                               else _VECTOR_FRACTION)
        bytes_ = (op.bytes_read + op.bytes_written) * self._byte_scale(op)
        fwd = max(op.fwd_flops / flops_per_s, bytes_ / tp.memory_bytes_per_s) + tp.launch_s
        if not op.differentiable:
            return OpCost(fwd_s=fwd, bwd_s=0.0)
        bwd = max(op.bwd_flops / flops_per_s, 2.0 * bytes_ / tp.memory_bytes_per_s) + tp.launch_s
        return OpCost(fwd_s=fwd, bwd_s=bwd)

    def base_cost(self, index: int) -> OpCost:
        """Cost of op ``index`` at its traced shape."""
        c = self._cache.get(index)
        if c is None:
            op = self.graph.ops[index]
            c = self._measured(op) or self._roofline(op)
            if self.slowdown != 1.0:
                c = OpCost(fwd_s=c.fwd_s * self.slowdown, bwd_s=c.bwd_s * self.slowdown)
            self._cache[index] = c
        return c

    def op_cost(self, index: int, work_scale: float = 1.0) -> OpCost:
        """Cost when the op's work is ``work_scale`` times the traced work (batch, TP shard)."""
        c = self.base_cost(index)
        if work_scale == 1.0:
            return c
        launch = self.tput.launch_s

        def scale(t: float) -> float:
            if t <= 0.0:
                return 0.0
            over = max(t - launch, 0.0)
            return min(t, launch) + over * work_scale
        return OpCost(fwd_s=scale(c.fwd_s), bwd_s=scale(c.bwd_s))


def _identity_dropout(op: Op) -> bool:
    """Dropout with p = 0 (or not training) returns its input: torch launches no kernel."""
    try:
        call = json.loads(op.args)
        args, kwargs = call.get("args", []), call.get("kwargs", {})
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return float(p) == 0.0 or train is False
    except (ValueError, TypeError, AttributeError, IndexError):
        return False
