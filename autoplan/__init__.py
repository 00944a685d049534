"""autoplan: automatic parallelization planner and compiler for PyTorch training."""

__version__ = "0.1.0"  # before the imports below: modules read it while autoplan initializes

from autoplan.errors import (AutoplanError, ClusterError, ConfigError, PlanError,
                             ProfileError, TraceError)
from autoplan.cluster import Cluster
from autoplan.estimate import Estimate, ParallelConfig, estimate
from autoplan.graph import OpGraph, trace
from autoplan.planner.planfile import Plan, load_plan
from autoplan.planner.search import NoFeasiblePlanError, plan
from autoplan.runtime.trainer import Trainer, compile  # noqa: A004 (autoplan.compile is the API)

__all__ = ["AutoplanError", "Cluster", "ClusterError", "ConfigError", "Estimate",
           "NoFeasiblePlanError", "OpGraph", "ParallelConfig", "Plan", "PlanError", "ProfileError",
           "TraceError", "Trainer", "compile", "estimate", "load_plan", "plan", "trace",
           "__version__"]
