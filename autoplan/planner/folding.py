"""Graph reduction for the sharding ILP (``problem.py``), so that a 96-layer model is one
layer's problem:
1. repeated blocks fold onto their first instance (``representatives``): every op of instance
   k stands for the op at the same position in instance 0;
2. ops that simply follow their producer (views, element-wise ops with one activation input,
   dropout, copies, reductions) join the producer's node (``group``), within one instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.placement import Placement
from autoplan.sharding.strategies import OpStrategy

FOLLOW_KINDS = frozenset({"view", "pointwise", "dropout", "copy", "reduction"})


@dataclass
class Node:
    """One node of the ILP: a leading op and the ops that follow it, in the first instance of
    their block, standing for ``mult`` instances; ``problem._expand`` fills its choices."""

    ops: list[int]                                   # rep op indices, leader first
    mult: int
    choices: list[list[OpStrategy]] = None           # per strategy j: one per op in ops
    placement: list[dict[str, Placement]] = None     # per strategy j: value -> placement
    internal: list[list[tuple[int, str, Placement, Placement]]] = None  # gathers inside it
    # per op in ops: the graph's ops it stands for, one per instance in order (itself first)
    copies: list[tuple[int, ...]] = None


def representatives(graph: OpGraph) -> tuple[list[int], dict[int, int], list[int]]:
    """(rep per op, multiplicity per rep op, block-instance id per op: -1 outside blocks)."""
    rep = list(range(len(graph.ops)))
    mult = {i: 1 for i in range(len(graph.ops))}
    inst = [-1] * len(graph.ops)
    k = 0
    for block in graph.blocks:
        first = block.instances[0]
        for inst_i, b in enumerate(block.instances):
            for off in range(b.stop - b.start):
                rep[b.start + off] = first.start + off
                inst[b.start + off] = k + inst_i
        for i in range(first.start, first.stop):
            mult[i] = len(block.instances)
        k += len(block.instances)
    return rep, mult, inst


def group(graph: OpGraph, rep: list[int], mult: dict[int, int],
           inst: list[int]) -> tuple[list[Node], dict[int, int]]:
    a = analyze(graph)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(rep):
        members.setdefault(r, []).append(i)
    nodes: list[Node] = []
    node_of: dict[int, int] = {}
    for i in sorted(set(rep)):
        op = graph.ops[i]
        if not op.outputs:
            continue
        acts = [n for n in op.inputs if graph.value(n).kind == "activation"]
        if op.kind in FOLLOW_KINDS and len(acts) == 1:
            p = a.producer.get(acts[0])
            if p is not None and rep[p] == p and p in node_of and inst[p] == inst[i]:
                nodes[node_of[p]].ops.append(i)
                nodes[node_of[p]].copies.append(tuple(members[i]))
                node_of[i] = node_of[p]
                continue
        node_of[i] = len(nodes)
        nodes.append(Node(ops=[i], mult=mult[i], copies=[tuple(members[i])]))
    return nodes, node_of
