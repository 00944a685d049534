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

On pools (``estimate/hetero.py``), each device draws its own type's power
(:func:`hetero_step_energy`): with stages on pools, each stage's devices at their pool's TDP,
busy as above; with replicas on pools, each replica's devices busy for its own share's
compute and communication (its own estimate) and idle for the rest of the step, the slowest
replica's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
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
    ``stages``), under ``economics`` (``cluster.economics.Economics``; a sequence of them: one
    per pipeline stage, each stage's devices' own). ConfigError where a device has no power
    figure."""
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
    econs = (tuple(economics) if isinstance(economics, Sequence)
             else (economics,) * len(shares))
    device_s = {"compute": 0.0, "communication": 0.0, "idle": 0.0}
    joules = {"compute": 0.0, "communication": 0.0, "idle": 0.0}
    for share, econ in zip(shares, econs, strict=True):
        # the optimizer step runs on every stage alike; forward and backward shrink with share
        work = (fwd_bwd_s * share + optimizer_s) * scale
        stage_s = {"compute": per_stage * work,
                   "communication": per_stage * comm_s * scale,
                   "idle": per_stage * max(step_s - work - comm_s * scale, 0.0)}
        for k, v in stage_s.items():
            device_s[k] += v
            joules[k] += v * econ.watt(k)
    return StepEnergy(compute_joules=joules["compute"],
                      communication_joules=joules["communication"],
                      idle_joules=joules["idle"], compute_device_s=device_s["compute"],
                      communication_device_s=device_s["communication"],
                      idle_device_s=device_s["idle"])


def add(parts: Sequence[StepEnergy]) -> StepEnergy:
    """The energy of several groups of devices over one step, summed part by part."""
    return StepEnergy(**{f.name: sum(getattr(p, f.name) for p in parts)
                         for f in fields(StepEnergy)})


def hetero_step_energy(het: Any, economics_of_pool: Sequence[Any]) -> StepEnergy:
    """The energy of one step of a config priced on pools (``estimate/hetero.HeteroEstimate``),
    each device at its own pool's power (``economics_of_pool[i]``: pool ``i``'s Economics):
    stages on pools, every stage's devices at their pool's; replicas on pools, each replica's
    devices busy for its own share (its ``unit_estimates`` entry) and idle until the slowest
    replica's step ends."""
    est = het.estimate
    world = est.config.world_size
    if not het.unit_estimates:            # stages on pools
        return step_energy(est.to_dict(), world, [economics_of_pool[p]
                                                  for p in het.pool_of_unit])
    step_s = est.step_time_s
    per_replica = world // len(het.unit_estimates)
    return add([step_energy({**unit.to_dict(), "step_time_s": step_s}, per_replica,
                            economics_of_pool[pool])
                for unit, pool in zip(het.unit_estimates, het.pool_of_unit, strict=True)])
