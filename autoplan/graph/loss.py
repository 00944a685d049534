"""The traced loss, where it is a mean over target tokens.

One device averages cross entropy over the batch's counted targets (those that are not
``ignore_index``: padding, prompt tokens in fine-tuning). A data-parallel rank and a
micro-batch only see their share, whose count differs from its neighbours' where padding
differs: the mean of their means is not the batch's mean (HF's trainer had this bug with
gradient accumulation). The runtime weights each micro-batch's mean by its share of the
counted targets (``runtime/trainer.py``, ``runtime/pipeline.py``); this module finds whether a
graph's loss is such a mean, and which input holds its targets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from autoplan.graph.opgraph import OpGraph, opname

_LOSSES = ("cross_entropy_loss", "nll_loss")
# views that keep every element once, so the targets the loss reads count as the input does
# (a slice, as a causal LM's shift, drops some: there the input's count is not the loss's)
# of them, those that keep the shape too (dims still the input's: a slice or pad may follow)
_SAME_SHAPE = frozenset({"to", "_to_copy", "contiguous", "alias", "clone"})
_SAME_ELEMENTS = _SAME_SHAPE | {"view", "reshape", "_unsafe_view", "flatten", "squeeze",
                                "unsqueeze", "permute", "transpose", "t"}
_MEAN = 1                         # torch's Reduction.Mean
# cross_entropy_loss / nll_loss: (self, target, weight=None, reduction=1, ignore_index=-100)
_WEIGHT, _REDUCTION, _IGNORE = 2, 3, 4


@dataclass(frozen=True)
class TokenMeanLoss:
    """The graph's output is ``loss(logits, targets)`` averaged over the targets that are not
    ``ignore_index``; the targets are the graph's input ``target_input``, through reshapes and
    first through ``prepare``: slices and constant pads off the batch dim, as a causal LM's
    shift (``("slice", dim, start, end, step)``, ``("pad", pad, value)``)."""

    target_input: int
    ignore_index: int
    prepare: tuple[tuple[Any, ...], ...] = ()

    def counted(self, targets: Any) -> int:
        """How many of ``targets`` (rows of the input) the mean counts."""
        import torch.nn.functional as F
        for step in self.prepare:
            if step[0] == "slice":
                _, dim, start, end, stride = step
                targets = targets[(slice(None),) * dim + (slice(start, end, stride),)]
            else:
                targets = F.pad(targets, list(step[1]), value=step[2])
        return int((targets != self.ignore_index).sum())


def token_mean_loss(graph: OpGraph) -> TokenMeanLoss | None:
    """The graph's loss as a mean over counted targets, or None where it is anything else (a
    sum, a weighted mean, a loss plus another term, targets shifted or padded on their way to
    it, no loss in the graph)."""
    if len(graph.outputs) != 1:
        return None
    producer = {o: op for op in graph.ops for o in op.outputs}
    op = producer.get(graph.outputs[0])
    if op is None or opname(op) not in _LOSSES:
        return None
    call = json.loads(op.args)
    if (_arg(call, _WEIGHT, "weight", None) is not None
            or _arg(call, _REDUCTION, "reduction", _MEAN) != _MEAN):
        return None
    target = _arg(call, 1, "target", None)
    if not isinstance(target, dict) or "v" not in target:
        return None
    name = target["v"]
    chain = []
    while name not in graph.inputs:          # back to the input
        src = producer.get(name)
        if src is None or not src.inputs:
            return None
        chain.append(src)
        name = src.inputs[0]
    prepare, reshaped = [], False
    for op_ in reversed(chain):              # input first
        step = _step(graph, op_)
        if step is None:
            return None
        if step == ():
            reshaped = reshaped or opname(op_) not in _SAME_SHAPE
        elif reshaped:                       # dims no longer the input's
            return None
        else:
            prepare.append(step)
    ignore = _arg(call, _IGNORE, "ignore_index", -100)
    return TokenMeanLoss(target_input=graph.inputs.index(name), ignore_index=int(ignore),
                         prepare=tuple(prepare))


def _step(graph: OpGraph, op: Any) -> tuple[Any, ...] | None:
    """How ``op`` changes which targets are counted: () not at all, a replayable slice or
    constant pad off the batch dim, None anything else."""
    name = opname(op)
    if name in _SAME_ELEMENTS:
        return ()
    call = json.loads(op.args)
    rank = len(graph.value(op.inputs[0]).meta.shape)
    if name == "slice":
        dim, start, end, stride = (_arg(call, 1, "dim", 0), _arg(call, 2, "start", None),
                                   _arg(call, 3, "end", None), _arg(call, 4, "step", 1))
        if not all(isinstance(v, (int, type(None))) for v in (dim, start, end, stride)) or \
                dim % rank == 0:             # the batch dim sliced
            return None
        return ("slice", dim % rank, start, end, stride)
    if name in ("pad", "constant_pad_nd"):
        pad = _arg(call, 1, "pad", None)
        if name == "pad":
            mode, value = _arg(call, 2, "mode", "constant"), _arg(call, 3, "value", 0)
        else:
            mode, value = "constant", _arg(call, 2, "value", 0)
        if mode != "constant" or not isinstance(pad, list) or len(pad) // 2 >= rank:
            return None                      # the batch dim padded, or not a constant
        return ("pad", tuple(pad), value)
    return None


def _arg(call: dict, i: int, name: str, default: Any) -> Any:
    """Argument ``i`` (keyword ``name``) of a recorded call (``Op.args``), else ``default``."""
    args = call.get("args", [])
    return args[i] if len(args) > i else call.get("kwargs", {}).get(name, default)


def step_weights(loss: TokenMeanLoss | None, global_targets: Any, dp_index: int, dp: int,
                 micro_batch_rows: int, shares: tuple[int, ...] | None = None
                 ) -> list[float] | None:
    """Per micro-batch of data-parallel rank ``dp_index``, the factor on its mean loss that
    makes the average over every rank's micro-batches (what the runtime computes: gradients
    averaged over micro-batches and dp) the mean over the global batch's counted targets, as
    one device computes it: ``counted * dp * micro_batches / counted in the global batch``.
    ``shares``: the micro-batches each rank runs, where they differ (``dp_shares``; rank d then
    holds the ``shares[d]`` micro-batches after those of ranks 0..d-1), else the batch splits
    evenly. Exactly 1 where every micro-batch counts as many and the shares are even; None
    where there is nothing to weigh (not a token mean, or nothing counted)."""
    if loss is None:
        return None
    total = loss.counted(global_targets)
    if shares is None:
        k = global_targets.shape[0] // dp // micro_batch_rows
        lo = dp_index * k * micro_batch_rows
    else:
        k = shares[dp_index]
        lo = sum(shares[:dp_index]) * micro_batch_rows
    if total == 0 or k == 0:
        return None
    counts = [loss.counted(global_targets[lo + j * micro_batch_rows:
                                          lo + (j + 1) * micro_batch_rows]) for j in range(k)]
    return [c * dp * k / total for c in counts]
