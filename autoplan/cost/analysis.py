"""Structural facts about an OpGraph that several cost functions need, computed once per graph.

- which op produces each value, and which ops consume it;
- which values depend on the batch (descend from a user input): only those grow with the
  micro-batch size; masks built from constants do not;
- Megatron-style tensor-parallel propagation: for each value whether, under tensor parallelism,
  it is split across the TP group ("S", the region between a column- and a row-parallel
  linear: attention heads, MLP hidden) or replicated ("R"); each parameter's sharded dim; and
  the collectives TP inserts (Shoeybi et al. 2019, "Megatron-LM", Sec. 3; sequence parallelism
  per Korthikanti et al. 2022, Sec. 4.2.2);
- the attention-score regions that selective recomputation drops (Korthikanti et al. 2022,
  Sec. 5: recompute QK^T, softmax, softmax dropout and the attention over V inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from autoplan.graph.opgraph import Op, OpGraph


@dataclass(frozen=True)
class TPComm:
    """A collective tensor parallelism adds at one op. ``value`` names the tensor it moves."""

    op_index: int
    phase: str          # "fwd" | "bwd"
    kind: str           # collective with TP only: "all_reduce"
    sp_kind: str        # the collective that replaces it under sequence parallelism
    value: str
    full_size: bool = True   # False: a small per-token reduction (loss parallel)


@dataclass(frozen=True)
class GraphAnalysis:
    producer: dict[str, int]                 # value -> index of the op producing it
    batch_dependent: frozenset[str]          # values that scale with the batch
    tp_state: dict[str, str]                 # value -> "S" (split by TP) or "R" (replicated)
    op_tp_split: tuple[bool, ...]            # per op: its work divides across the TP group
    param_shard_dim: dict[str, int | None]   # parameter FQN -> dim sharded by TP (None: replicated)
    tp_comms: tuple[TPComm, ...]
    head_counts: frozenset[int]              # head counts seen where heads are split from features
    score_values: frozenset[str]             # values inside attention-score regions
    score_ops: frozenset[int]                # ops inside those regions (recomputed by "selective")


def _activation_inputs(graph: OpGraph, op: Op) -> list[str]:
    return [n for n in op.inputs if graph.value(n).kind in ("activation", "input")]


def _weight_input(graph: OpGraph, op: Op) -> tuple[int, str] | None:
    for i, n in enumerate(op.inputs):
        v = graph.value(n)
        if v.kind == "param" and len(v.meta.shape) == 2:
            return i, n
    return None


def analyze(graph: OpGraph) -> GraphAnalysis:
    """The analysis of ``graph``, computed on first use and kept on the (immutable) graph."""
    cached = graph.__dict__.get("_autoplan_analysis")
    if cached is None:
        cached = _analyze(graph)
        graph.__dict__["_autoplan_analysis"] = cached
    return cached


def _analyze(graph: OpGraph) -> GraphAnalysis:
    producer: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for out in op.outputs:
            producer[out] = i

    batch_dep: set[str] = set(graph.inputs)
    for op in graph.ops:
        if any(n in batch_dep for n in op.inputs):
            batch_dep.update(op.outputs)

    state: dict[str, str] = {}
    split = []
    shard_dim: dict[str, int | None] = {}
    comms: list[TPComm] = []
    heads: set[int] = set()
    bwd_reduced: set[str] = set()

    def st(n: str) -> str:
        return state.get(n, "R")

    for i, op in enumerate(graph.ops):
        acts = _activation_inputs(graph, op)
        any_split = any(st(n) == "S" for n in acts)
        weight = _weight_input(graph, op) if op.kind == "matmul" else None
        out_state = "S" if any_split else "R"
        op_split = any_split
        if weight is not None and acts:
            w_pos, w_name = weight
            fqn = graph.value(w_name).fqn
            # linear stores (out, in); x @ W stores (in, out)
            out_dim, in_dim = (0, 1) if op.target.startswith("aten.linear") or w_pos == 0 else (1, 0)
            if not any_split:       # column parallel: split output features
                shard_dim.setdefault(fqn, out_dim)
                for n in op.inputs:
                    v = graph.value(n)
                    if v.kind == "param" and len(v.meta.shape) == 1:
                        shard_dim.setdefault(v.fqn, 0)
                x = acts[0]
                if x not in bwd_reduced:   # one backward all-reduce per replicated input
                    bwd_reduced.add(x)
                    comms.append(TPComm(i, "fwd", "none", "all_gather", x))
                    comms.append(TPComm(i, "bwd", "all_reduce", "reduce_scatter", x))
                out_state, op_split = "S", True
            else:                   # row parallel: split input features, all-reduce output
                shard_dim.setdefault(fqn, in_dim)
                comms.append(TPComm(i, "fwd", "all_reduce", "reduce_scatter", op.outputs[0]))
                comms.append(TPComm(i, "bwd", "none", "all_gather", op.outputs[0]))
                out_state, op_split = "R", True
        elif op.kind == "embedding" and op.params and acts:
            w = next(n for n in op.inputs if graph.value(n).kind == "param")
            shard_dim.setdefault(graph.value(w).fqn, 0)      # vocab-parallel table
            comms.append(TPComm(i, "fwd", "all_reduce", "reduce_scatter", op.outputs[0]))
            out_state, op_split = "R", True
        elif op.kind == "loss" and any_split:
            # loss parallel: max, sum-exp and target logit are reduced across the vocab shards
            comms.append(TPComm(i, "fwd", "all_reduce", "all_reduce", op.inputs[0],
                                full_size=False))
            out_state = "R"
        elif op.kind == "view" and any_split and op.inputs and op.outputs:
            a = graph.value(op.inputs[0]).meta.shape
            b = graph.value(op.outputs[0]).meta.shape
            if len(b) == len(a) + 1 and a and b[-2] * b[-1] == a[-1] and b[-2] > 1:
                heads.add(b[-2])
        for n in op.params:
            shard_dim.setdefault(n, None)
        for out in op.outputs:
            state[out] = out_state
        split.append(op_split)

    score_values, score_ops = _score_regions(graph, producer)
    return GraphAnalysis(producer=producer, batch_dependent=frozenset(batch_dep), tp_state=state,
                         op_tp_split=tuple(split), param_shard_dim=shard_dim,
                         tp_comms=tuple(comms), head_counts=frozenset(heads),
                         score_values=frozenset(score_values), score_ops=frozenset(score_ops))


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
