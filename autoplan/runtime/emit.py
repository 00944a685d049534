"""From a plan to this rank's program: export at the micro-batch, strategies by position,
local weights, the rewritten graph, its shape check, and one module per layer.

The plan's strategies were chosen on the planning graph (traced with the user's example
inputs, layers possibly stamped from two traced ones). The plan names ops as the planning
process traced them; this rank's trace of the model finds them by canonical key
(``op_binding.bind_strategies``: another hash seed can give a name to another op). The program
runs the graph exported at the micro-batch each rank sees, under the step's autocast; its ops
take the strategies of the same ops of this rank's planning graph, paired by canonical key and,
where the other batch size or autocast changed the keys, in order by aten target
(``pair_ops``). A strategy that does not exist at the micro-batch (a batch split the
micro-batch does not divide) is refused with the op named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplan.errors import PlanError, ConfigError
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import export_program, sixteen_bit_inputs
from autoplan.planner.op_binding import bind_strategies
from autoplan.runtime.program import Program, build_program
from autoplan.runtime.float8 import fp8_program_ops
from autoplan.runtime.program_check import check_shapes
from autoplan.runtime.program_modules import layer_ranges, split_layers
from autoplan.runtime.state import (LocalState, keep_out_of_state_dict,
                                    non_persistent_buffers, register_aliases, tied_names)
from autoplan.sharding.sharding import Sharding, as_inputs_come
from autoplan.sharding.strategies import strategies_by_name
from autoplan.sharding.context_axis import context_axis
from autoplan.runtime.tp_comm import AxisComm


@dataclass
class RankProgram:
    module: nn.Module                 # the root GraphModule (layers installed at their paths)
    program: Program
    graph: OpGraph                    # the exported graph the program runs
    sharding: Sharding
    layers: list[str]                 # layer paths (modules of the program)
    with_loss: bool
    aliases: dict[str, tuple[str, ...]]   # tied weights: every name of each


def micro_batch(tensors: Sequence[Any], rows: int) -> tuple:
    """Example tensors of ``rows`` samples: the first ``rows`` of each batch-first tensor,
    repeated when it has fewer (only shapes and dtypes matter to the export)."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            if t.shape[0] < rows:
                t = t.repeat((-(-rows // t.shape[0]),) + (1,) * (t.dim() - 1))
            t = t[:rows]
        out.append(t)
    return tuple(out)


def on_weights_device(model: nn.Module, tensors: Sequence[Any]) -> tuple:
    """``tensors`` moved to the device of ``model``'s weights where that is not the CPU (a model
    on the meta device, or on the CPU, takes them as they are)."""
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None or device.type == "cpu":
        return tuple(tensors)
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors)


def pair_ops(plan_graph: OpGraph, graph: OpGraph) -> dict[int, int]:
    """Index in ``graph`` -> index of the same op in ``plan_graph``: first by canonical key
    (``OpGraph.op_keys``: the same op whatever order and names the two traces gave it; every op
    when the two are the same program), then the ops left in order by their aten target
    (``difflib``), where the export at another batch size or under autocast changed the keys."""
    import difflib
    planned = {k: i for i, k in enumerate(plan_graph.op_keys()[op.name]
                                          for op in plan_graph.ops)}
    keys = graph.op_keys()
    pairs: dict[int, int] = {}
    for j, op in enumerate(graph.ops):
        i = planned.get(keys[op.name])
        if i is not None and plan_graph.ops[i].target == op.target:
            pairs[j] = i
    taken = set(pairs.values())
    a = [i for i in range(len(plan_graph.ops)) if i not in taken]
    b = [j for j in range(len(graph.ops)) if j not in pairs]
    matcher = difflib.SequenceMatcher(a=[plan_graph.ops[i].target for i in a],
                                      b=[graph.ops[j].target for j in b], autojunk=False)
    for blk in matcher.get_matching_blocks():
        for k in range(blk.size):
            pairs[b[blk.b + k]] = a[blk.a + k]
    return pairs


# the ops a change of dtype adds to a traced graph (a cast and the assert export writes before it)
DTYPE_CASTS = frozenset({"aten.to.dtype", "aten._to_copy.default",
                         "aten._assert_tensor_metadata.default"})


def strategies_by_position(plan_graph: OpGraph, op_strategies: dict[str, str],
                           graph: OpGraph, t: int) -> Sharding:
    """The plan's per-op strategy names (keyed by ``plan_graph``'s op names: see
    ``op_binding.bind_strategies`` for a plan made in another process), carried to ``graph``
    (the same model exported at another batch size, or under autocast). Ops are paired by
    ``pair_ops``; a model whose forward adds or drops an op at another batch size (a squeeze
    that only batch 1 needs) gets, for each unpaired op, the strategy that takes its inputs as
    they come."""
    pairs = pair_ops(plan_graph, graph)
    a, b = plan_graph.ops, graph.ops
    matched = len(pairs)
    # casts another precision adds (16-bit weights' fp32 outputs) say nothing of the batch
    casts = sum(1 for j, op in enumerate(b) if j not in pairs and op.target in DTYPE_CASTS)
    if matched < 0.9 * max(len(a), len(b) - casts):
        raise PlanError(f"the model exported at the micro-batch has {len(b)} ops, the planning "
                        f"graph {len(a)}, and only {matched} line up: its forward depends on the "
                        "batch size; plan with example inputs of the micro-batch size")
    chosen = []
    adapted: list[str] = []
    placement: dict[str, Any] = {}
    for j, op in enumerate(graph.ops):
        options = strategies_by_name(graph, op, t)
        s = None
        if j in pairs:
            src = plan_graph.ops[pairs[j]]
            name = op_strategies.get(src.name)
            if name is None:
                raise PlanError(f"the plan has no strategy for op {src.name!r}: it was made "
                                "for another graph; re-plan")
            s = options.get(name)
            if s is None and op.params:
                raise PlanError(f"op {src.name} ({src.target}) has no strategy {name!r} on a "
                                f"{t}-way axis at the micro-batch (it has {sorted(options)}); "
                                "re-plan with example inputs of the micro-batch size")
            if s is None:
                adapted.append(src.name)
        if s is None:
            # an op only this batch size has, or a view whose dims differ at it (a size-1
            # batch dim cannot be split): it takes its inputs as they come, resharding where
            # the next op needs it
            s = as_inputs_come(graph, op, list(options.values()), placement)
        chosen.append(s)
        for k, n in enumerate(op.outputs):
            placement[n] = s.outputs[k]
    if adapted:
        import warnings
        warnings.warn(f"{len(adapted)} parameter-free ops of the plan ({', '.join(adapted[:5])}"
                      f"{', ...' if len(adapted) > 5 else ''}) have other shapes at the "
                      "micro-batch than when planned; they take their inputs as they come. "
                      "Plan with example inputs of the micro-batch size for the exact plan",
                      stacklevel=2)
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
    autocast_dtype: torch.dtype | None = None     # the step's autocast (16-bit plans)
    # (recipe, ops): the linears the plan runs in fp8 (``runtime/float8.py``)
    fp8: tuple[str, frozenset[int]] = ("none", frozenset())
    weights_dtype: torch.dtype | None = None      # 16-bit weights (mixed_precision "params")


PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast_dtype(plan: Any) -> torch.dtype | None:
    """The dtype the plan's step runs ``torch.autocast`` in; None for fp32 plans and for
    16-bit weights (``mixed_precision="params"``: the model itself runs in 16 bits)."""
    if weights_dtype(plan) is not None:
        return None
    return compute_dtype(plan)


def compute_dtype(plan: Any) -> torch.dtype | None:
    """The 16-bit dtype the plan's products run in (either way of holding the weights); None
    for fp32 plans."""
    return None if plan.config.precision == "fp32" else PRECISION_DTYPES[plan.config.precision]


def weights_dtype(plan: Any) -> torch.dtype | None:
    """The dtype of the rank program's weights under ``mixed_precision="params"`` (Megatron-LM's
    --bf16: weights and activations in 16 bits, the fp32 master copy with the optimizer); None
    when the weights are fp32 (autocast, or an fp32 plan, where "params" is plain fp32)."""
    cfg = plan.config
    if cfg.mixed_precision != "params" or cfg.precision == "fp32":
        return None
    return PRECISION_DTYPES[cfg.precision]


def export_for_plan(model: nn.Module, plan: Any, plan_graph: OpGraph, *,
                    example_inputs: Sequence[Any], example_targets: Any,
                    loss_fn: Callable | None, t: int,
                    device: torch.device | None = None) -> Exported:
    """The model exported at the micro-batch under the step's autocast, on the device the step
    runs on (``device``: where a meta model's 16-bit program is traced), with the plan's
    strategies carried to its ops."""
    mbs = plan.config.micro_batch_size
    # the export runs the model: its example tensors go where its weights are (a GPU)
    inputs = on_weights_device(model, micro_batch(example_inputs, mbs))
    with_loss = loss_fn is not None and example_targets is not None
    targets = (on_weights_device(model, micro_batch([example_targets], mbs))[0] if with_loss
               else None)
    # exported under the step's autocast: the graph is the program the step runs (its casts,
    # its autocast-disabled regions), not the fp32 program the planner priced autocast over
    amp, weights = autocast_dtype(plan), weights_dtype(plan)
    if weights is not None:     # the program takes them so (the step casts them alike)
        inputs = sixteen_bit_inputs(inputs, weights)
    ep, graph, prefix = export_program(model, inputs, loss_fn=loss_fn if with_loss else None,
                                       targets=targets, autocast_dtype=amp, device=device,
                                       weights_dtype=weights)
    # the plan names ops as the planning process's trace did: found here by canonical key
    named = bind_strategies(plan, plan_graph).strategies
    sh = strategies_by_position(plan_graph, named, graph, t)
    return Exported(ep=ep, graph=graph, prefix=prefix, sharding=sh,
                    inputs=inputs + ((targets,) if with_loss else ()), with_loss=with_loss,
                    autocast_dtype=amp, weights_dtype=weights,
                    fp8=(plan.config.fp8, fp8_program_ops(graph, plan.config)))


def lower(model: nn.Module, ex: Exported, *, t: int, tp_rank: int, device: torch.device,
          seed: int, keep: Callable[[str], bool] | None = None,
          ep: tuple[int, int] = (1, 0), cp: int = 1, cp_layout: str = "contiguous"
          ) -> Program:
    """The checked rank program. ``keep(fqn)`` False: that weight is not this rank's (another
    pipeline rank holds it) and stays an unallocated placeholder. ``ep`` (size, index): the
    expert-parallel group, whose experts this rank holds. ``cp``: the context-parallel
    degree (the sequence split over an axis of its own), laid out as ``cp_layout`` says."""
    try:
        axis = context_axis(ex.graph, cp, cp_layout)
    except ConfigError as e:
        raise PlanError(f"{e} (the model exported at the micro-batch)") from None
    found = find_experts(ex.graph) if ep[0] > 1 else None
    state = LocalState(model, t=t, rank=tp_rank, device=device, seed=seed, keep=keep,
                       experts=found.params if found is not None else (), ep=ep,
                       dtype=ex.weights_dtype)
    program = build_program(ex.ep, ex.graph, ex.sharding, prefix=ex.prefix, t=t, device=device,
                            state_tensor=state, ep_size=ep[0], cp=axis, fp8=ex.fp8)
    check_shapes(program, ex.inputs, t, device, autocast_dtype=ex.autocast_dtype)
    return program


def emit(model: nn.Module, plan: Any, plan_graph: OpGraph, *, example_inputs: Sequence[Any],
         example_targets: Any, loss_fn: Callable | None, t: int, tp_rank: int,
         device: torch.device, seed: int, ep: tuple[int, int] = (1, 0),
         cp: int = 1) -> RankProgram:
    """This rank's program of ``plan`` (tensor-parallel degree ``t``, index ``tp_rank``;
    expert-parallel group ``ep`` = (size, index); context-parallel degree ``cp``)."""
    ex = export_for_plan(model, plan, plan_graph, example_inputs=example_inputs,
                         example_targets=example_targets, loss_fn=loss_fn, t=t, device=device)
    aliases = tied_names(model)
    program = lower(model, ex, t=t, tp_rank=tp_rank, device=device, seed=seed, ep=ep, cp=cp)
    ranges = layer_ranges(ex.graph)
    module = split_layers(program.graph_module, ranges)
    register_aliases(module, aliases)
    keep_out_of_state_dict(module, non_persistent_buffers(model))
    return RankProgram(module=module, program=program, graph=ex.graph, sharding=ex.sharding,
                       layers=[p for p, _, _ in ranges], with_loss=ex.with_loss,
                       aliases=aliases)


def connect(slot: Any, *, tp: tuple[Any, int, int], dp: tuple[Any, int, int],
            dp_tp: tuple[Any, int, int] | None = None,
            ep: tuple[Any, int, int] | None = None, cp_slot: Any = None,
            cp: tuple[Any, int, int] | None = None) -> None:
    """Point the program's collectives at this rank's groups, each ``(group, size, index)``:
    the tensor-parallel axis, for batch norm's statistics the data-parallel group and the
    data x tensor-parallel group (the whole job when not pipelined), the expert-parallel
    group of the grouped products' token exchanges, and the context-parallel axis (its own
    slot, ``cp_slot``)."""
    if cp_slot is not None and cp is not None and cp[1] > 1:
        cp_slot.comm = AxisComm(*cp, zigzag=cp_slot.zigzag)
    if ep is not None and ep[1] > 1:
        slot.ep = AxisComm(*ep)
    if tp[1] > 1:
        slot.comm = AxisComm(*tp)
    if dp[1] > 1:
        slot.dp = AxisComm(*dp)
        if tp[1] > 1:
            import torch.distributed as dist
            slot.dp_tp = AxisComm(*(dp_tp or (dist.group.WORLD, dist.get_world_size(),
                                              dist.get_rank())))
