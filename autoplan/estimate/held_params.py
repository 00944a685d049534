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
    graph, found = ci.graph, experts_of(ci)
    index, reads = graph.param_reads
    counted: set[str] = set()
    elements = experts = 0.0
    tensors = 0
    fqns: set[str] = set()
    for start, stop in spans:
        mine: dict[str, tuple[float, bool]] = {}      # each storage as its first reader reads it
        for k in range(bisect_left(index, start), bisect_left(index, stop)):
            n, base = reads[k]
            if base not in mine:
                mine[base] = held_elements(ci, index[k], n, found)
        for base, (held, expert) in mine.items():
            if base in counted:
                elements += held
                experts += held if expert else 0.0
                tensors += 1
                fqns.add(graph.value(base).fqn)
        counted.update(mine)
    return Repeated(elements, experts, tensors, frozenset(fqns))


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
