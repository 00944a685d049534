"""Measure op timings on this machine by replaying the ops of an OpGraph on real tensors.

Every distinct op (one per ``op_key``: same target, shapes, dtypes and arguments) is rebuilt from
``op.target`` and its JSON ``op.args`` with random tensors of the recorded shapes, then timed:

1. Forward: ``warmup`` untimed calls, then ``repeats`` timed samples; the median is kept, with
   the coefficient of variation of the samples (CPU timings are noisy: 5-30 %). Ops faster than
   ``min_time_s`` are called back to back inside one sample and the sample divided by the count
   (back-to-back throughput, which is what a training step sees). Slow ops use fewer samples so
   one op never takes much more than ``max_op_time_s``. When the samples vary by more than
   ``max_cv`` (another process took a core for a while) the op is measured again, up to
   ``retries`` times, and the steadiest attempt kept.
2. Backward (differentiable ops): inputs whose graph values require grad are leaf tensors that
   require grad; the forward runs once and ``torch.autograd.grad(outputs, leaves, grad_outputs,
   retain_graph=True)`` is timed the same way. Each such call pays the autograd engine's fixed
   start-up (about 50 us on CPU) that a real backward pays once per step, so every backward
   sample is paired with a sample of an ``autograd.grad`` call that has nothing to do, and the
   difference kept.

Input values. Floats are ``randn`` (retried once with ``rand`` in [0, 1) when the op rejects
them, e.g. a probability input). Integer tensors are indices as often as not, so they are drawn
from [0, bound): for embeddings the bound is the table's row count; otherwise it is the smallest
dimension of the op's other tensor inputs (always a valid index, whatever the dim indexed), or 2
when there is none. Booleans are random. Ops that mutate their inputs (``add_`` on a counter) get
their inputs restored, untimed, before every call.

Timing (``timing.py``) uses ``time.perf_counter`` on CPU and CUDA events (after a synchronize)
on CUDA, at the thread count the process has (``torch.get_num_threads()``, recorded in the
ProfileDB). An op that cannot be replayed (an argument that is not JSON-encodable, an unknown
target, an error) is recorded as a failure with its reason; profiling never stops because of
one op.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoplan.cluster import local, specs
from autoplan.cluster.profile_db import Calibration, OpTiming, ProfileDB, op_key
from autoplan.cost.host_allocator import keep_freed_host_memory
from autoplan.errors import ProfileError
from autoplan.graph.opgraph import Op, OpGraph, TensorMeta
from autoplan.graph.trace import trace
from autoplan.machine.timing import Clock, check_device, steady_measure

Progress = Callable[[int, int, str], None]   # (index, total, op target)

_EMBEDDING_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag",
                            "_embedding_bag_forward_only"})
_ENUMS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format", "strided",
          "sparse_coo", "sparse_csr", "_mkldnn")


class _Unreplayable(Exception):
    """This op's call cannot be rebuilt from the graph (a reason, not a bug)."""


@dataclass(frozen=True, kw_only=True)
class GraphProfile:
    """What ``profile_graph`` measured: timings per op key, and the keys it could not replay."""

    timings: Mapping[str, OpTiming]
    failures: Mapping[str, str]          # op key -> "target: reason"
    num_ops: int                         # ops in the graph
    num_keys: int                        # distinct op keys in the graph
    skipped: int                         # keys not measured because the caller already had them
    autograd_overhead_s: float           # median autograd.grad baseline subtracted from bwd_s
    elapsed_s: float


# ---- devices ----------------------------------------------------------------------------------

def local_device_name(device: str | torch.device = "cpu") -> str:
    """The profile-database name of this machine's ``device``: the cluster's device name, so
    ``ProfileDB.find(cluster.device.name)`` finds it ("cpu-amd-epyc"; a GPU's name in
    ``cost_models/devices.yaml`` such as "h100-sxm-80gb", else the slug of its product name)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        product = torch.cuda.get_device_name(check_device(dev))
        known = specs.find_device_by_alias(product)
        return known.name if known is not None else local.slug(product)
    return local.local_cpu_device_name()


def _autograd_baseline(device: torch.device) -> Callable[[], Any]:
    """An ``autograd.grad`` call with (almost) nothing to do: a view of a 1-element tensor.

    Every per-op backward sample pays the engine's fixed start-up (40-60 us on CPU), a real
    backward pays it once per step (it is in ``Calibration.step_overhead_s``), so each op's
    backward samples are paired with this call's and the difference kept.
    """
    x = torch.ones(1, device=device, requires_grad=True)
    y = x.view(1)
    g = torch.ones(1, device=device)
    return lambda: torch.autograd.grad([y], [x], [g], retain_graph=True)


# ---- rebuilding one call ----------------------------------------------------------------------

def _resolve_target(target: str) -> torch._ops.OpOverload:
    parts = target.split(".")
    if len(parts) != 3:
        raise _Unreplayable(f"target {target!r} is not namespace.op.overload")
    try:
        fn = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as e:
        raise _Unreplayable(f"torch has no op {target!r}") from e
    if not isinstance(fn, torch._ops.OpOverload):
        raise _Unreplayable(f"{target!r} is not an operator overload")
    return fn


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise _Unreplayable(f"unknown dtype {name!r}")
    return dt


def _enum(text: str) -> Any:
    name = str(text).removeprefix("torch.")
    if name not in _ENUMS:
        raise _Unreplayable(f"unknown enum value {text!r}")
    return getattr(torch, name)


def _decode(x: Any, tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    if isinstance(x, list):
        return [_decode(a, tensors, device) for a in x]
    if isinstance(x, dict):
        if "v" in x:
            return tensors[x["v"]]
        if "float" in x:
            return float(x["float"])
        if "dtype" in x:
            return _dtype(x["dtype"])
        if "device" in x:
            return device            # rebuild on the device being profiled
        if "enum" in x:
            return _enum(x["enum"])
        raise _Unreplayable(f"argument {json.dumps(x)} was not recorded as data")
    return x


def _names_in(x: Any, out: list[str]) -> list[str]:
    if isinstance(x, list):
        for a in x:
            _names_in(a, out)
    elif isinstance(x, dict):
        if "v" in x:
            if x["v"] not in out:
                out.append(x["v"])
        else:
            for a in x.values():
                _names_in(a, out)
    return out


def _int_bound(op: Op, metas: Mapping[str, TensorMeta], name: str) -> int:
    """Exclusive upper bound for the values of integer input ``name`` (valid as an index)."""
    packet = op.target.split(".")[1] if op.target.count(".") == 2 else op.target
    if packet in _EMBEDDING_OPS and op.inputs and op.inputs[0] != name:
        rows = metas[op.inputs[0]].shape
        if rows:
            return max(1, rows[0])
    dims = [d for n, m in metas.items() if n != name for d in m.shape if d > 0]
    return max(1, min(dims)) if dims else 2


def _random_tensor(meta: TensorMeta, device: torch.device, gen: torch.Generator, *,
                   high: int, uniform: bool) -> torch.Tensor:
    dtype = _dtype(meta.dtype)
    shape = meta.shape
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device=device) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        make_dtype = dtype if dtype.itemsize >= 2 or dtype.is_complex else torch.float32
        draw = torch.rand if uniform else torch.randn
        return draw(shape, generator=gen, device=device, dtype=make_dtype).to(dtype)
    return torch.randint(0, high, shape, generator=gen, device=device, dtype=dtype)


class _Call:
    """One op's call, rebuilt with fresh random tensors; ``leaves`` require grad."""

    def __init__(self, graph: OpGraph, op: Op, device: torch.device, *, grad: bool,
                 uniform: bool, seed: int):
        call = json.loads(op.args)
        names = _names_in(call, [])
        try:
            metas = {n: graph.value(n).meta for n in names}
        except KeyError as e:
            raise _Unreplayable(str(e)) from e
        gen = torch.Generator(device=device).manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}
        self.leaves: list[torch.Tensor] = []
        for n in names:
            t = _random_tensor(metas[n], device, gen, high=_int_bound(op, metas, n),
                               uniform=uniform)
            if grad and graph.value(n).requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
                self.leaves.append(t)
            self.tensors[n] = t
        self.call = call
        self.device = device

    def arguments(self, tensors: Mapping[str, torch.Tensor] | None = None) -> tuple[list, dict]:
        tensors = self.tensors if tensors is None else tensors
        args = _decode(self.call.get("args", []), tensors, self.device)
        kwargs = {k: _decode(v, tensors, self.device)
                  for k, v in self.call.get("kwargs", {}).items()}
        return args, kwargs


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    flat = out if isinstance(out, (list, tuple)) else [out]
    found: list[torch.Tensor] = []
    for t in flat:
        if isinstance(t, (list, tuple)):
            found.extend(_grad_outputs(t))
        elif isinstance(t, torch.Tensor) and t.requires_grad:
            found.append(t)
    return found


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _build_working_call(graph: OpGraph, op: Op, fn: torch._ops.OpOverload,
                        device: torch.device, *, grad: bool, seed: int) -> _Call:
    """A call that runs once: randn inputs first, then uniform [0, 1) ones."""
    error: BaseException | None = None
    for uniform in (False, True):
        call = _Call(graph, op, device, grad=grad, uniform=uniform, seed=seed)
        snapshot = {n: t.detach().clone() for n, t in call.tensors.items()}
        try:
            args, kwargs = call.arguments(
                {n: (t.clone() if t.requires_grad else t) for n, t in call.tensors.items()})
            with torch.set_grad_enabled(grad):
                fn(*args, **kwargs)
            with torch.no_grad():           # undo what a mutating op changed
                for n, t in call.tensors.items():
                    t.copy_(snapshot[n])
            return call
        except _Unreplayable:
            raise
        except Exception as e:  # the op rejected these values; try the other distribution
            error = e
    raise _Unreplayable(_first_line(error))


def _profile_op(graph: OpGraph, op: Op, clock: Clock, *, warmup: int, repeats: int,
                min_time_s: float, max_op_time_s: float, retries: int, max_cv: float,
                baseline: Callable[[], Any], seed: int) -> tuple[OpTiming, float | None]:
    """The op's timing, and the paired autograd baseline (None for ops without backward)."""
    fn = _resolve_target(op.target)
    mutable = fn._schema.is_mutable
    device = clock.device
    timing = dict(warmup=warmup, repeats=repeats, min_time_s=min_time_s,
                  max_time_s=max_op_time_s, retries=retries, max_cv=max_cv)

    # Forward. Differentiable ops run with autograd recording, as in training. Mutating ops run
    # without grad, on inputs restored before every call (a leaf that requires grad cannot be
    # changed in place, and repeating e.g. mul_ would drift into denormals).
    fwd_grad = op.differentiable and not mutable
    call = _build_working_call(graph, op, fn, device, grad=fwd_grad, seed=seed)
    args, kwargs = call.arguments()
    reset = None
    if mutable:
        snapshot = {n: t.detach().clone() for n, t in call.tensors.items()}

        def reset() -> None:
            with torch.no_grad():
                for n, t in call.tensors.items():
                    t.copy_(snapshot[n])

    with torch.set_grad_enabled(fwd_grad):
        fwd = steady_measure(clock, lambda: fn(*args, **kwargs), reset=reset, **timing)

    bwd_s = bwd_cv = 0.0
    base_s = None
    if op.differentiable:
        bcall = call if fwd_grad else _build_working_call(graph, op, fn, device, grad=True,
                                                          seed=seed)
        if bcall.leaves:
            # Mutating ops act on non-leaf clones of the leaves (autograd allows that).
            tensors = {k: (t.clone() if mutable and t.requires_grad else t)
                       for k, t in bcall.tensors.items()}
            bargs, bkwargs = bcall.arguments(tensors)
            with torch.enable_grad():
                out = fn(*bargs, **bkwargs)
            outs = _grad_outputs(out)
            if outs:
                grads = [torch.randn_like(o) for o in outs]
                leaves = bcall.leaves

                def backward() -> Any:
                    return torch.autograd.grad(outs, leaves, grads, retain_graph=True,
                                               allow_unused=True)
                bwd = steady_measure(clock, backward, baseline=baseline, **timing)
                # The engine start is paid once per step, not per op; keep at least a tenth of
                # the raw time so a view's backward stays positive.
                bwd_s, bwd_cv = max(bwd.net_s, 0.1 * bwd.median_s), bwd.cv
                base_s = bwd.median_s - bwd.net_s
    return OpTiming(fwd_s=fwd.median_s, bwd_s=bwd_s, fwd_cv=fwd.cv, bwd_cv=bwd_cv,
                    repeats=fwd.samples), base_s


# ---- public API -------------------------------------------------------------------------------

def distinct_ops(graph: OpGraph) -> dict[str, Op]:
    """The first op of each distinct key, in graph order."""
    out: dict[str, Op] = {}
    for op in graph.ops:
        out.setdefault(op_key(graph, op), op)
    return out


def profile_graph(graph: OpGraph, *, device: str | torch.device = "cpu", warmup: int = 3,
                  repeats: int = 15, min_time_s: float = 2e-5, max_op_time_s: float = 2.0,
                  retries: int = 2, max_cv: float = 0.5, skip: Collection[str] = (), seed: int = 0,
                  progress: Progress | None = None) -> GraphProfile:
    """Time every distinct op of ``graph`` on ``device`` (keys in ``skip`` are left out).

    ``min_time_s``: the shortest timed sample (faster ops are called back to back within one);
    ``max_op_time_s``: the budget per op and direction, after which fewer samples are taken;
    ``retries``: extra attempts for an op whose samples vary by more than ``max_cv``.
    """
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, "
                           f"repeats={repeats}")
    if retries < 0 or max_cv <= 0:
        raise ProfileError(f"need retries >= 0 and max_cv > 0, got {retries}, {max_cv}")
    if min_time_s < 0 or max_op_time_s <= 0:
        raise ProfileError(f"need min_time_s >= 0 and max_op_time_s > 0, got {min_time_s}, "
                           f"{max_op_time_s}")
    dev = check_device(device)
    if dev.type == "cpu":
        keep_freed_host_memory()
    clock = Clock(dev)
    t0 = time.perf_counter()
    keyed = distinct_ops(graph)
    todo = [(k, op) for k, op in keyed.items() if k not in skip]
    timings: dict[str, OpTiming] = {}
    failures: dict[str, str] = {}
    baseline = _autograd_baseline(dev)
    baselines: list[float] = []
    gc_was_enabled = gc.isenabled()
    # A collection inside a timed sample is noise, and one full collection after tracing takes
    # about 0.3 s: collect once, then keep the collector off (tensors are freed by refcount).
    gc.collect()
    gc.disable()
    try:
        for i, (key, op) in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), op.target)
            try:
                timings[key], base_s = _profile_op(
                    graph, op, clock, warmup=warmup, repeats=repeats, min_time_s=min_time_s,
                    max_op_time_s=max_op_time_s, retries=retries, max_cv=max_cv,
                    baseline=baseline, seed=seed)
                if base_s is not None:
                    baselines.append(base_s)
            except _Unreplayable as e:
                failures[key] = f"{op.target}: {e}"
            except Exception as e:  # never let one op stop the profile
                failures[key] = f"{op.target}: {_first_line(e)}"
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if gc_was_enabled:
            gc.enable()
    return GraphProfile(timings=timings, failures=failures, num_ops=len(graph.ops),
                        num_keys=len(keyed), skipped=len(keyed) - len(todo),
                        autograd_overhead_s=statistics.median(baselines) if baselines else 0.0,
                        elapsed_s=time.perf_counter() - t0)


def profile_model(model: Any, example_inputs: Any = None, *, loss_fn: Any = None,
                  targets: Any = None, name: str | None = None,
                  device: str | torch.device = "cpu",
                  **profile_kwargs: Any) -> tuple[OpGraph, GraphProfile]:
    """Trace and profile a model. ``model`` may be an ``autoplan.models.Example`` (its inputs,
    targets and loss are used) or an ``nn.Module`` with ``example_inputs``."""
    if example_inputs is None and hasattr(model, "example_inputs"):
        ex = model
        model, example_inputs = ex.model, ex.example_inputs
        loss_fn = loss_fn if loss_fn is not None else ex.loss_fn
        targets = targets if targets is not None else ex.targets
        name = name or getattr(ex, "name", None)
    if example_inputs is None:
        raise ProfileError("profile_model() needs example_inputs (or an Example that has them)")
    if loss_fn is not None and targets is None:
        loss_fn = None  # a loss that ignores targets (e.g. hidden-state loss): profile the model
    graph = trace(model, example_inputs, loss_fn=loss_fn, targets=targets, name=name)
    return graph, profile_graph(graph, device=device, **profile_kwargs)


def build_db(timings: Mapping[str, OpTiming], calibration: Calibration, *,
             device: str | torch.device = "cpu", device_name: str | None = None,
             sources: Collection[str] = ()) -> ProfileDB:
    """A ProfileDB of this process's measurements (name, thread count and torch version)."""
    dev = torch.device(device)
    return ProfileDB(device=device_name or local_device_name(dev), device_kind=dev.type,
                     threads=torch.get_num_threads(), torch_version=torch.__version__,
                     calibration=calibration, entries=dict(timings), sources=tuple(sources))
