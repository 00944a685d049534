"""What the sharding ILP counts as the activations a choice keeps for backward, as the
estimate keeps them over its one chunk (``cost.memory.activation_parts``): which op owns each
kept value, and what the layers keep under full recomputation (only their inputs, laid out as
their producers' choices leave them). ``problem.reduce_graph`` prices node memory with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoplan.cost.memory import shared_inputs
from autoplan.errors import ConfigError
from autoplan.estimate.chunk_cost import chunk_parts
from autoplan.estimate.partition import partition
from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.axis_costs import value_bytes
from autoplan.planner.cost_context import CostContext
from autoplan.planner.folding import Node
from autoplan.sharding.placement import REPLICATE


def activation_owners(graph: OpGraph, recompute: str, copies: Any = None
                       ) -> tuple[dict[tuple[int, str], int], list[int]]:
    """Which op counts each kept activation, as ``cost.memory.activation_bytes`` does over each
    part of the estimate's one chunk (a layer, or the ops around the layers): per (part, value)
    the first op of the part that keeps it, skipping what the policy drops (a tensor several
    layers keep, made outside them, once for the whole chunk); and per op its part. ``copies``:
    per op, the values it keeps as its own 16-bit copy under autocast (``cost.dtypes.
    cast_copies``), which it counts itself, not as the value."""
    a = analyze(graph)
    shared = shared_inputs(graph)        # kept by several layers, held once: one owner
    first: dict[tuple[int, str], int] = {}
    part_of = [0] * len(graph.ops)
    (chunk,) = partition(graph, 1)
    for part, (start, stop, is_layer) in enumerate(chunk_parts(chunk)):
        part_of[start:stop] = [part] * (stop - start)
        policy = recompute if is_layer else "none"
        for i in range(start, stop):
            if policy == "selective" and i in a.score_ops:
                continue
            for n in graph.ops[i].saved:
                base = graph.value(graph.value(n).base)
                if copies is not None and base.name in copies.get(i, ()):
                    continue
                if base.kind == "activation" and not (policy == "selective"
                                                      and base.name in a.score_values):
                    first.setdefault((-1 if base.name in shared else part, base.name), i)
    return first, part_of


def layer_inputs(graph: OpGraph, nodes: Sequence[Node], rep: Sequence[int],
                  node_of: dict[int, int], ctx: CostContext, chunk_of: Sequence[int]
                  ) -> list[tuple[int, int, int, float]]:
    """What the layers keep per micro-batch under full recomputation: each layer's inputs
    (``cost.memory.activation_parts``), as (the layer's first op, producing node, its choice,
    bytes), split over tp where the producer's choice leaves them split; an input several
    layers read (a mask) once per chunk (``chunk_of``: op -> chunk), as the estimate keeps it."""
    a = analyze(graph)
    shared, held_once = shared_inputs(graph), set()
    out = []
    (whole,) = partition(graph, 1)
    for start, stop, is_layer in chunk_parts(whole):
        if not is_layer:
            continue
        seen: set[str] = set()
        for i in range(start, stop):
            for n in graph.ops[i].inputs:
                base = graph.value(n).base
                if (graph.value(n).kind != "activation" or graph.value(base).kind != "activation"
                        or a.producer.get(base, -1) >= start or base in seen
                        or (chunk_of[start], base) in held_once):
                    continue
                seen.add(base)
                if base in shared:
                    held_once.add((chunk_of[start], base))
                b = value_bytes(ctx, base, "own") * (ctx.context.value_scale(base)
                                                     if ctx.context is not None else 1.0)
                k = a.producer[base]
                u = node_of.get(rep[k])
                if u is None:
                    raise ConfigError(f"op {graph.ops[k].name} makes a layer's input but no "
                                      "sharding node holds it")
                x_rep = graph.ops[rep[k]].outputs[graph.ops[k].outputs.index(base)]
                for j, place in enumerate(nodes[u].placement):
                    split = place.get(x_rep, REPLICATE).kind == "S"
                    out.append((start, u, j, b / (ctx.t if split else 1)))
    return out
