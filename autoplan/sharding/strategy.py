"""One way to run one op on a ``t``-way mesh axis, and the collectives that follow from it.

An ``OpStrategy`` states placements, and its collectives are *derived* from them by one function
(``derive_comms``), which the cost model prices and the runtime executes, so the two cannot
disagree:

- ``inputs``: the placement each tensor input must arrive in (parameters included: that is how
  weights get sharded); ``outputs``: the placement each output leaves in;
- ``local_inputs`` / ``local_outputs``: the placements the rank-local computation consumes and
  produces, when they differ (a column-parallel linear under sequence parallelism takes its
  input sequence-sharded but computes on the gathered input; a row-parallel linear computes a
  partial sum ``P`` that leaves reduced, ``R``, or reduce-scattered, ``S(d)``);
- ``kernel``: what runs on the rank, ``""`` for the op itself on local tensors, or a named local
  kernel (``registry.KERNELS``, each declared beside the rule that needs it; the runtime
  registers its implementation under the same name) for ops whose sharded form is not the op
  on shards (vocab-parallel embedding and cross entropy, losses over a split batch, batch norm
  with synchronized statistics, a bias added after the reduction, a mean over a split dim).

Gradients. The gradient of a value has the value's placement (R: every rank holds the whole
gradient). A rank-local computation is *split* when any of its local inputs or outputs is
sharded or partial; then the gradient it computes for a replicated input is only this rank's
part (a partial sum). ``derive_comms`` adds the collective that makes it whole: an all-reduce in
backward for an activation (Megatron's ``f``), an all-reduce once per step for a weight, or a
reduce-scatter where the input was gathered for the op (Megatron's sequence parallelism).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from autoplan.errors import AutoplanError
from autoplan.graph.opgraph import Op, OpGraph, opname  # noqa: F401  (opname: re-exported)
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.registry import KERNELS, declare_kernel

BIAS_AFTER_REDUCE = declare_kernel(
    "bias_after_reduce", "the op without its bias, reduced, then the bias added once")


@dataclass(frozen=True)
class Comm:
    """One collective an op issues on the axis. ``value`` is the tensor whose full (logical)
    size sets the bytes, times ``scale``. ``phase``: fwd / bwd per micro-batch, or step."""

    kind: str
    value: str
    phase: str
    scale: float = 1.0


@dataclass(frozen=True)
class OpStrategy:
    name: str
    inputs: tuple[Placement, ...]       # one per op.inputs entry (parameters included)
    outputs: tuple[Placement, ...]      # one per op.outputs entry
    work_divisor: int
    comms: tuple[Comm, ...] = ()        # derived: see derive_comms
    style: str = "local"                # label shown per module (inspect, plan file)
    kernel: str = ""
    local_inputs: tuple[Placement, ...] = ()    # () = inputs
    local_outputs: tuple[Placement, ...] = ()   # () = outputs

    def local_input(self, k: int) -> Placement:
        return (self.local_inputs or self.inputs)[k]

    def local_output(self, k: int) -> Placement:
        return (self.local_outputs or self.outputs)[k]

    def gathered_inputs(self) -> tuple[int, ...]:
        """Input slots the op reads whole that are stored split (``gathered_weight``: the
        weight its kernel gathers for the product)."""
        return tuple(k for k in range(len(self.inputs)) if self.inputs[k] != self.local_input(k))

    @property
    def split(self) -> bool:
        """True when the rank-local computation differs between ranks."""
        return any(p.kind != "R" for p in (self.local_inputs or self.inputs)) or any(
            p.kind != "R" for p in (self.local_outputs or self.outputs))


def call_args(op: Op) -> tuple[list[Any], dict[str, Any]]:
    d = json.loads(op.args)
    return d["args"], d["kwargs"]


def needs_grad(graph: OpGraph, op: Op, k: int) -> bool:
    v = graph.value(op.inputs[k])
    return op.differentiable and v.requires_grad and v.meta.is_float


def input_action(graph: OpGraph, op: Op, s: OpStrategy, k: int) -> str:
    """What input ``k`` needs between arriving in ``s.inputs[k]`` and the local computation:
    "" (nothing), "gather" (S -> R, free backward), "gather_sp" (S -> R, reduce-scatter in
    backward), "reduce_grad" (all-reduce its gradient in backward) or "step" (a weight whose
    gradient is all-reduced once per step)."""
    want, local = s.inputs[k], s.local_input(k)
    grad = needs_grad(graph, op, k)
    if want != local:
        if not (want.kind == "S" and local.kind == "R"):
            raise AutoplanError(f"op {op.name}: strategy {s.name} turns input {op.inputs[k]} "
                                f"from {want} into {local}; only a gather (S -> R) is defined")
        return "gather_sp" if grad and s.split else "gather"
    if s.kernel == BIAS_AFTER_REDUCE and k == bias_slot(graph, op):
        split_here = any(p.kind == "S" for p in s.outputs)   # the bias meets the reduced output
    else:
        split_here = s.split
    if local.kind == "R" and split_here and grad:
        return "step" if graph.value(op.inputs[k]).kind == "param" else "reduce_grad"
    return ""


def output_action(graph: OpGraph, op: Op, s: OpStrategy, k: int) -> str:
    """What output ``k`` needs after the local computation: "" (nothing), "reduce" (P -> R),
    "reduce_scatter" (P -> S, all-gather in backward) or "gather" (S -> R)."""
    local, want = s.local_output(k), s.outputs[k]
    if local == want:
        return ""
    if local.kind == "P" and want.kind == "R":
        return "reduce"
    if local.kind == "P" and want.kind == "S":
        return "reduce_scatter"
    if local.kind == "S" and want.kind == "R":
        return "gather"
    raise AutoplanError(f"op {op.name}: strategy {s.name} turns output {op.outputs[k]} from "
                        f"{local} into {want}, which no collective does")


_INPUT_COMMS = {"gather": (("all_gather", "fwd"),),
                "gather_sp": (("all_gather", "fwd"), ("reduce_scatter", "bwd")),
                "reduce_grad": (("all_reduce", "bwd"),), "step": (("all_reduce", "step"),)}
_OUTPUT_COMMS = {"reduce": (("all_reduce", "fwd"),),
                 "reduce_scatter": (("reduce_scatter", "fwd"), ("all_gather", "bwd")),
                 "gather": (("all_gather", "fwd"),)}


def derive_comms(graph: OpGraph, op: Op, s: OpStrategy) -> tuple[Comm, ...]:
    """The collectives strategy ``s`` of ``op`` needs (see the module docstring): exactly the
    ones the runtime issues for ``input_action`` / ``output_action``."""
    out: list[Comm] = []
    for k, n in enumerate(op.inputs):
        for kind, phase in _INPUT_COMMS.get(input_action(graph, op, s, k), ()):
            out.append(Comm(kind, n, phase))
    for k, n in enumerate(op.outputs):
        grad = op.differentiable and graph.value(n).requires_grad
        for kind, phase in _OUTPUT_COMMS.get(output_action(graph, op, s, k), ()):
            if phase == "fwd" or grad:
                out.append(Comm(kind, n, phase))
    return tuple(out)


def bias_slot(graph: OpGraph, op: Op) -> int | None:
    """The input slot of a product's bias (linear's third, addmm's first, conv's third)."""
    name = opname(op)
    slot = 0 if name in ("addmm", "baddbmm") else 2
    if slot < len(op.inputs) and len(graph.value(op.inputs[slot]).meta.shape) <= 1 and \
            (name != "addmm" or len(op.inputs) == 3):
        return slot
    return None


def make(graph: OpGraph, op: Op, name: str, inputs: tuple[Placement, ...],
         outputs: tuple[Placement, ...], t: int, *, style: str = "local", kernel: str = "",
         local_inputs: tuple[Placement, ...] = (), local_outputs: tuple[Placement, ...] = (),
         extra: tuple[Comm, ...] = (), divisor: int | None = None) -> OpStrategy:
    """A strategy with its collectives derived (plus a kernel's own ``extra`` ones)."""
    if len(inputs) != len(op.inputs) or len(outputs) != len(op.outputs):
        raise AutoplanError(f"op {op.name}: strategy {name} gives {len(inputs)} input and "
                            f"{len(outputs)} output placements for {len(op.inputs)} inputs "
                            f"and {len(op.outputs)} outputs")
    if kernel not in KERNELS:
        raise AutoplanError(f"op {op.name}: strategy {name} names unknown kernel {kernel!r}")
    s = OpStrategy(name, tuple(inputs), tuple(outputs), 1, (), style, kernel,
                   tuple(local_inputs), tuple(local_outputs))
    div = divisor if divisor is not None else (t if s.split else 1)
    return OpStrategy(name, s.inputs, s.outputs, div, derive_comms(graph, op, s) + extra, style,
                      kernel, s.local_inputs, s.local_outputs)


def replicate(op: Op) -> OpStrategy:
    return OpStrategy("replicate", tuple(REPLICATE for _ in op.inputs),
                      tuple(REPLICATE for _ in op.outputs), 1, (), "replicate")


def divided_split(graph: OpGraph, op: Op, s: OpStrategy) -> tuple[str, int]:
    """(side, parts): the side of ``op``'s matrix product that strategy ``s`` divides among the
    axis's ranks: "n" where each rank computes some of the output's columns (its last dim
    split), "k" where each computes a partial sum (part of the contraction), else "m" (rows:
    tokens, samples, heads); parts is the strategy's work divisor (``ComputeModel.op_cost``)."""
    if s.work_divisor == 1 or not op.outputs:
        return "m", s.work_divisor
    p = s.local_output(0)
    if p.kind == "P":
        return "k", s.work_divisor
    rank = len(graph.value(op.outputs[0]).meta.shape)
    if p.kind == "S" and p.dim == rank - 1:
        return "n", s.work_divisor
    return "m", s.work_divisor
