"""A plan's family on a smaller model and fewer ranks, for ``autoplan verify``.

A plan for 1,024 GPUs cannot be run on a laptop, but what can go wrong numerically lives in its
family (which axes exist, ZeRO stage, sequence parallelism, recomputation, schedule, offload)
and in its per-op strategies, not in the degrees. ``shrunk_force`` keeps the family at degree 2
per axis within the ranks at hand; ``transfer_sharding`` carries the plan's per-op strategies
to the same model with fewer layers, op by op (names of the export number each kind of op in
order, which lines the two graphs up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from autoplan.errors import PlanError
from autoplan.estimate.partition import pipeline_units
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.mesh_axes import BASE_AXES, MeshAxis as A
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.sharding import Sharding, as_inputs_come
from autoplan.sharding.strategies import strategies_by_name


def shrunk_force(cfg: ParallelConfig, ranks: int) -> dict[str, Any]:
    """The plan's family at degree 2 per parallel axis (context parallelism's cp too), within
    ``ranks`` processes (an axis is dropped, data parallelism first, when they do not fit);
    HSDP as 2 x 2 where the ranks allow, else plain sharding over dp."""
    degrees = {a: 2 if cfg.dims.degree(a) > 1 else 1 for a in BASE_AXES}

    def used() -> int:
        return math.prod(degrees.values())
    for axis in (A.DP, A.PP, A.TP, A.CP):        # dropped in this order where ranks lack
        if used() <= ranks:
            break
        degrees[axis] = 1
    hsdp = cfg.dp_shard is not None and degrees[A.DP] > 1 and ranks >= 2 * used()
    if hsdp:                  # shard groups of 2, replicated twice
        degrees[A.DP] = 4
    force: dict[str, Any] = {a.value: n for a, n in degrees.items()}   # config field names
    if hsdp:
        force["dp_shard"] = 2
    force["zero_stage"] = (cfg.zero_stage if degrees[A.DP] * degrees[A.CP] > 1
                           or cfg.offload_params else 0)
    if cfg.offload_params:
        force["zero_stage"] = 3
    force.update(offload_optimizer=cfg.offload_optimizer, offload_params=cfg.offload_params,
                 recompute=cfg.recompute, micro_batch_size=1)
    # expert parallelism over the shrunk dp ranks (2-way), where the plan has it
    force["ep"] = 2 if cfg.ep > 1 and degrees[A.DP] > 1 else 1
    if cfg.dp_whole and degrees[A.DP] > 1 and force["zero_stage"] == 3:
        force["dp_whole"] = cfg.dp_whole        # the same weights kept whole
    if degrees[A.TP] > 1:
        force["sequence_parallel"] = cfg.sequence_parallel
    if degrees[A.PP] > 1:
        force["schedule"] = cfg.schedule
        force["virtual_stages"] = min(cfg.virtual_stages, 2)
    return force


def layers_needed(force: Mapping[str, Any]) -> int:
    """Layers the shrunk model keeps: two per pipeline chunk, at least two."""
    return max(2, 2 * force.get("pp", 1) * force.get("virtual_stages", 1))


_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


def _split_name(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    return m.group(1), int(m.group(2) or 0)


def transfer_sharding(op_strategies: Mapping[str, str], full_layers: int, small: OpGraph,
                      t: int) -> tuple[Sharding, list[str]]:
    """The plan's strategies (named per op of the full model, ``full_layers`` layers) on
    ``small``, the same model with fewer layers, over a ``t``-way tensor-parallel axis.
    Returns the sharding and the ops that could not keep their strategy (they take their inputs
    as they come).

    Op names number each kind of op in graph order (``addmm``, ``addmm_1``, ...), so the ops
    before the first layer and in the first layer have the same names in both models; every
    layer takes the first layer's strategies (a repeated block is solved once). An op after the
    last layer is numbered ``extra * (its kind per layer)`` higher in the plan, ``extra`` being
    the layers the plan's graph traced beyond these (all of the plan's extra layers, or none
    when the planner stamped its layers from a short trace, as it does for deep models)."""
    units = pipeline_units(small)
    if not units:        # nothing to shrink by: the plan's own model, op for op
        return _by_name(op_strategies, small, t, [op.name for op in small.ops])
    if full_layers < len(units):
        raise PlanError(f"the plan's model has {full_layers} layers, fewer than the shrunk "
                        f"one's {len(units)}: verify needs the model the plan was made for")
    first = small.ops[units[0].start:units[0].stop]
    per_layer: dict[str, int] = {}
    for op in first:
        base, _ = _split_name(op.name)
        per_layer[base] = per_layer.get(base, 0) + 1
    end = units[-1].stop
    tail = small.ops[end:]

    def shifted(name: str, extra: int) -> str:
        base, k = _split_name(name)
        k += extra * per_layer.get(base, 0)
        return f"{base}_{k}" if k else base
    candidates = [full_layers - len(units)] + list(range(full_layers - len(units)))
    extra = next((e for e in candidates
                  if all(shifted(op.name, e) in op_strategies for op in tail)), None)
    if extra is None:
        raise PlanError("the ops after the last layer do not match the plan's: it was made for "
                        "another model")
    source: list[str] = []
    for i, op in enumerate(small.ops):
        if i < units[0].start:
            source.append(op.name)
        elif i < end:
            unit = next(u for u in units if u.start <= i < u.stop)
            if unit.stop - unit.start != len(first):
                raise PlanError(f"layer {unit.path} differs from the first layer: verify "
                                "shrinks models whose layers repeat one block")
            source.append(first[i - unit.start].name)
        else:
            source.append(shifted(op.name, extra))
    return _by_name(op_strategies, small, t, source)


def _by_name(op_strategies: Mapping[str, str], small: OpGraph, t: int,
             source: list[str]) -> tuple[Sharding, list[str]]:
    """``small``'s ops with the plan's strategies of the ops named ``source``."""
    chosen, kept_inputs = [], []
    placement: dict[str, Any] = {}
    for op, name in zip(small.ops, source):
        if name not in op_strategies:
            raise PlanError(f"the plan has no op {name!r} ({op.target}): it was made for "
                            "another model")
        options = strategies_by_name(small, op, t)
        s = options.get(op_strategies[name])
        if s is None:          # a split the smaller axis or batch does not allow: as inputs come
            kept_inputs.append(name)
            s = as_inputs_come(small, op, list(options.values()), placement)
        chosen.append(s)
        for k, n in enumerate(op.outputs):
            placement[n] = s.outputs[k]
    return Sharding.build(small, t, chosen), kept_inputs
