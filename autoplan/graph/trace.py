"""Trace a PyTorch model into an ``OpGraph`` with torch.export.

``torch.export`` (not ``fx.symbolic_trace``, which fails on Hugging Face models) gives an
aten-level training graph whose nodes carry FakeTensor values and ``nn_module_stack``. It runs
on meta-device models, so a 175B-parameter model traces without memory. We read the graph once,
apply the op rules (``oprules``), track views to their storage owner (for activation liveness),
propagate ``requires_grad``, and find the repeated blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from autoplan.errors import TraceError
from autoplan.gc_pause import with_fewer_collections
from autoplan.graph.blocks import find_blocks, outermost_indexed
from autoplan.graph.opgraph import Op, OpGraph, TensorMeta, Value
from autoplan.graph.oprules import OpCall, io_bytes, rule_for
from autoplan.graph import stamp

_TORCH_DIR = os.path.dirname(torch.__file__)

# Ops that change no value, only (maybe) its memory layout, and that export records or not
# depending on the layout it saw (``contiguous`` after a transpose is a copy on one device and
# a no-op on another, meta included): the graph treats their output as their input, so a plan
# made on the meta device fits the model on any device; the runtime still runs them.
TRANSPARENT = (torch.ops.aten.contiguous.default,)


class _WithLoss(nn.Module):
    """Puts the loss inside the traced program so its ops are costed too."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 num_inputs: int, upcast: bool = False):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.upcast = upcast        # 16-bit weights: the loss reads the outputs in fp32

    def forward(self, *args):
        out = self.model(*args[: self.num_inputs])
        if self.upcast:
            out = float_outputs(out)
        return self.loss_fn(out, args[self.num_inputs])


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor in it (tuples, lists, dicts, dataclass-like
    outputs with ``__dict__`` left alone) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floating(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _cast_floating(v, dtype)) for k, v in obj.items())
    return obj


def float_outputs(out: Any) -> Any:
    """A 16-bit model's outputs in fp32, as Megatron-LM's ``Float16Module`` hands them to the
    loss (its cross entropy reads fp32 logits)."""
    return _cast_floating(out, torch.float32)


def sixteen_bit_inputs(inputs: Sequence[Any], dtype: torch.dtype) -> tuple:
    """A 16-bit model's inputs: the floating-point ones cast to ``dtype`` (Megatron-LM's
    ``Float16Module`` casts them so), token ids and masks of other dtypes as they are."""
    return tuple(_cast_floating(x, dtype) for x in inputs)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(d) for d in t.shape), dtype=_dtype_name(t.dtype))


def _to_meta_inputs(inputs: Sequence[Any]) -> tuple:
    return tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


# ---- errors that help -----------------------------------------------------------------------

@contextmanager
def _module_tracker(model: nn.Module):
    """Keep the stack of modules whose forward is running, to name where tracing failed."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(mod, args):
        if id(mod) in names:
            stack.append(names[id(mod)] or "<root>")

    def post(mod, args, out):
        if id(mod) in names and stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield stack
    finally:
        h1.remove()
        h2.remove()


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch (the user's model code), as file:line."""
    best = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(_TORCH_DIR) and "autoplan/graph/trace" not in frame.filename:
            best = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return best


def _trace_error(exc: BaseException, model_name: str, stack: list[str]) -> TraceError:
    module = stack[-1] if stack else "<unknown>"
    where = _user_frame(exc) or "<no frame outside torch>"
    msg = str(exc).strip().splitlines()
    original = "\n    ".join(msg[:12]) + ("\n    ..." if len(msg) > 12 else "")
    return TraceError(
        f"torch.export could not trace model {model_name!r}.\n"
        f"  module: {module}\n"
        f"  source: {where}\n"
        f"  error:  {type(exc).__name__}: {original}\n"
        "  what to try: remove data-dependent Python control flow and .item()/.tolist() calls "
        "from forward (use torch.where / torch.cond), avoid Python-side shape asserts on "
        "tensor values, pass use_cache=False to Hugging Face models, and check that the "
        "example inputs have the shapes the model expects.")


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


# ---- the tracer -------------------------------------------------------------------------------

@with_fewer_collections
def trace(model: nn.Module, example_inputs: Sequence[Any], *,
          loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
          targets: torch.Tensor | None = None, train: bool = True,
          name: str | None = None, fold_repeats: bool = True) -> OpGraph:
    """Trace ``model(*example_inputs)`` (plus ``loss_fn(output, targets)`` if given) to an OpGraph.

    Works on real and meta-device models; a meta-device model never allocates its parameters.
    With ``fold_repeats`` a model whose layers sit in a list of identical modules is traced
    through two layers and the others are stamped from them (``stamp.py``; same graph, a
    fraction of the time); anything unusual falls back to tracing every layer.
    Raises ``TraceError`` naming the failing module and source line when export fails.
    """
    if fold_repeats and isinstance(model, nn.Module):
        found = stamp.repeated_list(model)
        if found is not None:
            container, _mod, n = found
            t0 = time.perf_counter()
            quiet = logging.getLogger("torch._subclasses.fake_tensor")
            level = quiet.level
            quiet.setLevel(logging.CRITICAL)     # a failed cut is expected to log errors
            try:
                with stamp.cut_to_two(model, container):
                    short = trace(model, example_inputs, loss_fn=loss_fn, targets=targets,
                                  train=train, name=name, fold_repeats=False)
            except TraceError:
                short = None
            finally:
                quiet.setLevel(level)
            full = stamp.stamp(short, container, n) if short is not None else None
            expected = sum(p.numel() for p in model.parameters())
            if full is not None and full.num_params == expected:
                meta = dict(full.meta)
                meta["trace_s"] = round(time.perf_counter() - t0, 3)
                return OpGraph(name=full.name, ops=full.ops, values=full.values,
                               inputs=full.inputs, outputs=full.outputs, blocks=full.blocks,
                               batch_size=full.batch_size, meta=meta)
    ep, graph, _prefix = export_program(model, example_inputs, loss_fn=loss_fn,
                                        targets=targets, train=train, name=name)
    return graph


@with_fewer_collections
def export_program(model: nn.Module, example_inputs: Sequence[Any], *,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                   targets: torch.Tensor | None = None, train: bool = True,
                   name: str | None = None, autocast_dtype: torch.dtype | None = None,
                   device: torch.device | None = None,
                   weights_dtype: torch.dtype | None = None) -> tuple[Any, OpGraph, str]:
    """Export ``model(*example_inputs)`` (plus the loss) with torch.export and read it into an
    OpGraph with one op per call node (every layer traced, nothing stamped). Returns the
    ExportedProgram, the graph (op names are the program's node names) and the prefix its
    parameter names carry (``"model."`` when the loss is included, else ``""``).

    ``autocast_dtype`` (16-bit training): the export runs under ``torch.autocast`` of that
    dtype on the model's device, as the training step will, so the graph is the program that
    step runs: the dtypes the model reads at run time (``x.to(q.dtype)``, HF's RMSNorm casting
    back to its input's dtype), the autocast-disabled regions it opens only when autocast is on
    (HF's rotary embeddings), and dtype-keyed branches are what eager ``torch.autocast`` would
    meet, not what an fp32 trace baked in. Torch keeps no autocast for meta tensors: a model
    on the meta device is exported as fake tensors on ``device`` (the device the step runs on;
    nothing is allocated), so its graph is that device's 16-bit program too.

    ``weights_dtype`` (16-bit weights, ``mixed_precision="params"``): the model is exported as
    ``model.to(weights_dtype)`` would run (its floating parameters and buffers in that dtype,
    swapped in for the export only), its floating inputs cast to it and, with a loss, its
    outputs cast to fp32 before the loss, as Megatron-LM's ``Float16Module`` runs a model."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise TraceError("trace() needs example inputs: a tensor (or a tuple of them) shaped "
                         "like one batch the model takes; meta tensors are fine")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs:
        raise TraceError("trace() needs at least one example input (a tensor of the batch)")
    if (loss_fn is None) != (targets is None):
        raise TraceError("pass loss_fn and targets together (or neither)")
    model_name = name or type(model).__name__
    root: nn.Module = model
    prefix = ""
    if weights_dtype is not None:
        inputs = sixteen_bit_inputs(inputs, weights_dtype)
    if loss_fn is not None:
        root = _WithLoss(model, loss_fn, len(inputs), upcast=weights_dtype is not None)
        inputs = inputs + (targets,)
        prefix = "model."
    fakes = contextlib.nullcontext()
    if _on_meta(model):
        inputs = _to_meta_inputs(inputs)
        if autocast_dtype not in (None, torch.float32) and device is not None \
                and device.type != "meta":
            fakes = _fakes_on(model, device)
    was_training = model.training
    model.train(train)
    t0 = time.perf_counter()
    try:
        with _module_tracker(root) as stack, fakes as to_fake, \
                _weights_in(model, weights_dtype):
            if to_fake is not None:
                inputs = tuple(to_fake(x) for x in inputs)
            try:
                with _autocast(model, inputs, autocast_dtype):
                    ep = torch.export.export(root, inputs)
            except Exception as e:  # export raises many types; re-raise as one that helps
                raise _trace_error(e, model_name, stack) from e
    finally:
        model.train(was_training)
    trace_s = time.perf_counter() - t0
    graph = _to_opgraph(ep, model_name, prefix, model)
    meta = dict(graph.meta)
    meta.update({"trace_s": round(trace_s, 3), "torch": torch.__version__,
                 "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
                 "train": train})
    graph = OpGraph(name=graph.name, ops=graph.ops, values=graph.values, inputs=graph.inputs,
                    outputs=graph.outputs, blocks=graph.blocks, batch_size=graph.batch_size,
                    meta=meta)
    return ep, graph, prefix


@contextmanager
def _weights_in(model: nn.Module, dtype: torch.dtype | None):
    """``model``'s floating parameters and buffers swapped for copies in ``dtype`` while the
    block runs (tied ones staying tied; nothing when ``dtype`` is None); the model's own tensors
    are put back after."""
    if dtype is None:
        yield
        return
    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in made:
                    c = t.detach().to(dtype)
                    made[id(t)] = (nn.Parameter(c, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else c)
                table[attr] = made[id(t)]
                swapped.append((table, attr, t))
    try:
        yield
    finally:
        for table, attr, t in reversed(swapped):
            table[attr] = t


@contextmanager
def _fakes_on(model: nn.Module, device: torch.device):
    """``model``'s meta parameters and buffers swapped for fake tensors on ``device`` (shapes,
    dtypes and a device, no memory) while the block runs, tied ones staying tied; yields the
    function that makes a meta input such a fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        if id(t) not in made:
            with mode:
                f = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = (nn.Parameter(f, requires_grad=t.requires_grad)
                           if isinstance(t, nn.Parameter) else f)
        return made[id(t)]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is not None and t.is_meta:
                    table[attr] = fake(t)
                    swapped.append((table, attr, t))
    try:
        yield fake
    finally:
        for table, attr, t in reversed(swapped):
            table[attr] = t


def _autocast(model: nn.Module, inputs: Sequence[Any], dtype: torch.dtype | None) -> Any:
    """The autocast the training step runs the model under, keyed on the device its weights
    (else its inputs) live on; a null context for fp32 or a model on the meta device."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in inputs if isinstance(x, torch.Tensor))]
    device = next((t.device for t in tensors if not t.is_meta), None)
    if device is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def as_graph(model: Any, example_inputs: Sequence[Any] | None, *, loss_fn: Any = None,
             targets: Any = None, who: str = "this function",
             error: type[Exception] = TraceError) -> OpGraph:
    """``model`` itself when it is an OpGraph, else its trace; ``error`` when there are no inputs."""
    if isinstance(model, OpGraph):
        return model
    if example_inputs is None:
        raise error(f"{who} needs example_inputs to trace the model (meta tensors are fine), "
                    "or an OpGraph from autoplan.trace")
    return trace(model, example_inputs, loss_fn=loss_fn, targets=targets)


def _strip(path: str, prefix: str) -> str:
    if prefix and path.startswith(prefix):
        return path[len(prefix):]
    if prefix and path + "." == prefix:
        return ""
    return path


def _to_opgraph(ep: torch.export.ExportedProgram, model_name: str, prefix: str,
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


if sys.version_info < (3, 10):  # pragma: no cover
    raise ImportError("autoplan needs Python 3.10 or newer")
