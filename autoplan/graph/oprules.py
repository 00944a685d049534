"""Per-op knowledge: one rule per op family (kind, FLOPs, bytes, what backward keeps).

Search and cost code never branch on op names; they read ``Op.kind`` and the numbers a rule
computed here at trace time. An op without a rule gets a conservative default (kind "other",
FLOPs = output elements, saves its float inputs) and a one-time warning, never a crash.

Sources of the saved-tensor rules: PyTorch's autograd formulas (``derivatives.yaml``) — a
matmul keeps the operand the *other* operand's gradient needs, softmax keeps its output, GELU
and SiLU keep their input, ReLU keeps its output, dropout keeps a 1-byte mask, LayerNorm/RMSNorm
keep their input; these are also the terms of Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.graph.opgraph import Op, TensorMeta, opname


@dataclass(frozen=True)
class OpCall:
    """What a rule sees of one call: tensor inputs (metas, requires_grad), outputs, other args."""

    name: str                               # overload packet, e.g. "linear"
    inputs: tuple[TensorMeta, ...]
    input_requires_grad: tuple[bool, ...]
    outputs: tuple[TensorMeta, ...]
    scalars: tuple[Any, ...]                # non-tensor positional args, in order
    kwargs: dict[str, Any]

    @property
    def out_numel(self) -> int:
        return sum(o.numel for o in self.outputs)

    def grad_needed(self, i: int) -> bool:
        return i < len(self.input_requires_grad) and self.input_requires_grad[i]

    def any_grad(self) -> bool:
        return any(self.input_requires_grad)


@dataclass(frozen=True)
class Saved:
    inputs: tuple[int, ...] = ()            # indices into OpCall.inputs
    outputs: tuple[int, ...] = ()           # indices into OpCall.outputs
    internal: tuple[TensorMeta, ...] = ()   # e.g. a dropout mask


@dataclass(frozen=True)
class OpRule:
    kind: str
    flops: Callable[[OpCall], int]
    bwd_flops: Callable[[OpCall, int], int]     # (call, fwd_flops) -> backward FLOPs
    saves: Callable[[OpCall], Saved]


# ---- FLOP formulas ------------------------------------------------------------------------

def _zero(c: OpCall) -> int:
    return 0


def _per_out(k: float) -> Callable[[OpCall], int]:
    return lambda c: int(k * c.out_numel)


def _matmul_flops(c: OpCall) -> int:
    """2*M*N*K for every output element: K is the contracted size of the first operand."""
    a = c.inputs[0]
    k = a.shape[-1] if a.shape else 1
    flops = 2 * c.outputs[0].numel * k
    if c.name in ("linear", "addmm", "baddbmm") and len(c.inputs) > 2:
        flops += c.outputs[0].numel          # bias add
    return flops


def _conv_flops(c: OpCall) -> int:
    weight = c.inputs[1]
    per_out = math.prod(weight.shape[1:])    # (Cin/groups) * prod(kernel)
    return 2 * c.outputs[0].numel * per_out


def _sdpa_flops(c: OpCall) -> int:
    q, k, v = c.inputs[:3]
    *batch, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    b = math.prod(batch)
    return 2 * b * s_q * s_k * d + 2 * b * s_q * s_k * d_v


def _bwd_by_operand(c: OpCall, fwd: int) -> int:
    """Matmul-like backward: one forward-sized product per operand that needs a gradient."""
    n_grad = sum(1 for i in range(min(2, len(c.inputs))) if c.grad_needed(i))
    return n_grad * fwd


def _bwd_conv(c: OpCall, fwd: int) -> int:
    n = (1 if c.grad_needed(0) else 0) + (1 if c.grad_needed(1) else 0)
    return n * fwd


def _bwd_factor(k: float) -> Callable[[OpCall, int], int]:
    return lambda c, fwd: int(k * fwd) if c.any_grad() else 0


# ---- saved-tensor rules -------------------------------------------------------------------

def _save_nothing(c: OpCall) -> Saved:
    return Saved()


def _save_inputs_for_other(c: OpCall) -> Saved:
    """Product of two operands: keep operand i when the other operand needs a gradient."""
    keep = []
    if len(c.inputs) >= 2:
        if c.grad_needed(1):
            keep.append(0)
        if c.grad_needed(0):
            keep.append(1)
    return Saved(inputs=tuple(sorted(keep)))


def _save_input0(c: OpCall) -> Saved:
    return Saved(inputs=(0,)) if c.any_grad() else Saved()


def _save_output0(c: OpCall) -> Saved:
    return Saved(outputs=(0,)) if c.any_grad() else Saved()


def _save_float_inputs(c: OpCall) -> Saved:
    if not c.any_grad():
        return Saved()
    return Saved(inputs=tuple(i for i, m in enumerate(c.inputs) if m.is_float))


def _save_dropout(c: OpCall) -> Saved:
    p = c.scalars[0] if c.scalars else c.kwargs.get("p", 0.5)
    train = c.scalars[1] if len(c.scalars) > 1 else c.kwargs.get("train", True)
    if not c.any_grad() or not train or p == 0:
        return Saved()
    return Saved(internal=(TensorMeta(shape=c.outputs[0].shape, dtype="bool"),))


def _save_sdpa(c: OpCall) -> Saved:
    if not c.any_grad():
        return Saved()
    q = c.inputs[0]
    lse = TensorMeta(shape=q.shape[:-1], dtype="float32")   # log-sum-exp per query row
    return Saved(inputs=(0, 1, 2), outputs=(0,), internal=(lse,))


def _save_loss(c: OpCall) -> Saved:
    """Cross entropy keeps its log-softmax (same size as the logits) and the targets."""
    if not c.any_grad():
        return Saved()
    logits = c.inputs[0]
    return Saved(inputs=tuple(range(1, len(c.inputs))),
                 internal=(TensorMeta(shape=logits.shape, dtype=logits.dtype),))


def _save_index_inputs(c: OpCall) -> Saved:
    """Embedding lookups keep only the integer indices (and offsets)."""
    if not c.any_grad():
        return Saved()
    return Saved(inputs=tuple(i for i, m in enumerate(c.inputs) if not m.is_float))


def _save_pool(c: OpCall) -> Saved:
    if not c.any_grad():
        return Saved()
    if c.name.startswith("max_pool"):
        return Saved(inputs=(0,), internal=(TensorMeta(shape=c.outputs[0].shape, dtype="int64"),))
    return Saved()


def _save_masked(c: OpCall) -> Saved:
    """masked_fill / where keep the boolean condition only."""
    return Saved(inputs=tuple(i for i, m in enumerate(c.inputs) if m.dtype == "bool"))


def _save_binary(c: OpCall) -> Saved:
    """mul/div: d(a*b)/da needs b and vice versa; a scalar operand is not a tensor input."""
    if c.name in ("mul", "div"):
        return _save_inputs_for_other(c) if len(c.inputs) == 2 else Saved()
    return Saved()


def _rule(kind: str, flops=_zero, bwd=_bwd_factor(1.0), saves=_save_nothing) -> OpRule:
    return OpRule(kind=kind, flops=flops, bwd_flops=bwd, saves=saves)


_MATMUL = _rule("matmul", _matmul_flops, _bwd_by_operand, _save_inputs_for_other)
_VIEW = _rule("view", bwd=_bwd_factor(0.0))
_CREATION = _rule("creation", bwd=_bwd_factor(0.0))
_COPY = _rule("copy", bwd=_bwd_factor(0.0))

RULES: dict[str, OpRule] = {
    # products
    **{n: _MATMUL for n in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum")},
    # experts' grouped product: tokens (sorted by expert) x (experts, in, out); the FLOPs are
    # those of the tokens routed (active experts), not of every expert
    **{n: _MATMUL for n in ("grouped_mm_fallback", "_grouped_mm", "grouped_mm")},
    **{n: _rule("conv", _conv_flops, _bwd_conv, _save_inputs_for_other)
       for n in ("convolution", "conv1d", "conv2d", "conv3d", "_convolution")},
    # the fused kernels a CompositeImplicit ``scaled_dot_product_attention`` dispatches to (what
    # a dispatch mode, such as selective checkpointing's policy, sees of it)
    **{n: _rule("attention", _sdpa_flops, _bwd_factor(2.5), _save_sdpa)
       for n in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")},
    # lookups
    "embedding": _rule("embedding", saves=_save_index_inputs),
    "embedding_bag": _rule("embedding", _per_out(1), saves=_save_index_inputs),
    "_embedding_bag": _rule("embedding", _per_out(1), saves=_save_index_inputs),
    # normalization and activations with memory rules
    "layer_norm": _rule("norm", _per_out(5), _bwd_factor(2.0), _save_input0),
    "rms_norm": _rule("norm", _per_out(4), _bwd_factor(2.0), _save_input0),
    "batch_norm": _rule("norm", _per_out(5), _bwd_factor(2.0), _save_input0),
    "group_norm": _rule("norm", _per_out(5), _bwd_factor(2.0), _save_input0),
    "softmax": _rule("pointwise", _per_out(5), _bwd_factor(0.8), _save_output0),
    "_softmax": _rule("pointwise", _per_out(5), _bwd_factor(0.8), _save_output0),
    "log_softmax": _rule("pointwise", _per_out(5), _bwd_factor(0.8), _save_output0),
    "_log_softmax": _rule("pointwise", _per_out(5), _bwd_factor(0.8), _save_output0),
    "gelu": _rule("pointwise", _per_out(8), _bwd_factor(1.5), _save_input0),
    "silu": _rule("pointwise", _per_out(4), _bwd_factor(1.5), _save_input0),
    "relu": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_output0),
    "relu_": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_output0),
    "sigmoid": _rule("pointwise", _per_out(4), _bwd_factor(0.75), _save_output0),
    "tanh": _rule("pointwise", _per_out(4), _bwd_factor(0.75), _save_output0),
    "exp": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_output0),
    "rsqrt": _rule("pointwise", _per_out(2), _bwd_factor(1.5), _save_output0),
    "sqrt": _rule("pointwise", _per_out(1), _bwd_factor(1.5), _save_output0),
    "pow": _rule("pointwise", _per_out(1), _bwd_factor(2.0), _save_input0),
    "log": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_input0),
    "sin": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_input0),
    "cos": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_input0),
    "mul": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_binary),
    "div": _rule("pointwise", _per_out(1), _bwd_factor(2.0), _save_binary),
    "masked_fill": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_masked),
    "where": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_masked),
    "dropout": _rule("dropout", _per_out(2), _bwd_factor(0.5), _save_dropout),
    "native_dropout": _rule("dropout", _per_out(2), _bwd_factor(0.5), _save_dropout),
    "feature_dropout": _rule("dropout", _per_out(2), _bwd_factor(0.5), _save_dropout),
    # losses
    "cross_entropy_loss": _rule("loss", _per_out(0), _bwd_factor(1.0), _save_loss),
    "nll_loss": _rule("loss", _per_out(1), _bwd_factor(1.0), _save_index_inputs),
    "mse_loss": _rule("loss", _per_out(3), _bwd_factor(1.0), _save_float_inputs),
    "binary_cross_entropy_with_logits": _rule("loss", _per_out(4), _bwd_factor(1.0),
                                              _save_float_inputs),
    # pooling
    **{n: _rule("pool", _per_out(1), _bwd_factor(1.0), _save_pool)
       for n in ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
                 "adaptive_avg_pool1d", "_adaptive_avg_pool2d", "avg_pool1d", "max_pool1d")},
    # reductions
    **{n: _rule("reduction", lambda c: sum(m.numel for m in c.inputs[:1]), _bwd_factor(0.0))
       for n in ("sum", "mean", "amax", "amin", "max", "min", "norm", "var", "std",
                 "var_mean", "logsumexp", "argmax", "cumsum", "prod")},
    # copies that move data but do no arithmetic
    # routing: choosing, sorting and counting tokens (integer work, memory-bound)
    **{n: _rule("copy", _per_out(1), _bwd_factor(1.0), _save_index_inputs)
       for n in ("topk", "sort", "argsort", "histc", "bincount", "index_put", "index_put_",
                 "index_add", "index_add_", "scatter_add", "scatter_add_", "masked_scatter",
                 "one_hot")},
    "floor_divide": _rule("pointwise", _per_out(1), _bwd_factor(0.0)),
    **{n: _COPY for n in ("contiguous", "clone", "cat", "stack", "to", "_to_copy", "copy",
                          "repeat", "repeat_interleave", "tril", "triu", "pad",
                          "constant_pad_nd", "index", "index_select", "gather", "scatter",
                          "type_as", "flip", "roll")},
    # products without a contraction
    "outer": _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_inputs_for_other),
    "__and__": _rule("pointwise", _per_out(1), _bwd_factor(0.0)),
    "__or__": _rule("pointwise", _per_out(1), _bwd_factor(0.0)),
    "diff": _COPY,
    # metadata checks and broadcasting views: no data moves
    **{n: _VIEW for n in ("_assert_tensor_metadata", "_assert_async", "broadcast_tensors",
                          "sym_size", "sym_numel", "sym_stride", "detach", "alias")},
    # higher-order ops wrapping a no-grad region (e.g. rotary tables computed under no_grad)
    "wrap_with_set_grad_enabled": _rule("other", _per_out(1), _bwd_factor(0.0)),
    "wrap_with_autocast": _rule("other", _per_out(1), _bwd_factor(1.0), _save_float_inputs),
    # tensor factories
    **{n: _CREATION for n in ("ones", "zeros", "full", "empty", "arange", "ones_like",
                              "zeros_like", "full_like", "empty_like", "scalar_tensor", "rand",
                              "randn", "lift_fresh_copy", "_to_dtype", "new_ones",
                              "new_zeros", "new_full", "new_empty", "tril_indices",
                              "triu_indices")},
}

# add/sub/neg/... are pointwise without saved tensors; found through torch's pointwise tag.
# The op-level recompute policy ("ops", ``ParallelConfig.recompute``) keeps the outputs of these
# kinds, the products that are expensive to run again (Korthikanti et al. 2022 keep GEMM
# outputs; torchtitan's op-level SAC saves matmuls and attention), and recomputes every other
# op of a checkpointed layer (norms, element-wise ops, dropout: cheap in FLOPs). The cost model
# (``cost.memory``, ``estimate.chunk_cost``) and the runtime's policy
# (``runtime.parallelize.ops_policy_saves``) both read it.
OPS_POLICY_SAVES = frozenset({"matmul", "attention", "conv"})


def ops_policy_names() -> frozenset[str]:
    """The aten overload packets whose outputs the op-level policy keeps: every op with a rule
    of a kind in ``OPS_POLICY_SAVES``."""
    return frozenset(n for n, r in RULES.items() if r.kind in OPS_POLICY_SAVES)


_POINTWISE = _rule("pointwise", _per_out(1), _bwd_factor(1.0), _save_nothing)
_OTHER = _rule("other", _per_out(1), _bwd_factor(1.0), _save_float_inputs)

_warned: set[str] = set()


def rule_for(name: str, *, is_view: bool, is_pointwise: bool) -> OpRule:
    """The rule for overload packet ``name``; views and tagged pointwise ops have generic rules."""
    rule = RULES.get(name)
    if rule is not None:
        return rule
    if is_view:
        return _VIEW
    if is_pointwise:
        return _POINTWISE
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"autoplan has no rule for aten op {name!r}: costing it as a replicated "
                      "memory-bound op that keeps its float inputs for backward",
                      stacklevel=3)
    return _OTHER


def io_bytes(name: str, kind: str, inputs: Sequence[TensorMeta],
             outputs: Sequence[TensorMeta]) -> tuple[int, int]:
    """(bytes read, bytes written) of one forward call; views and factories move nothing."""
    if kind == "view":
        return 0, 0
    written = sum(o.nbytes for o in outputs)
    if kind == "creation":
        return 0, written
    if kind == "embedding":
        # a lookup reads only the rows it gathers, not the whole table
        idx = sum(m.nbytes for m in inputs if not m.is_float)
        return written + idx, written
    return sum(m.nbytes for m in inputs), written


# ---- properties of op families that the search reads -------------------------------------

# ops that normalize with the statistics of the batch they see while training
_BATCH_STATISTICS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                               "_native_batch_norm_legit_functional"})


def uses_batch_statistics(op: Op) -> bool:
    """Whether ``op`` normalizes with its batch's statistics (batch norm in training mode):
    its result depends on how many samples one device sees at once."""
    return opname(op) in _BATCH_STATISTICS


def is_attention(op: Op) -> bool:
    """Whether ``op`` is scaled-dot-product attention (queries ``(b, heads, s, d)``)."""
    return op.kind == "attention"
