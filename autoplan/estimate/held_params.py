"""The parameters a rank holds, each storage once.

``chunk_cost`` prices a chunk by its parts (the layers and the ops around them), each counting
the parameters it reads; a weight two parts read is one tensor, held once: a tied embedding and
LM head (gpt-tiny: 118,528 parameters, 134,912 when the tied weight counts twice). So are two
chunks of one pipeline rank that read it (the V schedules put both ends of the model on rank 0).
Two ranks reading it each hold a copy (Megatron-LM's embedding and LM head on the first and the
last stage, their gradients all-reduced between them): counted on both.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.graph.experts import find_experts


@dataclass(frozen=True)
class Repeated:
    """What counting per part counts more than once: held elements (of them, expert slabs'),
    tensors, and the FQNs of those weights."""

    elements: float = 0.0
    experts: float = 0.0
    tensors: int = 0
    fqns: frozenset[str] = frozenset()

    def minus(self, other: Repeated) -> Repeated:
        return Repeated(self.elements - other.elements, self.experts - other.experts,
                        self.tensors - other.tensors, self.fqns)


def held_elements(ci: Any, i: int, n: str, found: Any) -> tuple[float, bool]:
    """(elements one rank holds, whether an expert slab) of parameter value ``n`` as op ``i``
    reads it: split over tp where the op reads it split, expert slabs over ep."""
    v = ci.graph.value(n)
    split = ci.sharding.input_placement(ci.graph, i, n).kind == "S"
    held = v.meta.numel / (ci.sharding.t if split else 1)
    if found is not None and v.base in found.param_values:
        return held / ci.config.ep, True          # this rank's experts only
    return held, False


def experts_of(ci: Any) -> Any:
    """The model's experts where expert parallelism splits them (``held_elements``)."""
    return find_experts(ci.graph) if ci.config.ep > 1 else None


def repeated_params(ci: Any, spans: Iterable[tuple[int, int]]) -> Repeated:
    """Of the parameter storages the ops of ``spans`` ((start, stop) ranges, each counting
    every storage it reads once) read, those a later span reads again, as that span holds them."""
    graph = ci.graph
    spans_read = _held_table(ci).spans
    counted: set[str] = set()
    elements = experts = 0.0
    tensors = 0
    fqns: set[str] = set()
    for span in spans:
        mine = spans_read(span)
        for base, (elems, expert) in mine.items():
            if base in counted:
                elements += elems
                experts += elems if expert else 0.0
                tensors += 1
                fqns.add(graph.value(base).fqn)
        counted.update(mine)
    return Repeated(elements, experts, tensors, frozenset(fqns))


class _HeldReads:
    """``held_elements`` of every read in ``graph.param_reads`` for one sharding and expert
    parallelism (all it depends on), and each span's storages as their first readers read them
    (the search prices the same layer ranges in many stages)."""

    def __init__(self, ci: Any):
        self.graph, self.sharding = ci.graph, ci.sharding   # (their ids key the cache)
        experts = experts_of(ci)
        self.index, reads = ci.graph.param_reads
        self.bases = [base for _, base in reads]
        self.held = [held_elements(ci, i, n, experts) for i, (n, _) in zip(self.index, reads)]
        self._spans: dict[tuple[int, int], dict[str, tuple[float, bool]]] = {}

    def spans(self, span: tuple[int, int]) -> dict[str, tuple[float, bool]]:
        found = self._spans.get(span)
        if found is None:
            found = {}
            for k in range(bisect_left(self.index, span[0]), bisect_left(self.index, span[1])):
                found.setdefault(self.bases[k], self.held[k])
            self._spans[span] = found
        return found


_HELD: dict[tuple[int, int, int], _HeldReads] = {}
_HELD_ENTRIES = 32


def _held_table(ci: Any) -> _HeldReads:
    key = (id(ci.graph), id(ci.sharding), ci.config.ep)
    found = _HELD.get(key)
    if found is None:
        if len(_HELD) >= _HELD_ENTRIES:
            _HELD.pop(next(iter(_HELD)))
        found = _HELD[key] = _HeldReads(ci)
    return found


def rank_repeated(ci: Any, chunk_spans: Sequence[Sequence[tuple[int, int]]]) -> Repeated:
    """What the chunks of one rank (``chunk_spans``: each chunk's parts, (start, stop)) count
    again of each other's weights (their own repeats are off each chunk's count already):
    nothing for a rank of one chunk."""
    if len(chunk_spans) < 2:
        return Repeated()
    out = repeated_params(ci, [span for spans in chunk_spans for span in spans])
    for spans in chunk_spans:
        out = out.minus(repeated_params(ci, spans))
    return out
