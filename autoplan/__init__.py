"""autoplan: automatic parallelization planner and compiler for PyTorch training."""

from autoplan.errors import (AutoplanError, ClusterError, ConfigError, ProfileError,
                             TraceError)
from autoplan.cluster import Cluster
from autoplan.estimate import Estimate, ParallelConfig, estimate
from autoplan.graph import OpGraph, trace

__version__ = "0.1.0"

__all__ = ["AutoplanError", "Cluster", "ClusterError", "ConfigError", "Estimate", "OpGraph",
           "ParallelConfig", "ProfileError", "TraceError", "estimate", "trace", "__version__"]
