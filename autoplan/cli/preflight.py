"""`autoplan run`'s pre-flight: what every rank would refuse, checked once, in this process,
before torchrun starts any rank.

A mistake found by the ranks costs their start-up (15-60 s) and one traceback per rank; found
here it costs the model's build and trace (a second or two) and one message saying what to do.
In the order they are cheap:

1. the arguments (checkpoint flags need ``--checkpoint-dir``, counts are counts);
2. the world size: ``--nnodes`` x ``--nproc-per-node`` against the plan's;
3. the checkpoint folder (``runtime/checkpoint_dir.py``): another job's, another run's, a
   ``--resume`` with nothing to resume;
4. the cluster the ranks will describe (``Cluster.local``, as ``compile`` does) against the
   plan's (``planfile.plan_mismatch``);
5. the model, built as a rank builds it and traced, against the plan's fingerprint and its
   per-op choices (``plan_vs_model.check_plan_against``). A wrong ``--model`` names the plan's;
   a forgotten or wrong ``--layers`` is found by building the plan's layer count and says
   ``--layers N``.

``--print-command`` (a multi-node launch) checks 1, 2 and 5: the folder and the cluster are
those of the nodes that run it.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from typing import Any

from autoplan.errors import AutoplanError, PlanError


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What the checks found: the plan, the ranks per node, and the checkpoint folder's
    answer (None without ``--checkpoint-dir`` or when not checked)."""

    plan: Any
    nproc: int
    start: Any = None


def check_launch(args: argparse.Namespace, *, local: bool = True) -> Launch:
    """Every check above (``local``: also the checkpoint folder and the cluster, which only
    the machine that launches can see). Raises the AutoplanError a rank would, reworded."""
    from autoplan.planner.planfile import plan_from_file
    plan = plan_from_file(args.plan)
    _check_arguments(args)
    nproc = _check_world(plan, args) if not args.elastic else _elastic_nproc(plan, args)
    start = None
    if local and args.checkpoint_dir:
        from autoplan.runtime.checkpoint_dir import plan_start
        start = plan_start(args.checkpoint_dir, resume=args.resume,
                           resume_or_start=args.resume_or_start, overwrite=args.overwrite)
    if local and not args.elastic:       # elastic ranks re-plan for the cluster they find
        _check_cluster(plan, nproc, args)
    _check_model(plan, args)
    gc.collect()                      # the model built here is not the ranks' to keep
    return Launch(plan=plan, nproc=nproc, start=start)


def _check_arguments(args: argparse.Namespace) -> None:
    flags = [f for f, on in (("--checkpoint-every", args.checkpoint_every),
                             ("--resume", args.resume),
                             ("--resume-or-start", args.resume_or_start),
                             ("--overwrite", args.overwrite),
                             ("--async-checkpoint", args.async_checkpoint)) if on]
    if flags and not args.checkpoint_dir:
        raise PlanError(f"{', '.join(flags)} need{'s' if len(flags) == 1 else ''} "
                        "--checkpoint-dir DIR")
    for flag, value, low in (("--checkpoint-every", args.checkpoint_every, 0),
                             ("--max-restarts", args.max_restarts, 0),
                             ("--steps", args.steps, 0), ("--nnodes", args.nnodes, 1),
                             ("--warmup-steps", args.warmup_steps, 0),
                             ("--nproc-per-node", args.nproc_per_node, 1),
                             ("--layers", args.layers, 1), ("--seq-len", args.seq_len, 1)):
        if value is not None and value < low:
            raise PlanError(f"{flag} takes a count >= {low}, got {value}")
    if not 0 <= args.node_rank < args.nnodes:
        raise PlanError(f"--node-rank {args.node_rank} is not one of the {args.nnodes} nodes "
                        f"(0 to {args.nnodes - 1})")
    if not 0 <= args.lr < float("inf"):
        raise PlanError(f"--lr takes a learning rate >= 0, got {args.lr}")
    if not 0 < args.master_port < 65536:
        raise PlanError(f"--master-port takes a TCP port, 1 to 65535, got {args.master_port}")


def _check_world(plan: Any, args: argparse.Namespace) -> int:
    """The ranks per node: the plan's world size over ``--nnodes`` unless given."""
    world, c = plan.config.world_size, plan.cluster
    # a CPU plan's nodes (a mixed CPU cluster's pools, say) may run on one machine: CPU rank
    # processes run a plan on any split of its ranks, its prediction then stale
    # (cluster/hardware.py)
    cpu = c.hardware is not None and c.hardware.device_kind == "cpu"
    if args.nnodes != c.num_nodes and not (cpu and args.nnodes == 1):
        raise PlanError(f"the plan is for {c.num_nodes} node(s) of {c.devices_per_node} devices "
                        f"({c.name}); --nnodes {args.nnodes} does not match: launch on "
                        f"{c.num_nodes} node(s) or re-plan for {args.nnodes}")
    nproc = args.nproc_per_node or world // args.nnodes
    if nproc * args.nnodes != world:
        raise PlanError(f"the plan needs {world} ranks, but --nnodes {args.nnodes} x "
                        f"--nproc-per-node {nproc} makes {nproc * args.nnodes}: drop "
                        f"--nproc-per-node (it defaults to {world // args.nnodes}) or re-plan "
                        f"for {nproc * args.nnodes} ranks (autoplan plan ... --cluster "
                        f"local:{nproc * args.nnodes})")
    return nproc


def _elastic_nproc(plan: Any, args: argparse.Namespace) -> int:
    """The ranks per node of an elastic job: ``--nproc-per-node``, else the plan's devices per
    node. Any number of nodes in ``--nnodes`` goes: the ranks re-plan for the world they get."""
    return args.nproc_per_node or plan.config.world_size // plan.cluster.num_nodes


def _check_cluster(plan: Any, nproc: int, args: argparse.Namespace) -> None:
    """The plan against the cluster the ranks will describe: ``compile(model, "local")`` on
    ``nproc`` ranks per node, as ``runtime/worker.py`` calls it (or ``--cluster``)."""
    from autoplan.cluster import Cluster
    from autoplan.planner.planfile import plan_mismatch
    world = nproc * args.nnodes
    cluster = (Cluster.from_spec(args.cluster) if args.cluster else
               Cluster.local(nproc, nodes=args.nnodes))
    what = plan_mismatch(plan, cluster=cluster,
                         allow_cluster_mismatch=args.allow_cluster_mismatch)
    if what:
        raise PlanError(f"{what}. The ranks would refuse this plan: re-plan for the machine "
                        f"they run on (autoplan plan MODEL --cluster local:{world} here)")


def _trace(args: argparse.Namespace, plan: Any, layers: int | None) -> Any:
    from autoplan.graph.trace import trace
    from autoplan.runtime.packed_data import run_histogram
    from autoplan.runtime.worker import build_run_model
    small = build_run_model(args.model, batch=plan.training.global_batch_size, layers=layers,
                            seq_len=args.seq_len, meta=args.meta, traced_only=True,
                            documents=run_histogram(plan, getattr(args, "seq_lengths", None))
                            ).small
    return trace(small.model, small.example_inputs,
                 loss_fn=small.loss_fn if small.targets is not None else None,
                 targets=small.targets, name=args.model)


def _layers(graph: Any) -> int:
    return len({i.path for b in graph.blocks for i in b.instances})


def _check_model(plan: Any, args: argparse.Namespace) -> None:
    """The model ``--model`` (with ``--layers``/``--seq-len``/``--meta``) builds, traced as the
    ranks trace it, against the plan."""
    from autoplan.planner.plan_vs_model import check_plan_against
    from autoplan.planner.planfile import plan_mismatch
    graph = _trace(args, plan, args.layers)
    what = plan_mismatch(plan, graph=graph)
    if what:
        raise PlanError(_model_advice(plan, args, graph, what))
    check_plan_against(plan, graph)


def _model_advice(plan: Any, args: argparse.Namespace, graph: Any, what: str) -> str:
    """What to do when the model differs: the plan's model name, the plan's layer count (when
    building it gives the plan's model), or the options given to `autoplan plan`."""
    from autoplan.planner.planfile import model_fingerprint
    m = plan.model
    given = f"{graph.num_params:,} parameters, {len(graph.ops):,} ops"
    planned = f"{m.num_params:,} parameters, {m.num_ops:,} ops"
    if m.name != args.model and _buildable(m.name):
        return (f"the plan was made for model {m.name!r} ({planned}); --model {args.model} is "
                f"another model ({given}). Run it with --model {m.name}, or plan "
                f"{args.model}: autoplan plan {args.model} ...")
    want, have = len(plan.recompute), _layers(graph)
    if want and have and want != have and want != args.layers:
        try:
            fits = model_fingerprint(plan, _trace(args, plan, want)) == m.fingerprint
        except AutoplanError:
            fits = False
        if fits:
            default = " (its default)" if args.layers is None else f" (--layers {args.layers})"
            return (f"the plan was made for {m.name} with {want} layers; this {args.model} has "
                    f"{have}{default}. Run with --layers {want}, as the plan was made")
        return (f"the plan's model has {want} layers, this {args.model} {have}: pass the "
                f"--layers (and --seq-len) given to `autoplan plan` ({what})")
    return (f"{what}. Pass `autoplan run` the --layers, --seq-len and --meta the plan was made "
            f"with (the plan's model: {m.name}, {planned}), or re-plan this model")


def _buildable(name: str) -> bool:
    """``name`` is something ``--model`` takes (an example or package.module:function)."""
    if ":" in name:
        return True
    from autoplan.models.registry import list_examples
    return name in list_examples()
