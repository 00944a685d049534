"""Trace a deep model through two of its layers, then stamp the rest.

A 96-layer model's layers are the same program 96 times; ``torch.export`` spends most of its
time re-tracing them. When a model keeps its layers in an ``nn.ModuleList`` (or
``nn.Sequential``) of structurally identical children, we trace it with the list cut to its
first two children, check that the two traced instances are alike and adjacent, and copy the
second instance's ops for layers 2..N-1 with their parameter paths, value names and the links
between consecutive layers renamed. The ops after the layers then read the last layer's outputs.

Anything unexpected (no such list, instances not adjacent or not alike, a parameter count that
does not add up) falls back to the full trace, so the result is always the model's graph.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autoplan.graph.blocks import find_blocks, outermost_indexed
from autoplan.graph.opgraph import Op, OpGraph, Value


def _signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def repeated_list(model: nn.Module) -> tuple[str, nn.Module, int] | None:
    """The module list holding the most parameters among lists of >= 3 identical children."""
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 3 or not name:
            continue
        children = list(mod)
        sig = _signature(children[0])
        if any(_signature(c) != sig for c in children[1:]):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[3]:
            best = (name, mod, len(children), size)
    return None if best is None else best[:3]


@contextmanager
def cut_to_two(model: nn.Module, name: str) -> Iterator[None]:
    """Temporarily replace the list ``name`` by one holding its first two children."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    original = getattr(parent, attr)
    cut = type(original)(*list(original)[:2]) if isinstance(original, nn.Sequential) \
        else nn.ModuleList(list(original)[:2])
    parent._modules[attr] = cut
    try:
        yield
    finally:
        parent._modules[attr] = original


def _rename_args(args: str, names: dict[str, str]) -> str:
    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"v"} and x["v"] in names:
                return {"v": names[x["v"]]}
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return x
    return json.dumps(fix(json.loads(args)), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class _TracedLayers:
    """The two traced layers of a container, adjacent in the graph's op order."""

    container: str          # the layer list's path in the model
    path: str               # its module path (with the export prefix)
    module_type: str        # its layers' module type
    first: range            # layer 0's op indices
    second: range           # layer 1's op indices: the one copied
    param_re: re.Pattern    # a layer-1 parameter path
    mod_re: re.Pattern      # a layer-1 module path


def stamp(graph: OpGraph, container: str, num_layers: int, prefix: str = "") -> OpGraph | None:
    """Extend a graph traced with two layers of ``container`` to ``num_layers`` layers (None:
    the graph does not hold two adjacent traced layers of it)."""
    layers = _traced_layers(graph, container, prefix)
    if layers is None:
        return None
    values = {v.name: v for v in graph.values}
    carry = _carried(graph, layers)
    new_values: list[Value] = []
    new_ops: list[Op] = []
    latest: dict[str, str] = {}       # layer-1 value -> its copy in the latest layer
    for k in range(2, num_layers):
        names = _copy_layer(graph, values, layers, k=k, carry=carry, latest=latest,
                            new_values=new_values, new_ops=new_ops)
        latest = {n: names[n] for idx in layers.second for n in graph.ops[idx].outputs}
    tail = _read_last_layer(graph.ops[layers.second.stop:], latest)
    return _stamped_graph(graph, layers, num_layers=num_layers, new_values=new_values,
                          new_ops=new_ops, tail=tail, latest=latest)


def _traced_layers(graph: OpGraph, container: str, prefix: str) -> _TracedLayers | None:
    """The container's two traced layers, when they are adjacent instances ``.0`` and ``.1``
    of one block."""
    path = f"{prefix}{container}"
    block = next((b for b in graph.blocks if b.name == path and len(b.instances) == 2), None)
    if block is None:
        return None
    i0, i1 = block.instances
    if i0.stop != i1.start or i0.path != f"{path}.0" or i1.path != f"{path}.1":
        return None
    return _TracedLayers(container=container, path=path, module_type=block.module_type,
                         first=range(i0.start, i0.stop), second=range(i1.start, i1.stop),
                         param_re=re.compile(rf"^{re.escape(container)}\.1(\.|$)"),
                         mod_re=re.compile(rf"^{re.escape(path)}\.1(\.|$)"))


def _carried(graph: OpGraph, layers: _TracedLayers) -> dict[str, str]:
    """For each value layer 1 reads from layer 0: the matching value layer 1 produces (what
    layer k reads from layer k - 1)."""
    produced_in = {}
    for idx, op in enumerate(graph.ops):
        for n in op.outputs:
            produced_in[n] = idx
    offset = layers.second.start - layers.first.start
    carry: dict[str, str] = {}
    for idx in layers.second:
        for n in graph.ops[idx].inputs:
            p = produced_in.get(n)
            if p is not None and p in layers.first:
                pos = graph.ops[p].outputs.index(n)
                carry[n] = graph.ops[p + offset].outputs[pos]
    return carry


def _copy_layer(graph: OpGraph, values: dict[str, Value], layers: _TracedLayers, *, k: int,
                carry: dict[str, str], latest: dict[str, str], new_values: list[Value],
                new_ops: list[Op]) -> dict[str, str]:
    """Layer ``k`` as a copy of layer 1 (its parameters, values and ops appended to
    ``new_values`` and ``new_ops``), reading layer ``k - 1``'s outputs (``latest``). Returns
    the layer-1 value names -> layer ``k``'s."""
    sfx = f"__L{k}"
    param_re, mod_re, path = layers.param_re, layers.mod_re, layers.path
    container = layers.container
    names: dict[str, str] = {}
    for idx in layers.second:
        op = graph.ops[idx]
        for n in op.inputs:
            v = values[n]
            if v.kind in ("param", "buffer") and param_re.match(v.fqn) and n not in names:
                nv = replace(v, name=n + sfx, base=n + sfx if v.base == n else v.base,
                             fqn=param_re.sub(rf"{container}.{k}\1", v.fqn))
                names[n] = nv.name
                new_values.append(nv)
        for n in op.outputs:
            names[n] = n + sfx
    for n0, n1 in carry.items():
        names[n0] = latest.get(n1, n1)
    for idx in layers.second:
        op = graph.ops[idx]
        for n in op.outputs:
            v = values[n]
            base = names.get(v.base, v.base)
            new_values.append(replace(v, name=names[n], base=base))
        new_ops.append(replace(
            op, name=op.name + sfx, inputs=tuple(names.get(n, n) for n in op.inputs),
            outputs=tuple(names[n] for n in op.outputs),
            saved=tuple(names.get(n, n) for n in op.saved),
            params=tuple(param_re.sub(rf"{container}.{k}\1", f) for f in op.params),
            module_path=mod_re.sub(rf"{path}.{k}\1", op.module_path),
            args=_rename_args(op.args, names)))
    return names


def _read_last_layer(tail_ops: Sequence[Op], latest: dict[str, str]) -> list[Op]:
    """The ops after the layers, reading the last layer's outputs."""
    tail: list[Op] = []
    for op in tail_ops:
        ren = {n: latest.get(n, n) for n in op.inputs}
        tail.append(replace(op, inputs=tuple(ren[n] for n in op.inputs),
                            saved=tuple(latest.get(n, n) for n in op.saved),
                            args=_rename_args(op.args, latest)))
    return tail


def _stamped_graph(graph: OpGraph, layers: _TracedLayers, *, num_layers: int,
                   new_values: list[Value], new_ops: list[Op], tail: list[Op],
                   latest: dict[str, str]) -> OpGraph:
    """The whole graph: the traced ops up to layer 1, the copies, the tail; its blocks found
    again over all ``num_layers`` layers."""
    path = layers.path
    ops = list(graph.ops[:layers.second.stop]) + new_ops + tail
    tail_outputs = {n for op in tail for n in op.outputs}
    all_values = [replace(v, base=latest.get(v.base, v.base)) if v.name in tail_outputs else v
                  for v in graph.values] + new_values
    vals = {v.name: v for v in all_values}
    instance_of_op = [outermost_indexed(_prefixes(op.module_path)) for op in ops]
    module_types = {inst.path: b.module_type for b in graph.blocks for inst in b.instances}
    module_types.update({f"{path}.{k}": layers.module_type for k in range(num_layers)})
    blocks = find_blocks(ops, instance_of_op, vals, module_types)
    meta = dict(graph.meta)
    meta["stamped"] = {"container": path, "traced_layers": 2, "layers": num_layers}
    return OpGraph(name=graph.name, ops=tuple(ops), values=tuple(all_values),
                   inputs=graph.inputs,
                   outputs=tuple(latest.get(n, n) for n in graph.outputs), blocks=blocks,
                   batch_size=graph.batch_size, meta=meta)


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
