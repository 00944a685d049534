"""The experts of a mixture-of-experts graph: what expert parallelism shards.

An MoE layer reaches its experts through a product with a stack of expert weights, in one of
two ways (``graph/products.py`` names the expert dim of either):

- grouped: HF Mixtral, torchtitan-style code or any model that sorts its routed tokens by
  expert calls a grouped product (``grouped_mm``: rows sorted by expert, weights ``(experts,
  in, out)``, cumulative row offsets per expert; ``mk,ekn->mn``);
- stacked: expert-choice routing and many research MoEs gather each expert's tokens into one
  tensor ``(experts, capacity, in)`` and apply the stacked weights with ``torch.bmm`` or
  ``torch.einsum`` (``ecd,edf->ecf``: the experts a batch dim leading the tokens, the weight
  and the output).

Expert parallelism
(``ParallelConfig.ep``) stores each expert weight's leading (expert) dim split over the ``ep``
ranks of a group and sends every routed row to the rank holding its expert (all-to-all), as
Megatron-Core and DeepSpeed-MoE do.

``find_experts`` names these products, the parameters that feed their weight operand
through ops that keep the expert dim leading (transposes of the other dims, dtype casts,
reshapes that keep dim 0), and every value on those chains: the runtime holds each of them
with ``experts / ep`` rows on dim 0. A weight reached any other way is not an expert weight,
and a graph without one cannot be planned with ``ep > 1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from autoplan.graph.opgraph import Op, OpGraph, opname
from autoplan.graph.products import expert_dim, product_spec

GROUPED_MM = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})
# single-input ops that keep an expert's rows one contiguous block on dim 0
_KEEP_DIM0 = frozenset({"transpose", "permute", "_to_copy", "to", "contiguous", "clone",
                        "alias", "detach", "view", "reshape", "_unsafe_view", "t"})


@dataclass(frozen=True)
class Experts:
    """The grouped products of a graph and the expert weights they read."""

    ops: tuple[int, ...]                  # the expert products' op indices
    num_experts: int                      # experts per grouped product (all alike)
    params: tuple[str, ...]               # expert weights' FQNs
    chain: frozenset[str]                 # values with the expert dim leading (weights, views)
    param_values: frozenset[str]          # their parameter values (graph value names)
    stacked: frozenset[int] = frozenset()  # ops whose rows arrive stacked (experts, rows, ...)

    def ep_degrees(self, limit: int) -> tuple[int, ...]:
        """Expert-parallel degrees up to ``limit`` that split the experts evenly."""
        return tuple(e for e in range(1, min(limit, self.num_experts) + 1)
                     if self.num_experts % e == 0)


def _keeps_dim0(op: Op, graph: OpGraph) -> bool:
    name = opname(op)
    if name not in _KEEP_DIM0 or len(op.inputs) != 1 or len(op.outputs) != 1:
        return False
    x = graph.value(op.inputs[0]).meta.shape
    y = graph.value(op.outputs[0]).meta.shape
    if not x or not y or x[0] != y[0]:
        return False
    args = json.loads(op.args)["args"]
    if name == "transpose":
        return 0 not in [d % len(x) for d in args[1:3] if isinstance(d, int)]
    if name == "permute":
        return bool(args[1]) and args[1][0] % len(x) == 0
    if name == "t":
        return False
    return True


def find_experts(graph: OpGraph) -> Experts | None:
    """The graph's experts, or None when it has no expert product reading a parameter.
    Cached on the (immutable) graph."""
    cache = graph.__dict__
    if "_autoplan_experts" in cache:
        return cache["_autoplan_experts"]
    producer = {n: i for i, op in enumerate(graph.ops) for n in op.outputs}
    ops, counts, params, chain, pvals, stacked = [], set(), [], set(), set(), set()
    for i, op in enumerate(graph.ops):
        if expert_dim(graph, op) is None:
            continue
        spec = product_spec(graph, op)
        path, v = [], op.inputs[spec.rhs_slot]
        while graph.value(v).kind != "param":
            j = producer.get(v)
            if j is None or not _keeps_dim0(graph.ops[j], graph):
                path = None
                break
            path.append(v)
            v = graph.ops[j].inputs[0]
        if path is None:
            continue
        w = graph.value(v)
        ops.append(i)
        if not spec.grouped:
            stacked.add(i)
        counts.add(w.meta.shape[0])
        chain.update(path + [v])
        pvals.add(v)
        if w.fqn not in params:
            params.append(w.fqn)
    found = None
    if ops and len(counts) == 1:
        found = Experts(ops=tuple(ops), num_experts=counts.pop(), params=tuple(params),
                        chain=frozenset(chain), param_values=frozenset(pvals),
                        stacked=frozenset(stacked))
    cache["_autoplan_experts"] = found
    return found
