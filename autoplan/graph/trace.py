"""Trace a PyTorch model into an ``OpGraph`` with torch.export.

``torch.export`` (not ``fx.symbolic_trace``, which fails on Hugging Face models) gives an
aten-level training graph whose nodes carry FakeTensor values and ``nn_module_stack``. It runs
on meta-device models, so a 175B-parameter model traces without memory. This module runs the
export (the loss inside it, 16-bit weights and autocast as the training step runs them, errors
that name the failing module); ``export_reader`` reads the program into an OpGraph.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autoplan.errors import TraceError
from autoplan.gc_pause import with_fewer_collections
from autoplan.graph.export_reader import TRANSPARENT, read_exported
from autoplan.graph.opgraph import OpGraph
from autoplan.graph import stamp

__all__ = ["TRANSPARENT", "as_graph", "export_program", "float_outputs", "sixteen_bit_inputs",
           "trace"]

_TORCH_DIR = os.path.dirname(torch.__file__)


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


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


def _off_cpu(model: nn.Module) -> bool:
    return any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers()))


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
    meet, not what an fp32 trace baked in.

    A model on the meta device is exported as fake tensors (shapes and strides, no memory) on
    ``device`` (the device the step runs on), the CPU by default, never on meta: the meta
    device's kernels lay out outputs otherwise (SDPA's, so the reshape after it is a copy
    there and a view on the CPU and CUDA), models branch on their tensors' device (Hugging
    Face's MoE routers count experts in floats on the CPU; autocast regions are keyed on it,
    and meta has no autocast), so a meta trace would not be the graph the ranks trace from the
    model built on the CPU, nor run. Views among the inputs stay views (targets that are the
    shifted tokens). Without ``device`` (the planning trace) a model on a GPU is traced so too:
    a plan is made from the CPU's graph wherever the model sits.

    ``weights_dtype`` (16-bit weights, ``mixed_precision="params"``): the model is exported as
    ``model.to(weights_dtype)`` would run (its floating parameters and buffers in that dtype,
    swapped in for the export only), its floating inputs cast to it and, with a loss, its
    outputs cast to fp32 before the loss, as Megatron-LM's ``Float16Module`` runs a model."""
    inputs = _checked_inputs(model, example_inputs, loss_fn, targets)
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
        fakes = _fakes_on(model, device if device is not None and device.type != "meta"
                          else torch.device("cpu"))
    elif device is None and _off_cpu(model):      # planning a model that sits on a GPU
        fakes = _fakes_on(model, torch.device("cpu"))
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
    graph = read_exported(ep, model_name, prefix, model)
    meta = dict(graph.meta)
    meta.update({"trace_s": round(trace_s, 3), "torch": torch.__version__,
                 "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
                 "train": train})
    graph = OpGraph(name=graph.name, ops=graph.ops, values=graph.values, inputs=graph.inputs,
                    outputs=graph.outputs, blocks=graph.blocks, batch_size=graph.batch_size,
                    meta=meta)
    return ep, graph, prefix


def _checked_inputs(model: Any, example_inputs: Any, loss_fn: Any, targets: Any) -> tuple:
    """The example inputs as a tuple, or a TraceError that says what trace() needs."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise TraceError("trace() needs example inputs: a tensor (or a tuple of them) shaped "
                         "like one batch the model takes; meta tensors are fine")
    inputs = (tuple(example_inputs) if isinstance(example_inputs, (tuple, list))
              else (example_inputs,))
    if not inputs:
        raise TraceError("trace() needs at least one example input (a tensor of the batch)")
    if (loss_fn is None) != (targets is None):
        raise TraceError("pass loss_fn and targets together (or neither)")
    return inputs


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
    """``model``'s parameters and buffers swapped for fake tensors on ``device`` (shapes,
    dtypes and a device, no memory; also those that hold values: a GPU model's, a buffer
    computed on the CPU beside meta weights) while the block runs, tied ones staying tied;
    yields the function that makes an input such a fake."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or (isinstance(t, FakeTensor) and t.fake_mode is mode):
            return t
        if id(t) not in made:
            if t._base is not None:      # a view stays a view of its base (targets that are
                base = fake(t._base)     # the shifted tokens: the CPU trace sees the alias)
                with mode:
                    f = base.as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                with mode:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            made[id(t)] = (nn.Parameter(f, requires_grad=t.requires_grad)
                           if isinstance(t, nn.Parameter) else f)
        return made[id(t)]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is not None:
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


if sys.version_info < (3, 10):  # pragma: no cover
    raise ImportError("autoplan needs Python 3.10 or newer")
