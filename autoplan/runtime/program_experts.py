"""Expert parallelism in the rank program (``program.py``): inside the expert regions
(``sharding/expert_regions.py``) values are held as the rows dispatched to the ranks of their
experts, not as the rows of this rank's batch. ``ExpertRows`` keeps those held values with the
state of the exchange that dispatched them, dispatches an expert product's input once per value
and placement (``kernel_dispatch`` / ``kernel_dispatch_stacked``), and brings a held value home
(``kernel_combine``) where an op outside the region reads it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import fx

from autoplan.errors import PlanError
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.runtime.program_calls import kernel_combine, kernel_dispatch, kernel_dispatch_stacked
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategy import OpStrategy


@dataclass(frozen=True)
class ExpertSite:
    """An op inside an expert region (values held as the rows dispatched to the experts)."""

    expert_op: bool             # the experts' product itself
    stacked: bool               # rows held stacked: (experts / ep, ep * rows, ...)
    to_dispatch: frozenset[str]  # its inputs dispatched at this op


class ExpertRows:
    """The values an expert-parallel program holds as dispatched rows, their exchanges'
    states, and the dispatches made (one per value and placement). ``emit(fn, args, i)`` adds
    a call of op ``i`` to the program; ``slot_node`` is the node of its tensor-parallel
    ``CommSlot`` (whose ``ep`` group the exchanges use)."""

    def __init__(self, graph: OpGraph, sh: Sharding, ep_size: int,
                 emit: Callable[[Any, Any, int], fx.Node], slot_node: fx.Node):
        self.experts = find_experts(graph)
        if self.experts is None:
            raise PlanError(f"the plan splits experts over ep={ep_size} ranks, but the model "
                            "has no product of stacked expert weights (grouped_mm, or bmm / "
                            "einsum over an experts dim) to split; re-plan with ep=1")
        self.regions = expert_regions(graph, sh)
        self.ep_size = ep_size
        self.emit, self.slot_node = emit, slot_node
        self.held: dict[str, fx.Node] = {}
        self.held_state: dict[str, fx.Node] = {}
        self.dispatched: dict[tuple[str, str], tuple[fx.Node, fx.Node]] = {}
        self.stacked_held: set[str] = set()

    def site(self, i: int, op: Op) -> ExpertSite | None:
        """Where op ``i`` stands in expert parallelism (None: outside the regions where
        values are held as dispatched rows)."""
        if i not in self.regions.members:
            return None
        expert_op = i in self.experts.ops
        # stacked rows are held as (experts / ep, ep * rows, ...): every peer's rows of this
        # rank's experts
        stacked = (i in self.experts.stacked if expert_op else
                   any(vn in self.stacked_held for vn in op.inputs))
        return ExpertSite(expert_op=expert_op, stacked=stacked,
                          to_dispatch=frozenset(x for j, x in self.regions.dispatch if j == i))

    def read_held(self, op: Op, site: ExpertSite, env: dict[str, fx.Node]
                  ) -> dict[str, fx.Node]:
        """Inside an expert region, inputs are read as the rows the experts hold (all but the
        expert product's own input still to dispatch): swapped into ``env``; returns the nodes
        to put back."""
        swapped: dict[str, fx.Node] = {}
        for k, vn in enumerate(op.inputs):
            if vn in self.held and not (site.expert_op and k == 0
                                        and vn in site.to_dispatch):
                swapped[vn] = env[vn]
                env[vn] = self.held[vn]
        return swapped

    def state(self, i: int, op: Op, s: OpStrategy, site: ExpertSite,
              inputs: list[fx.Node]) -> fx.Node:
        """The exchange state the held rows of op ``i`` go with (what ``kernel_combine`` needs
        to bring them home). An expert product's input to dispatch is dispatched here, once
        per value and placement, and ``inputs[0]`` becomes its rows."""
        if not site.expert_op:
            return next(self.held_state[vn] for vn in op.inputs if vn in self.held_state)
        x = op.inputs[0]
        if x not in site.to_dispatch:
            return self.held_state[x]
        key = (x, str(s.inputs[0]))
        if key not in self.dispatched:
            self.dispatched[key] = self._dispatch(i, inputs)
        inputs[0], state = self.dispatched[key]
        return state

    def _dispatch(self, i: int, inputs: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
        """(rows, state): the expert product's input sent to the ranks of its experts."""
        if i in self.experts.stacked:
            pair = self.emit(kernel_dispatch_stacked, (inputs[0], self.slot_node), i)
        else:
            pair = self.emit(kernel_dispatch, (inputs[0], inputs[2], self.experts.num_experts
                                               // self.ep_size, self.slot_node), i)
        return (self.emit(operator.getitem, (pair, 0), i),
                self.emit(operator.getitem, (pair, 1), i))

    def hold(self, i: int, vn: str, y: fx.Node, state: fx.Node, site: ExpertSite) -> fx.Node:
        """Output ``vn`` of op ``i`` held as dispatched rows (``y``); returns the node the
        program reads it as: ``y``, or its rows brought home where read from outside."""
        self.held[vn], self.held_state[vn] = y, state
        if site.stacked:
            self.stacked_held.add(vn)
        if vn in self.regions.combine:
            return self.emit(kernel_combine, (y, state), i)
        return y

    def local_outs(self, op: Op, local_outs: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Expert weights' views: this rank's experts only."""
        return [(shape[0] // self.ep_size,) + tuple(shape[1:])
                if n in self.experts.chain else shape
                for shape, n in zip(local_outs, op.outputs)]
