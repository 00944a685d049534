"""`autoplan demo`: the main job on built-in defaults.

1. plans a small GPT (gpt-small-cpu) for this machine as 4 CPU ranks on gloo and prints the plan;
2. trains it with that plan under torchrun for a few steps: the loss per step, then the measured
   step time next to the predicted one (calibrated: a CPU without a profile is measured on first
   use); it saves a checkpoint, and new processes resume from it and train on;
3. traces GPT-3 175B on the meta device (nothing allocated) and plans it for 1,024 A100s
   (128 DGX nodes), printing the plan: mesh, sharding, memory, time, alternatives, solver.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="plan and train a small GPT here, then plan GPT-3 175B",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks for the small GPT (4)")
    p.add_argument("--steps", type=int, default=10, help="training steps (10)")
    p.add_argument("--quick", action="store_true",
                   help="trace GPT-3 175B with 8 layers instead of 96 (same per-layer costs)")
    p.add_argument("--out", default=None, help="folder for the plan files (a temp folder)")
    p.set_defaults(func=run)


def _headline(text: str) -> None:
    print(f"\n{'=' * 100}\n{text}\n{'=' * 100}", flush=True)


def run(args: argparse.Namespace) -> int:
    from autoplan.cli.run_cmd import launch_torchrun, torchrun_command
    from autoplan.cluster import Cluster
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.search import plan

    from autoplan.errors import AutoplanError
    if not (1 <= args.ranks <= 1024 and args.steps >= 1):
        raise AutoplanError(f"--ranks takes 1 to 1,024 CPU processes and --steps a count >= 1, "
                            f"got --ranks {args.ranks} --steps {args.steps}")
    out = args.out or tempfile.mkdtemp(prefix="autoplan-demo-")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise AutoplanError(f"--out {out!r} cannot be made a folder: {e.strerror or e}") from None
    t_start = time.perf_counter()

    _headline(f"1. plan a small GPT (gpt-small-cpu) for this machine: {args.ranks} CPU ranks, gloo")
    small = build_example("gpt-small-cpu", batch_size=1, seed=0)
    graph = trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                  targets=small.targets, name="gpt-small-cpu")
    local = Cluster.local(args.ranks)
    gbs = 4 * args.ranks
    small_plan = plan(graph, local, global_batch_size=gbs, precision="fp32",
                      name="gpt-small-cpu")
    path = os.path.join(out, "gpt-small-cpu.plan.json")
    small_plan.save(path)
    print(explain_plan(small_plan))
    print(f"\nwrote {path}", flush=True)

    _headline(f"2. train it with the plan: torchrun, {args.ranks} processes, {args.steps} steps, "
              f"global batch {gbs}")
    ckpt = os.path.join(out, "checkpoints")
    run_id = uuid.uuid4().hex[:12]
    cmd = torchrun_command(path, "gpt-small-cpu", nproc=args.ranks, steps=args.steps, lr=1e-3,
                           master_port=free_port(), checkpoint_dir=ckpt,
                           checkpoint_every=args.steps, overwrite=True,   # the demo's own folder
                           run_id=run_id)
    print("$ " + " ".join(cmd[2:]), flush=True)
    # torchrun in this process, as `autoplan run` starts it (no second interpreter importing
    # torch for the launcher); its ranks' failures are summarized once
    code = launch_torchrun(cmd, run_id=run_id, checkpoint_dir=ckpt)
    if code:
        print(f"training failed (exit {code})", file=sys.stderr)
        return code

    more = max(1, args.steps // 2)
    _headline(f"2b. new processes resume from the checkpoint and train {more} more steps")
    run_id = uuid.uuid4().hex[:12]
    cmd = torchrun_command(path, "gpt-small-cpu", nproc=args.ranks, steps=args.steps + more,
                           lr=1e-3, master_port=free_port(), checkpoint_dir=ckpt,
                           resume=True, run_id=run_id)
    print("$ " + " ".join(cmd[2:]), flush=True)
    code = launch_torchrun(cmd, run_id=run_id, checkpoint_dir=ckpt)
    if code:
        print(f"resuming failed (exit {code})", file=sys.stderr)
        return code

    layers = 8 if args.quick else 96
    _headline(f"3. GPT-3 175B on the meta device ({layers} layers traced), planned for 1,024 A100")
    t0 = time.perf_counter()
    big = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=layers)
    big_graph = trace(big.model, big.example_inputs, loss_fn=big.loss_fn, targets=big.targets,
                      name="gpt3-175b")
    print(big_graph.summary())
    cluster = Cluster.preset("dgx-a100-80gb", nodes=128)
    big_plan = plan(big_graph, cluster, global_batch_size=1536, name="gpt3-175b")
    big_path = os.path.join(out, "gpt3-175b.plan.json")
    big_plan.save(big_path)
    print(f"traced and planned in {time.perf_counter() - t0:.1f} s\n")
    print(explain_plan(big_plan))
    print(f"\nwrote {big_path}; demo finished in {time.perf_counter() - t_start:.0f} s")
    return 0


def rank_env() -> dict[str, str]:
    """The environment of torchrun's ranks: unbuffered output, and OMP_NUM_THREADS (torchrun's
    own default of 1 for its ranks) set, so that torchrun prints no banner about setting it."""
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
