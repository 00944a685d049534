"""Read an exported program (``torch.export``) into an ``OpGraph``.

One pass over the program's nodes in order: parameters, buffers, constants and user inputs
become values; every call becomes an op priced by the op rules (``oprules``), its arguments
encoded as JSON (no code); views are tracked to their storage owner (for activation liveness),
``requires_grad`` is propagated, and the repeated blocks are found. ``trace.py`` runs the export
and hands its program here (``read_exported``).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from autoplan.errors import TraceError
from autoplan.graph.blocks import find_blocks, outermost_indexed
from autoplan.graph.opgraph import Op, OpGraph, TensorMeta, Value
from autoplan.graph.oprules import OpCall, io_bytes, rule_for


# Ops that change no value, only (maybe) its memory layout, and that export records or not
# depending on the layout it saw (``contiguous`` after a transpose is a copy on one device and
# a no-op on another, meta included): the graph treats their output as their input, so a plan
# made on the meta device fits the model on any device; the runtime still runs them.
TRANSPARENT = (torch.ops.aten.contiguous.default,)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(d) for d in t.shape), dtype=_dtype_name(t.dtype))


# ---- argument encoding (JSON, no code) --------------------------------------------------------

def _encode_arg(a: Any, node_value: Callable[[torch.fx.Node], str | None]) -> Any:
    if isinstance(a, torch.fx.Node):
        name = node_value(a)
        return {"v": name} if name is not None else {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [_encode_arg(x, node_value) for x in a]
    if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"float": repr(a)}
    if isinstance(a, torch.dtype):
        return {"dtype": _dtype_name(a)}
    if isinstance(a, torch.device):
        # the graph is the same program on any device: a plan made on meta runs on GPUs
        return {"device": "*"}
    if isinstance(a, (torch.memory_format, torch.layout)):
        return {"enum": str(a)}
    return {"repr": type(a).__name__}


def _scalars(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(a for a in args if not isinstance(a, torch.fx.Node)
                 and not (isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a)))


def _tensor_nodes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []

    def visit(a):
        if isinstance(a, torch.fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
    for a in args:
        visit(a)
    for a in kwargs.values():
        visit(a)
    return out


# ---- the reader ------------------------------------------------------------------------------

def _strip(path: str, prefix: str) -> str:
    if prefix and path.startswith(prefix):
        return path[len(prefix):]
    if prefix and path + "." == prefix:
        return ""
    return path


def read_exported(ep: torch.export.ExportedProgram, model_name: str, prefix: str,
                  model: nn.Module) -> OpGraph:
    """The OpGraph of an exported program: its nodes read in order (``_GraphReader``), then
    its outputs, the batch size and the repeated blocks; refused when it has no samples or
    computes nothing."""
    reader = _GraphReader(ep, prefix, model)
    for node in ep.graph.nodes:
        reader.read(node)
    outputs = []
    for node in ep.graph.nodes:
        if node.op == "output":
            for a in _tensor_nodes(node.args, {}):
                if reader.resolve(a) is not None:
                    outputs.append(reader.resolve(a))
    values, ops, user_inputs = reader.values, reader.ops, reader.user_inputs
    first = values[user_inputs[0]].meta if user_inputs else None
    batch = first.shape[0] if first is not None and first.shape else 1
    if batch < 1:
        raise TraceError(f"the first example input of {model_name!r} has shape "
                         f"{list(first.shape)}: no samples; pass at least one row")
    if not any(op.fwd_flops or op.bytes_written for op in ops):
        raise TraceError(f"{model_name!r} computes nothing (no op reads or writes data): an "
                         "empty nn.Sequential or an identity has nothing to plan")
    blocks = find_blocks(ops, reader.instance_of_op, values, reader.module_types)
    return OpGraph(name=model_name, ops=tuple(ops), values=tuple(values.values()),
                   inputs=tuple(user_inputs), outputs=tuple(outputs), blocks=blocks,
                   batch_size=int(batch))


class _GraphReader:
    """Reads an exported program's nodes in order into values and ops: parameters, buffers,
    constants and user inputs become values; ``getitem`` and layout-only ops name values
    already read; every other call becomes an op (with the module instance it runs in)."""

    def __init__(self, ep: torch.export.ExportedProgram, prefix: str, model: nn.Module):
        self.prefix = prefix
        self.requires_grad = {n: p.requires_grad
                              for n, p in model.named_parameters(remove_duplicate=False)}
        self.spec_of = {s.arg.name: s for s in ep.graph_signature.input_specs
                        if hasattr(s.arg, "name")}
        self.values: dict[str, Value] = {}
        self.storage_owner: dict[StorageWeakRef, str] = {}
        self.node_value: dict[str, str] = {}     # fx node name -> value name (getitem resolves)
        self.ops: list[Op] = []
        self.instance_of_op: list[str | None] = []
        self.module_types: dict[str, str] = {}
        self.user_inputs: list[str] = []

    def add_value(self, name: str, t: torch.Tensor, kind: str, grad: bool,
                  fqn: str = "") -> None:
        try:
            ref = StorageWeakRef(t.untyped_storage())
            base = self.storage_owner.setdefault(ref, name)
        except (RuntimeError, NotImplementedError):
            base = name
        if base != name and self.values[base].meta.nbytes < _meta_of(t).nbytes:
            base = name  # a view larger than its recorded owner: treat it as its own storage
        self.values[name] = Value(name=name, kind=kind, meta=_meta_of(t), base=base,
                                  requires_grad=grad, fqn=fqn)

    def resolve(self, n: torch.fx.Node) -> str | None:
        return self.node_value.get(n.name)

    def read(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                self._input(node, val)
        elif node.op == "get_attr":
            if isinstance(val, torch.Tensor):
                self.add_value(node.name, val, "constant", False, str(node.target))
                self.node_value[node.name] = node.name
        elif node.op != "call_function":
            return
        elif node.target is operator.getitem:
            src, idx = node.args
            src_outs = getattr(src, "_autoplan_outputs", None)
            if src_outs is not None and idx < len(src_outs) and src_outs[idx] is not None:
                self.node_value[node.name] = src_outs[idx]
        elif node.target in TRANSPARENT and isinstance(node.args[0], torch.fx.Node) \
                and self.resolve(node.args[0]) is not None:
            self._same_value(node, val)
        else:
            self._op(node, val)

    def _input(self, node: torch.fx.Node, val: torch.Tensor) -> None:
        """A placeholder: a parameter, buffer, constant or user input."""
        from torch.export.graph_signature import InputKind
        spec = self.spec_of.get(node.name)
        if spec is not None and spec.kind == InputKind.PARAMETER:
            fqn = _strip(spec.target, self.prefix)
            grad = self.requires_grad.get(fqn, self.requires_grad.get(spec.target, True))
            self.add_value(node.name, val, "param", val.is_floating_point() and grad, fqn)
        elif spec is not None and spec.kind == InputKind.BUFFER:
            self.add_value(node.name, val, "buffer", False, _strip(spec.target, self.prefix))
        elif spec is not None and spec.kind in (InputKind.CONSTANT_TENSOR,):
            self.add_value(node.name, val, "constant", False, str(spec.target))
        else:
            self.add_value(node.name, val, "input", False)
            self.user_inputs.append(node.name)
        self.node_value[node.name] = node.name

    def _same_value(self, node: torch.fx.Node, val: Any) -> None:
        """A layout-only op (``TRANSPARENT``): the same value, and where it copied, its
        storage."""
        src = self.resolve(node.args[0])
        self.node_value[node.name] = src
        if isinstance(val, torch.Tensor):
            try:
                self.storage_owner.setdefault(StorageWeakRef(val.untyped_storage()),
                                              self.values[src].base)
            except (RuntimeError, NotImplementedError):
                pass

    def _op(self, node: torch.fx.Node, val: Any) -> None:
        """An op, with the module instance it runs in (and its modules' types)."""
        try:
            self.ops.append(_make_op(node, val, self.values, self.add_value, self.resolve,
                                     self.node_value, self.prefix))
        except TraceError:
            raise
        except Exception as e:      # e.g. a shape that depends on tensor values (unbacked)
            stack = node.meta.get("nn_module_stack") or {}
            where = list(stack.values())[-1][0] if stack else "<root>"
            raise TraceError(
                f"cannot read op {node.name} ({node.target}) in module "
                f"{_strip(where, self.prefix)!r}: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}. autoplan needs every "
                "tensor's shape at trace time; an output whose size depends on tensor values "
                "(nonzero, masked_select, unique, boolean indexing) cannot be planned: pad to a "
                "fixed size or use torch.where") from e
        stack = node.meta.get("nn_module_stack") or {}
        paths = [_strip(p, self.prefix) for p, _t in stack.values()]
        for (p, t) in stack.values():
            self.module_types[_strip(p, self.prefix)] = (
                t if isinstance(t, str) else getattr(t, "__qualname__", str(t)))
        self.instance_of_op.append(outermost_indexed([p for p in paths if p]))


def _make_op(node: torch.fx.Node, val: Any, values: dict[str, Value], add_value, resolve,
             node_value: dict[str, str], prefix: str) -> Op:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name.split("::")[-1]
        target_name = f"aten.{packet}.{target._overloadname}" if target.namespace == "aten" \
            else f"{target.namespace}.{packet}.{target._overloadname}"
        alias_returns = any(r.alias_info is not None and not r.alias_info.is_write
                            for r in target._schema.returns)
        is_pointwise = torch.Tag.pointwise in target.tags
    else:
        packet = getattr(target, "__name__", str(target))
        target_name = str(packet)
        alias_returns = False
        is_pointwise = False
    rule = rule_for(packet, is_view=alias_returns, is_pointwise=is_pointwise)

    in_nodes = [n for n in _tensor_nodes(node.args, node.kwargs) if resolve(n) is not None]
    in_names = tuple(resolve(n) for n in in_nodes)
    in_metas = tuple(values[n].meta for n in in_names)
    in_grad = tuple(values[n].requires_grad for n in in_names)

    outs = list(val) if isinstance(val, (tuple, list)) else [val]
    out_names: list[str | None] = []
    multi = isinstance(val, (tuple, list))
    getitem_names = {}
    if multi:
        for u in node.users:
            if u.target is operator.getitem:
                getitem_names[u.args[1]] = u.name
    differentiable = rule.kind not in ("creation",) and any(in_grad)
    for i, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            out_names.append(None)
            continue
        vname = getitem_names.get(i, f"{node.name}.{i}") if multi else node.name
        add_value(vname, t, "activation", differentiable and t.is_floating_point())
        out_names.append(vname)
    node._autoplan_outputs = out_names  # read by the getitem nodes that follow
    if not multi:
        node_value[node.name] = node.name
    out_list = tuple(n for n in out_names if n is not None)
    out_metas = tuple(values[n].meta for n in out_list)

    call = OpCall(name=packet, inputs=in_metas, input_requires_grad=in_grad, outputs=out_metas,
                  scalars=_scalars(node.args), kwargs={k: v for k, v in node.kwargs.items()
                                                       if not isinstance(v, torch.fx.Node)})
    fwd = int(rule.flops(call))
    bwd = int(rule.bwd_flops(call, fwd)) if differentiable else 0
    saved = rule.saves(call) if differentiable else None
    saved_names: tuple[str, ...] = ()
    internal: tuple[TensorMeta, ...] = ()
    if saved is not None:
        saved_names = tuple(in_names[i] for i in saved.inputs if i < len(in_names)) + \
            tuple(out_list[i] for i in saved.outputs if i < len(out_list))
        internal = saved.internal
    read, written = io_bytes(packet, rule.kind, in_metas, out_metas)
    params = tuple(values[n].fqn for n in in_names if values[n].kind in ("param", "buffer"))
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, mtype = list(stack.values())[-1]
        path = _strip(path, prefix)
        mtype = mtype if isinstance(mtype, str) else getattr(mtype, "__qualname__", str(mtype))
    else:
        path, mtype = "", ""
    args_json = json.dumps({"args": _encode_arg(list(node.args), resolve),
                            "kwargs": _encode_arg_dict(node.kwargs, resolve)},
                           sort_keys=True, separators=(",", ":"))
    return Op(name=node.name, target=target_name, kind=rule.kind, inputs=in_names,
              outputs=out_list, args=args_json, fwd_flops=fwd, bwd_flops=bwd,
              bytes_read=read, bytes_written=written, params=params, module_path=path,
              module_type=mtype, saved=saved_names, saved_internal=internal,
              differentiable=differentiable)


def _encode_arg_dict(kwargs: Mapping[str, Any], resolve) -> dict[str, Any]:
    return {k: _encode_arg(v, resolve) for k, v in sorted(kwargs.items())}
