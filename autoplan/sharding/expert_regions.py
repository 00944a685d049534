"""Where expert parallelism exchanges rows: once into an MoE block's experts, once out.

Under expert parallelism (``ParallelConfig.ep``) a grouped product runs on the rows of this
rank's experts, gathered from the ranks of its expert-parallel group (``runtime/experts.py``).
Between two grouped products the rows need not go home: Mixtral's SwiGLU (chunk, silu, mul, a
dtype cast) works row by row, so the rows stay with their experts from the first product to the
last, as Megatron-Core's dispatcher keeps them (one dispatch and one combine per MoE layer,
not one pair per product).

``expert_regions`` finds, for one sharding, the values that live "dispatched": every grouped
product's output, and the outputs of row-wise ops whose tensor inputs are all dispatched and
which run on their inputs as they arrive (same placement, no rows split over the
tensor-parallel axis, no collective of their own). Values read from outside are ``dispatch``
points (one exchange per value and placement); dispatched values read by any other op, or
returned, are ``combine`` points. Both the runtime and the estimate read it, so what is priced
is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.products import product_spec
from autoplan.sharding.placement import shard
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategy import call_args, opname

_S0 = shard(0)
_STACKED = "<stacked>"          # the origin of rows dispatched evenly (no value has this name)

# ops that map each row to itself (elementwise, casts, splits of the feature dims)
ROW_WISE = frozenset({"silu", "gelu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div",
                      "neg", "chunk", "split", "split_with_sizes", "to", "_to_copy", "clone",
                      "contiguous", "alias"})


@dataclass(frozen=True)
class ExpertRegions:
    members: frozenset[int]               # ops that run on dispatched rows
    inside: frozenset[str]                # values held dispatched
    dispatch: tuple[tuple[int, str], ...]  # (expert op, input value) sent to the experts
    combine: frozenset[str]               # dispatched values brought home (read outside)


def _row_wise(graph: OpGraph, sh: Sharding, i: int, inside: set[str], rows: dict[str, int],
              stacked: bool) -> bool:
    op = graph.ops[i]
    if opname(op) not in ROW_WISE or not op.outputs or not op.inputs:
        return False
    if any(n not in inside for n in op.inputs):
        return False
    n_rows = rows[op.inputs[0]]
    if any(graph.value(n).meta.shape[:1] != (n_rows,) for n in op.inputs + op.outputs):
        return False
    args, kwargs = call_args(op)
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) \
        if opname(op) in ("chunk", "split", "split_with_sizes") else None
    # a split keeps each row's features together; stacked rows (experts, rows, ...) are held
    # with every peer's rows along dim 1, which a split must not cut either
    if isinstance(dim, int) and dim % len(graph.value(op.inputs[0]).meta.shape) in (
            (0, 1) if stacked else (0,)):
        return False
    s = sh.op_strategy[i]
    if s.comms or s.kernel:
        return False
    for k, n in enumerate(op.inputs):
        if s.inputs[k] != sh.placement_of(graph, n) or s.inputs[k] == _S0:
            return False
    return all(s.outputs[k] != _S0 for k in range(len(op.outputs)))


def expert_regions(graph: OpGraph, sh: Sharding) -> ExpertRegions | None:
    """The dispatched values of ``graph`` under ``sh`` (None: the graph has no experts).
    Cached on the sharding."""
    cached = sh.__dict__.get("_autoplan_expert_regions", False)
    if cached is not False:
        return cached
    found = find_experts(graph)
    result = None
    if found is not None:
        ops = set(found.ops)
        offsets = {}
        for i in ops:
            k = product_spec(graph, graph.ops[i]).offsets
            # stacked rows are exchanged evenly, alike for every stacked product
            offsets[i] = graph.ops[i].inputs[k] if k is not None else _STACKED
        inside: set[str] = set()
        rows: dict[str, int] = {}
        origin: dict[str, str] = {}        # a dispatched value's offsets value (or _STACKED)
        members: set[int] = set()
        dispatch: list[tuple[int, str]] = []
        for i, op in enumerate(graph.ops):
            if i in ops:
                x = op.inputs[0]
                if x not in inside or origin[x] != offsets[i]:
                    dispatch.append((i, x))
                members.add(i)
                for n in op.outputs:
                    inside.add(n)
                    rows[n] = graph.value(n).meta.shape[0]
                    origin[n] = offsets[i]
            elif inside and all(n in origin for n in op.inputs) \
                    and len({origin[n] for n in op.inputs}) == 1 \
                    and _row_wise(graph, sh, i, inside, rows,
                                  origin[op.inputs[0]] == _STACKED):
                members.add(i)
                for n in op.outputs:
                    inside.add(n)
                    rows[n] = graph.value(n).meta.shape[0]
                    origin[n] = origin[op.inputs[0]]
        combine = set(graph.outputs) & inside
        for i, op in enumerate(graph.ops):
            if not op.outputs:
                continue            # metadata asserts read any value and produce none
            for k, n in enumerate(op.inputs):
                if n not in inside:
                    continue
                if i in ops and k == 0 and origin[n] == offsets[i]:
                    continue
                if i in members and i not in ops:
                    continue
                combine.add(n)
        result = ExpertRegions(members=frozenset(members), inside=frozenset(inside),
                               dispatch=tuple(dispatch), combine=frozenset(combine))
    sh.__dict__["_autoplan_expert_regions"] = result
    return result
