"""`autoplan run plan.json --model MODEL --nproc-per-node N`: train a plan under torchrun.

On one machine this launches ``torchrun`` itself. On several nodes run the printed torchrun
command on every node (``--print-command``), with ``--nnodes``, ``--node-rank`` and the
rendezvous address of node 0.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a plan under torchrun (launched for you)",
                       description=__doc__)
    p.add_argument("plan", help="plan.json written by `autoplan plan`")
    p.add_argument("--model", required=True,
                   help="the model the plan was made for: an example name or "
                        "'package.module:function' returning an autoplan.models.Example")
    p.add_argument("--layers", type=int, default=None,
                   help="the example's layer count, as given to `autoplan plan --layers`")
    p.add_argument("--seq-len", type=int, default=None,
                   help="the example's sequence length, as given to `autoplan plan --seq-len`")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: the plan's world size / --nnodes)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29511)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device; each rank allocates its shards")
    p.add_argument("--cluster", default=None,
                   help="the cluster the ranks run on, where discovery cannot see it (the "
                        "network between nodes): PRESET:NODES or a cluster file (default: "
                        "this machine as discovered, on --nnodes nodes)")
    p.add_argument("--allow-cluster-mismatch", action="store_true",
                   help="run a plan made for other hardware of the same world size; its "
                        "predicted step time and memory are then marked stale")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (a directory every node sees)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every N steps (and after the last step) into --checkpoint-dir")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (saved under "
                        "this plan or another one)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background while training goes on")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts the job this many times after a failure; with "
                        "--checkpoint-dir it resumes from the latest checkpoint")
    p.add_argument("--print-command", action="store_true",
                   help="print the torchrun command instead of running it")
    p.set_defaults(func=run)


def torchrun_command(plan_path: str, model: str, *, nproc: int, nnodes: int = 1,
                     node_rank: int = 0, master_addr: str = "127.0.0.1",
                     master_port: int = 29511, steps: int = 10, lr: float = 3e-3,
                     meta: bool = False, checkpoint_dir: str | None = None,
                     checkpoint_every: int = 0, resume: bool = False,
                     async_checkpoint: bool = False, max_restarts: int = 0,
                     cluster: str | None = None, allow_cluster_mismatch: bool = False,
                     extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
           f"--master-port={master_port}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "autoplan.runtime.worker", "--plan", plan_path, "--model", model,
            "--steps", str(steps), "--lr", str(lr)]
    if meta:
        cmd.append("--meta")
    if cluster:
        cmd += ["--cluster", cluster]
    if allow_cluster_mismatch:
        cmd.append("--allow-cluster-mismatch")
    if checkpoint_dir:
        cmd += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(checkpoint_every)]
        if resume:
            cmd.append("--resume")
        if async_checkpoint:
            cmd.append("--async-checkpoint")
    return cmd + (extra or [])


def run(args: argparse.Namespace) -> int:
    from autoplan.errors import PlanError
    from autoplan.planner.planfile import plan_from_file
    plan = plan_from_file(args.plan)
    world = plan.config.world_size
    if args.nnodes != plan.cluster.num_nodes:
        raise PlanError(f"the plan is for {plan.cluster.num_nodes} nodes of "
                        f"{plan.cluster.devices_per_node} devices ({plan.cluster.name}); "
                        f"--nnodes {args.nnodes} does not match: launch on "
                        f"{plan.cluster.num_nodes} nodes or re-plan for {args.nnodes}")
    if (args.checkpoint_every or args.resume or args.async_checkpoint) and not \
            args.checkpoint_dir:
        raise PlanError("--checkpoint-every, --resume and --async-checkpoint need "
                        "--checkpoint-dir DIR")
    if args.checkpoint_every < 0 or args.max_restarts < 0:
        raise PlanError("--checkpoint-every and --max-restarts take a count >= 0")
    nproc = args.nproc_per_node or world // args.nnodes
    if nproc * args.nnodes != world:
        raise PlanError(f"the plan needs {world} ranks but --nnodes {args.nnodes} x "
                        f"--nproc-per-node {nproc} = {nproc * args.nnodes}; fix the launch")
    cmd = torchrun_command(args.plan, args.model, nproc=nproc, nnodes=args.nnodes,
                           node_rank=args.node_rank, master_addr=args.master_addr,
                           master_port=args.master_port, steps=args.steps, lr=args.lr,
                           meta=args.meta, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, resume=args.resume,
                           async_checkpoint=args.async_checkpoint,
                           max_restarts=args.max_restarts, cluster=args.cluster,
                           allow_cluster_mismatch=args.allow_cluster_mismatch, extra=[
                               *(["--layers", str(args.layers)] if args.layers else []),
                               *(["--seq-len", str(args.seq_len)] if args.seq_len else [])])
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)
