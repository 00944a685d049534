"""The local kernels ``autoplan.sharding.strategy.KERNELS`` names, on one rank's tensors.

Each takes the op (an aten overload), its arguments with local tensors, and the axis ``comm``;
it returns what the strategy's ``local_outputs`` say (a partial sum where they say ``P``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autoplan.runtime import tp_comm

def _schema_index(op: Any, name: str) -> int | None:
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            return i
    return None


def get_arg(op: Any, args: list, kwargs: dict, name: str, default: Any = None) -> Any:
    i = _schema_index(op, name)
    if name in kwargs:
        return kwargs[name]
    if i is not None and i < len(args):
        return args[i]
    return default


def set_arg(op: Any, args: list, kwargs: dict, name: str, value: Any) -> tuple[list, dict]:
    args, kwargs = list(args), dict(kwargs)
    i = _schema_index(op, name)
    if name in kwargs or i is None or i >= len(args):
        kwargs[name] = value
    else:
        args[i] = value
    return args, kwargs


# ---- vocabulary-parallel embedding ---------------------------------------------------------------

def vocab_embedding(op: Any, args: list, kwargs: dict, comm) -> Any:
    """Lookup of this rank's rows of a row-split table; ids of other ranks give zeros (the sum
    over ranks is the whole lookup). Bags sum their rows the same way."""
    weight, ids = args[0], args[1]
    rows = weight.shape[0]
    start = comm.rank * rows
    outside = (ids < start) | (ids >= start + rows)
    local_ids = (ids - start).masked_fill(outside, 0)
    args = [weight, local_ids] + list(args[2:])
    pad = get_arg(op, args, kwargs, "padding_idx", None)
    if pad is not None and pad >= 0:
        args, kwargs = set_arg(op, args, kwargs, "padding_idx",
                            pad - start if start <= pad < start + rows else -1)
    if op._schema.name.endswith("embedding"):
        out = op(*args, **kwargs)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
    # a bag (sum mode): weigh the outside rows by zero
    keep = (~outside).to(weight.dtype)
    args, kwargs = set_arg(op, args, kwargs, "per_sample_weights", keep)
    return op(*args, **kwargs)


# ---- vocabulary-parallel cross entropy -----------------------------------------------------------

class _VocabCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of logits split over the vocabulary (Megatron-LM's
    ``vocab_parallel_cross_entropy``): the row max, the sum of exponentials and the target's
    logit are all-reduced; the gradient is local.

    In place, as Megatron-LM's is: one fp32 copy of the logits shard becomes the softmax kept
    for backward, and backward turns that softmax into the gradient. The logits shard is the
    rank's largest tensor (tokens x vocabulary / tp); out of place, the forward held four fp32
    copies of it at once (the cast, less the row max, its exponentials, the softmax) and
    backward three (measured on the CPU, ``tests/test_emulate.py``)."""

    @staticmethod
    def forward(ctx, logits, target, comm, ignore_index):
        v = logits.shape[-1]
        start = comm.rank * v
        x = logits.to(torch.float32, copy=True)      # a copy even of fp32 logits: x is
        row_max = comm.all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX)   # changed in place
        x.sub_(row_max.unsqueeze(-1))
        outside = (target < start) | (target >= start + v)
        local_t = (target - start).masked_fill(outside, 0)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = comm.all_reduce(picked)
        x.exp_()
        sum_exp = comm.all_reduce(x.sum(dim=-1))
        loss = sum_exp.log() - picked
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        x.div_(sum_exp.unsqueeze(-1))                  # the softmax
        ctx.save_for_backward(x, local_t, outside, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        # the saved softmax becomes the gradient (backward runs once: no retain_graph here)
        grad, local_t, outside, ignored = ctx.saved_tensors
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside)
        grad.mul_(g.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_cross_entropy(op: Any, args: list, kwargs: dict, comm) -> Any:
    logits, target = args[0], args[1]
    reduction = get_arg(op, args, kwargs, "reduction", 1)
    ignore = get_arg(op, args, kwargs, "ignore_index", -100)
    rows = _VocabCrossEntropy.apply(logits, target, comm, ignore)
    # autocast runs cross entropy in fp32 and returns fp32: a bf16 loss would be rounded to
    # 2^-8 of itself
    dtype = logits.dtype if tp_comm.autocast_dtype(logits) is None else torch.float32
    if reduction == 0:
        return rows.to(dtype)
    total = rows.sum()
    if reduction == 2:
        return total.to(dtype)
    return (total / (target != ignore).sum()).to(dtype)


# ---- a norm whose weights came in another dtype than its input ----------------------------------

def norm_in_input_dtype(op: Any, args: list, kwargs: dict) -> Any:
    """A layer or group norm with its weight and bias in its input's dtype. A traced graph
    keeps the casts the model made in fp32 (HF BART casts its positions to the traced dtype),
    so an input can stay fp32 while FSDP's mixed precision hands the norm bf16 weights; CPU
    autocast leaves ``layer_norm`` alone and its kernel refuses the pair. One device runs the
    norm in the input's dtype too (fp32 weights, fp32 input)."""
    x = args[0]
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        def same(a: Any) -> Any:
            return (a.to(x.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                    and a.dtype != x.dtype else a)
        args = [x] + [same(a) for a in args[1:]]
        kwargs = {k: same(v) for k, v in kwargs.items()}
    return op(*args, **kwargs)


# ---- a loss over a split batch (or any element-wise dim) -----------------------------------------

def split_loss(op: Any, args: list, kwargs: dict, comm) -> Any:
    """Sum of the loss over this rank's shard, then sum and count all-reduced and divided (the
    mean over the whole batch, ignored targets excluded, as one device computes it)."""
    reduction = get_arg(op, args, kwargs, "reduction", 1)
    args, kwargs = set_arg(op, args, kwargs, "reduction", 2)
    local_sum = op(*args, **kwargs)
    total = tp_comm.reduce(local_sum, comm)
    if reduction == 2:
        return total
    name = op._schema.name
    if "cross_entropy" in name or "nll_loss" in name:
        ignore = get_arg(op, args, kwargs, "ignore_index", -100)
        count = (args[1] != ignore).sum().to(total.dtype)
    else:
        count = torch.tensor(float(args[0].numel()), dtype=total.dtype, device=total.device)
    count = comm.all_reduce(count)
    return total / count


# ---- batch norm with statistics over a group ------------------------------------------------------

def batch_norm_over(group_comm) -> Callable[..., Any]:
    """A batch norm whose per-channel sum, sum of squares and count are all-reduced over
    ``group_comm`` (every rank normalizes with the whole micro-batch's statistics, and the
    running statistics stay identical across ranks)."""

    def run(op: Any, args: list, kwargs: dict, comm) -> Any:
        x, weight, bias, running_mean, running_var = (list(args) + [None] * 5)[:5]
        training = get_arg(op, args, kwargs, "training", True)
        momentum = get_arg(op, args, kwargs, "momentum", 0.1)
        eps = get_arg(op, args, kwargs, "eps", 1e-5)
        if not training:
            return op(*args, **kwargs)
        dims = [0] + list(range(2, x.dim()))
        c = x.shape[1]
        # statistics in fp32 whatever the input's dtype, as torch's batch norm kernels keep
        # them: E[x^2] - E[x]^2 of a 16-bit input cancels to noise in 16 bits (a bf16 CNN
        # under tp 2 trained 70 % off eager autocast so)
        out_dtype, x = x.dtype, x.float()
        count = torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = tp_comm.reduce_both(stats, group_comm)
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        if running_mean is not None:
            with torch.no_grad():
                m = momentum if momentum is not None else 0.1
                running_mean.mul_(1 - m).add_(mean.detach() * m)
                running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)) * m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + eps)
        if weight is not None:
            y = y * weight.reshape(shape)
        if bias is not None:
            y = y + bias.reshape(shape)
        return y.to(out_dtype)
    return run


# ---- partial sums ------------------------------------------------------------------------------------

def mean_partial(op: Any, args: list, kwargs: dict, comm) -> Any:
    """A mean over a split dim: this rank's mean times its share, a partial sum."""
    return op(*args, **kwargs) / comm.size


def without_bias(op: Any, args: list, kwargs: dict) -> tuple[Any, Any]:
    """The op's output without its bias, and the bias (added after the reduction)."""
    name = op._schema.name.split("::")[-1]
    args = list(args)
    if name in ("addmm", "baddbmm"):
        bias = args[0]
        a, b = args[1], args[2]
        return (torch.matmul(a, b) if name == "addmm" else torch.bmm(a, b)), bias
    bias = args[2]
    args[2] = None
    return op(*args, **kwargs), bias


def add_bias(y: torch.Tensor, bias: torch.Tensor, op: Any) -> torch.Tensor:
    name = op._schema.name.split("::")[-1]
    if "conv" in name:
        return y + bias.reshape([1, -1] + [1] * (y.dim() - 2))
    return y + bias


# ---- Megatron's sequence-parallel linear -----------------------------------------------------

def _product(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ (w.t() if kind == "linear" else w)
    return y if b is None else y + b


def _weight_grad(kind: str, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The weight's gradient of ``_product`` from the 2-D output gradient and input rows."""
    return g2.t() @ x2 if kind == "linear" else x2.t() @ g2


class _SequenceParallelProduct(torch.autograd.Function):
    """``x @ W (+ b)`` on a sequence-split ``x``: gathered for the product, gathered again in
    backward (only the shard is kept), the input gradient reduce-scattered back to shards."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, comm, p, kind):
        ctx.comm, ctx.p, ctx.kind, ctx.has_bias = comm, p, kind, bias is not None
        x = tp_comm.from_rank_major(comm.all_gather(x_shard), p, comm.size)
        dtype = tp_comm.autocast_dtype(x)
        if dtype is not None:
            x, weight_c = x.to(dtype), weight.to(dtype)
            bias_c = bias.to(dtype) if bias is not None else None
        else:
            weight_c, bias_c = weight, bias
        ctx.save_for_backward(x_shard, weight)
        with torch.autocast(x.device.type, enabled=False):
            return _product(kind, x, weight_c, bias_c)

    @staticmethod
    def backward(ctx, g):
        x_shard, weight = ctx.saved_tensors
        comm, p = ctx.comm, ctx.p
        x = tp_comm.from_rank_major(comm.all_gather(x_shard), p, comm.size).to(g.dtype)
        w = weight.to(g.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            full = g @ (w if ctx.kind == "linear" else w.t())
            grad_x = tp_comm.rank_major_reduce_scatter(comm, full, p).to(x_shard.dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(ctx.kind, g2, x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def _product_args(op: Any, args: list, kwargs: dict) -> tuple:
    """(x, weight, bias or None, "linear" | "xw") of a product with a weight."""
    name = op._schema.name.split("::")[-1]
    if name == "linear":
        return args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), "linear"
    if name == "addmm":
        if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            raise RuntimeError(f"{name} with beta/alpha != 1 on a split product")
        return args[1], args[2], args[0], "xw"
    return args[0], args[1], None, "xw"     # mm / matmul with the weight second


def sp_linear(op: Any, args: list, kwargs: dict, comm, p) -> Any:
    x, w, b, kind = _product_args(op, args, kwargs)
    return _SequenceParallelProduct.apply(x, w, b, comm, p, kind)


# ---- a weight stored split over the axis, gathered for the product (FSDP on this axis) --------

class _GatheredWeightProduct(torch.autograd.Function):
    """``x @ W (+ b)`` on rows of ``x`` (a batch or sequence shard) with ``W`` stored split:
    gathered (in the compute precision) for the product, not kept, gathered again in backward;
    its gradient, this rank's partial sum over its rows, reduce-scattered to the shards."""

    @staticmethod
    def forward(ctx, x, w_shard, bias, comm, p, kind):
        ctx.comm, ctx.p, ctx.kind, ctx.has_bias = comm, p, kind, bias is not None
        ctx.dtype = dtype = tp_comm.autocast_dtype(x)
        w = tp_comm.from_rank_major(comm.all_gather(w_shard if dtype is None
                                                    else w_shard.to(dtype)), p, comm.size)
        x_c, bias_c = ((x, bias) if dtype is None else
                       (x.to(dtype), bias.to(dtype) if bias is not None else None))
        ctx.save_for_backward(x, w_shard)
        with torch.autocast(x.device.type, enabled=False):
            return _product(kind, x_c, w, bias_c)

    @staticmethod
    def backward(ctx, g):
        x, w_shard = ctx.saved_tensors
        comm, p = ctx.comm, ctx.p
        shard = w_shard if ctx.dtype is None else w_shard.to(ctx.dtype)
        w = tp_comm.from_rank_major(comm.all_gather(shard), p, comm.size).to(g.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ (w if ctx.kind == "linear" else w.t())).to(x.dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.to(g.dtype).reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[1]:
            full = _weight_grad(ctx.kind, g2, x2).to(w_shard.dtype)
            grad_w = tp_comm.rank_major_reduce_scatter(comm, full, p)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def gathered_weight(op: Any, args: list, kwargs: dict, comm, p) -> Any:
    x, w, b, kind = _product_args(op, args, kwargs)
    return _GatheredWeightProduct.apply(x, w, b, comm, p, kind)


# ---- random ops on a split tensor ---------------------------------------------------------------

# spreads the ranks' seeds apart (Knuth's multiplicative hash constant)
_RANK_STRIDE = 2654435761


def draws_randomness(op: Any, args: list, kwargs: dict) -> bool:
    """Whether this call of a seeded random op (dropout, attention with dropout, bernoulli)
    draws anything: not with probability 0 or outside training."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    for name in ("p", "dropout_p"):
        if _schema_index(op, name) is not None and not get_arg(op, args, kwargs, name, 0.0):
            return False
    return get_arg(op, args, kwargs, "train", True) is not False


def split_random(op: Any, args: list, kwargs: dict, comm) -> Any:
    """A random op (dropout's mask) on this rank's piece of a tensor split on the tensor-parallel
    axis, with randomness of its own. Left to the process's generator, which every rank of the
    axis seeds alike (so that replicated tensors stay identical), each piece would get the same
    mask: head h on one rank dropped exactly where head h + H/t is on the next, one sequence
    chunk where the other is (Megatron-LM's model-parallel RNG tracker exists for this). Here
    one seed is drawn from the process's generator (the same draw on every rank: it stays in
    step for the replicated dropouts), offset by the rank, and the op runs on a generator
    seeded with it, the process's own restored after. The mask depends only on the generator's
    state before the op, which activation checkpointing restores: a recomputed forward draws
    the same mask."""
    if isinstance(comm, tp_comm.ShapeComm) or not draws_randomness(op, args, kwargs):
        return op(*args, **kwargs)          # nothing drawn, or a shape check
    seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    seed = (seed + _RANK_STRIDE * comm.rank) % (2 ** 63 - 1)
    devices = sorted({a.device.index or 0 for a in args
                      if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        return op(*args, **kwargs)


# ---- a gradient scaled on its way back ---------------------------------------------------------

class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` in forward; ``factor`` times its gradient in backward."""
    return _GradScale.apply(x, factor)
