"""Find repeated blocks (the N layers of a transformer, the units of a ResNet stage).

A block instance is a module whose path ends in an integer index (``layers.7``,
``transformer.h.3``, ``layer2.1``): the outermost such module of each op. Its ops must form one
contiguous range of the topological order. Instances of one container whose op sequences have
the same structure (targets, shapes, dtypes, the parameters' paths relative to the instance)
form a ``Block``; later stages solve one instance and reuse the answer for the others.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from autoplan.graph.opgraph import Block, BlockInstance, Op, Value

_INDEXED = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


def outermost_indexed(paths: Sequence[str]) -> str | None:
    """The first (outermost) module path of a stack that is an indexed container child."""
    for p in paths:
        if _INDEXED.match(p):
            return p
    return None


def _signature(ops: Sequence[Op], instance_path: str, values: dict[str, Value]) -> str:
    h = hashlib.sha256()
    prefix = instance_path + "."
    for op in ops:
        rel_params = [p[len(prefix):] if p.startswith(prefix) else p for p in op.params]
        shapes = [values[n].meta.to_json() for n in op.inputs + op.outputs]
        rel_module = op.module_path[len(instance_path):]
        h.update(repr((op.target, op.kind, shapes, rel_params, rel_module)).encode())
    return h.hexdigest()[:16]


def find_blocks(ops: Sequence[Op], instance_of_op: Sequence[str | None],
                values: dict[str, Value], module_types: dict[str, str]) -> tuple[Block, ...]:
    """Group contiguous, structurally identical indexed-module instances into blocks."""
    spans: dict[str, list[int]] = {}
    order: list[str] = []
    for i, inst in enumerate(instance_of_op):
        if inst is None:
            continue
        if inst not in spans:
            spans[inst] = [i, i + 1]
            order.append(inst)
        else:
            spans[inst][1] = i + 1

    # keep instances whose range holds only their own ops (contiguous in topological order)
    contiguous: list[tuple[str, int, int]] = []
    for inst in order:
        start, stop = spans[inst]
        if all(instance_of_op[j] == inst for j in range(start, stop)):
            contiguous.append((inst, start, stop))

    groups: dict[tuple[str, str], list[BlockInstance]] = {}
    for inst, start, stop in contiguous:
        container = _INDEXED.match(inst).group("container")  # type: ignore[union-attr]
        sig = _signature(ops[start:stop], inst, values)
        groups.setdefault((container, sig), []).append(
            BlockInstance(path=inst, start=start, stop=stop))

    blocks: list[Block] = []
    names: dict[str, int] = {}
    for (container, sig), instances in groups.items():
        if len(instances) < 2:
            continue
        k = names.get(container, 0)
        names[container] = k + 1
        name = container if k == 0 else f"{container}#{k}"
        blocks.append(Block(name=name, module_type=module_types.get(instances[0].path, ""),
                            signature=sig, instances=tuple(instances)))
    blocks.sort(key=lambda b: b.instances[0].start)
    return tuple(blocks)
