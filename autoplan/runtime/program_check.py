"""The rank program checked on fake tensors before any collective runs: every op's local
output must have the shape its placement says, else the plan is refused naming the op."""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from autoplan.errors import PlanError
from autoplan.runtime import tp_comm
from autoplan.runtime.program import SHAPE, VAL, Program


def check_shapes(program: Program, example_inputs: tuple, t: int,
                 device: torch.device | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
    """Run the program on fake tensors with shape-only collectives: every op must produce the
    local shape its placement says (else PlanError naming the op). Each node keeps what it
    produced (``node.meta[VAL]``: pipeline stages declare their inputs and outputs with it),
    under the step's autocast (``autocast_dtype``) so the dtypes are the step's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = program.graph_module
    device = device or next((x.device for x in example_inputs
                             if isinstance(x, torch.Tensor) and not x.is_meta),
                            torch.device("cpu"))
    real, real_ep = program.comm_slot.comm, program.comm_slot.ep
    program.comm_slot.comm = tp_comm.ShapeComm(size=t)
    if program.comm_slot.ep_size > 1:
        program.comm_slot.ep = tp_comm.ShapeComm(size=program.comm_slot.ep_size)
    cp = program.cp_slot
    real_cp = cp.comm if cp is not None else None
    if cp is not None:
        cp.comm = tp_comm.ShapeComm(size=cp.size, zigzag=cp.zigzag)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    amp = (torch.autocast(device.type, dtype=autocast_dtype)
           if autocast_dtype is not None and device.type != "meta" else contextlib.nullcontext())

    class Check(fx.Interpreter):
        def fetch_attr(self, target):
            obj = super().fetch_attr(target)
            if not isinstance(obj, torch.Tensor):
                return obj
            if obj.is_meta and device.type != "meta":
                # another pipeline rank's weight: its shape and dtype, on this rank's device
                return torch.empty(obj.shape, dtype=obj.dtype, device=device,
                                   requires_grad=obj.requires_grad)
            # a fake copy: in-place ops (batch norm's counters) must not touch the real one
            return mode.from_tensor(obj)

        def run_node(self, n):
            try:
                out = super().run_node(n)
            except PlanError:
                raise
            except Exception as e:
                raise PlanError(f"the rank program fails at {n.format_node()}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
            if isinstance(out, torch.Tensor):
                n.meta[VAL] = (tuple(out.shape), out.dtype, out.requires_grad)
            want = n.meta.get(SHAPE)
            if want is not None and isinstance(out, torch.Tensor) and tuple(out.shape) != want:
                raise PlanError(f"the rank program computes shape {tuple(out.shape)} at "
                                f"{n.format_node()}, the plan says {want}")
            return out
    try:
        with mode, amp:
            fake = [(torch.empty(x.shape, dtype=x.dtype, device=device) if x.is_meta
                     else mode.from_tensor(x)) if isinstance(x, torch.Tensor) else x
                    for x in example_inputs]
            Check(gm).run(*fake)
    finally:
        program.comm_slot.comm, program.comm_slot.ep = real, real_ep
        if cp is not None:
            cp.comm = real_cp


__all__ = ["check_shapes"]
