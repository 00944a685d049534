"""Estimating one parallel configuration: step time, memory per device, breakdowns."""

from autoplan.estimate.estimator import estimate
from autoplan.estimate.hetero import HeteroEstimate, estimate_hetero
from autoplan.estimate.result import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown

__all__ = ["Estimate", "HeteroEstimate", "MemoryBreakdown", "StageEstimate", "TimeBreakdown",
           "estimate", "estimate_hetero"]
