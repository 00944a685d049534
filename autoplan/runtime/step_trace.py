"""Record what training steps spend their time on, with ``torch.profiler``, as plain data.

``record_steps`` runs a trainer's steps under the profiler (CPU activity, input shapes) and
keeps, per event, what attribution and the refit need (``autoplan.estimate.attribution``,
``autoplan.cost.refit``): its name, thread, start and duration, input shapes, and whether it
is a kernel (``leaf``: a matrix product, or an ``aten`` op with no ``aten`` op inside it and
outside any matrix product: the ops that do the work). Collectives are
the backends' own events (``gloo:all_reduce``, ``nccl:all_gather``...), which last from the
start of the transfer to its end on the backend's thread.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from autoplan.estimate.attribution import MATMUL_OPS


def record_steps(trainer: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Run ``steps`` steps of ``trainer`` on ``batch`` under the profiler (after the caller's
    warm-up); returns ``{"step_s": [...], "events": [...]}`` (seconds, plain values)."""
    from torch.profiler import ProfilerActivity, profile
    step_s = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.step(batch)
            step_s.append(time.perf_counter() - t0)

    def under_matmul(e: Any) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name in MATMUL_OPS:
                return True
            p = p.cpu_parent
        return False
    events = []
    for e in prof.events():
        name = e.name
        # a kernel: a matrix product (whatever helper ops it calls), or an aten op with no
        # aten op inside it that is not part of a matrix product
        if name in MATMUL_OPS:
            leaf = not under_matmul(e)
        else:
            leaf = (name.startswith("aten::") and not any(
                c.name.startswith("aten::") for c in e.cpu_children) and not under_matmul(e))
        shapes = [list(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]
        events.append({"name": name, "thread": int(e.thread), "start_s": e.time_range.start / 1e6,
                       "dur_s": (e.time_range.end - e.time_range.start) / 1e6,
                       "top": e.cpu_parent is None, "leaf": leaf,
                       "shapes": shapes[:4]})
    return {"step_s": step_s, "events": events, "threads": torch.get_num_threads()}
