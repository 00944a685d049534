"""PowerSGD against uncompressed training: the loss over 50 steps of a small GPT on 2 gloo
ranks (issue 39 part 7). Both runs are autoplan plans of the same model, data and seed, one
forced to ``grad_compression=powersgd``; the script prints both curves' summary.

    python benchmarks/powersgd_loss.py [--steps 50] [--rank 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from autoplan import Cluster  # noqa: E402
from autoplan import plan as make_plan  # noqa: E402
from autoplan.graph import trace  # noqa: E402
from autoplan.models import build_example  # noqa: E402
from autoplan.planner.planfile import Plan  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

MODEL, BATCH = "gpt-tiny", 8


def _rank(rank, world, plan_json, steps):
    from autoplan.runtime.trainer import compile
    torch.manual_seed(0)
    ex = build_example(MODEL, batch_size=BATCH, seed=0)
    small = build_example(MODEL, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                      global_batch_size=BATCH, plan=Plan.from_json(plan_json))
    gen = torch.Generator().manual_seed(1)
    vocab = int(ex.example_inputs[0].max()) + 1
    losses = []
    for _ in range(steps):        # fresh batches: a repeated one would only be memorised
        tokens = torch.randint(0, vocab, (BATCH, ex.example_inputs[0].shape[1] + 1),
                               generator=gen)
        tokens[:, 1::2] = tokens[:, 0:-1:2]          # learnable: every odd token repeats
        losses.append(float(trainer.step((tokens[:, :-1], tokens[:, 1:]))))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rank", type=int, default=2)
    args = ap.parse_args()
    small = build_example(MODEL, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    curves = {}
    for name, extra in (("exact", {}), (f"powersgd rank {args.rank}",
                                        {"grad_compression": "powersgd",
                                         "powersgd_rank": args.rank})):
        p = make_plan(g, Cluster.local(2), global_batch_size=BATCH, precision="fp32",
                      profile=None, max_pp=1, force=dict(tp=1, zero_stage=0, **extra))
        curves[name] = run_ranks(_rank, 2, p.to_json(), args.steps)[0]
    print(f"{MODEL}, 2 gloo ranks (DDP), global batch {BATCH}, AdamW lr 3e-3, "
          f"{args.steps} steps")
    print(f"{'run':<18} {'step 1':>8} {'step 10':>8} {'step 25':>8} {'last':>8} "
          f"{'mean last 10':>13}")
    for name, c in curves.items():
        print(f"{name:<18} {c[0]:8.4f} {c[min(9, len(c) - 1)]:8.4f} "
              f"{c[min(24, len(c) - 1)]:8.4f} {c[-1]:8.4f} {sum(c[-10:]) / len(c[-10:]):13.4f}")
    a, b = curves.values()
    print(f"largest |difference| over the run: {max(abs(x - y) for x, y in zip(a, b)):.4f}")


if __name__ == "__main__":
    main()
