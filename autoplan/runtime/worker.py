"""One rank of `autoplan run`: ``torchrun ... -m autoplan.runtime.worker --plan P --model M``.

Builds the example model (seeded, so every rank starts from the same weights; on the meta device
for models too big for host memory, then materialized shard by shard), compiles the plan and
trains ``--steps`` steps on one fixed synthetic batch (so the loss visibly falls). Rank 0 prints
the loss per step, then the measured median step time next to the plan's prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoplan.runtime.worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True, help="example model name")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--meta", action="store_true", help="build on meta, materialize shards")
    ap.add_argument("--json", default=None, help="rank 0 writes losses and times here")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from autoplan.models import build_example
    from autoplan.planner.planfile import plan_from_file
    from autoplan.runtime.trainer import compile
    torch.set_num_threads(1)
    plan = plan_from_file(args.plan)
    gbs = plan.training.global_batch_size
    data = build_example(args.model, batch_size=gbs, seed=0, device="cpu")
    if args.meta:
        ex = build_example(args.model, batch_size=1, device="meta")
        model = ex.model
    else:
        model = data.model
    small = build_example(args.model, batch_size=1, seed=0, device="meta" if args.meta else "cpu")
    trainer = compile(model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=data.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                      global_batch_size=gbs, plan=plan)
    batch = tuple(data.example_inputs) + (data.targets,)
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = trainer.step(batch)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if trainer.rank == 0:
            print(f"step {step:3d}  loss {loss:.4f}  {times[-1] * 1e3:8.1f} ms", flush=True)
    measured = statistics.median(times[1:] if len(times) > 2 else times)
    predicted = plan.predicted["step_time_s"]
    if trainer.rank == 0:
        print(f"measured step time {measured * 1e3:.1f} ms (median), predicted "
              f"{predicted * 1e3:.1f} ms, ratio {measured / predicted:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": losses, "times_s": times, "measured_s": measured,
                           "predicted_s": predicted}, f)
    if dist.is_initialized():
        dist.barrier()              # nobody tears the group down while a peer still uses it
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
