"""autoplan: automatic parallelization planner and compiler for PyTorch training.

Planning (``trace``, ``estimate``, ``plan``, ``load_plan``) never imports the runtime;
``compile`` and ``Trainer`` load it (and ``torch.distributed``) on first use; ``Example``
(your model with its example batch and loss: ``Example.from_model``) loads the model registry.
"""

from autoplan.version import __version__
from autoplan.errors import (AutoplanError, ClusterError, ConfigError, PlanError,
                             ProfileError, TraceError)
from autoplan.cluster import Cluster
from autoplan.estimate import Estimate, HeteroEstimate, estimate, estimate_hetero
from autoplan.graph import OpGraph, trace
from autoplan.planner.loading import load_plan
from autoplan.planner.planfile import Plan
from autoplan.planner.search import plan
from autoplan.planner.hetero import HeteroPlan, plan_hetero
from autoplan.planner.objectives_pools import PoolsPlan, plan_pools
from autoplan.planner.candidates import NoFeasiblePlanError
from autoplan.sharding.parallel_config import ParallelConfig

__all__ = ["AutoplanError", "Cluster", "ClusterError", "ConfigError", "Estimate", "Example", "HeteroEstimate", "HeteroPlan",
           "NoFeasiblePlanError", "OpGraph", "ParallelConfig", "Plan", "PlanError", "PoolsPlan", "ProfileError",
           "TraceError", "Trainer", "compile", "empty_weights", "estimate", "estimate_hetero", "load_plan", "plan", "plan_hetero", "plan_pools", "trace",
           "__version__"]


def __getattr__(name: str):
    if name in ("compile", "Trainer"):
        from autoplan.runtime import trainer    # lazily: planning never loads the runtime
        return getattr(trainer, name)
    if name == "empty_weights":
        from autoplan.models.empty_weights import empty_weights   # lazily: needs torch.nn
        return empty_weights
    if name == "Example":
        from autoplan.models.registry import Example    # lazily: the models need torch.nn
        return Example
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
