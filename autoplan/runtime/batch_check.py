"""What ``Trainer.step`` takes, and the check that a batch is that before anything runs.

``compile`` traces the model with its example inputs (and targets); the rank program is that
trace, so a step can only run a batch of the same kinds: as many tensors, in the same order,
each of the traced dtype and of the traced shape after its first dim, which is the sample dim
and holds the whole global batch (each rank takes its data-parallel slice of it). A batch
that differs would fail deep inside the program (a shape error in a matmul, a dtype error in a
loss, a missing positional argument) or, worse, on some ranks only, leaving the others waiting
in a collective; ``check_batch`` refuses it first, on every rank alike, saying what was
expected.

``BatchSpec`` is the frozen description, built from the example inputs and targets at
compile time; ``check_batch(spec, batch)`` returns the batch as a tuple of tensors or raises
``PlanError`` listing every slot that does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoplan.errors import PlanError


@dataclass(frozen=True)
class Slot:
    """One tensor of the batch: its name, its dims after the sample dim and its dtype (None
    where the trace saw no tensor: targets a loss_fn takes that compile was not shown)."""

    name: str
    tail: tuple[int, ...] | None
    dtype: torch.dtype | None

    def describe(self, rows: int) -> str:
        if self.tail is None:
            return f"{self.name}: a tensor of {rows} rows"
        dims = ", ".join(str(d) for d in (rows, *self.tail))
        return f"{self.name}: {_dtype(self.dtype)} [{dims}]"


@dataclass(frozen=True)
class BatchSpec:
    """The batch a compiled plan's ``step`` takes: ``(inputs..., targets)``."""

    slots: tuple[Slot, ...]
    global_batch_size: int
    device: str                      # where the step moves each micro-batch
    lone_tensor: bool = True         # a single tensor may stand for a batch of one slot

    @classmethod
    def of(cls, example_inputs: Any, example_targets: Any, *, loss_fn: Any,
           global_batch_size: int, device: Any, pipelined: bool = False) -> BatchSpec:
        """The batch ``compile`` traced: the example inputs, then the targets when there is a
        loss outside the model (the targets shown, or any tensor when only loss_fn was)."""
        inputs = (tuple(example_inputs) if isinstance(example_inputs, (tuple, list))
                  else (example_inputs,))
        slots = [_slot(f"input {i}", x) for i, x in enumerate(inputs)]
        if example_targets is not None:
            slots.append(_slot("targets", example_targets))
        elif loss_fn is not None:
            slots.append(Slot("targets", None, None))
        return cls(tuple(slots), int(global_batch_size), str(device), lone_tensor=not pipelined)

    def expected(self) -> str:
        return "(" + ", ".join(s.describe(self.global_batch_size) for s in self.slots) + ")"


def _slot(name: str, example: Any) -> Slot:
    if isinstance(example, torch.Tensor) and example.dim() >= 1:
        return Slot(name, tuple(int(d) for d in example.shape[1:]), example.dtype)
    return Slot(name, None, None)


def check_batch(spec: BatchSpec | None, batch: Any) -> Any:
    """``batch`` as a tuple of tensors when it is what ``spec`` describes; PlanError saying
    what differs and what was expected otherwise. No spec: the batch as given."""
    if spec is None:
        return batch
    want = spec.expected()
    if isinstance(batch, torch.Tensor) and spec.lone_tensor:
        batch = (batch,)
    if not isinstance(batch, (tuple, list)):
        raise PlanError(f"Trainer.step() takes the global batch as a tuple (inputs..., targets) "
                        f"of tensors, got {_kind(batch)}; expected {want}")
    if len(batch) != len(spec.slots):
        hint = ""
        if len(batch) == len(spec.slots) - 1 and spec.slots[-1].name == "targets":
            hint = " (the targets go last)"
        raise PlanError(f"Trainer.step() got a batch of {len(batch)} tensor(s), the model was "
                        f"traced with {len(spec.slots)}{hint}; expected {want}")
    problems = [p for slot, t in zip(spec.slots, batch)
                for p in _problems(slot, t, spec.global_batch_size)]
    if problems:
        raise PlanError("Trainer.step(): the batch is not what the model was traced with: "
                        + "; ".join(problems) + f". Expected {want} (the first dim is the "
                        "global batch; the others and the dtypes are the traced example's)")
    return tuple(batch)


def _problems(slot: Slot, t: Any, rows: int) -> list[str]:
    if not isinstance(t, torch.Tensor):
        return [f"{slot.name} is {_kind(t)}, not a tensor"]
    if t.layout != torch.strided:
        return [f"{slot.name} is a {t.layout} tensor; pass a dense one (.to_dense())"]
    if t.is_meta:
        return [f"{slot.name} is a meta tensor (it holds no data); pass real data on the CPU "
                "or the trainer's device"]
    if t.dim() == 0:
        return [f"{slot.name} is a 0-d tensor; its first dim must hold the {rows} samples"]
    out = []
    if t.shape[0] != rows:
        out.append(f"{slot.name} has {t.shape[0]} rows, the plan is for a global batch of "
                   f"{rows}")
    if slot.tail is not None and tuple(t.shape[1:]) != slot.tail:
        out.append(f"{slot.name} has shape {_shape(t.shape)}, traced as "
                   f"{_shape((rows, *slot.tail))}")
    if slot.dtype is not None and t.dtype != slot.dtype:
        out.append(f"{slot.name} is {_dtype(t.dtype)}, traced as {_dtype(slot.dtype)}")
    return out


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _dtype(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _kind(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"one tensor of shape {_shape(v.shape)}"
    text = repr(v)
    return f"a {type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
