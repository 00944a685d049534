"""What a search concludes besides its choice: the candidates it weighed, why each one lost
(the alternatives ``inspect`` lists), and the errors that say what would make a plan possible
(nothing fits the memory; a forced field no configuration had; too few layers for a forced
pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autoplan.errors import PlanError
from autoplan.estimate.result import Estimate
from autoplan.planner.ilp import ILPSolution
from autoplan.planner.planfile import Alternative
from autoplan.sharding.parallel_config import RECOMPUTE, ParallelConfig
from autoplan.sharding.sharding import Sharding


class NoFeasiblePlanError(PlanError):
    """No configuration fits the devices' memory. Carries the figures that say what would."""

    def __init__(self, message: str, *, min_memory_bytes: float, device_memory_bytes: float,
                 min_host_memory_bytes: float = 0.0, host_memory_bytes: float = float("inf"),
                 suggestions: tuple[str, ...] = ()):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.device_memory_bytes = device_memory_bytes
        self.min_host_memory_bytes = min_host_memory_bytes
        self.host_memory_bytes = host_memory_bytes
        self.suggestions = suggestions


@dataclass
class Candidate:
    est: Estimate
    sharding: Sharding
    ilp: ILPSolution | None
    label: str                      # "search", "baseline: data parallel", ...

    def key(self) -> tuple:
        return (self.est.step_time_s, self.est.config.short())


def why_lost(c: Candidate, best: Candidate, force: dict[str, Any]) -> str:
    if not honours(c.est.config, force):
        pinned = ", ".join(f"{k}={v}" for k, v in sorted(force.items()))
        return f"excluded: the search was pinned to {pinned}"
    if not c.est.fits:
        return (f"needs {c.est.peak_memory_bytes / 2**30:.1f} GiB > "
                f"{c.est.device_memory_bytes / 2**30:.1f} GiB per device")
    slower = c.est.step_time_s / best.est.step_time_s - 1
    if slower < 5e-4:
        return "same predicted step time as the chosen plan (the tie goes to the first in order)"
    diffs = {
        "compute": c.est.time.compute_s - best.est.time.compute_s,
        "recomputation": c.est.time.recompute_s - best.est.time.recompute_s,
        "optimizer step": c.est.time.optimizer_s - best.est.time.optimizer_s,
        "pipeline bubble": c.est.time.bubble_s - best.est.time.bubble_s,
    }
    for k, v in c.est.time.comm_exposed_s.items():
        diffs[f"exposed {k} communication"] = v - best.est.time.comm_exposed_s.get(k, 0.0)
    cause = max(diffs, key=lambda k: diffs[k])
    label = "" if c.label == "search" else f" ({c.label})"
    return f"{slower * 100:.1f}% slower: more {cause}{label}"


def infeasible(cands: list[Candidate], cluster: Any,
                force: dict[str, Any] | None = None) -> NoFeasiblePlanError:
    """The configuration closest to fitting (device and host memory), and what would help;
    with ``force``, among the configurations that honour it (and which one fits without)."""
    def shortfall(c: Candidate) -> float:
        return max(c.est.peak_memory_bytes / c.est.device_memory_bytes,
                   c.est.peak_offloaded_bytes / c.est.host_memory_per_device_bytes)
    forced = [c for c in cands if honours(c.est.config, force or {})]
    free_fit = min((c for c in cands if c.est.fits and not honours(c.est.config, force)),
                   key=Candidate.key, default=None) if force else None
    cands = forced or cands
    best = min(cands, key=lambda c: (shortfall(c), c.est.config.short()))
    need, have = best.est.peak_memory_bytes, best.est.device_memory_bytes
    host_need, host_have = best.est.peak_offloaded_bytes, best.est.host_memory_per_device_bytes
    gib = 2 ** 30
    ratio = shortfall(best)
    tips = [f"more devices: about {cluster.world_size * ratio:.0f} of these "
            f"(memory per device falls as weights and optimizer state shard wider)"
            ] if ratio > 1 else []
    if best.est.config.micro_batch_size > 1:
        tips.append("a smaller micro-batch (activations scale with it)")
    if need > have and not best.est.config.offload_optimizer:
        tips.append("optimizer-state offload to host memory")
    if need > have:
        tips.append(f"a device with more than {need / gib:.0f} GiB of memory "
                    "(e.g. hgx-h200, 141 GiB)")
    if host_need > host_have:
        tips.append(f"nodes with more host memory: {host_need / gib:.0f} GiB per device is "
                    f"offloaded, a device's share is {host_have / gib:.0f} GiB")
    if free_fit is not None:
        pinned = ", ".join(f"{k}={v}" for k, v in sorted(force.items()))
        tips.insert(0, f"dropping force {pinned}: {free_fit.est.config.short()} fits "
                       f"({free_fit.est.peak_memory_bytes / gib:.1f} GiB)")
    what = "no configuration" + (f" with force={force}" if force else "")
    msg = (f"{what} fits: the least memory any plan needs is {need / gib:.1f} GiB "
           f"per device" + (f" plus {host_need / gib:.1f} GiB of host memory"
                             if host_need else "")
           + f" ({best.est.config.short()}); the devices have {have / gib:.1f} GiB"
           + (f" and {host_have / gib:.1f} GiB of host memory each" if host_need else "")
           + ". What would make it fit: " + "; ".join(tips))
    return NoFeasiblePlanError(msg, min_memory_bytes=need, device_memory_bytes=have,
                               min_host_memory_bytes=host_need, host_memory_bytes=host_have,
                               suggestions=tuple(tips))


def too_few_layers(pp: int, layers: int, block: Any) -> str:
    """Why a forced pipeline degree has no mesh, where the layers are the reason."""
    if pp <= layers:
        return ""
    found = ("no repeated layers: a pipeline cuts between the instances of a list of identical "
             "layers (one module called several times is one layer)" if block is None else
             f"{layers} ({block.instances[0].path} to {block.instances[-1].path})")
    return f": pp={pp} needs at least {pp} layers to cut between, and the model has {found}"


def why_none_honours(cands: list[Candidate], force: dict[str, Any], stats: Any) -> str:
    """Which forced field no costed configuration had, and what they had instead."""
    reasons = []
    for k, v in sorted(force.items()):
        seen = sorted({repr(getattr(c.est.config, k)) for c in cands})
        if repr(v) not in seen:
            reasons.append(f"{k}={v!r} was never possible (the costed configurations had "
                           f"{k} in {{{', '.join(seen)}}})"
                           + ("; sequence parallelism needs an op whose sequence dim splits "
                              "evenly over tp" if k == "sequence_parallel" else ""))
    if stats.rejected:
        reasons.append(f"the last configuration refused: {stats.rejected}")
    return "; ".join(reasons) or "every forced field was seen, but never all together"


def memory_work(config: ParallelConfig) -> tuple[int, int]:
    """What ``config`` adds to plain training to save memory: its strongest recomputation
    (``RECOMPUTE``'s order) and how many layers offload their activations."""
    offloaded = config.offload_activations or sum(config.layer_offload or ())
    return RECOMPUTE.index(config.recompute), offloaded


def without_memory_work(config: ParallelConfig) -> ParallelConfig:
    """``config`` recomputing and offloading nothing, every weight ZeRO-3 shards sharded (which
    to keep whole is the finalists' refinement of a config, ``finalists.refine_dp``)."""
    return replace(config, recompute="none", stage_recompute=None, layer_recompute=None,
                   offload_activations=0, layer_offload=None, dp_whole=())


def only_adds_work(c: Candidate, fitting: list[Candidate]) -> bool:
    """Whether a fitting candidate differs from ``c`` only in recomputing or offloading less,
    and is no slower: ``c`` is then no alternative worth listing (the search's pruning skips
    such configs before costing them, ``search_costing.evaluate``; an exhaustive search
    lists neither). Without pipelines, as that pruning."""
    cfg = c.est.config
    if cfg.pp > 1 or memory_work(cfg) == (0, 0):
        return False
    rest, (rank, layers) = without_memory_work(cfg), memory_work(cfg)
    for o in fitting:
        r, n = memory_work(o.est.config)
        if ((r, n) != (rank, layers) and r <= rank and n <= layers
                and o.est.step_time_s <= c.est.step_time_s
                and without_memory_work(o.est.config) == rest):
            return True
    return False


def honours(config: ParallelConfig, force: dict[str, Any]) -> bool:
    return all(getattr(config, k) == v for k, v in force.items())


def alternatives(cands: list[Candidate], best: Candidate, k: int,
                  force: dict[str, Any]) -> list[Alternative]:
    """The next ``k`` configurations of the search, then every baseline, each with why it lost."""
    seen = {best.est.config}
    picked: list[Candidate] = []
    fitting = sorted((c for c in cands if c.est.fits), key=Candidate.key)
    for c in fitting:
        if (c.label == "search" and c.est.config not in seen and len(picked) < k
                and not only_adds_work(c, fitting)):
            seen.add(c.est.config)
            picked.append(c)
    for c in sorted((c for c in cands if c.label != "search"), key=lambda c: c.label):
        if c.est.config not in seen:
            seen.add(c.est.config)
            picked.append(c)
    return [Alternative.of(c.est, why_lost(c, best, force)) for c in picked]
