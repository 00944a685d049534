"""autoplan: automatic parallelization planner and compiler for PyTorch training."""

from autoplan.errors import (AutoplanError, ClusterError, ConfigError, ProfileError,
                             TraceError)
from autoplan.graph import OpGraph, trace

__version__ = "0.1.0"

__all__ = ["AutoplanError", "ClusterError", "ConfigError", "OpGraph", "ProfileError",
           "TraceError", "trace", "__version__"]
