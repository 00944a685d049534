"""Cut the rank program into one module per layer, at the layer's own path.

FSDP2 shards and gathers per module, activation checkpointing wraps a module, and pipeline
stages hold whole layers: all need the layers as modules. The rank program is one flat graph;
``split_layers`` moves the nodes of each layer (a pipeline unit: a child of the model's layer
container, ``layers.7``) into a ``GraphModule`` of its own, installed at the layer's path, that
owns the layer's parameters under their own names, so every FQN stays what the user's model
calls it (``layers.7.attn.q_proj.weight``). The root graph calls the layers in order; what a
layer reads from outside (activations, a weight tied to another module) comes in as arguments.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from autoplan.errors import PlanError


def _segment_of_nodes(gm: fx.GraphModule, op_of_node: dict[str, int],
                      ranges: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    seg: dict[str, int] = {}
    for node in gm.graph.nodes:
        i = op_of_node.get(node.name)
        if i is None and node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.name in seg:
                seg[node.name] = seg[src.name]
            continue
        if i is None:
            continue
        for k, (_path, start, stop) in enumerate(ranges):
            if start <= i < stop:
                seg[node.name] = k
                break
    return seg


def split_layers(gm: fx.GraphModule, op_of_node: dict[str, int],
                 ranges: Sequence[tuple[str, int, int]]) -> fx.GraphModule:
    """A root GraphModule calling one GraphModule per ``(path, start, stop)`` op range."""
    if not ranges:
        return gm
    seg = _segment_of_nodes(gm, op_of_node, ranges)
    nodes = list(gm.graph.nodes)
    members: list[list[fx.Node]] = [[] for _ in ranges]
    for n in nodes:
        if n.name in seg:
            members[seg[n.name]].append(n)
    attrs = dict(_attrs(gm))
    root = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root_attrs: dict[str, Any] = {}
    done: set[int] = set()

    def get(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":      # emitted where the root first reads it
            root_attrs[a.target] = attrs[a.target]
            env[a] = root.get_attr(a.target)
        return env[a]
    for n in nodes:
        k = seg.get(n.name)
        if k is None:
            if n.op != "get_attr":
                env[n] = root.node_copy(n, get)
            continue
        if k in done:
            continue
        done.add(k)
        path = ranges[k][0]
        module, inputs, outputs = _segment(members[k], path, attrs)
        root_attrs[path] = module
        call = root.call_module(path, tuple(get(x) for x in inputs))
        for j, out in enumerate(outputs):
            env[out] = root.call_function(operator.getitem, (call, j))
    root.lint()
    out = fx.GraphModule(root_attrs, root, class_name="RankProgram")
    out._autoplan_expected = getattr(gm, "_autoplan_expected", {})
    return out


def _attrs(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            yield n.target, obj


def _segment(members: list[fx.Node], path: str, attrs: dict[str, Any]
             ) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The layer's GraphModule, the root nodes it reads (in order) and the nodes it returns."""
    inside = set(members)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    own: dict[str, Any] = {}
    prefix = path + "."

    def arg(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr" and (a.target.startswith(prefix)
                                   or a.target.startswith("_autoplan_")):
            # the layer's own weights (and shared helpers: comm slot, constants) live in it
            rel = a.target[len(prefix):] if a.target.startswith(prefix) else a.target
            own[rel] = attrs[a.target]
            env[a] = g.get_attr(rel)
            return env[a]
        inputs.append(a)
        env[a] = g.placeholder(f"in_{len(inputs)}")
        return env[a]
    # placeholders first, in order of first use
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
    for n in members:
        env[n] = g.node_copy(n, arg)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        raise PlanError(f"layer {path!r} produces nothing the rest of the model reads")
    g.output(tuple(env[n] for n in outputs))
    g.lint()
    module = fx.GraphModule(own, g, class_name="LayerProgram")
    return module, inputs, outputs


def layer_ranges(graph: Any) -> list[tuple[str, int, int]]:
    """(path, start, stop) of every pipeline unit (a child of the layer container)."""
    from autoplan.estimate.partition import pipeline_units
    return [(u.path, u.start, u.stop) for u in pipeline_units(graph)]


def owned_modules(root: nn.Module, paths: Sequence[str]) -> list[nn.Module]:
    return [root.get_submodule(p) for p in paths]
