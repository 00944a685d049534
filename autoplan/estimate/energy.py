"""Energy of one training step: power x time, weighted by what each device is doing.

The estimate's time breakdown (``TimeBreakdown``) is the slowest pipeline stage's. Every device
of that stage spends the step

- computing: forward + backward (``compute_s``), recomputation and the optimizer step, at
  ``compute_fraction`` of its TDP (communication hidden behind compute is inside this time);
- communicating: the communication not hidden behind compute (``comm_exposed_s``), at
  ``communication_fraction``;
- idle: the rest of the step (the pipeline bubble, per-op launch overhead, waiting), at
  ``idle_fraction``.

A faster stage of a pipeline computes for less time, in proportion to its forward + backward
time per micro-batch against the slowest stage's, and waits for the rest of its compute time
(idle). Every stage holds the same number of devices (world / pp). The fractions and the TDP
come from ``cluster/economics.py`` (``cost_models/economics.yaml``: datasheet TDPs, assumed
fractions). Energy counts the devices' boards only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STATES = ("compute", "communication", "idle")


@dataclass(frozen=True, kw_only=True)
class StepEnergy:
    """Joules one training step takes on the whole cluster, by what the devices do, and the
    device-seconds behind them."""

    compute_joules: float
    communication_joules: float
    idle_joules: float
    compute_device_s: float
    communication_device_s: float
    idle_device_s: float

    @property
    def total_joules(self) -> float:
        return self.compute_joules + self.communication_joules + self.idle_joules

    def average_watt(self, step_time_s: float, devices: int) -> float:
        """The mean power of one device over the step."""
        return self.total_joules / (step_time_s * devices) if step_time_s > 0 else 0.0


def _stage_shares(stages: Any) -> list[float]:
    """Each stage's compute time as a fraction of the slowest stage's (1.0 without a pipeline):
    its forward + backward seconds per micro-batch over the largest."""
    work = [max(float(s["fwd_s"]) + float(s["bwd_s"]), 0.0) for s in stages] or [1.0]
    top = max(work)
    return [w / top if top > 0 else 1.0 for w in work]


def step_energy(predicted: Mapping[str, Any], devices: int, economics: Any) -> StepEnergy:
    """The energy of one step on ``devices`` devices, from an estimate's figures
    (``Estimate.to_dict()``, or a plan's ``predicted``: ``step_time_s``, ``time`` and
    ``stages``), under ``economics`` (``cluster.economics.Economics``). ConfigError where the
    device has no power figure."""
    t = predicted["time"]
    step_s = float(predicted["step_time_s"])
    fwd_bwd_s = float(t["compute_s"]) + float(t["recompute_s"])
    optimizer_s = float(t["optimizer_s"])
    comm_s = sum(float(v) for v in t["comm_exposed_s"].values())
    busy_s = fwd_bwd_s + optimizer_s
    # the breakdown adds up to the step (to rounding); where it adds up to more, its parts are
    # scaled down so that no device is busy longer than the step
    scale = step_s / (busy_s + comm_s) if busy_s + comm_s > step_s > 0 else 1.0
    shares = _stage_shares(predicted["stages"])
    per_stage = devices / len(shares)
    device_s = {"compute": 0.0, "communication": 0.0, "idle": 0.0}
    for share in shares:
        # the optimizer step runs on every stage alike; forward and backward shrink with share
        work = (fwd_bwd_s * share + optimizer_s) * scale
        device_s["compute"] += per_stage * work
        device_s["communication"] += per_stage * comm_s * scale
        device_s["idle"] += per_stage * max(step_s - work - comm_s * scale, 0.0)
    joules = {k: v * economics.watt(k) for k, v in device_s.items()}
    return StepEnergy(compute_joules=joules["compute"],
                      communication_joules=joules["communication"],
                      idle_joules=joules["idle"], compute_device_s=device_s["compute"],
                      communication_device_s=device_s["communication"],
                      idle_device_s=device_s["idle"])
