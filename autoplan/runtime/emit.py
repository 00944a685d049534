"""From a plan to this rank's program: export at the micro-batch, strategies by position,
local weights, the rewritten graph, its shape check, and one module per layer.

The plan's strategies were chosen on the planning graph (traced with the user's example
inputs, layers possibly stamped from two traced ones). The program runs the graph exported at
the micro-batch each rank sees, so the two graphs hold the same ops in the same order; the
strategies carry over by position, checked op by op (same aten target). A strategy that does not
exist at the micro-batch (a batch split the micro-batch does not divide) is refused with the op
named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplan.errors import PlanError
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import export_program
from autoplan.runtime.program import Program, build_program, check_shapes
from autoplan.runtime.segments import layer_ranges, split_layers
from autoplan.runtime.state import LocalState
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategies import strategies


@dataclass
class RankProgram:
    module: nn.Module                 # the root GraphModule (layers installed at their paths)
    program: Program
    graph: OpGraph                    # the exported graph the program runs
    sharding: Sharding
    layers: list[str]                 # layer paths (modules of the program)
    with_loss: bool


def micro_batch(tensors: Sequence[Any], rows: int) -> tuple:
    """The first ``rows`` samples of each batch-first tensor."""
    return tuple(t[:rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
                 for t in tensors)


def strategies_by_position(plan_graph: OpGraph, op_strategies: dict[str, str],
                           graph: OpGraph, t: int) -> Sharding:
    """The plan's per-op strategy names, carried to ``graph`` (same ops, maybe another batch)."""
    if len(plan_graph.ops) != len(graph.ops):
        raise PlanError(f"the model exported at the micro-batch has {len(graph.ops)} ops, the "
                        f"planning graph {len(plan_graph.ops)}: its forward depends on the "
                        "batch size; plan with example inputs of the micro-batch size")
    chosen = []
    for a, b in zip(plan_graph.ops, graph.ops):
        if a.target != b.target:
            raise PlanError(f"op {a.name} is {a.target} in the planning graph but {b.target} "
                            "when exported at the micro-batch; plan with example inputs of the "
                            "micro-batch size")
        name = op_strategies.get(a.name)
        if name is None:
            raise PlanError(f"the plan has no strategy for op {a.name!r}: it was made for "
                            "another graph; re-plan")
        options = {s.name: s for s in strategies(graph, b, t)}
        if name not in options:
            raise PlanError(f"op {a.name} ({a.target}) has no strategy {name!r} on a {t}-way "
                            f"axis at the micro-batch (it has {sorted(options)}); re-plan")
        chosen.append(options[name])
    return Sharding.build(graph, t, chosen)


@dataclass
class Exported:
    """The model exported at the micro-batch, with the plan's strategies on its ops."""

    ep: Any
    graph: OpGraph
    prefix: str
    sharding: Sharding
    inputs: tuple                     # the example micro-batch: inputs (and targets)
    with_loss: bool


def export_for_plan(model: nn.Module, plan: Any, plan_graph: OpGraph, *,
                    example_inputs: Sequence[Any], example_targets: Any,
                    loss_fn: Callable | None, t: int) -> Exported:
    mbs = plan.config.micro_batch_size
    inputs = micro_batch(example_inputs, mbs)
    with_loss = loss_fn is not None and example_targets is not None
    targets = micro_batch([example_targets], mbs)[0] if with_loss else None
    ep, graph, prefix = export_program(model, inputs, loss_fn=loss_fn if with_loss else None,
                                       targets=targets)
    sh = strategies_by_position(plan_graph, dict(plan.op_strategies), graph, t)
    return Exported(ep=ep, graph=graph, prefix=prefix, sharding=sh,
                    inputs=inputs + ((targets,) if with_loss else ()), with_loss=with_loss)


def lower(model: nn.Module, ex: Exported, *, t: int, tp_rank: int, device: torch.device,
          seed: int, keep: Callable[[str], bool] | None = None) -> Program:
    """The checked rank program. ``keep(fqn)`` False: that weight is not this rank's (another
    pipeline rank holds it) and stays an unallocated placeholder."""
    state = LocalState(model, t=t, rank=tp_rank, device=device, seed=seed, keep=keep)
    program = build_program(ex.ep, ex.graph, ex.sharding, prefix=ex.prefix, t=t, device=device,
                            state_tensor=state)
    check_shapes(program, ex.inputs, t, device)
    return program


def emit(model: nn.Module, plan: Any, plan_graph: OpGraph, *, example_inputs: Sequence[Any],
         example_targets: Any, loss_fn: Callable | None, t: int, tp_rank: int,
         device: torch.device, seed: int) -> RankProgram:
    """This rank's program of ``plan`` (tensor-parallel degree ``t``, index ``tp_rank``)."""
    ex = export_for_plan(model, plan, plan_graph, example_inputs=example_inputs,
                         example_targets=example_targets, loss_fn=loss_fn, t=t)
    program = lower(model, ex, t=t, tp_rank=tp_rank, device=device, seed=seed)
    ranges = layer_ranges(ex.graph)
    module = split_layers(program.graph_module, ranges)
    return RankProgram(module=module, program=program, graph=ex.graph, sharding=ex.sharding,
                       layers=[p for p, _, _ in ranges], with_loss=ex.with_loss)


def connect(slot: Any, *, tp: tuple[Any, int, int], dp: tuple[Any, int, int],
            dp_tp: tuple[Any, int, int] | None = None) -> None:
    """Point the program's collectives at this rank's groups, each ``(group, size, index)``:
    the tensor-parallel axis, and for batch norm's statistics the data-parallel group and the
    data x tensor-parallel group (the whole job when not pipelined)."""
    from autoplan.runtime.tp_comm import AxisComm
    if tp[1] > 1:
        slot.comm = AxisComm(*tp)
    if dp[1] > 1:
        slot.dp = AxisComm(*dp)
        if tp[1] > 1:
            import torch.distributed as dist
            slot.dp_tp = AxisComm(*(dp_tp or (dist.group.WORLD, dist.get_world_size(),
                                              dist.get_rank())))
