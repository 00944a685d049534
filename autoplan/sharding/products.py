"""Strategies of the products on one ``t``-way mesh axis (``strategies.py`` dispatches to them),
and the helpers the other rules share: a product with a weight (linear, HF ``Conv1D``'s addmm,
``x @ W``), a product of two activations (bmm, matmul), the experts' grouped product."""

from __future__ import annotations

from autoplan.graph.opgraph import Op, OpGraph, Value
from autoplan.sharding.blocks import block_counts
from autoplan.sharding.placement import PARTIAL, REPLICATE, Placement, shard
from autoplan.sharding.strategy import Comm, OpStrategy, bias_slot, make, opname


def _is_act(v: Value) -> bool:
    return v.kind in ("activation", "input")


def _div(size: int, t: int, blocks: int = 1) -> bool:
    return size >= t * blocks and size % (t * blocks) == 0


def _weight(graph: OpGraph, op: Op) -> int | None:
    for i, n in enumerate(op.inputs):
        v = graph.value(n)
        if v.kind == "param" and len(v.meta.shape) >= 2:
            return i
    return None


def _blocks(graph: OpGraph):
    counts = block_counts(graph)
    return lambda value, d: counts.get((value, d), ())


def merged_rows(graph: OpGraph, name: str) -> tuple[int, int] | None:
    """(samples, positions) where value ``name`` is a reshape merging its input's first two
    dims into its rows (``(b, s, h) -> (b * s, h)``), else None. Rows split by positions
    arrive as one block per sample (``dims.reshape_placement``): the products and losses on
    such rows offer that split as ``seq`` and the split of the samples as ``batch``, under the
    same names at every batch size."""
    from autoplan.graph.analysis import analyze
    from autoplan.sharding.passthrough import RESHAPES
    i = analyze(graph).producer.get(name)
    if i is None or opname(graph.ops[i]) not in RESHAPES or not graph.ops[i].inputs:
        return None
    x = graph.value(graph.ops[i].inputs[0]).meta.shape
    out = graph.value(name).meta.shape
    if len(x) < 2 or not out or x[0] * x[1] != out[0] or tuple(x[2:]) != tuple(out[1:]):
        return None
    return x[0], x[1]


def row_splits(rows: int, merged: tuple[int, int] | None, t: int
               ) -> list[tuple[str, Placement]]:
    """The splits of a tensor's rows (dim 0) over ``t`` ranks, by name: ``batch`` (plain), and
    for merged rows (``merged_rows``) ``batch`` over the samples and ``seq`` over each
    sample's positions."""
    if merged is None:
        return [("batch", shard(0))] if _div(rows, t) else []
    samples, positions = merged
    return [(label, p) for label, p, ok in (("batch", shard(0), _div(samples, t)),
                                            ("seq", shard(0, samples), _div(positions, t)))
            if ok]


def _seq_dim(shape: tuple[int, ...]) -> int:
    """The token dim sequence parallelism splits: the sequence of (b, s, h), the rows of
    (tokens, h)."""
    return 1 if len(shape) >= 3 else 0


# ---- products with a weight ------------------------------------------------------------------

def _linear(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    w = _weight(graph, op)
    acts = [i for i, n in enumerate(op.inputs) if _is_act(graph.value(n))]
    if w is None or not acts:
        return []
    x = acts[0]
    b = bias_slot(graph, op)
    if b in (x, w):
        b = None
    xm, wm = graph.value(op.inputs[x]).meta, graph.value(op.inputs[w]).meta
    out = graph.value(op.outputs[0]).meta.shape
    rank = len(out)
    # linear keeps (out, in); addmm / x @ W keep (in, out)
    out_dim, in_dim = (0, 1) if opname(op) == "linear" else (1, 0)
    if len(wm.shape) != 2 or len(xm.shape) < 1:
        return []

    def ps(x_p: Placement, w_p: Placement, b_p: Placement) -> tuple[Placement, ...]:
        return tuple(x_p if i == x else w_p if i == w else b_p if i == b else REPLICATE
                     for i in range(len(op.inputs)))
    res = []
    sp = _seq_dim(xm.shape)
    can_sp = len(xm.shape) >= 2 and _div(xm.shape[sp], t) and len(xm.shape) == rank
    # the token split sequence parallelism keeps: the sequence of (b, s, h), the rows of
    # (tokens, h), one block per sample where the rows are (b, s) merged
    merged = merged_rows(graph, op.inputs[x]) if len(xm.shape) == 2 else None
    sp_p = shard(sp)
    if merged is not None:
        sp_p = shard(0, merged[0])
        can_sp = can_sp and _div(merged[1], t)
    for k in (1,) + _blocks(graph)(op.outputs[0], rank - 1):
        if not _div(wm.shape[out_dim], t, k):
            continue
        sfx = "" if k == 1 else f"_blocks{k}"
        col_in = ps(REPLICATE, shard(out_dim, k), shard(0, k))
        res.append(make(graph, op, "colwise" + sfx, col_in, (shard(rank - 1, k),), t,
                        style="colwise"))
        if can_sp:
            # Megatron's sequence-parallel linear: the input is gathered inside the product
            # and again in backward, so only its shard is kept for backward
            regather = ((Comm("all_gather", op.inputs[x], "bwd"),)
                        if graph.value(op.inputs[w]).requires_grad else ())
            res.append(make(graph, op, "colwise_sp" + sfx, ps(sp_p, shard(out_dim, k),
                                                               shard(0, k)),
                            (shard(rank - 1, k),), t, style="colwise_sp", local_inputs=col_in,
                            kernel="sp_linear", extra=regather))
    if _div(wm.shape[in_dim], t) and _div(xm.shape[-1], t):
        row_in = ps(shard(len(xm.shape) - 1), shard(in_dim), REPLICATE)
        kernel = "bias_after_reduce" if b is not None else ""
        res.append(make(graph, op, "rowwise", row_in, (REPLICATE,), t, style="rowwise",
                        kernel=kernel, local_outputs=(PARTIAL,)))
        if len(xm.shape) == rank and rank >= 2 and _div(out[sp], t) and (
                merged is None or can_sp):
            res.append(make(graph, op, "rowwise_sp", row_in, (sp_p,), t,
                            style="rowwise_sp", kernel=kernel, local_outputs=(PARTIAL,)))
    # token splits: the batch, the sequence (the rows of a 2-D input: ``row_splits``)
    tokens: list[tuple[str, Placement]] = []
    if rank == 2 and len(xm.shape) == rank:
        tokens = row_splits(out[0], merged, t)
    elif rank >= 3 and len(xm.shape) == rank:
        tokens = [(label, shard(d)) for d, label in ((0, "batch"), (1, "seq"))
                  if _div(out[d], t)]
    for label, p in tokens:
        res.append(make(graph, op, label, ps(p, REPLICATE, REPLICATE), (p,), t, style=label))
    weight = graph.value(op.inputs[w])
    if weight.kind == "param" and _div(wm.shape[0], t):
        # the weight stored split, gathered for the product (FSDP on this axis) and in backward
        regather = ((Comm("all_gather", op.inputs[w], "bwd"),) if weight.requires_grad else ())
        for label, p in tokens:
            res.append(make(graph, op, f"{label}_gathered", ps(p, shard(0), REPLICATE),
                            (p,), t, style=label, kernel="gathered_weight",
                            local_inputs=ps(p, REPLICATE, REPLICATE), extra=regather))
    return res


def _grouped_mm(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Experts' grouped product: input (tokens, in) sorted by expert, weight (experts, in,
    out), offsets (experts,)."""
    if len(op.inputs) != 3:
        return []
    xm, wm = (graph.value(n).meta for n in op.inputs[:2])
    if len(xm.shape) != 2 or len(wm.shape) != 3:
        return []
    res = []
    if _div(wm.shape[2], t):
        res.append(make(graph, op, "colwise", (REPLICATE, shard(2), REPLICATE), (shard(1),), t,
                        style="colwise"))
    if _div(wm.shape[1], t):
        res.append(make(graph, op, "rowwise", (shard(1), shard(1), REPLICATE), (REPLICATE,), t,
                        style="rowwise", local_outputs=(PARTIAL,)))
    return res


def _act_matmul(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Product of two activations (batched, broadcasting over the leading dims)."""
    name = opname(op)
    if name not in ("bmm", "matmul", "mm") or len(op.inputs) != 2:
        return []
    a, b = (graph.value(n).meta.shape for n in op.inputs)
    out = graph.value(op.outputs[0]).meta.shape
    r = len(out)
    if len(a) < 2 or len(b) < 2 or r < 2:
        return []
    res = []
    for d in range(r - 2):
        pa, pb = (_batch_dim(s, out, d) for s in (a, b))
        if (pa is None and pb is None) or not _div(out[d], t):
            continue
        ins = (shard(pa) if pa is not None else REPLICATE,
               shard(pb) if pb is not None else REPLICATE)
        res.append(make(graph, op, "heads" if d == 1 else ("batch" if d == 0 else f"dim{d}"),
                        ins, (shard(d),), t))
    if _div(out[r - 2], t):
        res.append(make(graph, op, "rows", (shard(len(a) - 2), REPLICATE), (shard(r - 2),), t))
    if _div(out[r - 1], t):
        res.append(make(graph, op, "cols", (REPLICATE, shard(len(b) - 1)), (shard(r - 1),), t))
    if _div(a[-1], t):
        res.append(make(graph, op, "contract", (shard(len(a) - 1), shard(len(b) - 2)),
                        (REPLICATE,), t, local_outputs=(PARTIAL,)))
    return res


def _batch_dim(shape: tuple[int, ...], out: tuple[int, ...], d: int) -> int | None:
    """The operand dim aligned with output batch dim ``d`` (None: broadcast over it)."""
    k = d - (len(out) - len(shape))
    if k < 0 or k >= len(shape) - 2 or shape[k] == 1:
        return None
    return k
