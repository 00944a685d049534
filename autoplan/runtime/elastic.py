"""Elastic runs (``autoplan run --elastic``): the plan follows the world the job has.

Under torchrun's elastic rendezvous (``--nnodes MIN:MAX``) a job whose node died is restarted
on the nodes left; a run may also be resumed (``--resume``) on more or fewer devices. Each rank
then, before anything collective:

1. reads the world it is in (``WORLD_SIZE``) and the plan the run last trained under (the
   latest checkpoint's, else the plan file's);
2. keeps the plan file's plan where it is for this world and cluster; otherwise re-plans
   (``planner/replan.py``: warm-started from the last plan's layout, the run's global batch
   kept where any plan of the new world can keep it, else the nearest, stated). Planning is
   deterministic, so every rank finds the same plan; ``check_agreement`` proves it once the
   process group is up (one all-gather of the plan's text) and stops the job if not;
3. resumes from the latest checkpoint, resharded to the new plan (DCP), with the step count,
   the LR scheduler and the data position (samples consumed) it saved.

The data is a stream (``SampleStream``): sample i of the run is row i mod P of a fixed pool, and
each step takes the next global batch of samples. A run whose global batch is kept therefore
trains on exactly the samples an uninterrupted run would, whatever the world: its losses are
that run's up to fp32 round-off.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from autoplan.errors import PlanError
from autoplan.planner.planfile import plan_mismatch
from autoplan.planner.replan import replan
from autoplan.runtime.checkpoint_files import read_meta, resolve
from autoplan.sharding.parallel_config import ParallelConfig

POOL_BATCHES = 8           # the stream's pool: this many of the run's global batches


@dataclass(frozen=True)
class SampleStream:
    """Sample ``i`` of a run is row ``i mod pool`` of ``rows`` (every tensor's dim 0)."""

    rows: tuple                # the pool: inputs then targets, each with ``pool`` rows

    @property
    def pool(self) -> int:
        return next(t.shape[0] for t in self.rows if isinstance(t, torch.Tensor))

    def batch(self, first: int, size: int) -> tuple:
        """Samples ``first`` .. ``first + size - 1`` of the run."""
        index = torch.arange(first, first + size) % self.pool
        return tuple(t.index_select(0, index) if isinstance(t, torch.Tensor) else t
                     for t in self.rows)


@dataclass(frozen=True, kw_only=True)
class LastRun:
    """What the run last trained under: from the latest checkpoint, else the plan file."""

    config: Any                # ParallelConfig
    world: int
    batch: int
    predicted_step_s: float | None
    samples_seen: int = 0


def last_run(plan: Any, checkpoint: str | None) -> LastRun:
    """The latest checkpoint's plan and position (``checkpoint``: a root to resume), else
    ``plan``'s (a new run)."""
    if checkpoint is not None:
        meta = read_meta(resolve(checkpoint))
        saved = meta["plan"]
        return LastRun(config=ParallelConfig.from_dict(saved["config"]),
                       world=int(meta["world_size"]), batch=int(saved["global_batch_size"]),
                       predicted_step_s=saved.get("predicted_step_time_s"),
                       samples_seen=int(meta.get("samples_seen", 0)))
    return LastRun(config=plan.config, world=plan.config.world_size,
                   batch=plan.training.global_batch_size,
                   predicted_step_s=plan.predicted.get("step_time_s"))


@dataclass(frozen=True, kw_only=True)
class ElasticPlan:
    """The plan this attempt runs and, where it changed, what rank 0 says about it."""

    plan: Any
    report: tuple[str, ...]


def plan_for_world(plan: Any, last: LastRun, *, graph: Any, cluster: Any,
                   batch: str = "keep") -> ElasticPlan:
    """The plan file's ``plan`` where it is for ``cluster`` (its world and hardware), else a
    re-plan warm-started from ``last`` for the run's global batch (the plan file's; ``batch``:
    ``replan``'s policy where the new world cannot keep it)."""
    world = cluster.world_size
    if not plan_mismatch(plan, graph=graph, cluster=cluster):
        chosen, how, note, took = plan, "the plan file's", "", 0.0
    else:
        t0 = time.process_time()
        found = replan(graph, cluster, last=last.config,
                       global_batch_size=plan.training.global_batch_size,
                       batch=batch, name=plan.model.name)
        took = time.process_time() - t0
        chosen, how, note = found.plan, found.how, found.batch_note
    if chosen.config == last.config and world == last.world:
        return ElasticPlan(plan=chosen, report=())
    new_step = chosen.predicted.get("step_time_s")
    old = (f"{last.predicted_step_s * 1e3:.1f} ms" if last.predicted_step_s is not None
           else "unknown")
    gbs = chosen.training.global_batch_size
    report = (f"elastic: world {last.world} -> {world} devices"
              + (f" (re-planned by {how} in {took:.2f} s CPU)" if took else f" ({how})"),
              f"elastic: plan {last.config.short()} -> {chosen.config.short()}",
              f"elastic: predicted step {old} -> {new_step * 1e3:.1f} ms",
              (f"elastic: {note}" if note else
               f"elastic: global batch {gbs} kept")
              + f"; resuming at sample {last.samples_seen:,}")
    return ElasticPlan(plan=chosen, report=report)


def plan_digest(plan: Any) -> str:
    """A short hash of what the ranks must agree on: the config and the global batch."""
    text = json.dumps({"config": plan.config.to_dict(),
                       "batch": plan.training.global_batch_size}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_agreement(plan: Any) -> None:
    """PlanError on every rank unless every rank of the job runs the same plan (a collective;
    nothing to check outside a process group)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = plan_digest(plan)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        ranks = [r for r, d in enumerate(every) if d != every[0]]
        raise PlanError(f"the ranks re-planned differently (ranks {ranks} disagree with rank "
                        "0): they see different models or clusters; launch every node with the "
                        "same autoplan version, model options and --cluster")
