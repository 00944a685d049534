"""`autoplan emulate PLAN --model M [--rank R]`: one rank of a plan, alone on this machine.

Rank R's program (its shards, FSDP units, pipeline chunks) runs on this machine's GPU (a GPU
plan where CUDA is present), else its CPU, in a process group of the ``fake`` backend: every
collective returns at once and moves nothing. It measures the rank's compute time per step and
its peak memory, and prints them beside what the plan priced for that rank, communication left
out. So the memory and compute of a 64-GPU plan are checked on one GPU. The model is built
where ``autoplan plan`` traced it, since the plan holds that trace's fingerprint and some
models trace differently per device (Llama's attention output is a view of the CPU kernel's
result and a copy of the meta kernel's): on the meta device for a GPU plan (only rank R's
shards are ever allocated), on the CPU for a CPU cluster's plan; ``--device`` says otherwise,
as it did to ``plan``.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autoplan.cli.common import add_plan_model_args
    p = sub.add_parser("emulate", help="run one rank of a plan alone (collectives faked) and "
                                       "compare its compute and memory with the plan's",
                       description=__doc__)
    add_plan_model_args(p)
    p.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--steps", type=int, default=3,
                   help="steps to run; the first (allocation, warm-up) is not timed (default 3)")
    p.add_argument("--cluster", default=None,
                   help="the plan's cluster file, where it came from one (a preset's is "
                        "rebuilt from the plan)")
    p.add_argument("--device", default=None, choices=("meta", "cpu"),
                   help="where to build the model: where `autoplan plan` traced it (default: "
                        "the CPU for a CPU cluster's plan, else the meta device); pass what "
                        "`plan --device` was given")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.planner.planfile import plan_from_file
    from autoplan.runtime.emulate import emulate, plan_cluster
    from autoplan.runtime.worker import build_run_model
    plan = plan_from_file(args.plan)
    built = build_run_model(args.model, batch=plan.training.global_batch_size,
                            layers=args.layers, seq_len=args.seq_len,
                            # a user's function too: under autoplan.empty_weights()
                            meta=traced_on_meta(plan_cluster(plan, args.cluster).device.kind,
                                                args.device),
                            traced_only=True,
                            documents=plan.training.length_histogram())
    ex = built.small
    result = emulate(plan, ex.model, example_inputs=ex.example_inputs,
                     example_targets=ex.targets, loss_fn=ex.loss_fn, rank=args.rank,
                     steps=args.steps, cluster=args.cluster)
    print(result.report())
    return 0


def traced_on_meta(device_kind: str, device: str | None) -> bool:
    """Whether ``autoplan plan`` traced the model on the meta device: it does unless the plan's
    cluster is of CPUs (``plan_cmd._trace_for``) or ``--device`` said otherwise."""
    return device == "meta" if device is not None else device_kind != "cpu"
