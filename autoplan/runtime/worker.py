"""One rank of `autoplan run`: ``torchrun ... -m autoplan.runtime.worker --plan P --model M``.

Builds the example model (seeded, so every rank starts from the same weights; on the meta device
for models too big for host memory, then materialized shard by shard), compiles the plan and
trains up to step ``--steps`` on one fixed synthetic batch (so the loss visibly falls). Rank 0
prints the loss per step, then the measured median step time next to the plan's prediction.

With ``--checkpoint-dir`` it saves every ``--checkpoint-every`` steps and after the last one;
``--resume``, or a restart by ``torchrun --max-restarts`` after a rank died, continues from the
latest checkpoint there (saved under this plan or another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoplan.runtime.worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True,
                    help="an example name or a user's package.module:function")
    ap.add_argument("--layers", type=int, default=None, help="the example's layer count")
    ap.add_argument("--seq-len", type=int, default=None, help="the example's sequence length")
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
    ap.add_argument("--async-checkpoint", action="store_true")
    ap.add_argument("--profile-dir", default=None,
                    help="after the steps, profile --profile-steps more; each rank writes its "
                         "events to DIR/rank<r>.json (`autoplan calibrate`)")
    ap.add_argument("--profile-steps", type=int, default=5)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from autoplan.models import build_example
    from autoplan.models.registry import layer_overrides
    from autoplan.planner.planfile import plan_from_file
    from autoplan.runtime.verify import user_example
    from autoplan.runtime.trainer import compile
    torch.set_num_threads(1)
    plan = plan_from_file(args.plan)
    gbs = plan.training.global_batch_size
    if ":" in args.model:            # a user's package.module:function
        if args.meta or args.seq_len:
            raise SystemExit(f"autoplan run: --meta and --seq-len take example names; "
                             f"{args.model} builds its own model and inputs")
        data = user_example(args.model, batch=gbs, layers=args.layers)
        small = user_example(args.model, batch=None, layers=args.layers)  # as traced
        model = data.model
    else:
        shape = {"seq_len": args.seq_len, **layer_overrides(args.model, args.layers)}
        data = build_example(args.model, batch_size=gbs, seed=0, device="cpu", **shape)
        if args.meta:
            model = build_example(args.model, batch_size=1, device="meta", **shape).model
        else:
            model = data.model
        small = build_example(args.model, batch_size=1, seed=0,
                              device="meta" if args.meta else "cpu", **shape)
    resume = _resume_from(args)
    trainer = compile(model, args.cluster or "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=data.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                      global_batch_size=gbs, plan=plan, resume=resume,
                      allow_cluster_mismatch=args.allow_cluster_mismatch)
    if resume is not None and trainer.rank == 0:
        print(f"resumed from {resume} at step {trainer.steps_done}", flush=True)
    batch = tuple(data.example_inputs) + (data.targets,)
    losses, times = [], []
    first = trainer.steps_done
    while trainer.steps_done < args.steps:
        t0 = time.perf_counter()
        loss = trainer.step(batch)
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
    trainer.wait_for_checkpoint()
    if args.profile_dir:
        import os

        from autoplan.runtime.step_trace import record_steps
        rec = record_steps(trainer, batch, args.profile_steps)
        rec.update(rank=trainer.rank, world=plan.config.world_size)
        os.makedirs(args.profile_dir, exist_ok=True)
        with open(os.path.join(args.profile_dir, f"rank{trainer.rank}.json"), "w") as f:
            json.dump(rec, f)
    if not times:
        if trainer.rank == 0:
            print(f"nothing to do: the checkpoint is at step {first}, --steps is {args.steps}")
        _finish(dist)
        return 0
    measured = statistics.median(times[1:] if len(times) > 2 else times)
    predicted = plan.predicted["step_time_s"]
    if trainer.rank == 0:
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
                json.dump({"first_step": first, "losses": losses, "times_s": times,
                           "measured_s": measured, "predicted_s": predicted, **peak}, f)
    _finish(dist)
    return 0


def _peak_memory(plan: Any) -> dict[str, float]:
    """Rank 0's peak GPU memory over the steps (torch's allocator: what tensors held, and what
    it reserved from the driver) beside the plan's prediction; empty off CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"measured_peak_memory_bytes": float(torch.cuda.max_memory_allocated()),
            "measured_reserved_bytes": float(torch.cuda.max_memory_reserved()),
            "predicted_peak_memory_bytes": float(plan.predicted["peak_memory_bytes"])}


def _resume_from(args: argparse.Namespace) -> str | None:
    """The checkpoint root to resume from: with ``--resume``, or when torchrun restarted the
    job after a failure, if a complete checkpoint is there."""
    import os

    from autoplan.errors import CheckpointError
    from autoplan.runtime.checkpoint_files import resolve
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not args.checkpoint_dir or not (args.resume or restarted):
        return None
    try:
        resolve(args.checkpoint_dir)
    except CheckpointError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"starting from scratch: {e}", flush=True)
        return None
    return args.checkpoint_dir


def _finish(dist) -> None:
    if dist.is_initialized():
        dist.barrier()              # nobody tears the group down while a peer still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
