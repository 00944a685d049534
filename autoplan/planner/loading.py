"""``load_plan``: read a plan file, check it against the model and the cluster, and re-plan
on request. It sits above both the plan file and the search (it may call either)."""

from __future__ import annotations

import os
from typing import Any

from autoplan.errors import PlanError
from autoplan.estimate.arguments import cluster_arg, path_arg
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.trace import as_graph
from autoplan.planner import planfile, search
from autoplan.planner.plan_vs_model import check_plan_against
from autoplan.planner.planfile import Plan


def load_plan(path: str | os.PathLike[str], *, model: Any = None, cluster: Any = None,
              example_inputs: Any = None, graph: Any = None, loss_fn: Any = None,
              targets: Any = None, replan: bool = False, allow_cluster_mismatch: bool = False,
              **plan_kwargs: Any) -> Plan:
    """Read a plan and check it is for ``model`` / ``graph`` and ``cluster`` (those given).

    ``model`` is an ``nn.Module`` traced with ``example_inputs`` (and ``loss_fn``/``targets``
    exactly as when planning: they are part of the fingerprint), or an OpGraph. ``cluster``
    (a Cluster or a spec such as ``"dgx-h100:2"``) is compared by its hardware, not its name
    (``planfile.cluster_differences``). On a mismatch this raises PlanError saying what differs,
    or with ``replan=True`` plans again with the old plan's training settings (overridable by
    ``plan_kwargs``) and returns the new plan. ``allow_cluster_mismatch=True`` accepts other
    hardware of the plan's world size (its prediction is then stale: ``stale_prediction``).
    """
    path = path_arg(path, who="load_plan()", what="the plan file", error=PlanError,
                    fix="compile(plan=...) takes an autoplan.Plan too")
    if (graph is not None and not isinstance(graph, OpGraph)) or not isinstance(replan, bool):
        raise PlanError(f"load_plan(): graph must be None or an OpGraph (autoplan.trace), and "
                        f"replan True or False; got graph={graph!r:.40}, replan={replan!r:.20}")
    plan = planfile.plan_from_file(path)
    if plan_kwargs and not replan:
        raise PlanError(f"load_plan got planning options {sorted(plan_kwargs)} without "
                        "replan=True; they are only used when re-planning")
    if graph is None and model is not None:
        graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets,
                         who="load_plan(model=...)", error=PlanError)
    if cluster is not None:
        cluster = cluster_arg(cluster, "load_plan()")
    what = planfile.plan_mismatch(plan, graph=graph, cluster=cluster,
                                  allow_cluster_mismatch=allow_cluster_mismatch)
    if not what:
        if graph is not None:
            check_plan_against(plan, graph)
        return plan
    if not replan:
        raise PlanError(f"{what}. Re-plan with autoplan.plan(...) for this model and cluster, "
                        "or pass replan=True to load_plan")
    if graph is None or cluster is None:
        raise PlanError(f"{what}; replan=True needs both the model (model= with example_inputs=, "
                        "or graph=) and the cluster (cluster=)")
    kwargs = {"global_batch_size": plan.training.global_batch_size,
              "precision": plan.training.precision, "optimizer": plan.training.optimizer,
              "expert_capacity_factor": plan.training.expert_capacity_factor,
              **({"seq_lengths": plan.training.length_histogram()}
                 if plan.training.seq_lengths else {}), **plan_kwargs}
    return search.plan(graph, cluster, **kwargs)
