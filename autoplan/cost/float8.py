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
scales. Under FSDP with tensorwise scaling, torchao's ``enable_fsdp_float8_all_gather`` would
cast each weight shard to fp8 before the all-gather (the gather moving one byte per element
instead of two, the linear casting no weight); autoplan's runtime does not set it (its FSDP2
gathers the 16-bit weights and each fp8 linear casts its weight, ``runtime/float8.py``), so
it is priced as not enabled: ``Float8Setting.weight_gathered_fp8`` is False, and the dp terms
price FSDP's gathers at 16 bits (``estimate/dp_terms.py``), as the runtime moves them.
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

    @staticmethod
    def of(config: Any) -> Float8Setting | None:
        """The setting of ``config`` (a ParallelConfig); None where fp8 is off."""
        if getattr(config, "fp8", "none") == "none":
            return None
        fsdp = config.uses_fsdp
        return Float8Setting(recipe=config.fp8, skip=tuple(config.fp8_skip),
                             weight_bytes=2 if fsdp else 4,
                             # FSDP's fp8 all-gather: not run (module doc)
                             weight_gathered_fp8=False)

    def weight_cast(self) -> bool:
        """Whether the linear itself casts its weight (not done before FSDP's gather)."""
        return not self.weight_gathered_fp8


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
                compiled: bool, activation_bytes: int = 2) -> CastPasses:
    """The casts torchao makes for one linear of ``sides`` (module doc)."""
    m, n, k = sides
    a, w = activation_bytes, setting.weight_bytes
    rowwise = setting.recipe == "rowwise"

    def cast(elements: float, h: int, rows: float) -> tuple[float, int]:
        per = (2 * h + 1) if compiled else (6 * h + 1)
        scales = 4.0 * rows if rowwise else 4.0
        return elements * per + scales, (2 if compiled else 4)

    weight = [cast(n * k, w, n)] if setting.weight_cast() else []
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
