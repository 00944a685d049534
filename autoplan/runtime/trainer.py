"""``autoplan.compile``: a plan becomes a training step on torch.distributed.

``compile`` runs on every rank of a ``torchrun`` job (or alone for a one-process plan). Before
any collective it traces the model and checks the plan against it and the cluster (fingerprints,
world size, what this runtime can run), so a wrong plan fails fast on every rank with the same
message. Then it joins the process group and hands over to ``build.build_rank``, the one ordered
path from a plan to this rank's ``Trainer`` (``steps.py``), whose ``step`` computes what
single-device training computes.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.cost.host_allocator import keep_freed_host_memory
from autoplan.errors import PlanError
from autoplan.estimate.estimator import schedule_refusal
from autoplan.planner.loading import load_plan
from autoplan.planner.plan_vs_model import check_plan_against
from autoplan.planner.planfile import Plan, plan_mismatch, stale_prediction
from autoplan.runtime.batch_check import BatchSpec
from autoplan.runtime.checkpoint_held import optimizer_slots
from autoplan.runtime.float8 import float8_refusal
from autoplan.runtime.grads import LossScaler
from autoplan.runtime.lowbit_optim import require_library
from autoplan.runtime.steps import Trainer
from autoplan.cluster import Cluster
from autoplan.estimate.arguments import batch_arg, cluster_arg
from autoplan.graph.trace import trace
from autoplan.runtime.build import BuildInputs, build_rank
from autoplan.planner.search import plan as make_plan
from autoplan.planner.search_space import selective_compiles
from autoplan.sharding.parallel_config import SPLIT_BACKWARD

COLLECTIVE_TIMEOUT_S = int(os.environ.get("AUTOPLAN_COLLECTIVE_TIMEOUT_S", "120"))
ELASTIC_ENV = "AUTOPLAN_ELASTIC"     # set by the worker under --elastic (runtime/elastic.py)


def init_distributed(backend: str, *, single: bool = False) -> tuple[int, int]:
    """(rank, world size); starts the process group from torchrun's environment when needed.
    Collectives time out (``AUTOPLAN_COLLECTIVE_TIMEOUT_S``, default 120 s) so that a dead rank
    fails the job instead of hanging it. ``single``: start a one-process group when there is no
    job (FSDP2 needs one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo's connection setup can wait forever for a peer that never connects (seen when
        # torchrun restarts a job after a rank died; its listener side drops the timeout): a
        # rank that cannot join in time exits, so that torchrun restarts or fails the job
        watchdog = threading.Timer(COLLECTIVE_TIMEOUT_S, _join_timed_out)
        watchdog.daemon = True
        watchdog.start()
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        try:
            store = _attempt_store(timeout)
            if store is None:
                dist.init_process_group(backend=backend, timeout=timeout)
            else:
                dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                        rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
        finally:
            watchdog.cancel()
        return dist.get_rank(), dist.get_world_size()
    if single:        # one process whose plan runs FSDP2 (parameter offload) needs a group
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    return 0, 1


def _attempt_store(timeout: datetime.timedelta) -> Any:
    """Under torchrun, the rendezvous store of this attempt: the job's TCP store under a
    prefix of the restart count. torchrun's static rendezvous keeps one store across restarts,
    so without it a restarted rank can read the address a dead rank of the last attempt
    published, and gloo's connection to it is refused until the timeout (every restart of a
    job failed so). None outside torchrun (the default env:// rendezvous)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if os.environ.get(ELASTIC_ENV) and not agent:
        # elastic: the agents' restart counts differ (a restart for a node that joins counts
        # none), so no prefix of them is one every rank takes; `autoplan run --elastic` has
        # rank 0 host a fresh store on a fresh port every round
        # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), where no earlier attempt left a key
        return None
    rank = int(os.environ["RANK"])
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        int(os.environ["WORLD_SIZE"]), is_master=not agent and rank == 0,
                        timeout=timeout, multi_tenant=not agent)
    return dist.PrefixStore(f"autoplan/attempt_{attempt}", tcp)


def _join_timed_out() -> None:
    import sys
    print(f"autoplan: rank {os.environ.get('RANK', '?')} could not join the process group in "
          f"{COLLECTIVE_TIMEOUT_S} s (AUTOPLAN_COLLECTIVE_TIMEOUT_S); exiting so that torchrun "
          "can restart the job (--max-restarts) or report it", file=sys.stderr, flush=True)
    os._exit(3)


def compile(model: nn.Module, cluster: Any = "local", *, example_inputs: Sequence[Any],
            optimizer: Callable[[Any], Any], global_batch_size: int,
            loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            example_targets: Any = None, plan: Plan | str | os.PathLike | None = None,
            precision: str = "fp32", seed: int = 0,
            lr_scheduler: Callable[[Any], Any] | None = None,
            max_grad_norm: float | None = None, loss_scaler: LossScaler | None = None,
            resume: str | os.PathLike | None = None, allow_cluster_mismatch: bool = False,
            **plan_kwargs: Any) -> Any:
    """Build the sharded training program of ``plan`` (or plan now when None) on this rank.

    ``cluster``: ``"local"`` (the machines of this torchrun job, as discovered), a Cluster or a
    spec (``"dgx-h100:2"``, a file). A given plan must be for its hardware (device, memory,
    nodes, devices per node, links; not the name); ``allow_cluster_mismatch=True`` runs a plan
    made for other hardware of the same world size, and ``trainer.stale_prediction`` (also
    printed by rank 0) says for what hardware its prediction is ("" when it is for this one).

    ``model`` may live on the meta device: it is materialized module by module, each rank
    keeping only its shards. ``optimizer`` is a factory ``params -> torch.optim.Optimizer``.
    Every rank computes the same plan when none is given (planning is deterministic), so no
    broadcast is needed. After ``compile`` the user's model holds this rank's shards.

    ``lr_scheduler`` is a factory ``torch optimizer -> LR scheduler`` (stepped after every
    optimizer step). ``max_grad_norm`` clips the gradients by their global norm over the whole
    model, whatever the sharding (``trainer.last_grad_norm`` is the norm before clipping). fp16
    plans scale the loss dynamically (``loss_scaler``, default ``LossScaler()``), every rank
    agreeing on skipped steps. ``resume`` names a checkpoint (a root saved by ``trainer.save``, whose
    latest is taken, or one step directory), saved under this plan or any other: the model,
    optimizer, step count, RNG and scheduler continue from it.
    """
    cluster = Cluster.local_job() if cluster == "local" else cluster_arg(cluster, "compile()")
    trainer = _compile(model, cluster, example_inputs=example_inputs, optimizer=optimizer,
                       global_batch_size=global_batch_size, loss_fn=loss_fn,
                       example_targets=example_targets, plan=plan, precision=precision,
                       seed=seed, allow_cluster_mismatch=allow_cluster_mismatch, **plan_kwargs)
    trainer.stale_prediction = stale_prediction(trainer.plan, cluster)
    if trainer.stale_prediction and trainer.rank == 0:
        import sys
        print(f"autoplan: {trainer.stale_prediction}", file=sys.stderr, flush=True)
    trainer.batch_spec = BatchSpec.of(example_inputs, example_targets, loss_fn=loss_fn,
                                      global_batch_size=trainer.plan.training.global_batch_size,
                                      device=trainer.device, pipelined=trainer.config.pp > 1)
    if lr_scheduler is not None:
        trainer.lr_schedulers = [lr_scheduler(o) for o, _ in optimizer_slots(trainer.optimizer)]
    if max_grad_norm is not None:
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise PlanError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        trainer.max_grad_norm = float(max_grad_norm)
    if loss_scaler is None and trainer.config.precision == "fp16":
        loss_scaler = LossScaler()
    trainer.loss_scaler = loss_scaler
    if resume is not None:
        trainer.load(resume)
    return trainer


def _compile(model: nn.Module, cluster: Any, *, example_inputs: Sequence[Any],
             optimizer: Callable[[Any], Any], global_batch_size: int,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None, example_targets: Any,
             plan: Plan | str | os.PathLike | None, precision: str, seed: int,
             allow_cluster_mismatch: bool = False,
             **plan_kwargs: Any) -> Any:
    """The rank's Trainer, in order: the arguments checked; the model traced and the plan made,
    loaded or checked against it; what this runtime cannot run refused; the job's batch and
    world size checked: all before any collective, so a wrong plan fails on every rank with
    the same message. Then the process group and device, and ``build.build_rank``."""
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    global_batch_size = batch_arg(global_batch_size, "compile()")
    if not callable(optimizer):
        raise PlanError("compile(): optimizer must be a factory params -> torch.optim."
                        "Optimizer, e.g. lambda ps: torch.optim.AdamW(ps, lr=3e-4)")
    cluster = (Cluster.local(world_env) if cluster == "local"
               else cluster_arg(cluster, "compile()"))
    graph = trace(model, example_inputs,
                  loss_fn=loss_fn if example_targets is not None else None,
                  targets=example_targets)
    plan = _plan_for(graph, cluster, plan, global_batch_size=global_batch_size,
                     precision=precision, allow_cluster_mismatch=allow_cluster_mismatch,
                     **plan_kwargs)
    _refuse_unrunnable(plan, has_loss=loss_fn is not None and example_targets is not None,
                       device=_rank_device(cluster))
    _check_job(plan, global_batch_size=global_batch_size, world_env=world_env)
    rank, device = _join(cluster, plan)
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    return build_rank(BuildInputs(model=model, graph=graph, plan=plan,
                                  example_inputs=example_inputs,
                                  example_targets=example_targets, loss_fn=loss_fn,
                                  optimizer=optimizer, device=device, rank=rank, seed=seed))


def _plan_for(graph: Any, cluster: Any, plan: Plan | str | os.PathLike | None, *,
              global_batch_size: int, precision: str, allow_cluster_mismatch: bool,
              **plan_kwargs: Any) -> Plan:
    """The plan to run: made now (None), loaded from a file, or a given Plan checked to be for
    this model and cluster; then checked op by op against the traced graph (a hand-edited plan
    is refused before any collective)."""
    if plan is None:
        plan = make_plan(graph, cluster, global_batch_size=global_batch_size,
                         precision=precision, **plan_kwargs)
    elif not isinstance(plan, Plan):
        plan = load_plan(plan, graph=graph, cluster=cluster,
                         allow_cluster_mismatch=allow_cluster_mismatch)
    else:
        what = plan_mismatch(plan, graph=graph, cluster=cluster,
                             allow_cluster_mismatch=allow_cluster_mismatch)
        if what:
            raise PlanError(f"{what}. Re-plan with autoplan.plan(...) for this model and "
                            "cluster (or compile(..., plan=None) to plan now)")
    check_plan_against(plan, graph)
    return plan


def _refuse_unrunnable(plan: Plan, *, has_loss: bool,
                       device: torch.device = torch.device("cpu")) -> None:
    """PlanError for what the planner may price but this runtime cannot run on ``device``
    (the one this rank will take)."""
    cfg = plan.config
    if cfg.tp_comm_overlap:
        raise PlanError("the plan prices tensor-parallel communication pipelined with its GEMMs "
                        "(tp_comm_overlap, as Megatron-LM's --tp-comm-overlap), which this "
                        "runtime cannot run: it needs fused GEMM + collective kernels (CUDA "
                        "symmetric memory). Re-plan without forcing tp_comm_overlap")
    if cfg.mixed_precision == "params" and cfg.precision != "fp32":
        _refuse_master_weights_with(cfg)
    if cfg.offload_nvme:
        raise PlanError("the plan keeps its offloaded model state on NVMe (offload_nvme, "
                        "ZeRO-Infinity), which this runtime does not run: it offloads to host "
                        "memory only (FSDP2's CPU offload). Re-plan with --force "
                        "offload_nvme=false (force={'offload_nvme': False}), on more nodes or "
                        "on nodes with more host memory, or run it with DeepSpeed's "
                        "ZeRO-Infinity")
    why = float8_refusal(cfg, device)
    if why:
        raise PlanError(why)
    require_library(cfg.optimizer_state)      # torchao, for 8-bit or bf16 Adam states
    why = schedule_refusal(cfg, cfg.microbatches(plan.training.global_batch_size))
    if why:                   # (torch's schedule would raise, on every rank, mid-build)
        raise PlanError(f"this plan cannot run: {why}, and re-plan")
    if cfg.pp > 1 and not has_loss:
        raise PlanError("a pipelined plan needs loss_fn and example_targets: the last stage "
                        "computes the loss")
    if cfg.split_backward_on_fsdp_unsupported:
        raise PlanError(f"this plan runs the {cfg.schedule} schedule on FSDP2-sharded stages "
                        f"(zero_stage {cfg.zero_stage}" + (", offload_params" if
                                                           cfg.offload_params else "")
                        + "), which this runtime cannot: with each backward split in two, "
                        "torch's weight-gradient pass misses weights FSDP2 resharded after "
                        "forward, or shared by two chunks of a rank (torch 2.13). Re-plan "
                        "with zero_stage <= 1, ZeRO-2 with zero_bubble, or another schedule "
                        "(force schedule=1f1b or interleaved_1f1b)")
    if ({"selective", "ops"} & set(plan.recompute.values())
            and not selective_compiles(cfg)):
        raise PlanError("the plan compiles its layers and recomputes some selectively (policy "
                        "'selective' or 'ops') while "
                        "they hold collectives (tp, cp or ep > 1): torch.compile cannot trace "
                        "such a layer whole, and the selective policy cannot run inside "
                        "compiled code. Re-plan (the planner offers recompute 'full' or 'none' "
                        "there), or force compiled=false or recompute=full")


def _refuse_master_weights_with(cfg: Any) -> None:
    """PlanError for what 16-bit weights with an fp32 master copy (mixed_precision="params")
    do not run with yet: zero-bubble schedules, the sequence and expert axes."""
    what = [name for name, on in (
        (f"the {cfg.schedule} schedule (its weight gradients bypass the fp32 main grads)",
         cfg.pp > 1 and cfg.schedule in SPLIT_BACKWARD),
        (f"context parallelism (cp={cfg.cp})", cfg.cp > 1),
        (f"expert parallelism (ep={cfg.ep})", cfg.ep > 1)) if on]
    if what:
        raise PlanError(f"the plan holds {cfg.precision} weights with the fp32 master copy in "
                        "the optimizer (mixed_precision='params', as Megatron-LM's --bf16) "
                        f"together with {', '.join(what)}, which this runtime does not run "
                        "with 16-bit weights yet (it runs them under dp, ZeRO-1/2/3, tp, offload "
                        "and the 1F1B/GPipe/interleaved pipelines). "
                        "Re-plan with --force mixed_precision=autocast, or without "
                        f"{', '.join(what)}")


def _check_job(plan: Plan, *, global_batch_size: int, world_env: int) -> None:
    """PlanError when the plan is for another global batch or another number of processes
    than this job launched (checked before the process group starts)."""
    if plan.training.global_batch_size != global_batch_size:
        raise PlanError(f"the plan is for a global batch of {plan.training.global_batch_size}, "
                        f"compile() got {global_batch_size}")
    if plan.config.world_size != world_env and dist.is_initialized() is False:
        raise PlanError(f"the plan needs {plan.config.world_size} processes but this job has "
                        f"{world_env}; launch with torchrun --nproc-per-node "
                        f"{plan.config.world_size} (or `autoplan run`)")


def _rank_device(cluster: Any) -> torch.device:
    """The device this rank runs on: its local GPU on a GPU cluster, else the CPU."""
    return (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if cluster.device.kind == "gpu" and torch.cuda.is_available()
            else torch.device("cpu"))


def _join(cluster: Any, plan: Plan) -> tuple[int, torch.device]:
    """(rank, device): this process joins the job's process group (a one-process group for an
    offloading plan alone) and takes its device (its local GPU on a GPU cluster)."""
    if cluster.device.kind == "cpu":
        keep_freed_host_memory()   # gradients and activations stay mapped between steps
    rank, world = init_distributed(cluster.backend, single=plan.config.offload_params)
    if world != plan.config.world_size:
        raise PlanError(f"the plan needs {plan.config.world_size} ranks, the job has {world}")
    device = _rank_device(cluster)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return rank, device


# Trainer: re-exported for ``autoplan.Trainer`` (``autoplan/__init__.py`` takes it from here)
__all__ = ["COLLECTIVE_TIMEOUT_S", "Trainer", "compile", "init_distributed"]
