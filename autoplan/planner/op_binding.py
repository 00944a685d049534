"""The plan's ops found among another trace's ops.

A plan names its ops as the planning process's trace named them (fx numbers ops in the order
Python ran the forward: ``to_8`` is the ninth ``to`` call). A model that loops over a ``set``
(Hugging Face Gemma 3 and ModernBERT over their layer types) runs independent parts of its
forward in an order that follows ``PYTHONHASHSEED``, so another process, every rank of a
``torchrun`` job included, may give the name ``to_8`` to another op: the plan's strategy for one
rotary chain would be applied to the other, and ranks with different hash seeds would build
different programs.

Plans from schema 7 record each op's canonical key (``OpGraph.op_keys()``: what it computes,
from what, and for which readers; the same in every trace of the model). :func:`bind_strategies`
gives each op of ``graph`` the strategy of the plan's op with its key; an op whose key the plan
does not hold (a plan without keys, or a graph that differs) falls back to its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.planner.planfile import plan_op_keys


@dataclass(frozen=True)
class Bound:
    """The plan's op strategies keyed by the names of one graph's ops."""

    strategies: dict[str, str]      # op name in the graph -> strategy name
    unmatched: tuple[str, ...]      # the plan's ops that match no op of the graph (plan names)
    by_name: tuple[str, ...]        # the graph's ops matched by name: the plan has no key for them


def bind_strategies(plan: Any, graph: Any) -> Bound:
    """``plan.op_strategies`` keyed by ``graph``'s op names (``graph`` an OpGraph of the model
    the plan is for, traced in any process), matched by canonical key where the plan records
    keys, by name otherwise."""
    strategies = plan.op_strategies
    keys = plan_op_keys(plan, graph) if plan.op_keys else {}
    planned = {k: n for n, k in plan.op_keys.items()}
    out: dict[str, str] = {}
    used: set[str] = set()
    loose: list[str] = []
    for op in graph.ops:
        src = planned.get(keys.get(op.name, ""))
        if src is not None and src in strategies:
            out[op.name] = strategies[src]
            used.add(src)
        else:
            loose.append(op.name)
    by_name = []
    for name in loose:               # no key of the plan's: the op of the same name, if free
        if name in strategies and name not in used:
            out[name] = strategies[name]
            used.add(name)
            by_name.append(name)
    unmatched = tuple(sorted(set(strategies) - used))
    return Bound(strategies=out, unmatched=unmatched,
                 by_name=tuple(by_name) if plan.op_keys else ())


__all__ = ["Bound", "bind_strategies"]
