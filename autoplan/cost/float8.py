"""fp8 linear layers priced as torchao's float8 training runs them (``ParallelConfig.fp8``).

torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``, recipes
"tensorwise" and "rowwise") runs each of a linear layer's three GEMMs on fp8 copies of its
operands and keeps the 16-bit (or fp32) tensors for backward (``matmul_with_hp_or_float8_args``
saves ``input_hp`` and ``weight_hp_t``: activation memory is unchanged). Per linear of sides
(M, N, K) (``cost/compute.py``'s ``gemm_sides``: M rows, N outputs, K inputs) it casts:

- forward: the input (M x K, 16-bit under autocast) and the weight (N x K, fp32 under
  autoplan's autocast, 16-bit where FSDP's mixed precision gathers it so);
- backward: the output gradient twice (M x N: row-major for the input gradient, its
  transpose's layout for the weight gradient), the weight again (for the input gradient) and
  the saved input again (for the weight gradient).

Each cast is an amax reduction over the tensor (one per tensor with "tensorwise" scaling, one
per row with "rowwise": the same bytes read) and the scaled conversion (read it, write one byte
per element; "rowwise" also writes a 4-byte scale per row). Compiled (``ParallelConfig.compiled``,
as torchao and torchtitan require for speed: "--compile.enable: required - fuses float8
scaling/casting kernels"), a cast is two kernels: the reduction (read h bytes per element)
and the conversion (read h, write 1). Eager, torch runs the amax as ``abs`` then ``max``
(read h, write h, read h) and the conversion as the scale's multiply, then the clamp and
the cast to fp8 (read h, write h; read h, write 1): 6h + 1 bytes per element in four kernels.

The GEMMs run at the device's fp8 tensor-core rate (``peak_flops["fp8"]`` in
``cost_models/devices.yaml``; none on A100 or V100: fp8 is never priced there), shaped as
the 16-bit product (the same GEMM-shape table), times ``ROWWISE_GEMM_FRACTION`` for rowwise
scales.

Under FSDP (ZeRO-2/3, parameter offload) with tensorwise scaling, the runtime sets torchao's
``enable_fsdp_float8_all_gather`` (``runtime/float8.py``): each fp8 linear's weight shard is
cast to fp8 before FSDP's all-gather (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``,
torchao 0.18), so the gather moves one byte per element instead of two and the linear casts no
weight, forward or backward (the gathered weight arrives as a ``Float8TrainingTensor``). The
scale is the whole weight's amax, computed once a step after the optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``'s way: one pass over each rank's shards and one
all-reduce of the stacked amaxes over the shard group). ``fp8_gathered_weights`` names the
linears it applies to (a weight read by that linear alone, not kept whole by ``dp_whole``:
those are not FSDP's to gather); ``gather_scale_work`` prices the casts and the scales; the dp
terms price those gathers at one byte per element (``estimate/dp_terms.py``). Rowwise scaling
gathers 16-bit weights (torchao refuses fp8 all-gather for it) and every linear casts its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.graph.opgraph import Op

# torch._scaled_mm needs both sides of each fp8 operand's inner layout divisible by 16
# (torchao's Float8Linear refuses other shapes unless pad_inner_dim): K and N of the weight
FP8_MIN_MULTIPLE = 16
# The rowwise-scaled GEMM's rate as a fraction of the tensorwise one. ESTIMATE from the one
# public end-to-end comparison on the same run (torchtitan commit 7a04053, Llama-3-8B on 8
# H100, torch.compile: bf16 5,760 tokens/s, rowwise 6,424 (1.115x), tensorwise with fp8
# all-gather 7,186 (1.248x), https://github.com/pytorch/torchtitan/commit/7a04053 ): rowwise
# gains under half of tensorwise's, more than its extra per-row scales explain.
ROWWISE_GEMM_FRACTION = 0.8
LINEAR_TYPE = "torch.nn.modules.linear.Linear"    # what convert_to_float8_training swaps


@dataclass(frozen=True)
class Float8Setting:
    """What fp8 pricing needs of a config: the recipe, the skipped linears' patterns, the
    bytes per element of the weight the linear casts (4: autocast's fp32 weight; 2: FSDP's
    16-bit gathered one) and whether the weight arrives in fp8 already (FSDP's fp8
    all-gather, tensorwise only)."""

    recipe: str
    skip: tuple[str, ...]
    weight_bytes: int
    weight_gathered_fp8: bool

    whole: tuple[str, ...] = ()      # ``dp_whole``'s patterns: weights FSDP does not gather

    @staticmethod
    def of(config: Any) -> Float8Setting | None:
        """The setting of ``config`` (a ParallelConfig); None where fp8 is off."""
        if getattr(config, "fp8", "none") == "none":
            return None
        fsdp = config.uses_fsdp
        return Float8Setting(recipe=config.fp8, skip=tuple(config.fp8_skip),
                             weight_bytes=2 if fsdp else 4,
                             weight_gathered_fp8=gathers_fp8(config),
                             whole=tuple(config.dp_whole))

    def weight_cast(self) -> bool:
        """Whether a linear casts its own weight where FSDP does not gather it in fp8 (or
        gathers nothing): the linears ``fp8_gathered_weights`` leaves out."""
        return not self.weight_gathered_fp8


def gathers_fp8(config: Any) -> bool:
    """Whether ``config``'s FSDP gathers its fp8 linears' weights in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``): fp8 with tensorwise scaling (torchao refuses it for
    rowwise) on FSDP2 (``ParallelConfig.uses_fsdp``)."""
    return getattr(config, "fp8", "none") == "tensorwise" and bool(config.uses_fsdp)


def fp8_gathered_weights(graph: Any, fp8_ops: Any, whole: tuple[str, ...] = ()
                         ) -> dict[int, str]:
    """Of the linears ``fp8_ops`` (op indices), those whose weight FSDP gathers in fp8, with the
    weight's FQN: a parameter that op alone reads (a weight tied to an embedding is read in 16
    bits there too) and that no ``whole`` pattern (``dp_whole``) keeps out of FSDP."""
    from fnmatch import fnmatchcase      # lazily, as cost.compute.fp8_converted_ops
    readers: dict[str, set[int]] = {}
    for i, op in enumerate(graph.ops):
        for n in op.inputs:
            v = graph.value(n)
            if v.kind == "param":
                readers.setdefault(v.base, set()).add(i)
    out = {}
    for i in sorted(fp8_ops):
        inputs = graph.ops[i].inputs
        w = graph.value(inputs[1]) if len(inputs) > 1 else None
        if w is None or w.kind != "param" or readers.get(w.base) != {i}:
            continue
        fqn = graph.value(w.base).fqn
        if fqn and not any(fnmatchcase(fqn, p) for p in whole):
            out[i] = fqn
    return out


# FSDP's pre-all-gather cast of a weight shard to fp8 (``hp_tensor_and_scale_to_float8`` with
# the precomputed scale): read the fp32 shard, write one byte per element, in one kernel
SHARD_CAST_BYTES = 4 + 1


@dataclass(frozen=True)
class GatherScaleWork:
    """What FSDP's fp8 all-gather adds on a rank, beside the gather itself: seconds of device
    work per gather of a layer's shards (the casts to fp8), and once a step (the amax of every
    owned fp8 shard, after the optimizer step) with the all-reduce of the amaxes."""

    per_gather_s: float
    per_step_s: float


def gather_scale_work(owned_fp8: float, weights: int, layers: int, *,
                      memory_bytes_per_s: float, launch_s: float,
                      amax_all_reduce_s: float) -> GatherScaleWork:
    """``GatherScaleWork`` for ``owned_fp8`` weight elements (this rank's shards, fp32) of
    ``weights`` fp8-gathered weights in ``layers`` FSDP units: each gather casts one unit's
    shards (``SHARD_CAST_BYTES`` per element, a kernel per weight); each step reads every
    shard once for its amax (``torch._foreach_norm(ord=inf)``: 4 bytes per element) and
    all-reduces the stacked amaxes (``amax_all_reduce_s``), then a few kernels for the
    scales."""
    layers = max(layers, 1)
    per_gather = (owned_fp8 / layers * SHARD_CAST_BYTES / memory_bytes_per_s
                  + weights / layers * launch_s)
    per_step = owned_fp8 * 4.0 / memory_bytes_per_s + 4 * launch_s + amax_all_reduce_s
    return GatherScaleWork(per_gather_s=per_gather, per_step_s=per_step)


def fp8_flops_per_s(device: Any) -> float | None:
    """The device's dense fp8 tensor-core peak; None where it has none (A100, V100, CPUs)."""
    return (getattr(device, "peak_flops", None) or {}).get("fp8")


def convertible(op: Op, sides: tuple[float, float, float] | None) -> bool:
    """Whether torchao would convert ``op``'s layer: an ``nn.Linear``'s product whose weight
    sides (N, K) divide by ``FP8_MIN_MULTIPLE``."""
    if sides is None or op.module_type != LINEAR_TYPE or not op.params:
        return False
    _m, n, k = sides
    return n % FP8_MIN_MULTIPLE == 0 and k % FP8_MIN_MULTIPLE == 0


@dataclass(frozen=True)
class CastPasses:
    """The fp8 casts of one linear: bytes moved and kernels, forward and backward."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


def cast_passes(sides: tuple[float, float, float], setting: Float8Setting, *,
                compiled: bool, activation_bytes: int = 2, weight_cast: bool | None = None
                ) -> CastPasses:
    """The casts torchao makes for one linear of ``sides`` (module doc). ``weight_cast``:
    whether the linear casts its weight (False where FSDP gathers it in fp8:
    ``fp8_gathered_weights``); None: as ``setting`` says for every linear."""
    m, n, k = sides
    a, w = activation_bytes, setting.weight_bytes
    rowwise = setting.recipe == "rowwise"

    def cast(elements: float, h: int, rows: float) -> tuple[float, int]:
        per = (2 * h + 1) if compiled else (6 * h + 1)
        scales = 4.0 * rows if rowwise else 4.0
        return elements * per + scales, (2 if compiled else 4)

    if weight_cast is None:
        weight_cast = setting.weight_cast()
    weight = [cast(n * k, w, n)] if weight_cast else []
    fwd = [cast(m * k, a, m)] + weight
    bwd = [cast(m * n, a, m), cast(m * n, a, n), cast(m * k, a, k)] + weight
    return CastPasses(fwd_bytes=sum(b for b, _ in fwd), bwd_bytes=sum(b for b, _ in bwd),
                      fwd_kernels=sum(c for _, c in fwd), bwd_kernels=sum(c for _, c in bwd))


def float8_times(c16_fwd_s: float, c16_bwd_s: float, *, speedup: float,
                 passes: CastPasses, memory_bytes_per_s: float, launch_s: float
                 ) -> tuple[float, float]:
    """(forward, backward) seconds of a linear in fp8: its 16-bit GEMM times (each holding a
    kernel's fixed ``launch_s``) with the rest ``speedup`` times faster, plus the casts."""
    def gemm(t: float) -> float:
        return min(t, launch_s) + max(t - launch_s, 0.0) / speedup
    fwd = (gemm(c16_fwd_s) + passes.fwd_bytes / memory_bytes_per_s
           + passes.fwd_kernels * launch_s)
    bwd = (gemm(c16_bwd_s) + passes.bwd_bytes / memory_bytes_per_s
           + passes.bwd_kernels * launch_s) if c16_bwd_s > 0 else 0.0
    return fwd, bwd


def gemm_speedup(device: Any, precision: str, recipe: str) -> float:
    """How much faster a GEMM runs in fp8 under ``recipe`` than in ``precision``: the ratio of
    the datasheet rates (the efficiencies are the same chip's), rowwise at
    ``ROWWISE_GEMM_FRACTION``; 1.0 where the device has no fp8 rate."""
    fp8 = fp8_flops_per_s(device)
    if not fp8:
        return 1.0
    ratio = fp8 / device.peak_flops_for(precision)
    return ratio * (ROWWISE_GEMM_FRACTION if recipe == "rowwise" else 1.0)


# bytes per element an unfused (eager) cast holds beyond its fp8 output, on the largest tensor
# it casts: ``x.to(float32) * scale`` (4) and its clamp (4) alive at once
EAGER_CAST_TEMP_BYTES = 8


def backward_buffer_bytes(sides: tuple[float, float, float], *, compiled: bool) -> float:
    """Bytes one fp8 linear of ``sides`` (M, N, K) holds beyond its 16-bit twin while its
    backward runs (``matmul_with_hp_or_float8_args.backward``, torchao 0.18): nothing is
    saved beyond the 16-bit twin (torchao saves ``input_hp`` and the weight itself), but the
    backward holds, until it returns, the fp8 copies it casts: the output gradient twice
    (M x N: one per gradient GEMM), the weight (N x K) and the saved input (M x K), and the
    copies torch._scaled_mm's layouts make of them (the transposed gradient for the weight
    gradient, the input, the weight): 3MN + 2MK + 2NK bytes, counted all at once
    (conservative: the forward's casts of input and weight are freed sooner and are smaller).
    Eager, each cast also runs unfused, holding ``EAGER_CAST_TEMP_BYTES`` per element of the
    largest tensor it casts. Compiled fp8 memory is UNMEASURED on a GPU: this counts the fp8
    buffers as the eager source holds them, with no credit for inductor freeing them sooner.
    Measured once, eagerly (H200, HF Llama 0.89B, 8 x 2048 tokens, every linear in fp8): 12.8
    GiB over bf16; this prices the largest linear there (lm_head, 16,384 x 32,000 x 2,048)
    at 5.6 GiB eager and 1.6 GiB compiled: it explains under half of the eager figure."""
    m, n, k = sides
    held = 3 * m * n + 2 * m * k + 2 * n * k
    return held if compiled else held + EAGER_CAST_TEMP_BYTES * max(m * n, m * k, n * k)
