"""One rank of `autoplan run`: ``torchrun ... -m autoplan.runtime.worker --plan P --model M``.

Builds the example model (seeded, so every rank starts from the same weights; on the meta device
for models too big for host memory, then materialized shard by shard), compiles the plan and
trains up to step ``--steps`` on one fixed synthetic batch (so the loss visibly falls): for a
plan made for the data's document lengths (``training.seq_lengths``, or ``--seq-lengths``), its
rows packed as documents with position ids restarting per document (``packed_data.py``). Rank 0
prints the loss per step, then the measured median step time next to the plan's prediction.

With ``--checkpoint-dir`` it saves every ``--checkpoint-every`` steps and after the last one;
``--resume``, or a restart by ``torchrun --max-restarts`` after a rank died, continues from the
latest checkpoint there (saved under this plan or another). Rank 0 claims the folder before the
model is built (``checkpoint_dir.py``): another job's folder, another run's checkpoints without
``--overwrite``, or ``--resume`` with nothing to resume (without ``--resume-or-start``) stop the
job there.

A rank that fails with an AutoplanError writes it to torchrun's error file and exits 1 without
a traceback; ``autoplan run`` reports the ranks' errors once. Under a plain ``torchrun`` rank 0
prints its error in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoplan.errors import AutoplanError, CheckpointError
from autoplan.process_exit import exit_now
from autoplan.models import build_example
from autoplan.models.empty_weights import empty_weights
from autoplan.models.registry import layer_overrides
from autoplan.runtime.verify import user_example
from autoplan.planner import hetero_explain
from autoplan.planner.planfile import plan_from_file
from autoplan.runtime.trainer import ELASTIC_ENV, compile, init_distributed
from autoplan.runtime.checkpoint_dir import RUN_ID_ENV, release, run_id, claim, plan_start
from autoplan.runtime.step_trace import record_steps
from autoplan.runtime.packed_data import describe as describe_packing
from autoplan.runtime.packed_data import packed_run_examples, run_histogram
from autoplan.runtime.checkpoint_files import resolve
from autoplan.runtime.elastic import (POOL_BATCHES, ElasticPlan, SampleStream, check_agreement,
                                      last_run, plan_for_world)

LAUNCHED_ENV = "AUTOPLAN_LAUNCHER"      # set by `autoplan run`: it reports the ranks' errors


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except AutoplanError as e:
        _report(e, typed=True)
        return 1
    except Exception as e:
        if not _report(e, typed=False):
            raise
        return 1


def _report(e: BaseException, *, typed: bool) -> bool:
    """Record ``e`` for the launcher: torchrun's error file (its ``failures`` carry it), with
    this rank, whether it is an AutoplanError and a precise time. An AutoplanError is one line
    from rank 0 when no ``autoplan run`` summarizes; other errors keep their traceback there
    (returns False: the caller re-raises)."""
    rank = int(os.environ.get("RANK", "0"))
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    text = f"{type(e).__name__}: {e}"
    if path:
        data = {"message": {"message": text, "extraInfo": {
                    "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}},
                "autoplan": {"rank": rank, "typed": typed, "error": str(e),
                             "type": type(e).__name__, "time_s": time.time()}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass
    if os.environ.get(LAUNCHED_ENV):
        return True
    if typed:
        if rank == 0:
            print(f"autoplan run: error: {e}", file=sys.stderr, flush=True)
        return True
    return False


@dataclass(frozen=True)
class RunModel:
    """The model a run trains, as every rank builds it."""

    data: Any          # the example with the plan's global batch (None: traced_only)
    model: Any         # the module that trains (on meta with --meta)
    small: Any         # the example as the plan traced it (its inputs and targets)


def build_run_model(spec: str, *, batch: int, layers: int | None = None,
                    seq_len: int | None = None, meta: bool = False,
                    traced_only: bool = False, documents: Any = None) -> RunModel:
    """Build ``spec`` (an example name or ``package.module:function``) as a rank does: seeded,
    so every rank starts from the same weights; ``small`` is what ``compile`` traces.
    ``traced_only``: just ``small`` (the pre-flight check of ``autoplan run``). ``documents``
    (a LengthHistogram): the rows packed as its documents (``packed_data.py``)."""
    built = _build_run_model(spec, batch=batch, layers=layers, seq_len=seq_len, meta=meta,
                             traced_only=traced_only)
    if documents is None:
        return built
    data, small = packed_run_examples(built.data, built.small, documents)
    return RunModel(data=data, model=built.model, small=small)


def _build_run_model(spec: str, *, batch: int, layers: int | None, seq_len: int | None,
                     meta: bool, traced_only: bool) -> RunModel:
    if ":" in spec:                  # a user's package.module:function
        if seq_len:
            raise AutoplanError(f"--seq-len takes example names; {spec} builds its own "
                                "inputs: drop it")
        # --meta: its weights on the meta device, as autoplan.empty_weights() builds a model
        # (buffers its __init__ computes kept), so each rank allocates only its shards
        with empty_weights() if meta else contextlib.nullcontext():
            small = user_example(spec, batch=None, layers=layers)          # as traced
            data = None if traced_only else user_example(spec, batch=batch, layers=layers)
        return RunModel(data=data, model=small.model if data is None else data.model,
                        small=small)
    try:
        shape = {"seq_len": seq_len, **layer_overrides(spec, layers)}
        data = None if traced_only else build_example(spec, batch_size=batch, seed=0,
                                                      device="cpu", **shape)
        model = None
        if meta and not traced_only:
            model = build_example(spec, batch_size=1, device="meta", **shape).model
        small = build_example(spec, batch_size=1, seed=0, device="meta" if meta else "cpu",
                              **shape)
    except ValueError as e:            # an unknown name, a size the example cannot take
        raise AutoplanError(str(e)) from None
    return RunModel(data=data, model=model or (data.model if data else small.model),
                    small=small)


def _main(argv: list[str] | None = None) -> int:
    """The rank's run, in order: the checkpoint folder claimed (before the model: a refusal
    costs nothing), the model built and the plan compiled (resuming where asked), the steps,
    the last checkpoint committed and the folder released, the profile, and rank 0's report."""
    args = _arguments().parse_args(argv)

    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.run_id:
        os.environ[RUN_ID_ENV] = args.run_id
    plan = plan_from_file(args.plan)
    gbs = plan.training.global_batch_size
    resume = _start(args)           # before the model: a refusal costs nothing
    documents = run_histogram(plan, args.seq_lengths)      # packed documents, or None
    built = build_run_model(args.model, batch=gbs * POOL_BATCHES if args.elastic else gbs,
                            layers=args.layers, seq_len=args.seq_len, meta=args.meta,
                            documents=documents)
    data, model, small = built.data, built.model, built.small
    report: tuple[str, ...] = ()
    if documents is not None:       # packed documents: (tokens, position_ids) rows
        report = (describe_packing(documents, data),)
    if args.elastic:                # the plan for the world this attempt has
        os.environ[ELASTIC_ENV] = "1"
        chosen = _elastic_plan(plan, resume, small, args)
        plan, gbs = chosen.plan, chosen.plan.training.global_batch_size
        report += chosen.report
    trainer = compile(model, args.cluster or "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=data.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                      global_batch_size=gbs, plan=plan, resume=resume,
                      lr_scheduler=_warmup(args.warmup_steps),
                      allow_cluster_mismatch=args.allow_cluster_mismatch)
    if trainer.rank == 0:
        for line in report + _on_pools(plan):
            print(line, flush=True)
    if resume is not None and trainer.rank == 0:
        print(f"resumed from {resume} at step {trainer.steps_done}", flush=True)
    rows = tuple(data.example_inputs) + (data.targets,)
    batch = SampleStream(rows) if args.elastic else rows
    run = _train(trainer, batch, args)
    _close_checkpoints(trainer, args)
    if args.profile_dir:
        _profile(trainer, rows, args, world=plan.config.world_size)
    if trainer.rank == 0:
        _print_summary(trainer, plan, run, args)
    _finish(dist)
    return 0


def _on_pools(plan: Any) -> tuple[str, ...]:
    """A plan for a heterogeneous cluster: where its stages or replicas run (each rank finds
    its own pool in the plan: ``Plan.pool_of_rank``)."""
    if plan.hetero is None:
        return ()
    return tuple(f"on pools: {line}" for line in hetero_explain.units_lines(plan))


def _arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoplan.runtime.worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True,
                    help="an example name or a user's package.module:function")
    ap.add_argument("--layers", type=int, default=None, help="the example's layer count")
    ap.add_argument("--seq-len", type=int, default=None, help="the example's sequence length")
    ap.add_argument("--seq-lengths", default=None,
                    help="draw the packed documents from this file's lengths (default: the "
                         "plan's training.seq_lengths; runtime/packed_data.py)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--meta", action="store_true", help="build on meta, materialize shards")
    ap.add_argument("--cluster", default=None,
                    help="the cluster the job runs on (default: discovered, 'local')")
    ap.add_argument("--allow-cluster-mismatch", action="store_true",
                    help="run a plan made for other hardware (its prediction then stale)")
    ap.add_argument("--json", default=None, help="rank 0 writes losses and times here")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-or-start", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--run-id", default=None, help="the job's id (kept by torchrun restarts)")
    ap.add_argument("--async-checkpoint", action="store_true")
    ap.add_argument("--elastic", action="store_true",
                    help="re-plan for the world this attempt has (runtime/elastic.py); the "
                         "data is a stream of samples whose position checkpoints keep")
    ap.add_argument("--elastic-batch", choices=("keep", "nearest"), default="keep",
                    help="keep the global batch wherever a plan can, or take the nearest the "
                         "warm-started layout can (planner/replan.py)")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="the learning rate rises linearly over this many steps (0: none)")
    ap.add_argument("--profile-dir", default=None,
                    help="after the steps, profile --profile-steps more; each rank writes its "
                         "events to DIR/rank<r>.json (`autoplan calibrate`)")
    ap.add_argument("--profile-steps", type=int, default=5)
    return ap


@dataclass(frozen=True)
class StepsRun:
    """What the steps of this run measured."""

    first_step: int              # the step the run started at (after a resume)
    steps: int                   # --steps: the step the run trains up to
    losses: list[float]
    times_s: list[float]         # each step's wall time


def _train(trainer: Any, batch: Any, args: argparse.Namespace) -> StepsRun:
    """Train up to step ``--steps``, rank 0 printing each step's loss and time; saves every
    ``--checkpoint-every`` steps and after the last one. ``batch``: one fixed batch, or a
    SampleStream (--elastic) whose next global batch each step takes."""
    losses, times = [], []
    first = trainer.steps_done
    gbs = trainer.plan.training.global_batch_size
    while trainer.steps_done < args.steps:
        t0 = time.perf_counter()
        loss = trainer.step(batch.batch(trainer.samples_seen, gbs)
                            if isinstance(batch, SampleStream) else batch)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if trainer.rank == 0:
            print(f"step {trainer.steps_done - 1:3d}  loss {loss:.4f}  "
                  f"{times[-1] * 1e3:8.1f} ms", flush=True)
        every = args.checkpoint_every
        if args.checkpoint_dir and ((every and trainer.steps_done % every == 0)
                                    or trainer.steps_done == args.steps):
            path = trainer.save(args.checkpoint_dir, async_save=args.async_checkpoint)
            if trainer.rank == 0:
                note = " (writing in the background)" if args.async_checkpoint else ""
                print(f"checkpoint {path}{note}", flush=True)
    return StepsRun(first_step=first, steps=args.steps, losses=losses, times_s=times)


def _warmup(steps: int) -> Any:
    """The LR scheduler factory of ``--warmup-steps`` (None: a constant learning rate): the
    rate rises linearly from lr / steps to lr; checkpoints keep its position."""
    if steps <= 0:
        return None
    return lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / steps,
                                                         total_iters=steps)


def _elastic_plan(plan: Any, resume: str | None, small: Any,
                  args: argparse.Namespace) -> ElasticPlan:
    """The plan for this attempt's world (``elastic.plan_for_world``), on the cluster
    ``compile`` will describe (discovered, or ``--cluster`` where its world is this job's),
    checked to be every rank's."""
    from autoplan.cluster import Cluster  # lazily: only elastic attempts re-plan
    from autoplan.estimate.arguments import cluster_arg  # lazily: only elastic attempts re-plan
    from autoplan.graph.trace import trace  # lazily: only elastic attempts re-plan
    cluster = Cluster.local_job() if not args.cluster else cluster_arg(args.cluster, "--cluster")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cluster.world_size != world:
        raise AutoplanError(f"--elastic: --cluster {args.cluster} has {cluster.world_size} "
                            f"devices, this attempt of the job {world}; drop --cluster (the "
                            "ranks then describe the machines they run on)")
    graph = trace(small.model, small.example_inputs,
                  loss_fn=small.loss_fn if small.targets is not None else None,
                  targets=small.targets, name=plan.model.name)
    chosen = plan_for_world(plan, last_run(plan, resume), graph=graph, cluster=cluster,
                            batch=args.elastic_batch)
    # the process group compile joins, started here so that the ranks agree on the plan before
    # any collective of the program (a disagreement would hang or fail inside one)
    init_distributed(cluster.backend)
    check_agreement(chosen.plan)
    return chosen


def _close_checkpoints(trainer: Any, args: argparse.Namespace) -> None:
    """The last (async) save committed; rank 0 releases the folder's claim."""
    trainer.wait_for_checkpoint()
    if args.checkpoint_dir and trainer.rank == 0:
        release(Path(args.checkpoint_dir), run_id())


def _profile(trainer: Any, batch: tuple, args: argparse.Namespace, *, world: int) -> None:
    """``--profile-steps`` more steps recorded; each rank writes ``rank<r>.json`` under
    ``--profile-dir`` (read by ``autoplan calibrate``)."""
    rec = record_steps(trainer, batch, args.profile_steps)
    rec.update(rank=trainer.rank, world=world)
    os.makedirs(args.profile_dir, exist_ok=True)
    with open(os.path.join(args.profile_dir, f"rank{trainer.rank}.json"), "w") as f:
        json.dump(rec, f)


def _print_summary(trainer: Any, plan: Any, run: StepsRun, args: argparse.Namespace) -> None:
    """Rank 0's report: the median step time beside the plan's prediction, the peak memory
    beside its prediction (on CUDA), and the ``--json`` record."""
    times = run.times_s
    if not times:
        print(f"nothing to do: the checkpoint is at step {run.first_step}, --steps is "
              f"{run.steps}")
        return
    measured = statistics.median(times[1:] if len(times) > 2 else times)
    predicted = plan.predicted["step_time_s"]
    print(f"measured step time {measured * 1e3:.1f} ms (median), predicted "
          f"{predicted * 1e3:.1f} ms, ratio {measured / predicted:.2f}"
          + (" (the prediction is stale: made for other hardware)"
             if trainer.stale_prediction else ""), flush=True)
    peak = _peak_memory(plan)
    if peak:
        print(f"measured peak memory {peak['measured_peak_memory_bytes'] / 2**30:.2f} GiB "
              f"allocated ({peak['measured_reserved_bytes'] / 2**30:.2f} GiB reserved by "
              f"torch's allocator), predicted {peak['predicted_peak_memory_bytes'] / 2**30:.2f}"
              " GiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_step": run.first_step, "losses": run.losses, "times_s": times,
                       "measured_s": measured, "predicted_s": predicted, **peak}, f)


def _peak_memory(plan: Any) -> dict[str, float]:
    """Rank 0's peak GPU memory over the steps (torch's allocator: what tensors held, and what
    it reserved from the driver) beside the plan's prediction; empty off CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"measured_peak_memory_bytes": float(torch.cuda.max_memory_allocated()),
            "measured_reserved_bytes": float(torch.cuda.max_memory_reserved()),
            "predicted_peak_memory_bytes": float(plan.predicted["peak_memory_bytes"])}


def _start(args: argparse.Namespace) -> str | None:
    """The checkpoint root to resume from (None: a new run). ``--resume``: its newest
    checkpoint, or a CheckpointError when there is none (``--resume-or-start``: a new run);
    a restart by torchrun after a failure resumes the newest one if there is one. Rank 0
    claims the folder (``checkpoint_dir.claim``), deleting what ``--overwrite`` replaces, once:
    a restart keeps what this job wrote."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    root = args.checkpoint_dir
    if not root:
        return None
    if int(os.environ.get("RANK", "0")) != 0:      # rank 0 checks, claims and reports
        if not (args.resume or args.resume_or_start or restarted):
            return None
        try:
            resolve(root)
        except CheckpointError:
            return None
        return root
    start = plan_start(root, resume=args.resume and not restarted,
                       resume_or_start=args.resume_or_start or restarted,
                       overwrite=args.overwrite and not restarted)
    claim(root, resumed_from=start.resume_from, overwrite=args.overwrite and not restarted)
    if restarted and start.resume_from is None:
        print(f"restarted: no checkpoint in {root} yet, starting from step 0", flush=True)
    elif start.note:
        print(start.note, flush=True)
    return root if start.resume_from is not None else None


def _finish(dist) -> None:
    if dist.is_initialized():
        dist.barrier()              # nobody tears the group down while a peer still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main())         # without the interpreter's teardown: seconds per rank
