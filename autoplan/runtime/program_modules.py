"""Cut the rank program into modules: one per layer, and one per pipeline chunk.

FSDP2 shards and gathers per module, activation checkpointing wraps a module, and pipeline
stages hold whole layers: all need modules. The rank program is one flat graph whose nodes know
the op they belong to (``node.meta["autoplan_op"]``).

- ``split_layers`` moves the nodes of each layer (a pipeline unit: a child of the model's layer
  container, ``layers.7``) into a ``GraphModule`` of its own, installed at the layer's path,
  owning the layer's parameters under their own names, so every FQN stays what the user's model
  calls it (``layers.7.attn.q_proj.weight``). The root calls the layers in order; what a layer
  reads from outside (activations, a weight tied to another module) comes in as arguments.
- ``split_chunks`` cuts the program into consecutive op ranges (pipeline chunks): chunk ``c``
  takes every value that later chunks still need (its ``boundary``) and returns the next
  boundary, passing through what it does not produce (masks, rotary tables, the targets for the
  loss on the last chunk).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autoplan.errors import PlanError
from autoplan.runtime.program import COMM_SLOTS, OP
from autoplan.estimate.partition import pipeline_units


def op_of(node: fx.Node, seen: dict[fx.Node, int | None]) -> int | None:
    """The graph op a node belongs to (a getitem follows its source)."""
    if OP in node.meta:
        return node.meta[OP]
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node):
            return seen.get(src)
    return None


def _owner(nodes: Sequence[fx.Node], ranges: Sequence[tuple[int, int]]) -> dict[fx.Node, int]:
    seen: dict[fx.Node, int | None] = {}
    group: dict[fx.Node, int] = {}
    for n in nodes:
        i = op_of(n, seen)
        seen[n] = i
        if i is None:
            continue
        for k, (start, stop) in enumerate(ranges):
            if start <= i < stop:
                group[n] = k
                break
    return group


def _attrs(gm: fx.GraphModule) -> dict[str, Any]:
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            out[n.target] = obj
    return out


def extract(members: Sequence[fx.Node], attrs: dict[str, Any], *,
            own: Callable[[str], str | None], inputs: Sequence[fx.Node] | None = None,
            outputs: Sequence[fx.Node] | None = None, class_name: str = "LayerProgram",
            contiguous: bool = False) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A GraphModule of ``members`` (in order). Attributes ``own`` maps to a name live in it;
    other outside nodes become arguments (``inputs`` fixes them and their order). It returns
    ``outputs`` (default: the members read outside). Returns (module, inputs, outputs)."""
    inside = set(members)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    args: list[fx.Node] = list(inputs) if inputs is not None else []
    fixed = inputs is not None
    for k, a in enumerate(args):
        env[a] = g.placeholder(f"in_{k}")
    mine: dict[str, Any] = {}

    def arg(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr":
            name = own(a.target)
            if name is not None:
                mine[name] = attrs[a.target]
                env[a] = g.get_attr(name)
                return env[a]
        if fixed:
            raise PlanError(f"pipeline chunk reads {a.name}, which its inputs do not carry")
        args.append(a)
        env[a] = g.placeholder(f"in_{len(args) - 1}")
        return env[a]
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
    for n in members:
        env[n] = g.node_copy(n, arg)
    if outputs is None:
        outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        raise PlanError(f"{class_name}: a part of the model whose results nothing reads")
    results = [arg(n) for n in outputs]
    if contiguous:      # sent to another rank: point-to-point sends need contiguous tensors
        results = [g.call_function(torch.ops.aten.contiguous.default, (r,)) for r in results]
    g.output(tuple(results) if len(results) != 1 or inputs is None else results[0])
    for k, n in enumerate(n for n in g.nodes if n.op not in ("placeholder", "output")):
        n._rename(f"v{k}")     # by position: two identical layers read as the same program
    g.lint()
    return fx.GraphModule(mine, g, class_name=class_name), args, list(outputs)


def share_code(modules: Sequence[fx.GraphModule]) -> None:
    """Modules whose programs are the same text (the layers of one kind: ``extract`` names
    nodes by position) become instances of one class, so they run one ``forward`` code object
    and ``torch.compile`` compiles a layer kind once and reuses it for every layer of that kind
    (its cache lives on the code object, guarded on the module's type): regional compilation's
    bounded compile time. fx gives every GraphModule a class of its own, holding only the
    forward made from its text."""
    first: dict[str, fx.GraphModule] = {}
    for m in modules:
        twin = first.setdefault(m.code, m)
        if twin is not m:
            m.__class__ = type(twin)


def split_layers(gm: fx.GraphModule, ranges: Sequence[tuple[str, int, int]]
                 ) -> fx.GraphModule:
    """A root GraphModule calling one GraphModule per ``(path, start, stop)`` op range."""
    if not ranges:
        return gm
    nodes = list(gm.graph.nodes)
    group = _owner(nodes, [(s, e) for _, s, e in ranges])
    members: list[list[fx.Node]] = [[] for _ in ranges]
    for n in nodes:
        if n in group:
            members[group[n]].append(n)
    attrs = _attrs(gm)
    root = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root_attrs: dict[str, Any] = {}
    done: set[int] = set()
    layers: list[fx.GraphModule] = []

    def get(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":      # emitted where the root first reads it
            root_attrs[a.target] = attrs[a.target]
            env[a] = root.get_attr(a.target)
        return env[a]
    for n in nodes:
        k = group.get(n)
        if k is None:
            if n.op != "get_attr":
                env[n] = root.node_copy(n, get)
            continue
        if k in done:
            continue
        done.add(k)
        path = ranges[k][0]
        prefix = path + "."

        def own(target: str, prefix: str = prefix) -> str | None:
            if target.startswith(prefix):
                return target[len(prefix):]
            return target if target.startswith("_autoplan_") else None
        module, inputs, outputs = extract(members[k], attrs, own=own)
        root_attrs[path] = module
        layers.append(module)
        call = root.call_module(path, tuple(get(x) for x in inputs))
        for j, out in enumerate(outputs):
            env[out] = root.call_function(operator.getitem, (call, j))
    root.lint()
    share_code(layers)
    return fx.GraphModule(root_attrs, root, class_name=type(gm).__name__)


OUTSIDE = "_autoplan_outside"      # the parts between layers: ``_autoplan_outside_0``, ...


def split_outside(root: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """The parts of ``root`` (``split_layers``'s) that run between its layer calls, before the
    first (embedding, rotary tables, masks) and after the last (final norm, LM head, loss),
    each moved into a GraphModule of its own at ``_autoplan_outside_k``, so that regional
    compilation compiles them too (``parallelize.apply_compile``). A part holds no weight: the
    root reads them (``get_attr``, every FQN unchanged, FSDP's root unit gathers them) and
    passes them in; it holds only the process-group slots its collectives read. A part whose
    only ops are ``getitem`` stays in the root. Parts of the same text share one class
    (``share_code``), so the number of compiled graphs stays bounded at any depth. Returns the
    new root and the parts' attribute names, in order."""
    nodes = list(root.graph.nodes)
    layer_calls = {n for n in nodes if n.op == "call_module"}
    parts: list[list[fx.Node]] = [[]]
    for n in nodes:
        if n in layer_calls:
            parts.append([])
        elif n.op in ("call_function", "call_method") and not (
                n.target is operator.getitem and n.args[0] in layer_calls):
            parts[-1].append(n)
    parts = [p for p in parts if any(n.target is not operator.getitem for n in p)]
    if not parts:
        return root, []
    attrs = _attrs(root)
    last = {p[-1]: k for k, p in enumerate(parts)}
    inside = {n for p in parts for n in p}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    mods: dict[str, Any] = dict(attrs)
    names: list[str] = []
    made: list[fx.GraphModule] = []
    for n in nodes:
        if n.op == "call_module":
            mods[n.target] = root.get_submodule(n.target)
        if n not in inside:
            env[n] = g.node_copy(n, env.__getitem__)
            continue
        k = last.get(n)
        if k is None:
            continue
        # non-tensor attributes (the collectives' process-group slots) live in the part
        module, inputs, outputs = extract(
            parts[k], attrs, own=lambda t: None if isinstance(attrs[t], torch.Tensor) else t,
            class_name="OutsideProgram")
        _communicating_calls_eager(module)
        name = f"{OUTSIDE}_{k}"
        mods[name] = module
        names.append(name)
        made.append(module)
        call = g.call_module(name, tuple(env[x] for x in inputs))
        for j, out in enumerate(outputs):
            env[out] = g.call_function(operator.getitem, (call, j))
    for n in [n for n in g.nodes if n.op == "get_attr" and not n.users]:
        g.erase_node(n)                 # read by a part only (a slot it holds)
    g.lint()
    share_code(made)
    return fx.GraphModule(mods, g, class_name=type(root).__name__), names


def _communicating_calls_eager(part: fx.GraphModule) -> None:
    """The calls of ``part`` that read a process-group slot (collectives, a vocabulary-parallel
    embedding or loss, per-rank random masks) run eagerly under ``torch.compile``, each a
    graph break with its reason recorded (``torch._dynamo.utils.counters["graph_break"]``,
    ``TORCH_LOGS=graph_breaks``); the part's other ops compile around them."""
    for n in part.graph.nodes:
        if n.op == "call_function" and any(
                isinstance(a, fx.Node) and a.op == "get_attr" and a.target in COMM_SLOTS
                for a in n.args):
            n.target = eager_call(n.target)
    part.recompile()


@functools.lru_cache(maxsize=None)
def eager_call(fn: Callable) -> Callable:
    """``fn`` run eagerly under ``torch.compile`` (one wrapper per function, so that parts of
    the same text still share their code)."""
    return torch.compiler.disable(
        fn, reason=f"autoplan: {fn.__name__} communicates over a process group (dynamo "
        "cannot trace its kernel's schema checks or the gloo/NCCL call): it runs eagerly "
        "between the compiled pieces")


@dataclass(frozen=True)
class Chunk:
    module: fx.GraphModule
    held: list[str]                 # FQNs of the attributes it holds
    inputs: list[fx.Node]           # program nodes it takes, in order
    outputs: list[fx.Node]          # program nodes it returns, in order


def split_chunks(gm: fx.GraphModule, cuts: Sequence[int]) -> list[Chunk]:
    """One GraphModule per op range ``[cuts[c], cuts[c + 1])``; chunk 0 takes the program's
    inputs, chunk c > 0 the values chunk c - 1 returns."""
    nodes = list(gm.graph.nodes)
    ranges = list(zip(cuts[:-1], cuts[1:]))
    group = _owner(nodes, ranges)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    n_chunks = len(ranges)
    members: list[list[fx.Node]] = [[] for _ in ranges]
    for n in nodes:
        if n in group:
            members[group[n]].append(n)
    # boundary after chunk c: values made in chunks <= c (or program inputs) read after it
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        k = n_chunks if n is out_node else group.get(n)
        if k is None:
            continue
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                last_use[a] = max(last_use.get(a, -1), k)
    made = {n: group.get(n, -1) for n in nodes}
    attrs = _attrs(gm)
    out = []
    boundary = placeholders
    for c in range(n_chunks):
        if c == n_chunks - 1:
            results = list(out_node.all_input_nodes)
        else:
            results = [n for n in nodes if n.op != "get_attr" and made[n] <= c
                       and last_use.get(n, -1) > c and (n.op == "placeholder" or n in group)]
        module, _, _ = extract(members[c], attrs, own=lambda t: t, inputs=boundary,
                               outputs=results, class_name=f"PipelineChunk{c}",
                               contiguous=c < n_chunks - 1)
        held = [n.target for n in module.graph.nodes if n.op == "get_attr"]
        out.append(Chunk(module, held, list(boundary), list(results)))
        boundary = results
    return out


def layer_ranges(graph: Any) -> list[tuple[str, int, int]]:
    """(path, start, stop) of every pipeline unit (a child of the layer container)."""
    return [(u.path, u.start, u.stop) for u in pipeline_units(graph)]
