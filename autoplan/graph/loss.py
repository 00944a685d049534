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
_MEAN = 1                         # torch's Reduction.Mean
# cross_entropy_loss / nll_loss: (self, target, weight=None, reduction=1, ignore_index=-100)
_WEIGHT, _REDUCTION, _IGNORE = 2, 3, 4


@dataclass(frozen=True)
class TokenMeanLoss:
    """The graph's output is ``loss(logits, targets)`` averaged over the targets that are not
    ``ignore_index``; the targets are the graph's input ``target_input`` (through views)."""

    target_input: int
    ignore_index: int

    def counted(self, targets: Any) -> int:
        """How many of ``targets`` the mean counts."""
        return int((targets != self.ignore_index).sum())


def token_mean_loss(graph: OpGraph) -> TokenMeanLoss | None:
    """The graph's loss as a mean over counted targets, or None where it is anything else (a
    sum, a weighted mean, a loss plus another term, no loss in the graph)."""
    if len(graph.outputs) != 1:
        return None
    producer = {o: op for op in graph.ops for o in op.outputs}
    op = producer.get(graph.outputs[0])
    if op is None or opname(op) not in _LOSSES:
        return None
    call = json.loads(op.args)
    args, kwargs = call.get("args", []), call.get("kwargs", {})

    def arg(i: int, name: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(name, default)
    if arg(_WEIGHT, "weight", None) is not None or arg(_REDUCTION, "reduction", _MEAN) != _MEAN:
        return None
    target = arg(1, "target", None)
    if not isinstance(target, dict) or "v" not in target:
        return None
    name = target["v"]
    while name not in graph.inputs:          # back through views to the input
        src = producer.get(name)
        if src is None or not src.is_view or not src.inputs:
            return None
        name = src.inputs[0]
    ignore = arg(_IGNORE, "ignore_index", -100)
    return TokenMeanLoss(target_input=graph.inputs.index(name), ignore_index=int(ignore))


def step_weights(loss: TokenMeanLoss | None, global_targets: Any, dp_index: int, dp: int,
                 micro_batch_rows: int) -> list[float] | None:
    """Per micro-batch of data-parallel rank ``dp_index``, the factor on its mean loss that
    makes the average over every rank's micro-batches (what the runtime computes: gradients
    averaged over micro-batches and dp) the mean over the global batch's counted targets, as
    one device computes it: ``counted * dp * micro_batches / counted in the global batch``.
    Exactly 1 where every micro-batch counts as many; None where there is nothing to weigh
    (not a token mean, or nothing counted)."""
    if loss is None:
        return None
    total = loss.counted(global_targets)
    rows = global_targets.shape[0]
    per = rows // dp
    k = per // micro_batch_rows
    if total == 0 or k == 0:
        return None
    lo = dp_index * per
    counts = [loss.counted(global_targets[lo + j * micro_batch_rows:
                                          lo + (j + 1) * micro_batch_rows]) for j in range(k)]
    return [c * dp * k / total for c in counts]
