"""Sharding strategies per op on one ``t``-way mesh axis: the one source of truth for what the
planner may choose and the runtime runs, and the rules of the op families not defined
elsewhere.

``strategies(graph, op, t)`` lists an op's strategies (``strategy.OpStrategy``), the first always
``replicate``, from the op's rule in the registry (``registry.py``: each rule registered beside
its definition with ``@register_op_strategy(names)``, the ops known by a property through
``register_fallback``). An op no rule knows is only replicated (with the one-time warning the
tracer gave for it), never guessed. Families (Megatron-LM, Shoeybi et al. 2019; sequence
parallelism, Korthikanti et al. 2022; Alpa, Zheng et al. 2022, for the general per-op space):

- every matmul-like op (linear, addmm, mm, bmm, baddbmm, matmul, einsum, the experts' grouped
  product): one einsum rule, ``products.py``;
- scaled-dot-product attention: ``heads`` or ``batch`` (a mask follows where it has that dim),
  or ``seq``: context parallelism, the sequence split and key/value blocks passed around the
  ring (kernel ``ring_attention``);
- embedding: ``vocab`` (rows split, a partial sum reduced), ``vocab_sp``, ``embed_dim``
  (columns split), ``batch``, ``seq``;
- norms: split over any token dim (``seq``, ``batch``), weights replicated; batch norm:
  ``channel``, or ``batch`` with synchronized statistics;
- convolution: ``batch``, ``out_channel``, ``in_channel`` (partial output reduced);
- losses: ``batch`` (or any element-wise dim: sum and count all-reduced), ``vocab`` (loss
  parallel cross entropy);
- element-wise ops, views, copies, reductions: ``passthrough`` (registered in
  ``carry_rules.py``).

These rules live here; a new family is a function registered with ``register_op_strategy``
(in a module ``strategies`` imports), and a kernel it needs is declared with
``registry.declare_kernel`` and implemented under the same name in
``runtime/program_calls.py`` (``register_kernel``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding import carry_rules, products  # noqa: F401  (their rules register)
from autoplan.sharding.placement import PARTIAL, REPLICATE, Placement, local_size, shard
from autoplan.sharding.products import divides, is_activation, merged_rows, row_splits, seq_dim
from autoplan.sharding.registry import (KERNELS, declare_kernel, fallbacks, register_op_strategy,
                                        rule_for)
from autoplan.sharding.strategy import (BIAS_AFTER_REDUCE, Comm, OpStrategy, call_args, make,
                                        opname, replicate)
from autoplan.graph.analysis import analyze

SPLIT_LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "mse_loss", "l1_loss",
                          "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
                          "binary_cross_entropy"})
ELEMENTWISE_LOSSES = SPLIT_LOSSES - {"cross_entropy_loss", "nll_loss"}

RING_ATTENTION = declare_kernel(
    "ring_attention", "attention over a sequence split across the ranks: key/value blocks "
    "passed around the ring while each block's attention runs, outputs merged by log-sum-exp "
    "(context parallelism)")
VOCAB_EMBEDDING = declare_kernel(
    "vocab_embedding", "lookup of the rank's vocabulary rows, other ids masked to zero (a "
    "partial sum over the vocabulary shards)")
SYNC_BATCH_NORM = declare_kernel(
    "sync_batch_norm", "batch norm with per-channel sum, sum of squares and count all-reduced")
SPLIT_LOSS = declare_kernel(
    "split_loss", "loss summed on the rank's shard, sum and count all-reduced, then divided")
VOCAB_CROSS_ENTROPY = declare_kernel(
    "vocab_cross_entropy", "cross entropy over vocabulary-sharded logits: max, sum of "
    "exponentials and target logit all-reduced per row")


# ---- attention, embedding, norms, convolution ------------------------------------------------

@register_op_strategy("scaled_dot_product_attention")
def _attention(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """scaled_dot_product_attention(q, k, v, attn_mask?): batch or heads; a mask follows where
    it has that dim and broadcasts (stays whole) where it has size 1."""
    if len(op.inputs) < 3:
        return []
    q = graph.value(op.inputs[0]).meta.shape
    if len(q) != 4:
        return []
    res = []
    for d, name in ((0, "batch"), (1, "heads")):
        if not divides(q[d], t) or any(graph.value(n).meta.shape[d] != q[d]
                                    for n in op.inputs[1:3]):
            continue
        ins = []
        for i, n in enumerate(op.inputs):
            m = graph.value(n).meta.shape
            if i < 3:
                ins.append(shard(d))
                continue
            k = d - (4 - len(m))
            ins.append(shard(k) if 0 <= k < len(m) and m[k] == q[d] else REPLICATE)
        res.append(make(graph, op, name, tuple(ins), tuple(shard(d) for _ in op.outputs), t,
                        style=name))
    ring = _ring_attention(graph, op, t)
    return res + ([ring] if ring is not None else [])


def _ring_attention(graph: OpGraph, op: Op, t: int) -> OpStrategy | None:
    """Context parallelism: queries, keys and values split on the sequence (dim 2), the
    key/value blocks circulated around the ring (kernel ``ring_attention``); a mask keeps its
    rows' split and all its columns. Self-attention lengths, no dropout, no implicit GQA."""
    shapes = [graph.value(n).meta.shape for n in op.inputs[:3]]
    if len(op.inputs) > 4 or any(len(s) != 4 for s in shapes) or t == 1:
        return None
    s_len = shapes[0][2]
    if any(s[2] != s_len for s in shapes[1:]) or not divides(s_len, t):
        return None
    args, kwargs = call_args(op)
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    if dropout or kwargs.get("enable_gqa") or (len(args) > 3 and not isinstance(args[3], dict)
                                               and args[3] is not None):
        return None
    ins = [shard(2)] * 3
    if len(op.inputs) == 4:
        m = graph.value(op.inputs[3]).meta.shape
        # a learned mask (T5's relative position bias) would need its gradient, which the ring's
        # kernels do not give
        if len(m) < 2 or m[-1] != s_len or graph.value(op.inputs[3]).requires_grad:
            return None
        ins.append(shard(len(m) - 2) if m[-2] == s_len else REPLICATE)
    k, v = op.inputs[1], op.inputs[2]
    # every rank receives the other t - 1 key/value blocks (an all-gather's bytes) forward,
    # again backward, and their gradients travel home (a reduce-scatter's)
    ring = tuple(Comm(kind, n, phase) for n in (k, v)
                 for kind, phase in (("all_gather", "fwd"), ("all_gather", "bwd"),
                                     ("reduce_scatter", "bwd")))
    return make(graph, op, "seq", tuple(ins), tuple(shard(2) for _ in op.outputs), t,
                style="context", kernel=RING_ATTENTION, extra=ring)


@register_op_strategy("embedding", "embedding_bag", "_embedding_bag")
def _embedding(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    w = next((i for i, n in enumerate(op.inputs) if graph.value(n).kind == "param"), None)
    if w is None or w != 0 or len(op.inputs) < 2:
        return []
    wm = graph.value(op.inputs[0]).meta.shape
    idx = graph.value(op.inputs[1]).meta.shape
    out = graph.value(op.outputs[0]).meta.shape
    rank = len(out)
    name = opname(op)
    bag = name != "embedding"
    if bag:
        args, kwargs = call_args(op)
        mode = args[4] if len(args) > 4 else kwargs.get("mode", 0)
        if mode != 0 or len(op.inputs) > 3:      # sum bags only, no per-sample weights
            return []

    def ps(w_p: Placement, idx_p: Placement) -> tuple[Placement, ...]:
        return tuple(w_p if i == 0 else idx_p if i == 1 else REPLICATE
                     for i in range(len(op.inputs)))
    outs = len(op.outputs)
    res = []
    if divides(wm[0], t):
        res.append(make(graph, op, "vocab", ps(shard(0), REPLICATE), (REPLICATE,) * outs, t,
                        style="vocab", kernel=VOCAB_EMBEDDING,
                        local_outputs=(PARTIAL,) + (REPLICATE,) * (outs - 1)))
        sp = seq_dim(out)
        if not bag and rank >= 2 and divides(out[sp], t):
            res.append(make(graph, op, "vocab_sp", ps(shard(0), REPLICATE), (shard(sp),), t,
                            style="vocab_sp", kernel=VOCAB_EMBEDDING,
                            local_outputs=(PARTIAL,)))
    if divides(wm[1], t):
        res.append(make(graph, op, "embed_dim", ps(shard(1), REPLICATE),
                        (shard(rank - 1),) + (REPLICATE,) * (outs - 1), t, style="embed_dim"))
    if not bag:
        for d, label in ((0, "batch"), (1, "seq")):
            if d < len(idx) and d < rank - 1 and divides(out[d], t):
                res.append(make(graph, op, label, ps(REPLICATE, shard(d)), (shard(d),), t,
                                style=label))
    return res


@register_op_strategy("layer_norm", "rms_norm", "batch_norm", "group_norm")
def _norm(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    name = opname(op)
    x = graph.value(op.inputs[0]).meta.shape
    args, kwargs = call_args(op)
    if name in ("layer_norm", "rms_norm"):
        normalized = args[1] if len(args) > 1 else kwargs.get("normalized_shape", [])
        token_dims = range(len(x) - len(normalized))
    elif name == "batch_norm":
        return _batch_norm(graph, op, t, x)
    else:                                       # group norm: statistics over channel groups
        token_dims = range(1)
    res = []
    for d in token_dims:
        if not divides(x[d], t):
            continue
        ins = tuple(shard(d) if is_activation(graph.value(n)) else REPLICATE for n in op.inputs)
        outs = tuple(shard(d) if graph.value(n).meta.shape == x else REPLICATE
                     for n in op.outputs)
        label = "seq" if d == 1 else "batch" if d == 0 else f"shard{d}"
        res.append(make(graph, op, label, ins, outs, t, style=label))
    return res


def _batch_norm(graph: OpGraph, op: Op, t: int, x: tuple[int, ...]) -> list[OpStrategy]:
    """aten.batch_norm(x, weight, bias, running_mean, running_var, training, ...)."""
    res = []
    if len(x) >= 2 and divides(x[1], t):
        ins = tuple(shard(1) if is_activation(graph.value(n)) else shard(0) for n in op.inputs)
        outs = tuple(shard(1) if graph.value(n).meta.shape == x else shard(0)
                     for n in op.outputs)
        res.append(make(graph, op, "channel", ins, outs, t, style="channel"))
    if divides(x[0], t):
        ins = tuple(shard(0) if is_activation(graph.value(n)) else REPLICATE for n in op.inputs)
        outs = tuple(shard(0) if graph.value(n).meta.shape == x else REPLICATE
                     for n in op.outputs)
        per_channel = 2.0 * x[1] / max(1, _numel(x)) if len(x) > 1 else 1.0
        stats = (Comm("all_reduce", op.outputs[0], "fwd", per_channel),
                 Comm("all_reduce", op.outputs[0], "bwd", per_channel))
        res.append(make(graph, op, "batch", ins, outs, t, style="batch",
                        kernel=SYNC_BATCH_NORM, local_outputs=outs, extra=stats))
    return res


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@register_op_strategy("convolution", "conv1d", "conv2d", "conv3d", "_convolution")
def _conv(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """conv{1,2,3}d(x, w, b, stride, padding, dilation, groups) / convolution(..., transposed,
    output_padding, groups)."""
    if len(op.inputs) < 2:
        return []
    x, w = (graph.value(n).meta.shape for n in op.inputs[:2])
    out = graph.value(op.outputs[0]).meta.shape
    args, kwargs = call_args(op)
    name = opname(op)
    if name in ("convolution", "_convolution"):
        transposed = args[6] if len(args) > 6 else kwargs.get("transposed", False)
        groups = args[8] if len(args) > 8 else kwargs.get("groups", 1)
    else:
        transposed = False
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    b = 2 if len(op.inputs) > 2 else None
    extra = len(op.inputs) - 2
    res = []
    if divides(out[0], t):
        res.append(make(graph, op, "batch", (shard(0), REPLICATE) + (REPLICATE,) * extra,
                        (shard(0),), t, style="batch"))
    if groups != 1 or transposed:
        return res
    if divides(w[0], t):
        res.append(make(graph, op, "out_channel", (REPLICATE, shard(0)) + (shard(0),) * extra,
                        (shard(1),), t, style="out_channel"))
    if divides(w[1], t) and divides(x[1], t):
        res.append(make(graph, op, "in_channel", (shard(1), shard(1)) + (REPLICATE,) * extra,
                        (REPLICATE,), t, style="in_channel",
                        kernel=BIAS_AFTER_REDUCE if b is not None else "",
                        local_outputs=(PARTIAL,)))
    return res


# ---- losses ------------------------------------------------------------------------------------

def _row_losses(graph: OpGraph, op: Op, t: int, rows: int, merged: tuple[int, int] | None,
                reduced: bool) -> list[OpStrategy]:
    """A loss split over its rows (``row_splits``): summed on each rank's rows, sum and count
    all-reduced (``split_loss``), or per row."""
    out = []
    for label, p in row_splits(rows, merged, t):
        ins = tuple(p for _ in op.inputs)
        if reduced:
            out.append(make(graph, op, label, ins, (REPLICATE,), t, style="loss_batch",
                            kernel=SPLIT_LOSS,
                            extra=(Comm("all_reduce", op.outputs[0], "fwd", 2.0),)))
        else:
            out.append(make(graph, op, label, ins, (p,), t, style="loss_batch"))
    return out


@register_op_strategy("cross_entropy_loss", "nll_loss", "mse_loss",
                      "binary_cross_entropy_with_logits")
def _loss(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    name = opname(op)
    if name not in SPLIT_LOSSES:
        return []
    args, kwargs = call_args(op)
    x = graph.value(op.inputs[0]).meta.shape
    out = graph.value(op.outputs[0]).meta.shape
    reduced = len(out) == 0
    res = []
    tensors = [graph.value(n).meta.shape for n in op.inputs]
    if name in ELEMENTWISE_LOSSES:
        dims_ok = range(len(x)) if all(s == x for s in tensors[:2]) and len(tensors) <= 2 \
            else ()
    else:                   # (N, C, ...) logits with (N, ...) targets: split the samples
        weight = args[2] if len(args) > 2 else kwargs.get("weight")
        dims_ok = range(1) if weight is None and len(op.inputs) == 2 and x and \
            tensors[1][:1] == x[:1] else ()
    if name not in ELEMENTWISE_LOSSES and dims_ok:
        # (N, C) logits: the rows split, by samples or (rows merged from (b, s)) positions
        merged = {merged_rows(graph, n) for n in op.inputs}
        res += _row_losses(graph, op, t, x[0], merged.pop() if len(merged) == 1 else None,
                           reduced)
        dims_ok = ()
    for d in dims_ok:
        if not divides(x[d], t):
            continue
        ins = tuple(shard(d) for _ in op.inputs)
        label = "batch" if d == 0 else f"shard{d}"
        if reduced:
            res.append(make(graph, op, label, ins, (REPLICATE,), t, style="loss_batch",
                            kernel=SPLIT_LOSS,
                            extra=(Comm("all_reduce", op.outputs[0], "fwd", 2.0),)))
        elif out == x or (name not in ELEMENTWISE_LOSSES and out == x[:1]):
            res.append(make(graph, op, label, ins, (shard(d),), t, style="loss_batch"))
    smoothing = args[5] if len(args) > 5 else kwargs.get("label_smoothing", 0.0)
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    if name == "cross_entropy_loss" and len(x) == 2 and divides(x[1], t) and weight is None \
            and not smoothing and len(op.inputs) == 2 and len(tensors[1]) == 1:
        # loss parallel: per row, the max, the sum of exponentials and the target logit
        scale = 3.0 / x[1]
        res.append(make(graph, op, "vocab", (shard(1), REPLICATE),
                        (REPLICATE,) if reduced else (REPLICATE,), t, style="loss_parallel",
                        kernel=VOCAB_CROSS_ENTROPY,
                        extra=(Comm("all_reduce", op.inputs[0], "fwd", scale),)))
    return res


# ---- dispatch ----------------------------------------------------------------------------------

def _shaped(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Every strategy whose input and output placements split evenly: the op's registered
    rule (``registry``), else the first fallback that claims it, else none."""
    if op.kind == "creation" or not op.outputs:
        return []
    rule = rule_for(op)
    if rule is not None:
        return rule(graph, op, t)
    for fallback in fallbacks():
        found = fallback(graph, op, t)
        if found is not None:
            return found
    return []


def strategies(graph: OpGraph, op: Op, t: int, *, micro_batch: int | None = None
               ) -> list[OpStrategy]:
    """All strategies of ``op`` on a ``t``-way axis; the first is always ``replicate``.

    With ``micro_batch``, a strategy that splits a dim growing with the batch must split it
    evenly at that micro-batch size too (the graph was traced at ``graph.batch_size``)."""
    # the planner asks again for every mesh, micro-batch and baseline: derive them once per
    # graph (they depend on the op and t only; the values are frozen)
    cache = graph.__dict__.setdefault("_autoplan_strategies", {})
    key = (op.name, t if op.outputs else 1)
    found = cache.get(key)
    if found is None:
        found = cache[key] = (replicate(op), *_derived(graph, op, t))
    if micro_batch is not None and micro_batch != graph.batch_size and len(found) > 1:
        return [found[0], *(s for s in found[1:] if _even_at(graph, op, s, t, micro_batch))]
    return list(found)


def _derived(graph: OpGraph, op: Op, t: int) -> tuple[OpStrategy, ...]:
    """The strategies beside ``replicate``."""
    if t == 1 or not op.outputs:
        return ()
    found = _from_first_layer(graph, op, t)
    if found is not None:
        return found
    try:
        return tuple(_shaped(graph, op, t))
    except (TypeError, ValueError, IndexError, KeyError, AttributeError,
            ZeroDivisionError) as e:
        # arguments no rule expects (a graph read from a hand-edited file): replicated
        _warn_once(op, e)
        return ()


def strategies_by_name(graph: OpGraph, op: Op, t: int) -> Mapping[str, OpStrategy]:
    """``strategies(graph, op, t)`` by name (made once per graph, op and t; read-only): how a
    plan file's strategy names turn back into strategies."""
    cache = graph.__dict__.setdefault("_autoplan_strategies_by_name", {})
    key = (op.name, t)
    named = cache.get(key)
    if named is None:
        named = cache[key] = MappingProxyType({s.name: s for s in strategies(graph, op, t)})
    return named


def _rebind(s: OpStrategy, rep: Op, op: Op) -> OpStrategy | None:
    """Strategy ``s`` of ``rep`` for ``op``, the op at the same place in another instance of a
    repeated block: the same placements, with its collectives on ``op``'s own values (None when
    a collective's value is not one of ``rep``'s inputs or outputs)."""
    if not s.comms:
        return s
    if (len(rep.inputs), len(rep.outputs)) != (len(op.inputs), len(op.outputs)):
        return None
    names = {**dict(zip(rep.inputs, op.inputs)), **dict(zip(rep.outputs, op.outputs))}
    if not all(c.value in names for c in s.comms):
        return None
    return replace(s, comms=tuple(replace(c, value=names[c.value]) for c in s.comms))


def _from_first_layer(graph: OpGraph, op: Op, t: int) -> tuple[OpStrategy, ...] | None:
    """The strategies of ``op`` from those of its counterpart in the first instance of its
    repeated block (same targets, shapes, parameters and call arguments: the rules would derive
    the same), or None where it has none or they differ. A 96-layer model derives one layer."""
    rep = _first_layer_ops(graph).get(op.name)
    if rep is None or _call(graph, rep) != _call(graph, op):
        return None
    out = []
    for s in strategies(graph, rep, t)[1:]:
        r = _rebind(s, rep, op)
        if r is None:
            return None
        out.append(r)
    return tuple(out)


def _first_layer_ops(graph: OpGraph) -> dict[str, Op]:
    """Op name -> its counterpart in the first instance of its block (later instances only)."""
    table = graph.__dict__.get("_autoplan_first_layer_ops")
    if table is None:
        table = {}
        for block in graph.blocks:
            first = block.instances[0]
            for inst in block.instances[1:]:
                if inst.stop - inst.start != first.stop - first.start:
                    continue
                for k in range(inst.stop - inst.start):
                    table[graph.ops[inst.start + k].name] = graph.ops[first.start + k]
        graph.__dict__["_autoplan_first_layer_ops"] = table
    return table


def _call(graph: OpGraph, op: Op) -> Any:
    """The op's call with its tensors as positions (``{"v": name}`` -> its input index), read
    once per graph and op."""
    cache = graph.__dict__.setdefault("_autoplan_calls", {})
    found = cache.get(op.name)
    if found is None:
        found = cache[op.name] = _read_call(op)
    return found


def _read_call(op: Op) -> Any:
    where = {n: k for k, n in enumerate(op.inputs)}

    def norm(a: Any) -> Any:
        if isinstance(a, dict):
            if set(a) == {"v"}:
                return ("v", where.get(a["v"], "?"))
            if set(a) == {"node"}:
                return ("node",)
            return {k: norm(v) for k, v in a.items()}
        if isinstance(a, list):
            return [norm(x) for x in a]
        return a
    return (op.target, norm(json.loads(op.args)))


_warned: set[str] = set()


def _warn_once(op: Op, e: Exception) -> None:
    import warnings
    if op.target not in _warned:
        _warned.add(op.target)
        warnings.warn(f"the sharding rules cannot read op {op.name} ({op.target}): "
                      f"{type(e).__name__}: {e}; it runs replicated", stacklevel=3)


def _even_at(graph: OpGraph, op: Op, s: OpStrategy, t: int, micro_batch: int) -> bool:
    """Whether every split of ``s`` stays even when dims that are multiples of the traced batch
    scale to ``micro_batch``."""
    dependent = analyze(graph).batch_dependent
    B = graph.batch_size
    for names, ps in ((op.inputs, s.inputs), (op.outputs, s.outputs)):
        for n, p in zip(names, ps):
            if p.kind != "S" or n not in dependent:
                continue
            size = graph.value(n).meta.shape[p.dim]
            if size % B == 0 and local_size(size // B * micro_batch, p, t) is None:
                return False
    return True


__all__ = ["Comm", "KERNELS", "OpStrategy", "call_args", "strategies"]
