"""The model's layers as the runtime cuts it: the children of the container that holds the
repeated layers (``layers.7``, ``transformer.h.3``), each a contiguous op range (a *unit*).

A pipeline stage holds whole units (``estimate/partition``), the runtime installs one module per
unit and compiles each on its own (``runtime/program_modules.split_layers``, regional
compilation), and a compiled program's fused element-wise chains end at a unit's edge
(``cost/fused.compiled_regions``): one definition of a layer for all three.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autoplan.graph.opgraph import Block, OpGraph

_CHILD = re.compile(r"^(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Unit:
    """One child of the layer container: ops ``[start, stop)``. ``like`` is the range of a unit
    with the same structure whose costs stand for this one's (its own range if none)."""

    path: str
    start: int
    stop: int
    like: tuple[int, int]


def main_block(graph: OpGraph) -> Block | None:
    """The repeated block holding most ops (the transformer layers)."""
    if not graph.blocks:
        return None
    return max(graph.blocks, key=lambda b: (len(b.instances) * b.num_ops, -b.instances[0].start))


def pipeline_units(graph: OpGraph) -> tuple[Unit, ...]:
    """The children of every layer container (one per repeated block: an encoder-decoder has
    two), in op order (kept on the graph). Falls back to the main block's container, then to
    its instances, when children do not own contiguous, disjoint op ranges."""
    cache = graph.__dict__.get("_autoplan_units")
    if cache is not None:
        return cache
    block = main_block(graph)
    units: tuple[Unit, ...] = ()
    if block is not None:
        units = (_all_container_units(graph) or _container_units(graph, block)
                 or _block_units(graph, block))
    graph.__dict__["_autoplan_units"] = units
    return units


def _all_container_units(graph: OpGraph) -> tuple[Unit, ...]:
    containers: dict[str, Block] = {}
    for b in graph.blocks:
        containers.setdefault(b.instances[0].path.rpartition(".")[0], b)
    if len(containers) < 2:
        return ()
    units: list[Unit] = []
    for b in containers.values():
        found = _container_units(graph, b)
        if not found:
            return ()
        units.extend(found)
    units.sort(key=lambda u: u.start)
    if any(a.stop > b.start for a, b in zip(units, units[1:])):
        return ()                        # nested or interleaved containers
    return tuple(units)


def _representatives(graph: OpGraph) -> dict[str, tuple[int, int]]:
    """Per block instance path: the range costed for it (a block's second instance stands for
    all but the first, whose inputs may need a reshard the others do not)."""
    rep: dict[str, tuple[int, int]] = {}
    for b in graph.blocks:
        steady = b.instances[1] if len(b.instances) > 1 else b.instances[0]
        for k, inst in enumerate(b.instances):
            rep[inst.path] = (inst.start, inst.stop) if k == 0 else (steady.start, steady.stop)
    return rep


def _block_units(graph: OpGraph, block: Block) -> tuple[Unit, ...]:
    rep = _representatives(graph)
    return tuple(Unit(i.path, i.start, i.stop, rep[i.path]) for i in block.instances)


def _container_units(graph: OpGraph, block: Block) -> tuple[Unit, ...]:
    container = block.instances[0].path.rpartition(".")[0]
    prefix = container + "." if container else ""
    spans: dict[str, list[int]] = {}
    owner: list[str | None] = []
    for i, op in enumerate(graph.ops):
        path = op.module_path
        child = None
        if path.startswith(prefix):
            m = _CHILD.match(path[len(prefix):])
            if m:
                child = prefix + m.group(1)
        owner.append(child)
        if child is not None:
            spans.setdefault(child, [i, i + 1])[1] = i + 1
    rep = _representatives(graph)
    units = []
    for path, (start, stop) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if any(owner[j] != path for j in range(start, stop)):
            return ()
        units.append(Unit(path, start, stop, rep.get(path, (start, stop))))
    return tuple(units)
