"""A plan checked against the model it will run on, before any process group starts.

``planfile_check`` checks that a plan file is well formed; this checks that it makes sense for
the traced graph (the fingerprint says it is the same model, but a hand-edited plan keeps the
fingerprint): every parameter has a placement of its own shape that splits evenly and agrees
with how its ops read it, every op a strategy the rule registry offers (the plan's op found by
its canonical key, ``op_binding``: the names follow the trace's order), every module style and
recompute entry names a module or layer the model has, and pipeline stages hold every layer
once, in order, on valid, distinct ranks. Every problem found is reported, up to a few.
"""

from __future__ import annotations

from typing import Any

from autoplan.errors import AutoplanError, PlanError
from autoplan.estimate.partition import pipeline_units
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.op_binding import bind_strategies
from autoplan.sharding.mesh_axes import STAGE_AXES
from autoplan.sharding.placement import Placement, local_shape
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategies import strategies_by_name

MAX_REPORTED = 6


def check_plan_against(plan: Any, graph: OpGraph) -> None:
    """PlanError listing what in ``plan`` does not fit ``graph`` (nothing when it all fits)."""
    problems: list[str] = []
    cfg = plan.config
    t = cfg.tp
    _placements(plan, graph, t, problems)
    sh = _strategies(plan, graph, t, problems)
    if sh is not None:
        _agree(plan, graph, sh, problems)
    modules = {op.module_path for op in graph.ops}
    for path in plan.module_styles:
        if path not in modules:
            problems.append(f"module_styles names {path!r}, which is no module of the model")
    layers = [u.path for u in pipeline_units(graph)] or \
        [i.path for b in graph.blocks for i in b.instances]
    for path in plan.recompute:
        if path not in layers:
            problems.append(f"recompute names {path!r}, which is no layer of the model "
                            f"(its layers: {_few(layers)})")
    if cfg.pp > 1:
        _stages(plan, layers, problems)
    if problems:
        extra = len(problems) - MAX_REPORTED
        raise PlanError("the plan does not fit the model: " + "; ".join(problems[:MAX_REPORTED])
                        + (f"; and {extra} more" if extra > 0 else "")
                        + ". Re-plan (autoplan.plan or `autoplan plan`) instead of editing")


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


def _placements(plan: Any, graph: OpGraph, t: int, problems: list[str]) -> None:
    params = {v.fqn: v for v in graph.param_values}
    for fqn in sorted(set(plan.param_placements) - set(params)):
        problems.append(f"a placement for {fqn!r}, which is no parameter of the model")
    for fqn in sorted(set(params) - set(plan.param_placements)):
        problems.append(f"parameter {fqn!r} has no placement")
    for fqn, pp in sorted(plan.param_placements.items()):
        v = params.get(fqn)
        if v is None:
            continue
        shape = tuple(v.meta.shape)
        if tuple(pp.shape) != shape:
            problems.append(f"{fqn!r} has shape {list(shape)}, the plan says {list(pp.shape)}")
            continue
        try:
            p = Placement.parse(pp.tp)
        except AutoplanError as e:
            problems.append(f"{fqn!r}: {e}")
            continue
        if p.kind == "S" and t == 1:
            problems.append(f"{fqn!r} is split {p} on a tensor-parallel axis of 1 rank")
        elif p.kind == "S" and local_shape(shape, p, t) is None:
            problems.append(f"{fqn!r} of shape {list(shape)} does not split {p} over {t} ranks")


def _strategies(plan: Any, graph: OpGraph, t: int, problems: list[str]) -> Sharding | None:
    chosen = []
    bound = bind_strategies(plan, graph)         # by canonical key: names follow the trace
    for op in graph.ops:
        name = bound.strategies.get(op.name)
        options = strategies_by_name(graph, op, t)
        if name is None:
            problems.append(f"op {op.name!r} has no strategy")
        elif name not in options:
            problems.append(f"op {op.name!r} ({op.target}) has no strategy {name!r} on a "
                            f"{t}-way axis (it has {_few(sorted(options))})")
        else:
            chosen.append(options[name])
            continue
        chosen.append(next(iter(options.values())))
    for name in bound.unmatched[:2]:
        problems.append(f"a strategy for op {name!r}, which is no op of the model")
    return None if problems else Sharding.build(graph, t, chosen)


def _agree(plan: Any, graph: OpGraph, sh: Sharding, problems: list[str]) -> None:
    """Each parameter lies as the op that first reads it needs (the runtime stores it so)."""
    stored = sh.param_placement(graph)
    for fqn, pp in sorted(plan.param_placements.items()):
        want = stored.get(fqn)
        if want is not None and Placement.parse(pp.tp) != want:
            problems.append(f"{fqn!r} is placed {pp.tp} but the plan's ops read it as {want}")


def _stages(plan: Any, layers: list[str], problems: list[str]) -> None:
    cfg = plan.config
    seen: list[str] = []
    ranks: list[int] = []
    for st in plan.stages:
        for chunk in st.get("chunks") or [st["layers"]]:
            seen.extend(chunk)
        ranks.extend(st["ranks"])
    order = sorted(seen, key=lambda p: layers.index(p) if p in layers else -1)
    unknown = [p for p in seen if p not in layers]
    if unknown:
        problems.append(f"pipeline stages name layers {_few(unknown)}, which the model does "
                        f"not have (its layers: {_few(layers)})")
    elif sorted(seen) != sorted(layers):
        problems.append(f"pipeline stages hold {len(seen)} layers, the model has "
                        f"{len(layers)} (each must be held once)")
    elif any(len(st.get("chunks") or [st["layers"]]) != cfg.virtual_stages
             for st in plan.stages) or len(plan.stages) != cfg.pp:
        problems.append(f"the plan lists {len(plan.stages)} pipeline stages of "
                        f"{sorted({len(st.get('chunks') or [1]) for st in plan.stages})} chunks; "
                        f"its config has pp={cfg.pp} with {cfg.virtual_stages} chunks each")
    elif [c for st in chunks_in_model_order(plan) for c in st] != order:
        problems.append("pipeline chunks do not hold the layers in the model's order")
    if sorted(ranks) != list(range(cfg.world_size)):
        problems.append(f"pipeline stages list ranks {_few([str(r) for r in ranks], 8)}: each of "
                        f"the {cfg.world_size} ranks must appear exactly once")
    stage_ranks = cfg.dims.groups(STAGE_AXES)
    for st in plan.stages:
        want = list(stage_ranks[st["index"]]) if 0 <= st["index"] < cfg.pp else []
        if sorted(st["ranks"]) != want:
            problems.append(f"stage {st['index']} lists ranks {list(st['ranks'])}, its ranks "
                            f"are {want}")


def chunks_in_model_order(plan: Any) -> list[list[str]]:
    """The layers of each of the plan's ``pp * v`` chunks, in model order: chunk c is on rank
    ``chunk_rank(c)``, whose stage lists it ``rank_chunks(...).index(c)``-th (the stages must
    list ``virtual_stages`` chunks each, as ``_stages`` checks)."""
    cfg = plan.config
    per_rank = [st.get("chunks") or [st["layers"]] for st in plan.stages]
    out = []
    for c in range(cfg.pp * cfg.virtual_stages):
        r = cfg.chunk_rank(c)
        out.append(list(per_rank[r][cfg.rank_chunks(r).index(c)]))
    return out
