"""Which dims of which values are later cut into equal blocks (fused projections).

A fused q/k/v projection writes ``[q | k | v]`` along its last dim; the code after it splits
that dim into three (``split(h, dim=-1)``, ``chunk(3)``, ``unflatten(-1, (3, h))``,
``view(b, s, 3, heads, head_dim)``). Column-parallel with a plain split would give rank 0 all
of q and part of k. Sharding that dim in 3 blocks (``S(d)[3]``) gives every rank its share of
q, k and v, and after the cut each piece is head-sharded. This analysis finds, for every value
and dim, the block counts that some later op cuts it into, following the dim backwards through
element-wise ops and views; the strategies then offer those block splits. Rows that merge a
batch's samples with their positions (``(b * s, h)``, cut back into ``(b, s, h)`` later) are
``b`` blocks in the same way when each sample's positions are split.
"""

from __future__ import annotations

from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding import dims
from autoplan.sharding.passthrough import SPLITS, dim_arg, is_elementwise, unary_map
from autoplan.sharding.placement import shard
from autoplan.sharding.strategy import call_args, opname

MAX_BLOCKS = 64


def _cuts(graph: OpGraph, op: Op, slot: int, d: int) -> set[int]:
    """Block counts ``op`` cuts dim ``d`` of its input ``slot`` into."""
    x = graph.value(op.inputs[slot]).meta.shape
    name = opname(op)
    args, kwargs = call_args(op)
    out: set[int] = set()
    if name in SPLITS and name != "unbind" and dim_arg(op, len(x), i=2) == d:
        sizes = [graph.value(n).meta.shape[d] for n in op.outputs]
        if len(sizes) > 1 and len(set(sizes)) == 1:
            out.add(len(sizes))
    elif name in ("view", "reshape", "_unsafe_view", "unflatten"):
        # (3h) -> (3, heads, head_dim) is a fused projection cut in 3; (h) -> (heads,
        # head_dim) is not (a plain split already lands on the heads)
        o = graph.value(op.outputs[0]).meta.shape
        for gi, gj in dims.reshape_groups(x, o) or []:
            nontrivial_in = [k for k in gi if x[k] != 1]
            outs = [k for k in gj if o[k] != 1]
            if nontrivial_in == [d] and len(outs) >= (2 if name == "unflatten" else 3):
                out.add(o[outs[0]])
            elif nontrivial_in == [d] and len(outs) == 2 and o[outs[0]] == graph.batch_size:
                # rows of (samples x positions) cut back into (b, s): rows split by position
                # are one block per sample (``dims.reshape_placement``)
                out.add(o[outs[0]])
    return {k for k in out if 2 <= k <= MAX_BLOCKS}


def block_counts(graph: OpGraph) -> dict[tuple[str, int], tuple[int, ...]]:
    """(value, dim) -> block counts a later op cuts that dim into (kept on the graph)."""
    cached = graph.__dict__.get("_autoplan_blocks")
    if cached is not None:
        return cached
    found: dict[tuple[str, int], set[int]] = {}
    for i in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[i]
        if not op.outputs:
            continue
        for slot, n in enumerate(op.inputs):
            v = graph.value(n)
            if v.kind not in ("activation",):
                continue
            shape = v.meta.shape
            for d in range(len(shape)):
                ks = _cuts(graph, op, slot, d)
                ks |= _inherited(graph, op, slot, d, found)
                if ks:
                    found.setdefault((n, d), set()).update(ks)
    result = {key: tuple(sorted(ks)) for key, ks in found.items()}
    graph.__dict__["_autoplan_blocks"] = result
    return result


def _inherited(graph: OpGraph, op: Op, slot: int, d: int,
               found: dict[tuple[str, int], set[int]]) -> set[int]:
    """Block counts of the output dim that input dim ``d`` becomes (element-wise ops, views)."""
    out: set[int] = set()
    x = graph.value(op.inputs[slot]).meta.shape
    if is_elementwise(graph, op):
        y = graph.value(op.outputs[0]).meta.shape
        od = d + len(y) - len(x)
        if 0 <= od < len(y) and y[od] == x[d]:
            out |= found.get((op.outputs[0], od), set())
        return out
    mapped = unary_map(graph, op, slot, shard(d), 1)
    if mapped is None:
        return out
    for n, q in zip(op.outputs, mapped):
        if q.kind == "S" and graph.value(n).meta.shape[q.dim] == x[d]:
            out |= found.get((n, q.dim), set())
    return out
