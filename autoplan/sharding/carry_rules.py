"""The registered rules of the ops that carry a split through: concatenation by name, then,
for ops no named rule claims, element-wise ops (torch's pointwise tag) and the ops whose dim
maps ``passthrough`` knows (views, copies, reductions, softmax), in that order.

They live apart from ``passthrough`` (the dim maps) because they read the block counts of
fused projections (``blocks.block_counts``), which are themselves computed from those maps.
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding import passthrough
from autoplan.sharding.blocks import block_counts
from autoplan.sharding.registry import register_fallback, register_op_strategy
from autoplan.sharding.strategy import OpStrategy, opname


def _blocks(graph: OpGraph) -> Callable[[str, int], tuple[int, ...]]:
    counts = block_counts(graph)
    return lambda value, d: counts.get((value, d), ())


register_op_strategy("cat", "stack")(passthrough.concat)


@register_fallback
def _elementwise(graph: OpGraph, op: Op, t: int) -> list[OpStrategy] | None:
    """An element-wise op (with broadcasting): any output dim."""
    if not passthrough.is_elementwise(graph, op):
        return None
    return passthrough.elementwise(graph, op, t, _blocks(graph))


@register_fallback
def _carried(graph: OpGraph, op: Op, t: int) -> list[OpStrategy] | None:
    """A view, copy, reduction or softmax of one activation: where its split goes; ``type_as``
    and kin: the first tensor's split."""
    acts = [i for i, n in enumerate(op.inputs)
            if graph.value(n).kind in ("activation", "input")]
    if passthrough.has_rule(op) and len(acts) == 1:
        return passthrough.unary(graph, op, acts[0], t, _blocks(graph))
    if opname(op) in passthrough.LIKE_OTHER and acts and acts[0] == 0:
        return passthrough.like_other(graph, op, t, _blocks(graph))
    return None
