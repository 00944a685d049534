"""Tracing: nn.Module -> OpGraph (framework-free operator graph)."""

from autoplan.graph.opgraph import (Block, BlockInstance, Op, OpGraph, TensorMeta, Value,
                                    unique_storage_bytes)
from autoplan.graph.trace import trace

__all__ = ["Block", "BlockInstance", "Op", "OpGraph", "TensorMeta", "Value", "trace",
           "unique_storage_bytes"]
