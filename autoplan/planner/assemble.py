"""A chosen candidate written down as a ``Plan``: per-parameter placements on every mesh axis,
per-op strategies, recomputation per layer, the prediction, the alternatives and the solver's
report (``search.plan`` calls it last)."""

from __future__ import annotations

import time
from typing import Any

from autoplan.estimate.result import Estimate
from autoplan.estimate.partition import pipeline_units
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.planner import mesh as meshes
from autoplan.planner.planfile import (Alternative, ClusterInfo, MeshInfo, ModelInfo,
                                       ParamPlacement, Plan, SolverReport, TrainingInfo,
                                       predicted_from_estimate)
from autoplan.sharding.mesh_axes import STAGE_AXES
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.version import __version__


def _expert_fqns(graph: OpGraph, cfg: Any) -> set[str]:
    """Every name (tied aliases too) of the expert weights split over ep (ep > 1)."""
    if cfg.ep == 1:
        return set()
    found = find_experts(graph)
    values = found.param_values if found is not None else frozenset()
    return {v.fqn for v in graph.param_values if v.base in values}


def assemble(graph: OpGraph, cluster: Any, best: Any, alternatives: list[Alternative],
             stats: Any, gbs: int, name: str | None, expert_capacity_factor: float = 1.0,
             documents: Any = None) -> Plan:
    """The plan of candidate ``best`` (``candidates.Candidate``), with the search's ``stats``;
    ``documents``: the packing it was priced for (``doc_work.PackedWork``), recorded."""
    cfg = best.est.config
    sh = best.sharding
    tp_group = cfg.tp_group()
    zero3 = cfg.zero_stage == 3 and cfg.grad_degree > 1    # FSDP over dp (x cp)
    # every parameter FQN, tied aliases too (they share their owner's storage and placement)
    shapes = {v.fqn: tuple(v.meta.shape) for v in graph.param_values}
    canonical = {v.fqn: graph.value(v.base).fqn for v in graph.param_values}
    experts = _expert_fqns(graph, cfg)
    # FSDP2 keeps a scalar parameter whole on every rank (dim 0 to shard, it has none), and
    # the weights the plan keeps whole (dp_whole)
    placements = {fqn: ParamPlacement(tp=tp, dp="S(0)" if zero3 and shapes[fqn]
                                      and not cfg.keeps_whole(canonical.get(fqn, fqn)) else "R",
                                      shape=shapes[fqn], ep="S(0)" if fqn in experts else "R")
                  for fqn, tp in sh.param_placement_text(graph).items()}
    recompute = {}
    for block in graph.blocks:
        for inst in block.instances:
            recompute[inst.path] = cfg.recompute
    for stage in best.est.stages:          # pipelines: every layer, at its stage's policy
        for layer in stage.layers:
            recompute[layer] = cfg.stage_policy(stage.index)
    if cfg.layer_recompute is not None:    # one policy per layer (pipeline_units' order)
        for unit, policy in zip(pipeline_units(graph), cfg.layer_recompute):
            recompute[unit.path] = policy
    recompute = dict(sorted(recompute.items(), key=lambda kv: _layer_order(kv[0])))
    sol = best.ilp
    if sol is not None:
        solver = SolverReport(
            solver="CBC", status=sol.status, objective_s=sol.objective, bound_s=sol.bound,
            gap=sol.gap, num_variables=sol.num_variables, num_constraints=sol.num_constraints,
            ilps_solved=stats.ilps, candidates_evaluated=stats.evaluated,
            worst_gap=None if stats.gap_unknown else stats.worst_gap,
            time_s=time.perf_counter() - stats.t0)
    else:
        # the chosen plan's sharding came from no ILP (tp=1, or a baseline won): report the
        # search's largest problem, with the status saying none produced this plan
        solver = SolverReport(
            solver="CBC", status="not_solved", objective_s=best.est.step_time_s, bound_s=None,
            gap=None, num_variables=stats.largest[0], num_constraints=stats.largest[1],
            ilps_solved=stats.ilps, candidates_evaluated=stats.evaluated,
            worst_gap=None if stats.gap_unknown else stats.worst_gap,
            time_s=time.perf_counter() - stats.t0)
    return Plan(
        autoplan_version=__version__, model=ModelInfo.of(graph, name=name),
        cluster=ClusterInfo.of(cluster),
        training=TrainingInfo(global_batch_size=gbs, precision=cfg.precision,
                              optimizer=cfg.optimizer,
                              expert_capacity_factor=expert_capacity_factor,
                              seq_lengths=() if documents is None else tuple(zip(
                                  documents.histogram.lengths, documents.histogram.counts))),
        mesh=MeshInfo(axes=cfg.mesh_axes(), shape=cfg.mesh_shape(),
                      rank_to_device=meshes.rank_to_device(cluster, cfg.world_size),
                      tp_domain=meshes.tp_domain(cluster, tp_group)),
        config=cfg, param_placements=placements,
        op_strategies={op.name: s.name for op, s in zip(graph.ops, sh.op_strategy)},
        op_keys=dict(graph.op_keys()),
        module_styles=sh.module_styles(graph), recompute=recompute,
        offload=_offload(best.est, cfg, graph),
        predicted=predicted_from_estimate(best.est), alternatives=tuple(alternatives),
        solver=solver, stages=_stages(best.est, cfg))


def _offload(est: Estimate, cfg: ParallelConfig, graph: OpGraph) -> dict[str, Any]:
    """What goes to host memory: the optimizer state, the parameters, and (only when the config
    offloads some) the layers whose saved activations do, by path in model order: the first
    ``offload_activations`` of every chunk, or those ``layer_offload`` marks."""
    out: dict[str, Any] = {"optimizer": cfg.offload_optimizer, "params": cfg.offload_params}
    if cfg.layer_offload is not None and any(cfg.layer_offload):
        # one flag per layer in model order (pipeline_units'), as layer_recompute
        out["activations"] = sorted((u.path for u, on in zip(pipeline_units(graph),
                                                             cfg.layer_offload) if on),
                                    key=_layer_order)
    elif cfg.offload_activations:
        out["activations"] = sorted((layer for s in est.stages for c in (s.chunks or (s.layers,))
                                     for layer in c[:cfg.offload_activations]),
                                    key=_layer_order)
    return out


def _layer_order(path: str) -> tuple:
    """Sort key of a module path: numeric parts as numbers (layers.2 before layers.10)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _stages(est: Estimate, cfg: ParallelConfig) -> tuple[dict[str, Any], ...]:
    """Pipeline stages: their layers and ranks (empty without pipeline parallelism)."""
    if cfg.pp == 1:
        return ()
    return tuple({"index": s.index, "layers": list(s.layers),
                  "chunks": [list(c) for c in s.chunks],
                  "ranks": list(cfg.dims.groups(STAGE_AXES)[s.index])}
                 for s in est.stages)
