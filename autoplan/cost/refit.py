"""Least-squares refits of the cost model's coefficients from measured events (`autoplan
calibrate`).

- Matrix products: ``t = launch + flops / (rate * efficiency(size))`` over the measured
  mm/addmm/bmm/baddbmm kernels (FLOPs and sizes from their input shapes, the efficiency from the
  profile's size curve, which keeps its shape) gives the achieved rate and the per-op launch
  cost.
- Memory-bound kernels: ``t = launch + bytes / bandwidth`` (bytes: the inputs read and an output
  the size of the largest written) gives the achieved memory bandwidth; the fixed cost of a
  kernel is the median time of the smallest tenth.
- Collectives: the cost model prices a collective on a link as ``A * latency + B / bandwidth``
  (``A`` and ``B`` from its algorithm: steps and bytes moved per rank); least squares on
  (latency, 1 / bandwidth) over the transfers' lower envelope (the fastest tenth of each size)
  gives the link's figures. A blocking transfer's time also holds the wait for its latest peer
  (the ranks' jitter, a core shared with another rank's threads), which a step pays on every
  transfer: its mean per message step is added to the latency.
- On a GPU (``refit_device``) the same two lines over the GPU's kernels, each timed on the
  device and sized by the op that launched it in its own dtypes: the products in the dtype the
  profile's rate is for (another dtype's products run at another rate), the memory-bound
  kernels by the bytes of their dtypes. The eager program's element-wise kernels reach
  ``eager_elementwise_share`` of the bandwidth the profile holds (a large copy's, which the
  pricing scales by that share), so the fitted bandwidth is divided by the share the plan was
  priced with. The launch figure is a kernel's fixed time on the device (the smallest tenth's
  median), which is what a step pays per kernel while the host launches ahead of it.
Each fit needs a spread of sizes; with too few points (or a fit that comes out non-physical)
the coefficient is reported as not fitted and the old one is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost.compute import size_efficiency

F32 = 4


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of ``y = intercept + slope * x``; the intercept is held
    at 0 when it comes out negative. None without two distinct x."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if intercept < 0:
        sxx0 = sum(x * x for x in xs)
        slope, intercept = sum(x * y for x, y in zip(xs, ys)) / sxx0, 0.0
    return intercept, slope


def fit_two(a: Sequence[float], b: Sequence[float], ys: Sequence[float]
            ) -> tuple[float, float] | None:
    """Least squares of ``y = p * a + q * b`` (no intercept), both coefficients >= 0."""
    saa = sum(x * x for x in a)
    sbb = sum(x * x for x in b)
    sab = sum(x * y for x, y in zip(a, b))
    say = sum(x * y for x, y in zip(a, ys))
    sby = sum(x * y for x, y in zip(b, ys))
    det = saa * sbb - sab * sab
    if len(ys) < 2 or det <= 1e-12 * max(saa * sbb, 1e-300):
        return None
    p = (say * sbb - sby * sab) / det
    q = (sby * saa - say * sab) / det
    if p < 0:                          # latency not seen: bandwidth alone
        p, q = 0.0, sby / sbb if sbb else 0.0
    if q <= 0:
        return None
    return p, q


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def matmul_flops(name: str, shapes: Sequence[Sequence[int]]) -> float | None:
    """FLOPs of one matrix-product kernel from its input shapes (None when not one)."""
    s = [list(x) for x in shapes]
    try:
        if name == "aten::mm" and len(s) >= 2:
            (m, k), (_, n) = s[0], s[1]
            return 2.0 * m * k * n
        if name == "aten::addmm" and len(s) >= 3:
            (m, k), (_, n) = s[1], s[2]
            return 2.0 * m * k * n
        if name == "aten::bmm" and len(s) >= 2:
            (b, m, k), (_, _, n) = s[0], s[1]
            return 2.0 * b * m * k * n
        if name == "aten::baddbmm" and len(s) >= 3:
            (b, m, k), (_, _, n) = s[1], s[2]
            return 2.0 * b * m * k * n
    except (TypeError, ValueError):
        return None
    return None


def matmul_size(name: str, shapes: Sequence[Sequence[int]]) -> float | None:
    """The cube root of M*K*N of one matrix of a product kernel (``cost.compute.product_size``
    for a profiled kernel); None when not one."""
    s = [list(x) for x in shapes]
    try:
        if name in ("aten::mm", "aten::bmm"):
            a, b = s[0], s[1]
        elif name in ("aten::addmm", "aten::baddbmm"):
            a, b = s[1], s[2]
        else:
            return None
        cube = float(a[-2]) * float(a[-1]) * float(b[-1])
    except (IndexError, TypeError, ValueError):
        return None
    return cube ** (1.0 / 3.0) if cube > 0 else None


def op_bytes(shapes: Sequence[Sequence[int]]) -> float:
    """Bytes a memory-bound kernel moves: its inputs read, an output the size of the largest
    written (fp32)."""
    sizes = [_numel(s) for s in shapes if s]
    return F32 * (sum(sizes) + max(sizes)) if sizes else 0.0


@dataclass(frozen=True)
class ComputeFit:
    matmul_flops_per_s: float | None
    memory_bandwidth_bytes_per_s: float | None
    launch_s: float | None
    points: Mapping[str, int]


def refit_compute(events: Iterable[Mapping[str, Any]], thread: Any,
                  size_curve: Sequence[tuple[float, float]] = ()) -> ComputeFit:
    """Achieved matmul rate, memory bandwidth and launch cost from the leaf kernels of
    ``thread`` (``runtime/step_trace.py`` events); the rate is that of ``size_curve``'s
    fraction 1 (``Calibration.matmul_size_efficiency``)."""
    mm_x, mm_y, mem_x, mem_y = [], [], [], []
    for e in events:
        if not e.get("leaf") or e["thread"] != thread:
            continue
        f = matmul_flops(e["name"], e.get("shapes", []))
        if f is not None:
            size = matmul_size(e["name"], e.get("shapes", []))
            mm_x.append(f / size_efficiency(size_curve, size))
            mm_y.append(e["dur_s"])
        elif e.get("shapes"):
            b = op_bytes(e["shapes"])
            if b > 0:
                mem_x.append(b)
                mem_y.append(e["dur_s"])
    return _compute_fit(mm_x, mm_y, mem_x, mem_y)


def _compute_fit(mm_x: Sequence[float], mm_y: Sequence[float], mem_x: Sequence[float],
                 mem_y: Sequence[float], elementwise_share: float = 1.0) -> ComputeFit:
    """The rates fitted to products (size-scaled FLOPs -> seconds) and memory-bound ops
    (bytes -> seconds): the bandwidth divided by ``elementwise_share``, the share of it the
    kernels were priced to reach; and the fixed cost of one kernel: the median of the smallest
    tenth (by bytes), whose moving time is negligible (a fit's intercept is too sensitive to
    the large kernels)."""
    mm = fit_line(mm_x, mm_y)
    mem = fit_line(mem_x, mem_y)
    small = sorted(zip(mem_x, mem_y))[:max(1, len(mem_x) // 10)]
    launch = sorted(t for _, t in small)[len(small) // 2] if small else None
    return ComputeFit(matmul_flops_per_s=1.0 / mm[1] if mm and mm[1] > 0 else None,
                      memory_bandwidth_bytes_per_s=(1.0 / mem[1] / elementwise_share
                                                    if mem and mem[1] > 0 else None),
                      launch_s=launch if launch and launch > 0 else None,
                      points={"matmul": len(mm_x), "memory": len(mem_x)})


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    bandwidth_bytes_per_s: float
    points: int
    sizes: int = 0
    wait_s: float = 0.0      # of latency_s: the mean wait for the latest peer per message step
    bandwidth_kept: bool = False     # the transfers did not determine it: the known one kept


def refit_link(samples: Sequence[tuple[float, float, float]],
               known_bandwidth_bytes_per_s: float | None = None) -> LinkFit | None:
    """``samples``: (A, B, measured seconds) per transfer, the model's time being
    ``A * latency + B / bandwidth``. When the sizes do not determine the bandwidth (one size,
    or noise that makes larger transfers no slower) the latency is fitted alone with
    ``known_bandwidth_bytes_per_s``; None when that is not given either."""
    # the fastest tenth of each size is the transfer itself; the rest of a transfer's time is
    # the wait for its latest peer
    by_size: dict[tuple[float, float], list[float]] = {}
    for a, b, t in samples:
        by_size.setdefault((a, b), []).append(t)
    envelope = [(a, b, sorted(ts)[len(ts) // 10]) for (a, b), ts in by_size.items()]
    fit = fit_two([a for a, _, _ in envelope], [b for _, b, _ in envelope],
                  [t for _, _, t in envelope])
    kept = False
    if fit is None and known_bandwidth_bytes_per_s and any(a > 0 for a, _, _ in envelope):
        inv = 1.0 / known_bandwidth_bytes_per_s
        fit = (max(0.0, sum(a * (t - b * inv) for a, b, t in envelope)
                   / sum(a * a for a, _, _ in envelope)), inv)
        kept = True
    if fit is None:
        return None
    latency, inv_bw = fit
    waits = [(t - a * latency - b * inv_bw) / a for a, b, t in samples if a > 0]
    wait = max(0.0, sum(waits) / len(waits)) if waits else 0.0
    return LinkFit(latency_s=latency + wait, bandwidth_bytes_per_s=1.0 / inv_bw,
                   points=len(samples), sizes=len(envelope), wait_s=wait, bandwidth_kept=kept)


# bytes per element of the dtypes ``runtime/step_trace.py`` records
DTYPE_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1}


def typed_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[str | None]) -> float | None:
    """``op_bytes`` in the inputs' own dtypes: the inputs read, an output the size of the
    largest written; None when a tensor's dtype is not known."""
    sizes = []
    for shape, dtype in zip(shapes, dtypes):
        if not shape:
            continue
        if dtype not in DTYPE_BYTES:
            return None
        sizes.append(_numel(shape) * DTYPE_BYTES[dtype])
    return float(sum(sizes) + max(sizes)) if sizes else None


def refit_device(kernels: Iterable[Mapping[str, Any]], size_curve: Sequence[tuple[float, float]],
                 matmul_dtype: str, elementwise_share: float = 1.0) -> ComputeFit:
    """Achieved matmul rate (of ``matmul_dtype`` products, on ``size_curve``), memory
    bandwidth (as a large copy's: the fit over the memory-bound kernels divided by
    ``elementwise_share``) and a kernel's fixed time, from a GPU's kernel events
    (``runtime/step_trace.device_kernels``)."""
    if not 0 < elementwise_share <= 1:
        raise ValueError(f"elementwise_share must be in (0, 1], got {elementwise_share!r}")
    mm_x, mm_y, mem_x, mem_y = [], [], [], []
    for e in kernels:
        if not e.get("leaf"):               # the optimizer's and the collectives' kernels
            continue
        shapes, dtypes = e.get("shapes", []), e.get("dtypes", [])
        if e.get("kind") == "matmul":
            f = matmul_flops(e["name"], shapes)
            if f is None or not dtypes or dtypes[-1] != matmul_dtype:
                continue                    # attention, another dtype's products
            size = matmul_size(e["name"], shapes)
            mm_x.append(f / size_efficiency(size_curve, size))
            mm_y.append(e["dur_s"])
        elif e.get("kind") == "other":
            b = typed_bytes(shapes, dtypes)
            if b:
                mem_x.append(b)
                mem_y.append(e["dur_s"])
    return _compute_fit(mm_x, mm_y, mem_x, mem_y, elementwise_share)


def calibration_changes(fits: Mapping[str, Any], *, optimizer_floor_s_per_param: float
                        ) -> dict[str, float]:
    """The profile's ``Calibration`` fields a calibration's ``fits`` replace (its
    ``ComputeFit`` under "compute", the framework residual and the optimizer's time per
    parameter), each only where it was fitted; the optimizer's floored at
    ``optimizer_floor_s_per_param``."""
    c = fits["compute"]
    changes: dict[str, float] = {}
    if c.matmul_flops_per_s:
        changes["matmul_flops_per_s"] = c.matmul_flops_per_s
    if c.memory_bandwidth_bytes_per_s:
        changes["memory_bandwidth_bytes_per_s"] = c.memory_bandwidth_bytes_per_s
    if c.launch_s:
        changes["launch_s"] = c.launch_s
    if fits.get("framework_s_per_op") is not None:
        changes["framework_s_per_op"] = fits["framework_s_per_op"]
    if fits.get("optimizer_s_per_param"):
        changes["optimizer_s_per_param"] = max(optimizer_floor_s_per_param,
                                               fits["optimizer_s_per_param"])
    return changes
