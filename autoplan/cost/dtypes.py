"""The dtypes autoplan's runtime trains a traced graph in: what torch.autocast makes of it.

A graph is traced in fp32. Trained in 16 bits, autoplan's runtime keeps fp32 weights and runs
the step under ``torch.autocast`` (``ParallelConfig.mixed_precision == "autocast"``), which
decides each op's dtype by three lists (PyTorch's AMP op reference, "CUDA Ops that can
autocast to float16 / float32", and the CPU lists beside them):

- products (linear, matmul, bmm, addmm, baddbmm, convolutions, scaled-dot-product attention)
  run in the 16-bit dtype: their outputs are 16-bit, and what they keep for backward are the
  16-bit copies autocast cast their inputs to (an fp32 input is copied, the copy saved);
- on CUDA, softmax, log-softmax, layer and group norm, the losses, exp, log, pow, rsqrt, sums
  and a few more run in fp32 and return fp32 (on the CPU only the losses and some linear
  algebra do);
- every other op computes in the widest float dtype among its inputs, and weights are fp32:
  an embedding's output is fp32, so the residual stream that adds 16-bit sublayer outputs to
  it stays fp32, and a norm's weight multiply lifts its input.

``kept_itemsizes`` gives, per activation a graph keeps for backward, the bytes per element
autocast keeps it in; ``value_itemsizes`` the dtype of every value. The 16-bit copies of the
weights autocast makes for the products are model state (``cost.memory.model_state_bytes``).
Measured on an H100 (benchmarks/data/h100-sxm5-runtime.json): GPT-3 1.3B under autocast
peaked 12.7 % above a model that held every activation in bf16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autoplan.graph.opgraph import OpGraph, opname

# ops autocast runs in the lower precision, on CUDA and on the CPU (overload packets)
LOWER_PRECISION_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv",
    "chain_matmul", "multi_dot", "linalg_multi_dot", "prelu", "conv1d", "conv2d", "conv3d",
    "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_native_multi_head_attention", "einsum"})
_PRODUCT_KINDS = frozenset({"matmul", "conv", "attention"})
# products autocast has no kernel for, on any device (torch 2.13's dispatcher registers none
# for ``aten::_grouped_mm``; a custom op is outside its lists): they compute in their inputs'
# dtype. HF's experts cast their rows to the weight's dtype before one, so under autocast with
# fp32 weights HF's experts multiply in fp32 (on the CPU and on CUDA alike)
UNCAST_PRODUCTS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})


# casts: one to fp32 in the trace may be HF's ``x.to(input_dtype)`` (16 bits at run time), one
# to 16 bits is the model's own (torchtitan's experts cast their rows and weights to bf16)
_CASTS = frozenset({"to", "_to_copy"})


def autocast_casts(op: Any) -> bool:
    """Whether autocast runs ``op`` in 16 bits on 16-bit copies of its float inputs: the
    products (by kind, or on its lower-precision list) but those it cannot reach."""
    name = opname(op)
    return (op.kind in _PRODUCT_KINDS or name in LOWER_PRECISION_OPS) and (
        name not in UNCAST_PRODUCTS)


# ops CUDA autocast runs in fp32 (their outputs are fp32)
_FP32_CUDA = frozenset({
    "pow", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
    "reciprocal", "rsqrt", "sinh", "tan", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "native_group_norm", "norm", "frobenius_norm", "nuclear_norm",
    "linalg_vector_norm", "linalg_matrix_norm", "normalize", "cosine_similarity", "softmax",
    "_softmax", "log_softmax", "_log_softmax", "softmin", "cumsum", "cumprod", "prod", "sum",
    "logsumexp", "renorm", "dist", "pdist", "cdist", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "nll_loss_forward", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "cross_entropy_loss",
    "binary_cross_entropy_with_logits"})
# ops CPU autocast runs in fp32
_FP32_CPU = frozenset({
    "nll_loss", "nll_loss2d", "nll_loss_forward", "cross_entropy_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "cdist", "prod", "avg_pool3d",
    "max_pool3d", "adaptive_avg_pool3d", "grid_sampler"})


def autocast_on(precision: str, mixed_precision: str) -> bool:
    """Whether the runtime's autocast decides the dtypes (16-bit training under autocast)."""
    return mixed_precision == "autocast" and precision in ("bf16", "fp16")


def value_itemsizes(graph: OpGraph, lower_bytes: int, device_kind: str) -> Mapping[str, int]:
    """Bytes per element of every value of ``graph`` when trained under autocast in a
    ``lower_bytes``-byte float (2) on a ``device_kind`` ("gpu" or "cpu") device. Cached."""
    cache = graph.__dict__.setdefault("_autoplan_autocast_sizes", {})
    key = (lower_bytes, device_kind)
    if key in cache:
        return cache[key]
    fp32_ops = _FP32_CUDA if device_kind == "gpu" else _FP32_CPU
    size: dict[str, int] = {}
    for v in graph.values:
        if v.kind != "activation" or not v.meta.is_float:
            size[v.name] = v.meta.itemsize       # weights fp32, inputs as given, indices
    for op in graph.ops:
        name = opname(op)
        floats = [size.get(n, graph.value(n).meta.itemsize) for n in op.inputs
                  if graph.value(n).meta.is_float]
        if autocast_casts(op):
            out = lower_bytes
        elif name in fp32_ops:
            out = 4
        elif op.kind == "view" and floats:
            out = floats[0]
        else:
            out = max(floats, default=4)
        cast_16 = name in _CASTS      # a cast to 16 bits in the fp32 trace is the model's own
        for n in op.outputs:
            meta = graph.value(n).meta
            size[n] = (meta.itemsize if not meta.is_float or cast_16 and meta.itemsize < 4
                       else out)
    result = MappingProxyType(size)
    cache[key] = result
    return result


def kept_itemsizes(graph: OpGraph, lower_bytes: int, device_kind: str) -> Mapping[str, int]:
    """Bytes per element each activation (by its storage's base value) is kept in for
    backward under autocast, where backward keeps the value itself: an op other than a
    product keeps it as it is, a product keeps it where it is already 16-bit (the widest,
    where both keep it). A product that reads a wider value keeps its own 16-bit copy instead
    (``cast_copies``): such a value is here only if another op keeps it too. Cached."""
    return _kept_and_copies(graph, lower_bytes, device_kind)[0]


def cast_copies(graph: OpGraph, lower_bytes: int, device_kind: str
                ) -> Mapping[int, frozenset[str]]:
    """Per product op (by index), the base values it reads in a wider dtype and keeps as its
    own 16-bit copy for backward. autocast casts at every call and caches only the casts of
    leaves that require grad (the weights: PyTorch's ``autocast`` docs, "the cast cache"), so
    HF Llama's separate q, k and v projections keep three copies of the normed input, and
    every layer's attention its own copy of the fp32 mask (measured on the CPU: the runtime's
    offload hooks copy exactly these). Cached."""
    return _kept_and_copies(graph, lower_bytes, device_kind)[1]


def _kept_and_copies(graph: OpGraph, lower_bytes: int, device_kind: str) -> tuple[Any, Any]:
    cache = graph.__dict__.setdefault("_autoplan_autocast_kept", {})
    key = (lower_bytes, device_kind)
    if key in cache:
        return cache[key]
    own = value_itemsizes(graph, lower_bytes, device_kind)
    kept: dict[str, int] = {}
    copies: dict[int, set[str]] = {}
    for i, op in enumerate(graph.ops):
        product = autocast_casts(op)
        for n in op.saved:
            base = graph.value(n).base
            if not graph.value(base).meta.is_float:
                continue
            if product and own.get(base, 4) > lower_bytes:
                copies.setdefault(i, set()).add(base)
                continue
            b = lower_bytes if product else own.get(base, 4)
            kept[base] = max(kept.get(base, 0), b)
    result = (MappingProxyType(kept),
              MappingProxyType({i: frozenset(c) for i, c in copies.items()}))
    cache[key] = result
    return result



@dataclass(frozen=True)
class HeldBytes:
    """Bytes per element the runtime holds activations in under autocast: ``kept`` for what
    backward keeps (by base value), ``own`` for a value itself (a block input that full
    recomputation keeps). A float value in neither holds the precision's bytes."""

    kept: Mapping[str, int]
    own: Mapping[str, int]
    # per product op (index), the values it keeps as its own 16-bit copy (``cast_copies``),
    # each in ``lower_bytes`` per element
    copies: Mapping[int, frozenset[str]] = field(default_factory=dict)
    lower_bytes: int = 2


def own_sizes(held: HeldBytes | None) -> Mapping[str, int] | None:
    """``held.own``: each value's bytes per element as autocast computes it; None where every
    float is held in the precision (no autocast)."""
    return held.own if held is not None else None


def held_bytes(graph: OpGraph, precision: str, mixed_precision: str, device_kind: str
               ) -> HeldBytes | None:
    """The autocast dtypes of ``graph`` for a config's (precision, mixed_precision) on a
    ``device_kind`` device; None where every float is held in ``precision`` (fp32 training,
    or weights and activations held in 16 bits, ``mixed_precision="params"``)."""
    if not autocast_on(precision, mixed_precision):
        return None
    lower = 2
    cache = graph.__dict__.setdefault("_autoplan_held_bytes", {})
    key = (lower, device_kind)
    if key not in cache:
        cache[key] = HeldBytes(kept=kept_itemsizes(graph, lower, device_kind),
                               own=value_itemsizes(graph, lower, device_kind),
                               copies=cast_copies(graph, lower, device_kind),
                               lower_bytes=lower)
    return cache[key]
