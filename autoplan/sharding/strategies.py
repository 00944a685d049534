"""Sharding strategies per op on the model-parallel ("tp") mesh axis: the one source of truth.

A strategy says, for one op on a ``t``-way axis: the placement each tensor input must have
(parameters included: that is how weights get sharded), the placement of each output, how much
of the op's work each rank does (1/``work_divisor``), the collectives the op itself issues, and
the runtime ``style`` that realizes it on the op's module (the runtime maps each style name to a
PyTorch ``ParallelStyle``; see ``RUNTIME_STYLES``). The data-parallel axis is not here: it
always splits the batch; ZeRO/FSDP decide how it shards weights.

Families (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022;
Alpa, Zheng et al. 2022, for the general per-op space):
- linear / matmul with a weight: ``replicate``; ``colwise`` (weight rows split, output features
  split; backward all-reduces the input gradient); ``colwise_sp`` (input arrives sequence-sharded
  and is all-gathered; backward reduce-scatters); ``rowwise`` (input features split, output
  all-reduced); ``rowwise_sp`` (output reduce-scattered to sequence shards); ``batch`` / ``seq``
  (activations split on batch or sequence, weight replicated: its gradient is all-reduced once
  per step);
- product of two activations (attention scores, attention @ V): split a shared batch-like dim
  (``heads`` for dim 1), or the rows of the first / columns of the second operand;
- scaled-dot-product attention: ``heads`` or ``batch``;
- embedding: ``vocab`` (rows split, output all-reduced), ``vocab_sp`` (reduce-scattered),
  ``embed_dim`` (columns split), ``batch``;
- norms: ``seq`` (sequence parallel) or ``batch`` over tokens; batch norm: ``channel``;
- convolution: ``batch``, ``out_channel``, ``in_channel``;
- loss: ``batch`` or ``vocab`` (loss parallel: a few floats per token all-reduced);
- every other op: ``replicate`` plus the shardings that pass straight through it (pointwise ops
  keep any dim; views, permutes and slices move the sharded dim; reductions over the sharded dim
  end in an all-reduce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from autoplan.graph.opgraph import Op, OpGraph, Value
from autoplan.sharding import dims
from autoplan.sharding.placement import REPLICATE, Placement, shard

# style name -> what the runtime applies to the op's module (PyTorch tensor-parallel API)
RUNTIME_STYLES = {
    "replicate": "no sharding on the tp axis (module replicated)",
    "colwise": "ColwiseParallel()",
    "colwise_sp": "ColwiseParallel(input_layouts=Shard(1))",
    "rowwise": "RowwiseParallel()",
    "rowwise_sp": "RowwiseParallel(output_layouts=Shard(1))",
    "vocab": "RowwiseParallel(input_layouts=Replicate()) on nn.Embedding",
    "vocab_sp": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) on nn.Embedding",
    "embed_dim": "ColwiseParallel(input_layouts=Replicate()) on nn.Embedding",
    "seq": "SequenceParallel()",
    "batch": "inputs split on the batch dim over the tp axis (data-parallel within the group)",
    "loss_parallel": "torch.distributed.tensor.parallel.loss_parallel()",
    "loss_batch": "loss on batch shards, averaged over the tp group (not runnable yet)",
    "out_channel": "convolution output channels split (not runnable yet)",
    "in_channel": "convolution input channels split, output all-reduced (not runnable yet)",
    "channel": "batch-norm channels split (not runnable yet)",
    "local": "no module: runs on local shards",
}


# Styles the runtime (autoplan.runtime) realizes today; the search only picks strategies with
# one of these. Channel splits of convolutions and batch norms are costed (estimate accepts
# them) but wait for a runtime style before the planner may choose them.
RUNNABLE_STYLES = frozenset({"replicate", "colwise", "colwise_sp", "rowwise", "rowwise_sp",
                             "vocab", "vocab_sp", "embed_dim", "seq", "batch", "loss_parallel",
                             "local"})


@dataclass(frozen=True)
class Comm:
    """One collective an op issues on the tp group. ``value`` is the tensor whose full (logical)
    size sets the bytes, times ``scale``. ``phase``: fwd / bwd per micro-batch, or step."""

    kind: str
    value: str
    phase: str
    scale: float = 1.0


@dataclass(frozen=True)
class OpStrategy:
    name: str
    inputs: tuple[Placement, ...]       # one per op.inputs entry (parameters included)
    outputs: tuple[Placement, ...]      # one per op.outputs entry
    work_divisor: int
    comms: tuple[Comm, ...] = ()
    style: str = "local"


def call_args(op: Op) -> tuple[list[Any], dict[str, Any]]:
    d = json.loads(op.args)
    return d["args"], d["kwargs"]


def _opname(op: Op) -> str:
    """The overload packet ("linear" for "aten.linear.default"; higher-order ops as named)."""
    parts = op.target.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def _is_act(v: Value) -> bool:
    return v.kind in ("activation", "input")


def _div(size: int, t: int) -> bool:
    return size >= t and size % t == 0


def _replicate(op: Op) -> OpStrategy:
    return OpStrategy("replicate", tuple(REPLICATE for _ in op.inputs),
                      tuple(REPLICATE for _ in op.outputs), 1, (), "replicate")


def _weight(graph: OpGraph, op: Op) -> int | None:
    for i, n in enumerate(op.inputs):
        v = graph.value(n)
        if v.kind == "param" and len(v.meta.shape) >= 2:
            return i
    return None


def _param_grads(graph: OpGraph, op: Op) -> tuple[Comm, ...]:
    """Replicated weights used on split activations: their gradients are all-reduced per step."""
    return tuple(Comm("all_reduce", n, "step") for n in op.inputs
                 if graph.value(n).kind == "param" and graph.value(n).requires_grad)


def _linear(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    w = _weight(graph, op)
    acts = [i for i, n in enumerate(op.inputs) if _is_act(graph.value(n))]
    if w is None or not acts:
        return _generic(graph, op, t)
    x = acts[0]
    xv, wv = graph.value(op.inputs[x]), graph.value(op.inputs[w])
    out = graph.value(op.outputs[0]).meta
    rank = len(out.shape)
    # linear keeps (out, in); x @ W keeps (in, out)
    out_dim, in_dim = (0, 1) if op.target.startswith("aten.linear") else (1, 0)
    n_out, n_in = wv.meta.shape[out_dim], wv.meta.shape[in_dim]
    res = [_replicate(op)]

    def placements(x_p, w_p, bias_p):
        ps = []
        for i, n in enumerate(op.inputs):
            if i == x:
                ps.append(x_p)
            elif i == w:
                ps.append(w_p)
            else:
                ps.append(bias_p)
        return tuple(ps)
    x_name = op.inputs[x]
    y = op.outputs[0]
    if _div(n_out, t):
        res.append(OpStrategy("colwise", placements(REPLICATE, shard(out_dim), shard(0)),
                              (shard(rank - 1),), t,
                              (Comm("all_reduce", x_name, "bwd"),) if xv.requires_grad else (),
                              "colwise"))
        if rank >= 3 and _div(xv.meta.shape[1], t):
            res.append(OpStrategy("colwise_sp", placements(shard(1), shard(out_dim), shard(0)),
                                  (shard(rank - 1),), t,
                                  (Comm("all_gather", x_name, "fwd"),)
                                  + ((Comm("reduce_scatter", x_name, "bwd"),)
                                     if xv.requires_grad else ()), "colwise_sp"))
    if _div(n_in, t):
        res.append(OpStrategy("rowwise", placements(shard(len(xv.meta.shape) - 1), shard(in_dim),
                                                    REPLICATE),
                              (REPLICATE,), t, (Comm("all_reduce", y, "fwd"),), "rowwise"))
        if rank >= 3 and _div(out.shape[1], t):
            res.append(OpStrategy("rowwise_sp", placements(shard(len(xv.meta.shape) - 1),
                                                           shard(in_dim), REPLICATE),
                                  (shard(1),), t,
                                  (Comm("reduce_scatter", y, "fwd"), Comm("all_gather", y, "bwd")),
                                  "rowwise_sp"))
    grads = _param_grads(graph, op)
    if _div(out.shape[0], t) and rank >= 2:
        res.append(OpStrategy("batch", placements(shard(0), REPLICATE, REPLICATE), (shard(0),), t,
                              grads, "batch"))
    if rank >= 3 and _div(out.shape[1], t):
        res.append(OpStrategy("seq", placements(shard(1), REPLICATE, REPLICATE), (shard(1),), t,
                              grads, "seq"))
    return res


def _act_matmul(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Product of two activations (batched): split a shared leading dim, rows, or columns."""
    a, b = (graph.value(n).meta for n in op.inputs[:2])
    out = graph.value(op.outputs[0]).meta
    res = [_replicate(op)]
    r = len(out.shape)
    if len(a.shape) != r or len(b.shape) != r or r < 2:
        return res
    for d in range(r - 2):
        if a.shape[d] == b.shape[d] and _div(out.shape[d], t):
            res.append(OpStrategy("heads" if d == 1 else ("batch" if d == 0 else f"dim{d}"),
                                  (shard(d), shard(d)), (shard(d),), t))
    if _div(out.shape[r - 2], t):
        res.append(OpStrategy("rows", (shard(r - 2), REPLICATE), (shard(r - 2),), t))
    if _div(out.shape[r - 1], t):
        res.append(OpStrategy("cols", (REPLICATE, shard(r - 1)), (shard(r - 1),), t))
    return res


def _attention(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    q = graph.value(op.inputs[0]).meta
    res = [_replicate(op)]
    for d, name in ((0, "batch"), (1, "heads")):
        if len(q.shape) == 4 and _div(q.shape[d], t) and all(
                graph.value(n).meta.shape[d] == q.shape[d] for n in op.inputs[:3]):
            ins = tuple(shard(d) if i < 3 else REPLICATE for i in range(len(op.inputs)))
            res.append(OpStrategy(name, ins, tuple(shard(d) for _ in op.outputs), t))
    return res


def _embedding(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    w = next((i for i, n in enumerate(op.inputs) if graph.value(n).kind == "param"), None)
    if w is None:
        return _generic(graph, op, t)
    wv = graph.value(op.inputs[w])
    out = graph.value(op.outputs[0]).meta
    y = op.outputs[0]
    rank = len(out.shape)

    def ps(w_p, idx_p):
        return tuple(w_p if i == w else idx_p for i in range(len(op.inputs)))
    res = [_replicate(op)]
    if _div(wv.meta.shape[0], t):
        res.append(OpStrategy("vocab", ps(shard(0), REPLICATE), (REPLICATE,), t,
                              (Comm("all_reduce", y, "fwd"),), "vocab"))
        if rank >= 3 and _div(out.shape[1], t):
            res.append(OpStrategy("vocab_sp", ps(shard(0), REPLICATE), (shard(1),), t,
                                  (Comm("reduce_scatter", y, "fwd"), Comm("all_gather", y, "bwd")),
                                  "vocab_sp"))
    if _div(wv.meta.shape[1], t):
        res.append(OpStrategy("embed_dim", ps(shard(1), REPLICATE), (shard(rank - 1),), t, (),
                              "embed_dim"))
    if _div(out.shape[0], t):
        res.append(OpStrategy("batch", ps(REPLICATE, shard(0)), (shard(0),), t,
                              _param_grads(graph, op), "batch"))
    return res


def _norm(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    x = graph.value(op.inputs[0]).meta
    out_meta = graph.value(op.outputs[0]).meta
    res = [_replicate(op)]
    grads = _param_grads(graph, op)
    channel_norm = op.target.startswith("aten.batch_norm")
    token_dims = [0, 1] if len(x.shape) >= 3 and not channel_norm else [0]
    for d in token_dims:
        if not _div(x.shape[d], t):
            continue
        ins = tuple(shard(d) if _is_act(graph.value(n)) else REPLICATE for n in op.inputs)
        outs = tuple(shard(d) if graph.value(n).meta.shape == out_meta.shape else REPLICATE
                     for n in op.outputs)
        comms = grads
        if channel_norm:   # batch statistics over a split batch: synchronized (SyncBatchNorm)
            comms = comms + (Comm("all_reduce", op.outputs[0], "fwd", 2.0 / max(x.numel / x.shape[1], 1)),)
        res.append(OpStrategy("seq" if d == 1 else "batch", ins, outs, t, comms,
                              "seq" if d == 1 else "batch"))
    if channel_norm and len(x.shape) >= 2 and _div(x.shape[1], t):
        ins = tuple(shard(1) if _is_act(graph.value(n)) else
                    (shard(0) if len(graph.value(n).meta.shape) == 1 else REPLICATE)
                    for n in op.inputs)
        outs = tuple(shard(1) if graph.value(n).meta.shape == out_meta.shape else shard(0)
                     for n in op.outputs)
        res.append(OpStrategy("channel", ins, outs, t, (), "channel"))
    return res


def _conv(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    x, w = (graph.value(n).meta for n in op.inputs[:2])
    out = graph.value(op.outputs[0]).meta
    args, kwargs = call_args(op)
    groups = kwargs.get("groups", args[-1] if args and isinstance(args[-1], int) else 1)
    res = [_replicate(op)]
    extra = len(op.inputs) - 2
    xn = op.inputs[0]
    if _div(out.shape[0], t):
        res.append(OpStrategy("batch", (shard(0), REPLICATE) + (REPLICATE,) * extra, (shard(0),),
                              t, _param_grads(graph, op), "batch"))
    if groups == 1 and _div(w.shape[0], t):
        res.append(OpStrategy("out_channel", (REPLICATE, shard(0)) + (shard(0),) * extra,
                              (shard(1),), t,
                              (Comm("all_reduce", xn, "bwd"),)
                              if graph.value(xn).requires_grad else (), "out_channel"))
    if groups == 1 and _div(w.shape[1], t):
        res.append(OpStrategy("in_channel", (shard(1), shard(1)) + (REPLICATE,) * extra,
                              (REPLICATE,), t, (Comm("all_reduce", op.outputs[0], "fwd"),),
                              "in_channel"))
    return res


def _loss(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    logits = graph.value(op.inputs[0]).meta
    res = [_replicate(op)]
    out = op.outputs[0]
    if _div(logits.shape[0], t) and all(graph.value(n).meta.shape[:1] == logits.shape[:1]
                                        for n in op.inputs):
        res.append(OpStrategy("batch", tuple(shard(0) for _ in op.inputs), (REPLICATE,), t,
                              (Comm("all_reduce", out, "fwd"),), "loss_batch"))
    if op.target.startswith("aten.cross_entropy_loss") and len(logits.shape) == 2 \
            and _div(logits.shape[1], t):
        # loss parallel: per token, the max, the sum of exponentials and the target logit
        scale = 3.0 / logits.shape[1]
        res.append(OpStrategy("vocab", (shard(1),) + (REPLICATE,) * (len(op.inputs) - 1),
                              (REPLICATE,), t,
                              (Comm("all_reduce", op.inputs[0], "fwd", scale),), "loss_parallel"))
    return res


# ---- ops that pass a sharding through: pointwise, views, reductions -----------------------------

def _map_through(graph: OpGraph, op: Op, d: int, t: int) -> tuple[int | None, str]:
    """Output dim a sharded dim ``d`` of the op's first input lands on (None: cannot)."""
    x = graph.value(op.inputs[0]).meta
    out = graph.value(op.outputs[0]).meta
    name = _opname(op)
    args, kwargs = call_args(op)
    rank = len(x.shape)
    if name in ("view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten",
                "unflatten", "expand", "expand_as", "view_as", "_reshape_alias"):
        if name.startswith("expand"):
            return (d + len(out.shape) - rank if x.shape[d] == out.shape[d + len(out.shape) - rank]
                    else None), "view"
        return dims.reshape_dim(x.shape, out.shape, d, t), "view"
    if name in ("transpose", "swapaxes"):
        return dims.transpose_dim(rank, args[1], args[2], d), "view"
    if name == "t":
        return dims.transpose_dim(rank, 0, 1, d) if rank == 2 else d, "view"
    if name == "permute":
        return dims.permute_dim(args[1], d), "view"
    if name in ("split", "split_with_sizes", "chunk", "slice", "narrow", "select", "unbind"):
        axis = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        axis = axis % rank
        if d == axis:
            return None, "view"
        if name in ("select", "unbind"):
            return (d - 1 if d > axis else d), "view"
        return d, "view"
    if name == "repeat_interleave":   # grouped-query attention: kv heads repeated in place
        return (d if x.shape[d] % t == 0 else None), "view"
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "flip", "roll"):
        axis = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if isinstance(axis, list):
            axis = axis[0] if axis else 0
        return (None if d == axis % rank else d), "pointwise"
    if name in ("sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp", "max", "min",
                "argmax", "prod", "var_mean"):
        dims_arg = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dims_arg, int):
            dims_arg = [dims_arg]
        keep = (args[2] if len(args) > 2 and isinstance(args[2], bool) else
                kwargs.get("keepdim", False))
        r = dims.reduced_dim(rank, dims_arg or [], keep, d)
        return r, ("reduce_partial" if r is None else "pointwise")
    if x.shape == out.shape or len(op.outputs) == 1 and out.shape == x.shape:
        return d, "pointwise"
    if len(out.shape) == rank and all(a == b or b == 1 or a == 1 for a, b in zip(x.shape, out.shape)):
        return (d if out.shape[d] == x.shape[d] else None), "pointwise"
    return None, "none"


def _generic(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Replicate, plus every input sharding the op carries through to its output."""
    res = [_replicate(op)]
    if not op.outputs or not op.inputs:
        return res
    outs = [graph.value(n).meta for n in op.outputs]
    acts = [i for i, n in enumerate(op.inputs) if _is_act(graph.value(n))]
    if not acts:
        return res
    if op.kind == "pointwise" or op.kind == "dropout" or (op.kind == "copy" and len(acts) > 1):
        # element-wise over a broadcast output: any output dim; inputs follow by broadcasting
        out = outs[0]
        if _opname(op) in ("cat", "stack"):
            return res + _concat(graph, op, t)
        mapped = {}
        for d in range(len(out.shape)):
            if not _div(out.shape[d], t):
                continue
            if _opname(op) in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
                if _map_through(graph, op, d, t)[0] is None:
                    continue
            ins = []
            for n in op.inputs:
                m = graph.value(n).meta
                bd = dims.broadcast_dim(m.shape, out.shape, d)
                ins.append(shard(bd) if bd is not None else REPLICATE)
            mapped[d] = OpStrategy(f"shard{d}", tuple(ins),
                                   tuple(shard(d) if o.shape == out.shape else REPLICATE
                                         for o in outs), t)
        return res + list(mapped.values())
    # single-activation-input shape changers and reductions
    x = graph.value(op.inputs[acts[0]]).meta
    for d in range(len(x.shape)):
        if not _div(x.shape[d], t):
            continue
        od, how = _map_through(graph, op, d, t)
        ins = tuple(shard(d) if i == acts[0] else REPLICATE for i in range(len(op.inputs)))
        if how == "reduce_partial":
            res.append(OpStrategy(f"shard{d}", ins, tuple(REPLICATE for _ in op.outputs), t,
                                  (Comm("all_reduce", op.outputs[0], "fwd"),)))
            continue
        if od is None:
            continue
        outp = []
        for o in outs:
            outp.append(shard(od) if od < len(o.shape) and _div(o.shape[od], t) else REPLICATE)
        divisor = t if op.kind not in ("view",) else 1
        res.append(OpStrategy(f"shard{d}", ins, tuple(outp), divisor))
    return res


def _concat(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    args, kwargs = call_args(op)
    out = graph.value(op.outputs[0]).meta
    axis = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(out.shape)
    res = []
    for d in range(len(out.shape)):
        if d == axis or not _div(out.shape[d], t):
            continue
        ins = tuple(shard(d) if len(graph.value(n).meta.shape) == len(out.shape) else REPLICATE
                    for n in op.inputs)
        res.append(OpStrategy(f"shard{d}", ins, (shard(d),), t))
    return res


def strategies(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """All strategies of ``op`` on a ``t``-way axis; the first is always ``replicate``."""
    if t == 1 or not op.outputs:
        return [_replicate(op)]
    if op.kind == "creation":
        return [_replicate(op)]
    if op.kind == "matmul":
        if _weight(graph, op) is not None:
            return _linear(graph, op, t)
        return _act_matmul(graph, op, t)
    if op.kind == "attention":
        return _attention(graph, op, t)
    if op.kind == "embedding":
        return _embedding(graph, op, t)
    if op.kind == "norm":
        return _norm(graph, op, t)
    if op.kind == "conv":
        return _conv(graph, op, t)
    if op.kind == "loss":
        return _loss(graph, op, t)
    return _generic(graph, op, t)


__all__ = ["Comm", "OpStrategy", "RUNNABLE_STYLES", "RUNTIME_STYLES", "call_args", "strategies"]
