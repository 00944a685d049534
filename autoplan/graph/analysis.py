"""Structural facts about an OpGraph that several cost functions need, computed once per graph.

- which op produces each value, and which ops consume it (in order);
- which values depend on the batch (descend from a user input): only those grow with the
  micro-batch size; masks built from constants do not;
- the head counts of attention (tensor parallelism splits whole heads);
- the attention-score regions that selective recomputation drops (Korthikanti et al. 2022,
  Sec. 5: recompute QK^T, softmax, softmax dropout and the attention over V inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph.opgraph import OpGraph, opname


@dataclass(frozen=True)
class GraphAnalysis:
    producer: dict[str, int]                 # value -> index of the op producing it
    consumers: dict[str, tuple[int, ...]]    # value -> indices of the ops reading it, in order
    batch_dependent: frozenset[str]          # values that scale with the batch
    head_counts: frozenset[int]              # head counts seen where heads are split from features
    score_values: frozenset[str]             # values inside attention-score regions
    score_ops: frozenset[int]                # ops inside those regions (recomputed by "selective")


def analyze(graph: OpGraph) -> GraphAnalysis:
    """The analysis of ``graph``, computed on first use and kept on the (immutable) graph."""
    cached = graph.__dict__.get("_autoplan_analysis")
    if cached is None:
        cached = _analyze(graph)
        graph.__dict__["_autoplan_analysis"] = cached
    return cached


def _analyze(graph: OpGraph) -> GraphAnalysis:
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for out in op.outputs:
            producer[out] = i
        for n in dict.fromkeys(op.inputs):
            readers.setdefault(n, []).append(i)

    batch_dep: set[str] = set(graph.inputs)
    for op in graph.ops:
        if any(n in batch_dep for n in op.inputs):
            batch_dep.update(op.outputs)

    # a view that splits the last (feature) dim of a (batch, seq, features) tensor into
    # (heads, head_dim): tensor parallelism must split whole heads
    heads: set[int] = set()
    for op in graph.ops:
        if op.kind != "view" or not op.inputs or not op.outputs:
            continue
        a = graph.value(op.inputs[0]).meta.shape
        b = graph.value(op.outputs[0]).meta.shape
        if len(a) >= 3 and len(b) == len(a) + 1 and b[-2] * b[-1] == a[-1] and b[-2] > 1 \
                and b[:-2] == a[:-1]:
            heads.add(b[-2])

    score_values, score_ops = _score_regions(graph, producer)
    return GraphAnalysis(producer=producer,
                         consumers={n: tuple(r) for n, r in readers.items()},
                         batch_dependent=frozenset(batch_dep),
                         head_counts=frozenset(heads), score_values=frozenset(score_values),
                         score_ops=frozenset(score_ops))


def _score_regions(graph: OpGraph, producer: dict[str, int]) -> tuple[set[str], set[int]]:
    """Attention-score regions: from a product of two activations (Q K^T) to the next product."""
    region_vals: set[str] = set()
    region_ops: set[int] = set()
    for i, op in enumerate(graph.ops):
        if op.kind != "matmul" or any(graph.value(n).kind == "param" for n in op.inputs):
            continue
        if len(op.inputs) < 2 or any(n in region_vals for n in op.inputs):
            continue          # the product that consumes a region (attention @ V) ends it
        region_ops.add(i)
        region_vals.update(op.outputs)
        frontier = set(op.outputs)
        for j in range(i + 1, len(graph.ops)):
            nxt = graph.ops[j]
            if not any(n in frontier for n in nxt.inputs):
                continue
            if nxt.kind in ("matmul", "loss", "norm", "conv", "embedding"):
                continue      # region ends at the next product
            region_ops.add(j)
            region_vals.update(nxt.outputs)
            frontier.update(nxt.outputs)
    return region_vals, region_ops


def reads_tables(graph: OpGraph) -> bool:
    """Whether the model reads rows of a weight (an embedding table). Under autocast FSDP
    gathers the weights outside the layers in fp32 then, as a 16-bit table would round the
    residual stream's start (``runtime/autocast_weights``); the estimate prices it so.
    Kept on the (immutable) graph."""
    cached = graph.__dict__.get("_autoplan_reads_tables")
    if cached is None:
        cached = any(op.params and opname(op) == "embedding" for op in graph.ops)
        graph.__dict__["_autoplan_reads_tables"] = cached
    return cached
