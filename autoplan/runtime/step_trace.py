"""Record what training steps spend their time on, with ``torch.profiler``, as plain data.

``record_steps`` runs a trainer's steps under the profiler (CPU activity, input shapes) and
keeps, per event, what attribution and the refit need (``autoplan.estimate.attribution``,
``autoplan.cost.refit``): its name, thread, start and duration, input shapes, and whether it
is a kernel (``leaf``: a matrix product, or an ``aten`` op with no ``aten`` op inside it and
outside any matrix product: the ops that do the work). Collectives are
the backends' own events (``gloo:all_reduce``, ``nccl:all_gather``...), which last from the
start of the transfer to its end on the backend's thread.

On a CUDA rank the work runs on the GPU's streams, not on the threads that launch it, so the
profiler also records the CUDA activity and the record gains ``kernels``: the GPU's own
timeline, one event per kernel (and per device copy or fill) in the same plain form, named
for the CPU op that launched it (``device_kernels``). torch links each kernel to that op: the
kernel's ``linked_correlation_id`` is the op's ``id`` (torch's ``FunctionEvent.kernels`` is
built from the same link); the op's parents then say what the kernel was part of:
``Optimizer.step``, a backend's collective, a matrix product or attention (``kind`` "matmul":
the product's own kernels, not the casts autocast runs inside it), else the innermost
``aten`` op (``kind`` "other"), or, for a kernel launched outside any ``aten`` op (inductor's
Triton kernels in a compiled region), the kernel's own name with no shapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from autoplan.estimate.attribution import MATMUL_OPS, collective_kind

DEVICE_TIMELINE = "device"         # the ``thread`` of every kernel event: the GPU's timeline
# torch.profiler's names of the input dtypes (``FunctionEvent.input_dtypes``), as torch names
# them; any other (a Scalar, a list) is not a tensor's
_PROFILER_DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16",
                    "double": "float64", "long int": "int64", "int": "int32",
                    "short int": "int16", "signed char": "int8", "unsigned char": "uint8",
                    "bool": "bool", "c10::Float8_e4m3fn": "float8_e4m3fn",
                    "c10::Float8_e5m2": "float8_e5m2"}
_CASTS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone"})


def record_steps(trainer: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Run ``steps`` steps of ``trainer`` on ``batch`` under the profiler (after the caller's
    warm-up); returns ``{"step_s": [...], "events": [...]}`` (seconds, plain values), with
    ``"device": "cuda"`` and the GPU's ``"kernels"`` on a CUDA rank (each step then waits for
    its kernels before its time is taken)."""
    from torch.profiler import ProfilerActivity, profile
    device = getattr(trainer, "device", torch.device("cpu"))
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step_s = []
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.step(batch)
            if cuda:
                torch.cuda.synchronize(device)
            step_s.append(time.perf_counter() - t0)
    found = prof.events()
    out = {"step_s": step_s, "events": cpu_events(found), "threads": torch.get_num_threads()}
    if cuda:
        out.update(device="cuda", kernels=device_kernels(found))
    return out


def _under_matmul(e: Any) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name in MATMUL_OPS:
            return True
        p = p.cpu_parent
    return False


def _shapes(e: Any) -> list[list[int]]:
    return [list(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]


def cpu_events(found: Iterable[Any]) -> list[dict[str, Any]]:
    """The CPU ops of ``found`` (torch.profiler's ``FunctionEvent``s) as plain events."""
    events = []
    for e in found:
        if _device_kind(e) != "cpu":
            continue
        name = e.name
        # a kernel: a matrix product (whatever helper ops it calls), or an aten op with no
        # aten op inside it that is not part of a matrix product
        if name in MATMUL_OPS:
            leaf = not _under_matmul(e)
        else:
            leaf = (name.startswith("aten::") and not any(
                c.name.startswith("aten::") for c in e.cpu_children) and not _under_matmul(e))
        events.append({"name": name, "thread": int(e.thread), "start_s": e.time_range.start / 1e6,
                       "dur_s": (e.time_range.end - e.time_range.start) / 1e6,
                       "top": e.cpu_parent is None, "leaf": leaf,
                       "shapes": _shapes(e)[:4]})
    return events


def _device_kind(e: Any) -> str:
    kind = getattr(e, "device_type", None)
    return str(getattr(kind, "name", kind) or "CPU").lower()


def is_product(name: str) -> bool:
    """A matrix product or attention op (its kernels are the products' time)."""
    return name in MATMUL_OPS or (name.startswith("aten::") and "attention" in name)


def device_kernels(found: Iterable[Any]) -> list[dict[str, Any]]:
    """The GPU's timeline of ``found`` (torch.profiler's ``FunctionEvent``s, their CPU tree
    built): one plain event per CUDA kernel, copy or fill, attributed to the CPU op that
    launched it (the module doc says how)."""
    found = list(found)
    ops: dict[int, Any] = {}
    # torch drops an op nested in one of the same name (its kernels lifted to the outer one):
    # a kernel linked to a dropped op is found among the outer op's ``kernels``
    lifted: dict[tuple[str, float], Any] = {}
    for e in found:          # the ops a kernel can link to: CPU events linked to nothing
        if _device_kind(e) == "cpu" and not getattr(e, "linked_correlation_id", 0):
            if e.id not in ops or ops[e.id].name.startswith("cu"):    # not a runtime call
                ops[e.id] = e
            for k in getattr(e, "kernels", ()):
                lifted[(k.name, round(float(k.duration), 3))] = e
    out = []
    for k in found:
        if _device_kind(k) != "cuda":
            continue
        event = {"name": k.name, "kernel": k.name, "thread": DEVICE_TIMELINE,
                 "stream": int(getattr(k, "device_resource_id", None) or 0),
                 "start_s": k.time_range.start / 1e6,
                 "dur_s": (k.time_range.end - k.time_range.start) / 1e6,
                 "top": False, "leaf": True, "kind": "other", "shapes": [], "dtypes": []}
        op = ops.get(getattr(k, "linked_correlation_id", 0) or -1)
        if op is None:
            op = lifted.get((k.name, round(k.time_range.end - k.time_range.start, 3)))
        event.update(_launched_by(op))
        out.append(event)
    return out


def _launched_by(op: Any) -> dict[str, Any]:
    """What a kernel launched by CPU op ``op`` counts as (see the module doc)."""
    chain = []
    while op is not None:
        chain.append(op)
        op = op.cpu_parent
    for e in chain:
        if e.name.startswith("Optimizer.step"):
            return {"name": e.name, "leaf": False, "kind": "optimizer"}
        if collective_kind(e.name) is not None:
            return {"name": e.name, "leaf": False, "kind": "collective",
                    "shapes": _shapes(e)[:4]}
    aten = next((e for e in chain if e.name.startswith("aten::")), None)
    if aten is None:
        return {}
    product = next((e for e in chain if is_product(e.name)), None)
    if product is not None and aten.name not in _CASTS:
        # the product's own kernels: named for the innermost product op, with its operands
        inner = aten if is_product(aten.name) else product
        return {"name": inner.name, "kind": "matmul", "shapes": _shapes(inner)[:4],
                "dtypes": _dtypes(inner)[:4]}
    return {"name": aten.name, "kind": "other", "shapes": _shapes(aten)[:4],
            "dtypes": _dtypes(aten)[:4]}


def _dtypes(e: Any) -> list[str | None]:
    """The dtype of each of ``e``'s inputs that ``_shapes`` keeps (None: not a tensor's)."""
    shapes = e.input_shapes or []
    names = list(getattr(e, "input_dtypes", None) or [])
    names += [""] * (len(shapes) - len(names))
    return [_PROFILER_DTYPES.get(n) for s, n in zip(shapes, names) if isinstance(s, (list, tuple))]
