"""Compute time of one op on one device: a measured profile when there is one, else a roofline.

Roofline (Williams et al. 2009): time = max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s)
plus a fixed launch overhead. "Achieved" is the datasheet peak times a calibrated efficiency
(``DeviceSpec.matmul_efficiency`` / ``memory_efficiency``); on a device with a measured profile
the calibration's own figures (the products of a reference forward and backward pass, a large
copy's bytes/s, a tiny op's latency) replace them. A calibration also measures how a product's
rate falls with its size (``Calibration.matmul_size_efficiency``: small products, such as
attention's per-head ones, leave the vector units idle): a product runs at the rate of its size,
the cube root of one matrix product's M*K*N (``product_size``). Element-wise functions whose
arithmetic outlasts their memory traffic (a CPU core's tanh, GELU's tanh form, softmax's exp)
run no faster than the rate a calibration measured for them (``elementwise_key``).
Backward: the op rule's backward FLOPs (its products have the forward's sizes, transposed),
and about twice the forward's bytes (read the output gradient and what was saved, write the
input gradients).

A compiled program (``ParallelConfig.compiled``, ``fused=True``) runs each chain of element-wise
ops, casts, norms and reductions as one kernel (what inductor does): an op of such a chain moves
only the bytes that cross the chain's edge (``cost/fused.fused_traffic``), and only the chain's
first op pays a launch. The runtime compiles regionally (each layer, each run of ops between
layers), so a chain ends at a region's edge (``fused.compiled_regions``): every layer of a block
prices alike.
Products, attention and the loss are priced as before.

An eager program on a GPU runs each element-wise op, cast, norm and reduction as its own
PyTorch kernel, and those reach less of the memory bandwidth than a large copy or inductor's
fused kernels do: ``EAGER_ELEMENTWISE_SHARE`` of the device's achieved bytes/s
(``eager_elementwise_share``, derived there from measured eager steps on two Hopper GPUs).

A profile entry is used as measured when the op runs at its traced shape and dtype; when the
planner scales the work (another micro-batch size, a TP shard) the measured time above the
launch overhead scales linearly with the work.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoplan.cluster.gemm_table import GemmShapeTable
from autoplan.cost.dtypes import autocast_casts, autocast_on, value_itemsizes
from autoplan.cost.float8 import (Float8Setting, cast_passes, convertible, float8_times,
                                  fp8_flops_per_s, fp8_gathered_weights, gemm_speedup)
from autoplan.cost.fused import FUSIBLE_KINDS, fused_traffic, identity_dropout
from autoplan.cost.memory import PRECISION_BYTES
from autoplan.graph.opgraph import Op, OpGraph, opname
from autoplan.graph.products import product_spec

_PRODUCT_KINDS = frozenset({"matmul", "conv", "attention"})
_FREE_KINDS = frozenset({"view"})            # metadata only: no kernel on GPU
# Non-matmul arithmetic runs on vector units: this fraction of the matmul peak bounds it.
_VECTOR_FRACTION = 0.25

# The share of a GPU's achieved memory bandwidth (``memory_efficiency`` x peak, or a calibrated
# large copy's) that eager PyTorch's unfused element-wise kernels, casts, norms and reductions
# reach in a training step. Derived from three measured eager steps on two Hopper GPUs, each's
# unfused memory-bound work being what the measured step leaves after the products, attention,
# loss and optimizer as priced (benchmarks/gpu_predictions.py prints them):
#   gpt3-1.3b, H200, mbs 4:  (731.2 - 215.6 - 77.9 - 10.5 - 11.8) / 280.7 ms priced = 1.48x
#   gpt3-1.3b, H100, mbs 2:  (947.7 - 214.4 - 96.6 - 15.1 - ~25 AdamW) / 422.7 ms   = 1.41x
#   HF Llama 0.89B, H200, mbs 8: (308.6 - 144.3 - 29.3 - 6.6 - 7.2) / 85.3 ms        = 1.42x
# (benchmarks/data/h200-gpu-check-20261127/speed.json, h100-sxm5-runtime.json): 1.41-1.48x
# the price at the achieved bandwidth, so a share of 1 / 1.43 = 0.70 (about 0.56 of the HBM
# peak). The H100's per-part layer timings (h100-sxm5-layers.json) bracket it: a lone GELU or
# add reaches 0.76 of the peak, a layer norm 0.31-0.46; a step's mix lies between. A launch
# floor per kernel does not explain the rows: the GPT step would need 47 us per kernel (136 ms
# over about 2,900 kernels), the Llama step 18 us, and these kernels run tens to hundreds of
# microseconds each. Inductor's fused kernels (``fused_traffic``) keep the achieved rate: the
# compiled steps are within 1-5 % of their prices with it (HF Llama -0.6 %, GPT -4.5 %). Plain
# eager PyTorch runs the HF Llama 42 ms faster than autoplan's eager program (flash attention
# where the exported graph passes SDPA a materialised causal mask), so its step is over-priced
# by this share.
EAGER_ELEMENTWISE_SHARE = 0.70


def eager_elementwise_share(device_kind: str, compiled: bool, autocast: bool) -> float:
    """The share of the achieved memory bandwidth an op of ``FUSIBLE_KINDS`` (and autocast's
    casts) runs at: ``EAGER_ELEMENTWISE_SHARE`` in an eager autocast program on a GPU (what the
    three rows measured); 1 where inductor fuses it (``compiled``), on a CPU (its calibration
    times such ops directly), and for 16-bit tensors held without autocast (Megatron-LM's
    ``mixed_precision="params"``: the H100's lone bf16 GELU and add reach the achieved rate)."""
    return (EAGER_ELEMENTWISE_SHARE if autocast and not compiled and device_kind != "cpu"
            else 1.0)


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
    # ((product size, fraction of matmul_flops_per_s), ...): see size_efficiency
    matmul_size_efficiency: tuple[tuple[float, float], ...] = ()
    # measured element-wise functions: name -> (forward, backward) seconds per element
    elementwise_s_per_element: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # the device's GEMM rate by shape (a datasheet device's ``matmul_shape_efficiency``; a
    # calibration measures its own size curve instead)
    matmul_shape: GemmShapeTable | None = None
    # the rate of a product autocast leaves in fp32 (``_fp32_rate``); None: matmul_flops_per_s
    fp32_matmul_flops_per_s: float | None = None

    @staticmethod
    def from_device(device: Any, precision: str, calibration: Any = None) -> Throughput:
        if calibration is not None:
            return Throughput(matmul_flops_per_s=calibration.matmul_flops_per_s,
                              fp32_matmul_flops_per_s=_fp32_rate(
                                  device, precision, calibration.matmul_flops_per_s),
                              memory_bytes_per_s=calibration.memory_bandwidth_bytes_per_s,
                              launch_s=calibration.launch_s, device_kind=device.kind,
                              matmul_size_efficiency=tuple(
                                  getattr(calibration, "matmul_size_efficiency", ()) or ()),
                              elementwise_s_per_element={
                                  k: (f, b) for k, f, b in
                                  getattr(calibration, "elementwise_s_per_element", ()) or ()})
        rate = device.peak_flops_for(precision) * device.matmul_efficiency
        return Throughput(
            matmul_flops_per_s=rate, fp32_matmul_flops_per_s=_fp32_rate(device, precision, rate),
            memory_bytes_per_s=device.memory_bandwidth_bytes_per_s * device.memory_efficiency,
            launch_s=device.kernel_launch_s, device_kind=device.kind,
            # the table measures 16-bit tensor-core products; fp32 runs on the vector units
            matmul_shape=(getattr(device, "matmul_shape_efficiency", None)
                          if PRECISION_BYTES[precision] == 2 else None))


def _fp32_rate(device: Any, precision: str, rate: float) -> float:
    """The rate of a product autocast cannot reach with fp32 inputs (HF's grouped experts):
    ``rate`` (the training precision's) times the datasheet's fp32-to-precision ratio; ``rate``
    itself where the device lists no such pair."""
    peaks = getattr(device, "peak_flops", None) or {}
    if precision == "fp32" or "fp32" not in peaks or not peaks.get(precision):
        return rate
    return rate * peaks["fp32"] / peaks[precision]


def elementwise_key(graph: OpGraph, op: Op) -> tuple[str, int] | None:
    """(name, elements) under which a calibration measures ``op``'s element-wise function
    (``Calibration.elementwise_s_per_element``): GELU (exact or tanh), SiLU, sigmoid, tanh, exp,
    softmax and log-softmax over their outputs, a cross entropy's log-softmax over its logits;
    None for other ops."""
    name = opname(op).lstrip("_")
    if op.kind == "loss" and name == "cross_entropy_loss" and op.inputs:
        return "log_softmax", graph.value(op.inputs[0]).meta.numel
    if name not in _ELEMENTWISE or not op.outputs:
        return None
    if name == "gelu":
        try:
            if json.loads(op.args).get("kwargs", {}).get("approximate") == "tanh":
                name = "gelu_tanh"
        except (ValueError, AttributeError):
            pass
    return name, graph.value(op.outputs[0]).meta.numel


_ELEMENTWISE = frozenset({"gelu", "silu", "sigmoid", "tanh", "exp", "softmax", "log_softmax"})


def size_efficiency(curve: Sequence[tuple[float, float]], size: float | None) -> float:
    """The fraction of the calibrated matmul rate a product of ``size`` achieves: ``curve``
    interpolated linearly in log size, held at its ends (1.0 without a curve or a size)."""
    if not curve or size is None or size <= 0:
        return 1.0
    if size <= curve[0][0]:
        return curve[0][1]
    for (n0, e0), (n1, e1) in zip(curve, curve[1:]):
        if size <= n1:
            w = math.log(size / n0) / math.log(n1 / n0)
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def product_size(graph: OpGraph, op: Op) -> float | None:
    """The cube root of M*K*N of one matrix product of ``op`` (a product is as efficient as
    its matrices are large: a batch of small ones runs like one small one); None for ops that
    are not matrix products. Leading dims of the first operand fold into M where the second
    operand is one matrix (a linear layer's weight); else they are the batch."""
    shapes = [graph.value(n).meta.shape for n in op.inputs]
    try:
        if op.kind == "attention":
            q, k = shapes[0], shapes[1]
            m, kk, n = q[-2], q[-1], k[-2]
        elif op.kind == "matmul":
            a, b = _factors(graph, op, shapes)
            out = graph.value(op.outputs[0]).meta.shape
            kk = a[-1]
            n = out[-1] if len(out) else 1
            if len(b) <= 2:
                m = math.prod(out[:-1]) if len(out) > 1 else 1
            else:
                m = out[-2]
        else:
            return None
    except (IndexError, TypeError):
        return None
    cube = float(m) * float(kk) * float(n)
    return cube ** (1.0 / 3.0) if cube > 0 else None


def _factors(graph: OpGraph, op: Op, shapes: list[tuple[int, ...]]
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a product's two factors (``graph/products.py``; the first two tensors
    where its call is not one the specs describe)."""
    spec = product_spec(graph, op)
    if spec is None:
        return shapes[0], shapes[1]
    return shapes[spec.lhs_slot], shapes[spec.rhs_slot]


def gemm_sides(graph: OpGraph, op: Op) -> tuple[float, float, float] | None:
    """(M, N, K) of a layer's product: ``op`` multiplies activations by one 2-D matrix (a
    linear layer, ``addmm``, ``x @ W``), the leading dims of the activations folding into M;
    None for other ops (batched products of activations, attention, convolutions)."""
    if op.kind != "matmul":
        return None
    spec = product_spec(graph, op)
    if spec is None or spec.grouped or spec.dims().batch:
        return None             # experts' or batched products
    shapes = [graph.value(n).meta.shape for n in op.inputs]
    a, b = _factors(graph, op, shapes)
    out = graph.value(op.outputs[0]).meta.shape
    if len(b) != 2 or not a or len(out) < 1:
        return None
    m = float(math.prod(out[:-1])) if len(out) > 1 else 1.0
    return m, float(out[-1]), float(a[-1])


def fp8_linear_ops(graph: OpGraph) -> frozenset[int]:
    """The ops of ``graph`` that torchao's float8 training would convert
    (``cost/float8.convertible``): the products of ``nn.Linear`` layers with weight sides
    divisible by 16."""
    return frozenset(i for i, op in enumerate(graph.ops)
                     if convertible(op, gemm_sides(graph, op)))


def fp8_converted_ops(graph: OpGraph, skip: tuple[str, ...]) -> frozenset[int]:
    """The linears an fp8 config runs in fp8: ``fp8_linear_ops`` but those whose module path
    matches a pattern of ``skip`` (``ParallelConfig.fp8_skip``). The planner prices these
    and the runtime emits torchao's float8 product for these (``runtime/float8.py``)."""
    from fnmatch import fnmatchcase      # lazily: only fp8 configs match module paths
    return frozenset(i for i in fp8_linear_ops(graph) if not any(
        fnmatchcase(graph.ops[i].module_path, p) for p in skip))


def _gemm_fractions(table: GemmShapeTable, sides: tuple[float, float, float],
                    bwd_parts: tuple[float, float], dgrad_chunks: int = 1
                    ) -> tuple[float, float]:
    """(forward, backward) fractions of the large-product rate for a product of ``sides``
    (M, N, K): the forward's product, and the backward's input gradient (M x N by N x K, run
    in ``dgrad_chunks`` row chunks) and weight gradient (N x M by M x K) in the shares
    ``bwd_parts`` of its FLOPs."""
    m, n, k = sides
    fwd = table.fraction(m, n, k)
    dgrad, wgrad = bwd_parts
    if dgrad + wgrad <= 0:
        return fwd, fwd
    per_flop = (dgrad / table.fraction(m / dgrad_chunks, k, n) + wgrad / table.fraction(n, k, m))
    return fwd, (dgrad + wgrad) / per_flop


def _bwd_parts(op: Op) -> tuple[float, float]:
    """Of a layer product's backward FLOPs, (input gradient, weight gradient) shares: one
    forward's FLOPs each, the weight's missing when it needs no gradient."""
    if op.fwd_flops <= 0 or op.bwd_flops <= 0:
        return 0.0, 0.0
    dgrad = min(op.fwd_flops, op.bwd_flops)
    return dgrad / op.bwd_flops, (op.bwd_flops - dgrad) / op.bwd_flops


def compute_model(graph: OpGraph, device: Any, precision: str, profile: Any = None,
                  mixed_precision: str = "autocast", fused: bool = False,
                  fp8: Float8Setting | None = None) -> ComputeModel:
    """The ComputeModel for (graph, device, precision, profile, mixed_precision, fused, fp8),
    built once and kept on the graph: the planner costs hundreds of configurations of one
    graph."""
    cache = graph.__dict__.setdefault("_autoplan_compute", {})
    key = (device, precision, id(profile), mixed_precision, fused, fp8)
    model = cache.get(key)
    if model is None or model.profile is not profile:
        model = ComputeModel(graph, device, precision, profile, mixed_precision, fused, fp8)
        cache[key] = model
    return model



class ComputeModel:
    """Op times for one (device, precision), optionally backed by a measured ProfileDB."""

    def __init__(self, graph: OpGraph, device: Any, precision: str, profile: Any = None,
                 mixed_precision: str = "autocast", fused: bool = False,
                 fp8: Float8Setting | None = None):
        if precision not in PRECISION_BYTES:
            raise ValueError(f"precision {precision!r} not in {sorted(PRECISION_BYTES)}")
        self.graph = graph
        self.precision = precision
        # under autocast, each value's dtype as torch.autocast makes it (cost/dtypes.py)
        self.sizes = (value_itemsizes(graph, PRECISION_BYTES[precision], device.kind)
                      if autocast_on(precision, mixed_precision) else None)
        calibration = getattr(profile, "calibration", None)
        self.tput = Throughput.from_device(device, precision, calibration)
        self.profile = profile
        # devices that share a machine's cores run its measured times this much slower
        self.slowdown = 1.0 / getattr(device, "compute_share", 1.0)
        self._cache: dict[int, OpCost] = {}
        self._scaled: dict[tuple[int, float, str, int], OpCost] = {}
        self._tabled: set[int] = set()      # ops priced by the device's GEMM table
        # a compiled program (``ParallelConfig.compiled``): element-wise chains fused
        self.fused = fused_traffic(graph) if fused else {}
        # eager PyTorch's own element-wise kernels reach less bandwidth than fused ones
        self.eager_share = eager_elementwise_share(self.tput.device_kind, fused,
                                                   self.sizes is not None)
        # fp8 linear layers (``cost/float8.py``): those torchao would convert on this device,
        # and of them those the config runs in fp8 (not skipped)
        self.fp8 = fp8
        self.device = device
        self.fp8_linears = fp8_linear_ops(graph) if fp8 is not None and fp8_flops_per_s(
            device) else frozenset()
        self.fp8_ops = fp8_converted_ops(graph, fp8.skip) if self.fp8_linears else frozenset()
        # of those, the ones whose weight FSDP gathers in fp8 (op index -> weight FQN)
        self.fp8_gathered = (fp8_gathered_weights(graph, self.fp8_ops, fp8.whole)
                             if self.fp8_ops and fp8.weight_gathered_fp8 else {})

    def _byte_scale(self, op: Op) -> float:
        """Traced float tensors become training-precision tensors; under autocast each takes
        the dtype autocast gives it (a product reads its inputs' 16-bit copies)."""
        metas = [self.graph.value(n).meta for n in op.inputs + op.outputs]
        floats = [m for m in metas if m.is_float]
        if not floats:
            return 1.0
        if self.sizes is None:
            return PRECISION_BYTES[self.precision] / floats[0].itemsize
        lower = PRECISION_BYTES[self.precision]
        product = autocast_casts(op)
        traced = held = 0.0
        for k, n in enumerate(op.inputs + op.outputs):
            meta = self.graph.value(n).meta
            if meta.is_float:
                traced += meta.numel * meta.itemsize
                held += meta.numel * (lower if product and k < len(op.inputs)
                                      else self.sizes.get(n, meta.itemsize))
        return held / traced if traced else 1.0

    @functools.cached_property
    def fp32_products(self) -> tuple[tuple[str, ...], float]:
        """The module paths of the products this 16-bit plan runs in fp32 because autocast
        cannot reach them (``_uncast_fp32``), and their share of the graph's FLOPs; nothing
        where the device multiplies fp32 as fast (a CPU)."""
        tp, ops = self.tput, self.graph.ops
        if (tp.fp32_matmul_flops_per_s or tp.matmul_flops_per_s) >= tp.matmul_flops_per_s:
            return (), 0.0
        uncast = [op for op in ops if self._uncast_fp32(op)]
        total = sum(op.fwd_flops + op.bwd_flops for op in ops)
        share = sum(op.fwd_flops + op.bwd_flops for op in uncast) / total if total else 0.0
        return tuple(sorted({op.module_path for op in uncast})), share

    def _uncast_fp32(self, op: Op) -> bool:
        """A product autocast does not reach (``dtypes.UNCAST_PRODUCTS``) on fp32 inputs: it
        runs in fp32 under a 16-bit plan, at fp32's rate (HF's experts with fp32 weights)."""
        if self.sizes is None or op.kind not in _PRODUCT_KINDS or autocast_casts(op):
            return False
        floats = [self.sizes.get(n, self.graph.value(n).meta.itemsize) for n in op.inputs
                  if self.graph.value(n).meta.is_float]
        return bool(floats) and min(floats) >= 4

    def _cast_s(self, op: Op) -> tuple[float, float]:
        """(forward, backward) seconds of the casts autocast makes before a product: each fp32
        activation it reads copied to 16 bits (read 4 bytes, write 2), and in backward the
        copy's gradient cast back (read 2, write 4); one kernel each. Weights' casts are left
        out (FSDP hands the products 16-bit weights; under ZeRO 0/1 it is a copy per weight and
        micro-batch)."""
        if self.sizes is None or not autocast_casts(op):
            return 0.0, 0.0
        lower = PRECISION_BYTES[self.precision]
        fwd = bwd = 0.0
        for n in op.inputs:
            v = self.graph.value(n)
            if v.kind == "activation" and v.meta.is_float and self.sizes.get(n, 4) > lower:
                moved = v.meta.numel * (self.sizes[n] + lower) / (
                    self.tput.memory_bytes_per_s * self.eager_share)
                fwd += moved + self.tput.launch_s
                bwd += moved + self.tput.launch_s
        return fwd, (bwd if op.differentiable else 0.0)

    def _measured(self, op: Op) -> OpCost | None:
        if self.profile is None or self._byte_scale(op) != 1.0:
            return None
        t = self.profile.lookup(self.graph, op)
        if t is None:
            return None
        return OpCost(fwd_s=t.fwd_s, bwd_s=t.bwd_s if op.differentiable else 0.0)

    def _roofline(self, op: Op, index: int = -1) -> OpCost:
        tp = self.tput
        if op.kind in _FREE_KINDS or op.kind == "dropout" and identity_dropout(op):
            # a view is a few microseconds of dispatch on CPU, nothing on a GPU
            t = tp.launch_s * 0.25 if tp.device_kind == "cpu" else 0.0
            return OpCost(fwd_s=t, bwd_s=0.0)
        bwd_flops_per_s = None
        in_fp32 = self._uncast_fp32(op)
        sides = (gemm_sides(self.graph, op) if tp.matmul_shape is not None and not in_fp32
                 else None)
        if in_fp32:       # a product autocast leaves in fp32: the vector units' rate
            flops_per_s = (tp.fp32_matmul_flops_per_s or tp.matmul_flops_per_s) * (
                size_efficiency(tp.matmul_size_efficiency, product_size(self.graph, op)))
        elif sides is not None:
            fwd_frac, bwd_frac = _gemm_fractions(tp.matmul_shape, sides, _bwd_parts(op))
            flops_per_s = tp.matmul_flops_per_s * fwd_frac
            bwd_flops_per_s = tp.matmul_flops_per_s * bwd_frac
        elif op.kind in _PRODUCT_KINDS:
            flops_per_s = tp.matmul_flops_per_s * size_efficiency(
                tp.matmul_size_efficiency, product_size(self.graph, op))
        else:
            flops_per_s = tp.matmul_flops_per_s * _VECTOR_FRACTION
        bytes_ = (op.bytes_read + op.bytes_written) * self._byte_scale(op)
        bwd_bytes = 2.0 * bytes_
        passes = _cross_entropy_bytes(self.graph, op, self.precision)
        if passes is not None:
            bytes_, bwd_bytes = passes
        fused = self.fused.get(index)
        if fused is not None:          # one pass of its chain's kernel, backward's too
            bytes_, bwd_bytes = bytes_ * fused.moved, bwd_bytes * fused.moved
        elif op.kind in FUSIBLE_KINDS:  # eager PyTorch's kernel of its own
            bytes_, bwd_bytes = bytes_ / self.eager_share, bwd_bytes / self.eager_share
        # a measured element-wise function: its arithmetic is a third ceiling
        key = elementwise_key(self.graph, op) if tp.elementwise_s_per_element else None
        per_fwd, per_bwd = (0.0, 0.0)
        if key is not None and key[0] in tp.elementwise_s_per_element:
            per_fwd, per_bwd = (key[1] * x for x in tp.elementwise_s_per_element[key[0]])
        cast_fwd, cast_bwd = self._cast_s(op)
        # a measured GEMM table's times hold each kernel's fixed part: no launch on top, but
        # none runs shorter than one
        floor, launch = (tp.launch_s, 0.0) if sides is not None else (0.0, tp.launch_s)
        if fused is not None and not fused.launches:
            launch = 0.0                 # inside a kernel a chain's first op opened
        fwd = max(op.fwd_flops / flops_per_s, bytes_ / tp.memory_bytes_per_s,
                  per_fwd, floor) + launch + cast_fwd
        if not op.differentiable:
            return OpCost(fwd_s=fwd, bwd_s=0.0)
        bwd = max(op.bwd_flops / (bwd_flops_per_s or flops_per_s),
                  bwd_bytes / tp.memory_bytes_per_s, per_bwd, floor) + launch + cast_bwd
        return OpCost(fwd_s=fwd, bwd_s=bwd)

    def base_cost(self, index: int) -> OpCost:
        """Cost of op ``index`` at its traced shape."""
        c = self._cache.get(index)
        if c is None:
            op = self.graph.ops[index]
            c = None if index in self.fused else self._measured(op)
            if c is None:
                c = self._roofline(op, index)
                if self.tput.matmul_shape is not None and gemm_sides(self.graph, op):
                    self._tabled.add(index)
            if self.slowdown != 1.0:
                c = OpCost(fwd_s=c.fwd_s * self.slowdown, bwd_s=c.bwd_s * self.slowdown)
            self._cache[index] = c
        return c

    def op_cost(self, index: int, work_scale: float = 1.0, split: tuple[str, int] = ("m", 1)
                ) -> OpCost:
        """Cost when the op's work is ``work_scale`` times the traced work, with ``split`` (as
        ``cost16``): an fp8 linear's (``fp8_ops``) as ``float8_cost`` prices it."""
        if index in self.fp8_ops:
            return self.float8_cost(index, work_scale, split)
        return self.cost16(index, work_scale, split)

    def float8_cost(self, index: int, work_scale: float = 1.0,
                    split: tuple[str, int] = ("m", 1)) -> OpCost:
        """Linear ``index`` run in fp8 under this model's fp8 recipe (``cost/float8.py``): its
        GEMMs at the fp8 rate, plus the casts of its operands at its sides there."""
        c = self.cost16(index, work_scale, split)
        sides = self.product_sides(index, work_scale, split)
        if self.fp8 is None or sides is None:
            return c
        passes = cast_passes(sides, self.fp8, compiled=bool(self.fused),
                             weight_cast=index not in self.fp8_gathered)
        fwd, bwd = float8_times(
            c.fwd_s, c.bwd_s, speedup=gemm_speedup(self.device, self.precision,
                                                    self.fp8.recipe),
            passes=passes, memory_bytes_per_s=self.tput.memory_bytes_per_s,
            launch_s=self.tput.launch_s)
        return OpCost(fwd_s=fwd, bwd_s=bwd)

    def cost16(self, index: int, work_scale: float = 1.0, split: tuple[str, int] = ("m", 1)
               ) -> OpCost:
        """Cost in the training precision when the op's work is ``work_scale`` times the traced work (batch, TP shard).
        ``split``: the product side a sharding strategy divides and by how much ("m" its rows,
        "n" its columns, "k" its contraction: ``sharding.strategy.divided_split``); the rest
        of the scale is rows (the micro-batch, a context-parallel shard, an expert's load)."""
        if work_scale == 1.0:
            return self.base_cost(index)
        key = (index, work_scale, split[0], split[1])
        hit = self._scaled.get(key)
        if hit is None:
            hit = self._scaled[key] = self._scale(index, work_scale, split)
        return hit

    def _scale(self, index: int, work_scale: float, split: tuple[str, int]) -> OpCost:
        c = self.base_cost(index)
        launch = self.tput.launch_s
        fwd_rate, bwd_rate = self._rate_change(index, work_scale, split)
        # a product priced by the GEMM table has its launch inside its time (``_roofline``)
        tabled = index in self._tabled
        inside = index in self.fused and not self.fused[index].launches   # no launch of its own
        fixed = 0.0 if tabled or inside else launch

        def scale(t: float, rate: float) -> float:
            if t <= 0.0:
                return 0.0
            over = max(t - fixed, 0.0)
            out = min(t, fixed) + over * work_scale / rate
            return max(out, launch) if tabled else out
        return OpCost(fwd_s=scale(c.fwd_s, fwd_rate), bwd_s=scale(c.bwd_s, bwd_rate))

    def product_sides(self, index: int, work_scale: float = 1.0, split: tuple[str, int] = ("m", 1)
                      ) -> tuple[float, float, float] | None:
        """(M, N, K) of op ``index``'s layer product at ``work_scale`` with ``split`` (as
        ``op_cost`` takes them); None where the op is no layer product."""
        sides = gemm_sides(self.graph, self.graph.ops[index])
        if sides is None:
            return None
        side, parts = split
        m, n, k = sides
        if side == "n":
            return m * work_scale * parts, n / parts, k
        if side == "k":
            return m * work_scale * parts, n, k / parts
        return m * work_scale, n, k

    def _rate_change(self, index: int, work_scale: float, split: tuple[str, int]
                     ) -> tuple[float, float]:
        """How much faster (> 1) or slower a product runs per FLOP, forward and backward, at
        ``work_scale`` times its traced work: by the device's GEMM shape table where it has one
        (the divided side smaller, the rows scaled), else by the calibrated size curve (its
        sides taken to scale alike)."""
        op = self.graph.ops[index]
        table = self.tput.matmul_shape
        if table is not None:
            if index not in self._tabled or work_scale <= 0:
                return 1.0, 1.0
            parts = _bwd_parts(op)
            f0, b0 = _gemm_fractions(table, self.product_sides(index), parts)
            f1, b1 = _gemm_fractions(table, self.product_sides(index, work_scale, split), parts)
            return f1 / f0, b1 / b0
        curve = self.tput.matmul_size_efficiency
        if not curve or op.kind not in _PRODUCT_KINDS or work_scale <= 0:
            return 1.0, 1.0
        size = product_size(self.graph, op)
        if size is None:
            return 1.0, 1.0
        r = (size_efficiency(curve, size * work_scale ** (1.0 / 3.0))
             / size_efficiency(curve, size))
        return r, r

    def chunked_slowdown(self, index: int, work_scale: float, split: tuple[str, int],
                         fwd_chunks: int, dgrad_chunks: int) -> tuple[float, float]:
        """(forward, backward) factors by which op ``index``'s product takes longer when its
        forward runs in ``fwd_chunks`` row chunks and its input gradient in ``dgrad_chunks``
        (communication pipelined with it): each chunk at the rate of its rows, by the device's
        GEMM shape table (1.0 without one)."""
        table = self.tput.matmul_shape
        sides = self.product_sides(index, work_scale, split)
        if table is None or sides is None:
            return 1.0, 1.0
        m, n, k = sides
        parts = _bwd_parts(self.graph.ops[index])
        fwd, bwd = _gemm_fractions(table, sides, parts)
        bwd_cut = _gemm_fractions(table, sides, parts, dgrad_chunks)[1]
        return fwd / table.fraction(m / fwd_chunks, n, k), bwd / bwd_cut


def _cross_entropy_bytes(graph: OpGraph, op: Op, precision: str) -> tuple[float, float] | None:
    """(forward, backward) bytes a cross entropy moves over its ``N`` logits; None for other
    ops. Torch computes it in fp32 whatever the training precision (it is on autocast's fp32
    list, and Megatron-LM upcasts its logits too), in passes over the whole logits: forward,
    the cast to fp32 (c bytes per logit), log-softmax's three reading passes (the row's max,
    its sum of exponentials, the output) and its write: (c + 16) N; backward, nll_loss's
    zero-filled gradient, log-softmax's backward (a pass summing the gradient, one reading it
    and the output to write the logits' gradient) and the cast back: (c + 20) N. c is 6 when
    training in 16 bits (read 2, write 4), 0 in fp32. Priced as one op's bytes, the logits of a
    128K vocabulary cost a tenth of this."""
    if op.kind != "loss" or opname(op) != "cross_entropy_loss" or not op.inputs:
        return None
    n = graph.value(op.inputs[0]).meta.numel
    cast = 0.0 if PRECISION_BYTES[precision] >= 4 else PRECISION_BYTES[precision] + 4.0
    return (cast + 16.0) * n, (cast + 20.0) * n
