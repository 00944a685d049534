"""`autoplan run plan.json --model MODEL --nproc-per-node N`: train a plan under torchrun.

On one machine this launches ``torchrun`` itself (torch's launcher, in this process), after
checking the plan against the model, the cluster, the world size and the checkpoint folder
(``preflight.py``): a mistake costs a second and one message, before any rank starts. A job
whose ranks fail is reported once: the first error, with the ranks it hit (``summarize``). On
several nodes run the printed torchrun command on every node (``--print-command``), with
``--nnodes``, ``--node-rank`` and the rendezvous address of node 0.

``--elastic --nnodes MIN:MAX`` runs under torchrun's elastic rendezvous (c10d, hosted at
``--master-addr:--master-port``): a job whose node dies is restarted (``--max-restarts``) on the
nodes left, and a run resumed on another number of devices, each re-planned for the devices it
has and resumed from the latest checkpoint (``runtime/elastic.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import uuid
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autoplan.cli.common import add_plan_model_args
    p = sub.add_parser("run", help="train a plan under torchrun (launched for you)",
                       description=__doc__)
    add_plan_model_args(p)
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: the plan's world size / --nnodes)")
    p.add_argument("--nnodes", default="1",
                   help="nodes the job spans (run the printed command on each; default 1); "
                        "with --elastic a range MIN:MAX, as torchrun's")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0 to --nnodes - 1 (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of node 0, where the job meets (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=29511,
                   help="port on node 0 where the job meets (default 29511)")
    p.add_argument("--steps", type=int, default=10,
                   help="train until this step (default 10; a resumed run counts on)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW's learning rate (default 3e-3)")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device (a package.module:function under "
                        "autoplan.empty_weights()); each rank allocates its shards")
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
                        "this plan or another one); an error when there is none")
    p.add_argument("--resume-or-start", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir, or start a "
                        "new run there when it holds none")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in --checkpoint-dir although it holds another run's "
                        "checkpoints: they are deleted (without it, that is refused)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background while training goes on")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts the job this many times after a failure; with "
                        "--checkpoint-dir it resumes from the latest checkpoint")
    p.add_argument("--elastic", action="store_true",
                   help="elastic: the ranks re-plan for the world each attempt has (a node "
                        "lost, a resume on more or fewer devices), warm-started from the last "
                        "plan, and resume from the latest checkpoint keeping the global batch "
                        "(or the nearest, stated), the LR schedule and the data position")
    p.add_argument("--elastic-batch", choices=("keep", "nearest"), default="keep",
                   help="with --elastic, where the last plan's layout cannot split the global "
                        "batch on the new world: keep it (default: the fastest neighbouring "
                        "layout that splits it, or uneven micro-batches per replica, else a "
                        "full search) or take the nearest batch that layout splits (the layout "
                        "kept, the batch stated)")
    p.add_argument("--rdzv-conf", default=None,
                   help="with --elastic: torchrun's --rdzv-conf (e.g. last_call_timeout=5,"
                        "keep_alive_interval=2), how long the rendezvous waits for nodes")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="the learning rate rises linearly to --lr over this many steps "
                        "(default 0: constant); checkpoints keep the schedule's position")
    p.add_argument("--seq-lengths", default=None, metavar="FILE",
                   help="train on packed documents whose lengths are drawn from FILE (a "
                        "histogram or a sample, as `plan --seq-lengths` reads) instead of the "
                        "plan's training.seq_lengths; the plan must be one made with "
                        "--seq-lengths (a plan with training.seq_lengths trains on packed "
                        "documents without this option)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="rank 0 writes the losses, step times and the measured and predicted "
                        "step time here as JSON")
    p.add_argument("--print-command", action="store_true",
                   help="print the torchrun command instead of running it")
    p.set_defaults(func=run)


def torchrun_command(plan_path: str, model: str, *, nproc: int, nnodes: int = 1,
                     node_rank: int = 0, master_addr: str = "127.0.0.1",
                     master_port: int = 29511, steps: int = 10, lr: float = 3e-3,
                     meta: bool = False, checkpoint_dir: str | None = None,
                     checkpoint_every: int = 0, resume: bool = False,
                     async_checkpoint: bool = False, max_restarts: int = 0,
                     resume_or_start: bool = False, overwrite: bool = False,
                     run_id: str | None = None, cluster: str | None = None,
                     allow_cluster_mismatch: bool = False, min_nodes: int | None = None,
                     rdzv_conf: str | None = None, warmup_steps: int = 0,
                     elastic_batch: str = "keep",
                     extra: list[str] | None = None) -> list[str]:
    """The torchrun command of a job; ``min_nodes`` (elastic): the job runs on ``min_nodes``
    to ``nnodes`` nodes under the c10d rendezvous at ``master_addr:master_port``, each rank
    re-planning for the world it gets (``--elastic``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if min_nodes is None:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                f"--master-port={master_port}"]
    else:
        cmd += [f"--nnodes={min_nodes}:{nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-id={run_id}"]
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
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
        if resume_or_start:
            cmd.append("--resume-or-start")
        if overwrite:
            cmd.append("--overwrite")
        if async_checkpoint:
            cmd.append("--async-checkpoint")
    if run_id:
        cmd += ["--run-id", run_id]
    if min_nodes is not None:
        cmd.append("--elastic")
        if elastic_batch != "keep":
            cmd += ["--elastic-batch", elastic_batch]
    if warmup_steps:
        cmd += ["--warmup-steps", str(warmup_steps)]
    return cmd + (extra or [])


def run(args: argparse.Namespace) -> int:
    from autoplan.cli.preflight import check_launch
    args.min_nodes, args.nnodes = node_range(args.nnodes, elastic=args.elastic)
    elastic_only = [f for f, on in (("--rdzv-conf", args.rdzv_conf),
                                    ("--elastic-batch", args.elastic_batch != "keep")) if on]
    if elastic_only and not args.elastic:
        from autoplan.errors import PlanError
        raise PlanError(f"{', '.join(elastic_only)} configure an elastic job: add --elastic")
    launch = check_launch(args, local=not args.print_command)
    run_id = elastic_run_id(args) if args.elastic else uuid.uuid4().hex[:12]
    cmd = torchrun_command(args.plan, args.model, nproc=launch.nproc, nnodes=args.nnodes,
                           node_rank=args.node_rank, master_addr=args.master_addr,
                           master_port=args.master_port, steps=args.steps, lr=args.lr,
                           meta=args.meta, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, resume=args.resume,
                           async_checkpoint=args.async_checkpoint,
                           max_restarts=args.max_restarts,
                           resume_or_start=args.resume_or_start, overwrite=args.overwrite,
                           run_id=run_id, cluster=args.cluster,
                           allow_cluster_mismatch=args.allow_cluster_mismatch,
                           min_nodes=args.min_nodes if args.elastic else None,
                           rdzv_conf=args.rdzv_conf, warmup_steps=args.warmup_steps,
                           elastic_batch=args.elastic_batch, extra=[
                               *(["--layers", str(args.layers)] if args.layers else []),
                               *(["--seq-len", str(args.seq_len)] if args.seq_len else []),
                               *data_options(args)])
    env = {**RANK_ENV_DEFAULTS, **(ELASTIC_ENV_DEFAULTS if args.elastic else {})}
    if args.print_command:       # with the environment launch_torchrun gives the ranks
        env = {k: os.environ.get(k) or v for k, v in env.items()}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    return launch_torchrun(cmd, run_id=run_id, checkpoint_dir=args.checkpoint_dir,
                           defaults=env)


def data_options(args: argparse.Namespace) -> list[str]:
    """The worker's data options of this `autoplan run` (``--seq-lengths``, ``--json``),
    their files as absolute paths (every rank opens them)."""
    out: list[str] = []
    for flag, value in (("--seq-lengths", args.seq_lengths), ("--json", args.json)):
        if value:
            out += [flag, os.path.abspath(value)]
    return out


def node_range(text: str, *, elastic: bool) -> tuple[int, int]:
    """(fewest, most) nodes of ``--nnodes``: N, or MIN:MAX with --elastic."""
    from autoplan.errors import PlanError
    low, sep, high = str(text).partition(":")
    try:
        low_n, high_n = int(low), int(high if sep else low)
    except ValueError:
        raise PlanError(f"--nnodes takes a count N, or MIN:MAX with --elastic; got {text!r}"
                        ) from None
    if sep and not elastic:
        raise PlanError(f"--nnodes {text} is a range: add --elastic (the job then runs on "
                        f"{low_n} to {high_n} nodes, re-planning for those it has), or give one "
                        "count")
    if not 1 <= low_n <= high_n:
        raise PlanError(f"--nnodes {text}: want 1 <= MIN <= MAX")
    return low_n, high_n


def elastic_run_id(args: argparse.Namespace) -> str:
    """One id for every node of an elastic job (each runs its own `autoplan run`): from where
    the job meets and where it saves, so that the nodes name the same rendezvous and claim the
    checkpoint folder as one job."""
    import hashlib
    where = f"{args.master_addr}:{args.master_port}:" + (
        os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else "")
    return "elastic-" + hashlib.sha256(where.encode()).hexdigest()[:12]


# What every rank's environment gets unless the user set it (see launch_torchrun).
RANK_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
# and under --elastic: torchrun's c10d rendezvous otherwise keeps one store for the workers
# across rounds, hosted by the first round's rank-0 node (gone with it), and the keys of an
# earlier round's ranks stay in it; with this, each round's rank 0 hosts a fresh one
ELASTIC_ENV_DEFAULTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch_torchrun(cmd: list[str], *, run_id: str, checkpoint_dir: str | None = None,
                    defaults: dict[str, str] | None = None) -> int:
    """Run ``cmd`` (a ``python -m torch.distributed.run ...`` command) with torch's launcher
    in this process, so that its ranks' failures arrive as data (``ChildFailedError``) and are
    reported once (``summarize``); restarts (``--max-restarts``) are torchrun's own."""
    import logging

    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    from autoplan.runtime.checkpoint_dir import RUN_ID_ENV
    from autoplan.runtime.worker import LAUNCHED_ENV
    defaults = RANK_ENV_DEFAULTS if defaults is None else defaults
    saved = {k: os.environ.get(k) for k in (RUN_ID_ENV, LAUNCHED_ENV, *defaults)}
    # OMP_NUM_THREADS: torchrun's own default for its ranks, set here so it needs no banner.
    # PYTHONHASHSEED: every Python process draws its own string-hash seed, and a model that
    # loops over a set (HF Gemma 3, ModernBERT) traces its forward in an order that follows
    # it; plans find their ops by canonical key whatever the order (planner/op_binding.py),
    # but ranks that also trace alike run their independent ops, and so their collectives,
    # in one order. A seed the user set is kept.
    os.environ.update({RUN_ID_ENV: run_id, LAUNCHED_ENV: "1",
                       **{k: saved[k] or v for k, v in defaults.items()}})
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)        # per-process exit lines: summarized below
    try:
        torchrun(parse_args(cmd[3:]))
        return 0
    except ChildFailedError as e:
        print(summarize(e.failures), file=sys.stderr, flush=True)
        return 1
    except DistNetworkError as e:         # the rendezvous port: the launch's to fix
        from autoplan.errors import AutoplanError
        raise AutoplanError(f"torchrun could not start its rendezvous ({e}); pass a free "
                            "--master-port") from None
    finally:
        quiet.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if checkpoint_dir:
            from pathlib import Path

            from autoplan.runtime.checkpoint_dir import release
            release(Path(checkpoint_dir), run_id)      # every rank has ended


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def summarize(failures: dict[int, Any]) -> str:
    """The failed ranks in a few lines: the first AutoplanError (what the user must fix) once,
    with the ranks that raised the same; else the first error's traceback once. The ranks that
    failed after it (their peers gone, or stopped by torchrun) in one line."""
    seen = []                   # (time_s, rank, typed, headline, traceback)
    for rank, f in failures.items():
        data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        mine = data.get("autoplan") if isinstance(data.get("autoplan"), dict) else None
        if mine:
            head = str(mine.get("error")) if mine.get("typed") else \
                f"{mine.get('type')}: {mine.get('error')}"
            stack = (data.get("message") or {}).get("extraInfo", {}).get("py_callstack", "") \
                if isinstance(data.get("message"), dict) else ""
            seen.append((float(mine.get("time_s", f.timestamp)), rank, bool(mine.get("typed")),
                         head, stack))
        elif f.exitcode < 0:
            seen.append((float(f.timestamp), rank, False,
                         f"killed by signal {f.signal_name()}", ""))
        else:
            msg = f.message if isinstance(f.message, str) else str(f.message)
            seen.append((float(f.timestamp), rank, False,
                         f"exited with code {f.exitcode}"
                         + (f" ({msg})" if msg and "To enable traceback" not in msg else ""),
                         ""))
    seen.sort()
    typed = [s for s in seen if s[2]]
    first = typed[0] if typed else seen[0]
    same = [s[1] for s in seen if s[3] == first[3]]
    rest = [s for s in seen if s[3] != first[3]]
    lines = []
    if not first[2] and first[4]:
        lines.append(first[4].rstrip())
    lines.append(f"autoplan run: error: {first[3]} ({_ranks(same)})")
    if rest:
        lines.append(f"  {_ranks([s[1] for s in rest])} failed too (the first: {rest[0][3]})")
    return "\n".join(lines)
