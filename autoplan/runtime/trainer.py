"""``autoplan.compile``: a plan becomes a training step on torch.distributed.

``compile`` runs on every rank of a ``torchrun`` job (or alone for a one-process plan). Before
any collective it traces the model and checks the plan against it and the cluster (fingerprints,
world size), so a wrong plan fails fast on every rank with the same message. Then it builds the
device mesh and this rank's program (``emit``: the traced graph running the plan's per-op
strategies on local tensors), and returns a ``Trainer`` whose ``step`` computes what
single-device training computes: the rank's data-parallel slice of the global batch, in
micro-batches (gradient accumulation), losses averaged the same way.

Order, and why (the order torchtitan uses):
1. the rank program first: it shards the weights over the tensor-parallel axis, which every
   later step must see;
2. activation recomputation per layer next: it must sit inside FSDP's units, so that FSDP's
   all-gathers bracket the recomputation too;
3. data parallelism last: FSDP2 ``fully_shard`` per layer then the root (ZeRO-2/3), or DDP
   (ZeRO-0/1); weights replicated over the tensor-parallel axis whose gradients are partial
   there are all-reduced over it once per step.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.cost.host_allocator import keep_freed_host_memory
from autoplan.errors import AutoplanError, PlanError
from autoplan.graph.loss import TokenMeanLoss, step_weights, token_mean_loss
from autoplan.planner.loading import load_plan
from autoplan.planner.plan_check import check_plan_against
from autoplan.planner.planfile import Plan
from autoplan.runtime import parallelize as par
from autoplan.runtime.batch_check import BatchSpec, check_batch
from autoplan.runtime.checkpoint import Checkpointing, optimizer_slots
from autoplan.runtime.grads import GradientStep, LossScaler, finish_step
from autoplan.runtime.health import for_job
from autoplan.runtime.optim import (
    DataParallelGrads,
    HostOffloadOptimizer,
    TensorParallelGrads,
    TensorShardedOptimizer,
    wait_gathers,
)

COLLECTIVE_TIMEOUT_S = int(os.environ.get("AUTOPLAN_COLLECTIVE_TIMEOUT_S", "120"))


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


@dataclass
class Trainer(Checkpointing, GradientStep):
    """A compiled plan on this rank: ``step(batch)`` trains one global batch; ``save(dir)``
    checkpoints it (``checkpoint.py``)."""

    model: nn.Module                  # the rank program (maybe DDP-wrapped), FQNs as the user's
    optimizer: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    plan: Plan
    rank: int
    dp_index: int
    dp_group: Any                     # the ranks that average gradients: dp (x cp)
    tp_grads: TensorParallelGrads | None
    loss_in_program: bool             # the program computes the loss itself
    device: torch.device
    autocast_dtype: torch.dtype | None
    health: Any = None                         # names a dead peer (runtime/health.py)
    steps_done: int = 0
    tp_comm: Any = None                        # the tensor-parallel axis (for state dicts)
    placements: dict[str, Any] = field(default_factory=dict)    # FQN -> tp placement
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    lr_schedulers: list[Any] = field(default_factory=list)
    checkpointer: Any = None
    max_grad_norm: float | None = None
    loss_scaler: LossScaler | None = None
    last_grad_norm: float | None = None
    shared_elsewhere: frozenset[str] = frozenset()
    experts: frozenset[str] = frozenset()     # expert weights split over the ep group
    ep_comm: Any = None                        # the expert-parallel group (ep > 1)
    # gradients no DDP or FSDP averages: expert slabs' (over the ranks holding them), scalar
    # weights' under FSDP (over dp: fully_shard refuses them)
    whole_grads: tuple[DataParallelGrads, ...] = ()
    # the loss is a mean over counted targets: micro-batches weighted by their share of them
    token_loss: TokenMeanLoss | None = None
    cp_index: int = 0                          # this rank's piece of the sequence (cp > 1)
    batch_spec: BatchSpec | None = None        # what step() takes (runtime/batch_check.py)

    @property
    def config(self):
        return self.plan.config

    def _slices(self, batch: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        cfg = self.config
        rows = batch[0].shape[0]
        if rows != self.plan.training.global_batch_size:
            raise PlanError(f"step() got a batch of {rows} samples; the plan is for a global "
                            f"batch of {self.plan.training.global_batch_size}")
        per = rows // cfg.dp
        lo = self.dp_index * per
        mbs = cfg.micro_batch_size
        return [[t[lo + k * mbs: lo + (k + 1) * mbs].to(self.device) for t in batch]
                for k in range(per // mbs)]

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """Forward, backward and optimizer step on the global ``batch`` (inputs..., targets);
        returns the loss averaged over the global batch (the same on every rank). If a peer
        rank dies, raises ``RankFailure`` naming it."""
        batch = check_batch(self.batch_spec, batch)
        return guarded(self, self._step, batch)

    def _step(self, batch: Sequence[torch.Tensor]) -> float:
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        chunks = self._slices(list(batch))
        total = torch.zeros((), dtype=torch.float64)
        no_sync = getattr(self.model, "no_sync", None)
        scale = self.loss_scale
        weights = _weights(self.token_loss, batch, self.dp_index, self.config)
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            if last:                  # their buckets go out as the last backward fills them
                for grads in self.whole_grads:
                    grads.arm()
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            f = scale * weights[k] if weights else scale
            # context parallelism: each cp rank's gradient is its tokens' part, and the dp x cp
            # average divides by cp as well (``sharding/context_axis.py``)
            f *= self.config.cp
            with ctx:
                loss = self._loss(chunk)
                (loss * (f / len(chunks)) if f != 1.0 else loss / len(chunks)).backward()
            total += float(loss.detach()) * (weights[k] if weights else 1.0)
        if self.tp_grads is not None:
            self.tp_grads.all_reduce()
        for grads in self.whole_grads:
            grads.all_reduce()
        finish_step(self)
        mean = total / len(chunks)
        if self.dp_group is not None and self.config.grad_degree > 1:
            t = mean.to(torch.float64).reshape(1)
            dist.all_reduce(t, group=self.dp_group)      # cp ranks hold the same loss
            mean = t[0] / self.config.grad_degree
        return float(mean)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers as full tensors (gathered over dp and tp), on the CPU, on
        every rank (a collective: every rank calls it)."""
        from autoplan.runtime.state import gather_tensor_parallel
        wait_gathers(self.optimizer)
        from autoplan.runtime.experts import gather_slabs
        sd = gather_slabs(par.full_state_dict(self.model), self.experts, self.ep_comm)
        return gather_tensor_parallel(sd, self.placements, self.aliases, self.tp_comm)

    def _loss(self, chunk: list[torch.Tensor]) -> torch.Tensor:
        amp = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        with amp:
            if self.loss_in_program:
                return self.model(*chunk)
            if self.loss_fn is None:
                return self.model(*chunk)
            out = self.model(*chunk[:-1])
            return self.loss_fn(out, chunk[-1])


def guarded(trainer: Any, step: Callable[[Any], float], batch: Any) -> float:
    """Run one step; a collective that fails because a peer stopped becomes a RankFailure
    naming that peer (``health.py``)."""
    status = f"step {trainer.steps_done}"
    if trainer.health is not None:
        trainer.health.mark(status)
    try:
        loss = step(batch)
    except AutoplanError:
        raise
    except RuntimeError as e:
        if trainer.health is not None and _peer_failure(e):
            raise trainer.health.fail(status, e) from e
        raise
    trainer.steps_done += 1
    return loss


def _peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "peer", "socket"))


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
    from autoplan.cluster import Cluster
    from autoplan.estimate.arguments import cluster_arg
    from autoplan.planner.planfile import stale_prediction
    cluster = Cluster.local_job() if cluster == "local" else cluster_arg(cluster, "compile()")
    trainer = _compile(model, cluster, example_inputs=example_inputs, optimizer=optimizer,
                       global_batch_size=global_batch_size, loss_fn=loss_fn,
                       example_targets=example_targets, plan=plan, precision=precision,
                       seed=seed, allow_cluster_mismatch=allow_cluster_mismatch, **plan_kwargs)
    trainer.batch_spec = BatchSpec.of(example_inputs, example_targets, loss_fn=loss_fn,
                                      global_batch_size=trainer.plan.training.global_batch_size,
                                      device=trainer.device, pipelined=trainer.config.pp > 1)
    trainer.stale_prediction = stale_prediction(trainer.plan, cluster)
    if trainer.stale_prediction and trainer.rank == 0:
        import sys
        print(f"autoplan: {trainer.stale_prediction}", file=sys.stderr, flush=True)
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
    from autoplan.cluster import Cluster
    from autoplan.estimate.arguments import batch_arg, cluster_arg
    from autoplan.graph.trace import trace
    from autoplan.planner.search import plan as make_plan
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
    if plan is None:
        plan = make_plan(graph, cluster, global_batch_size=global_batch_size,
                         precision=precision, **plan_kwargs)
    elif not isinstance(plan, Plan):
        plan = load_plan(plan, graph=graph, cluster=cluster,
                         allow_cluster_mismatch=allow_cluster_mismatch)
    else:
        from autoplan.planner.planfile import plan_mismatch
        what = plan_mismatch(plan, graph=graph, cluster=cluster,
                             allow_cluster_mismatch=allow_cluster_mismatch)
        if what:
            raise PlanError(f"{what}. Re-plan with autoplan.plan(...) for this model and "
                            "cluster (or compile(..., plan=None) to plan now)")
    check_plan_against(plan, graph)          # a hand-edited plan: refused before any collective
    if plan.config.tp_comm_overlap:
        raise PlanError("the plan prices tensor-parallel communication pipelined with its GEMMs "
                        "(tp_comm_overlap, as Megatron-LM's --tp-comm-overlap), which this "
                        "runtime cannot run: it needs fused GEMM + collective kernels (CUDA "
                        "symmetric memory). Re-plan without forcing tp_comm_overlap")
    if plan.config.mixed_precision != "autocast" and plan.config.precision != "fp32":
        raise PlanError(f"the plan prices {plan.config.precision} weights and activations with an "
                        f"fp32 master copy in the optimizer (mixed_precision="
                        f"{plan.config.mixed_precision!r}, as Megatron-LM's --bf16), which this "
                        "runtime does not run: it keeps fp32 weights and trains under "
                        "torch.autocast. Re-plan without forcing mixed_precision")
    if plan.training.global_batch_size != global_batch_size:
        raise PlanError(f"the plan is for a global batch of {plan.training.global_batch_size}, "
                        f"compile() got {global_batch_size}")
    if plan.config.world_size != world_env and dist.is_initialized() is False:
        raise PlanError(f"the plan needs {plan.config.world_size} processes but this job has "
                        f"{world_env}; launch with torchrun --nproc-per-node "
                        f"{plan.config.world_size} (or `autoplan run`)")
    if cluster.device.kind == "cpu":
        keep_freed_host_memory()   # gradients and activations stay mapped between steps
    rank, world = init_distributed(cluster.backend, single=plan.config.offload_params)
    if world != plan.config.world_size:
        raise PlanError(f"the plan needs {plan.config.world_size} ranks, the job has {world}")
    cfg = plan.config
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if cluster.device.kind == "gpu" and torch.cuda.is_available()
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    precision_dtype = _dtype(cfg.precision) if cfg.precision != "fp32" else None

    if cfg.pp > 1:
        from autoplan.runtime.pipeline import compile_pipelined
        return compile_pipelined(
            model, graph, plan, device=device, optimizer=optimizer, loss_fn=loss_fn, seed=seed,
            rank=rank, example_inputs=example_inputs, example_targets=example_targets,
            precision_dtype=precision_dtype)
    where = cfg.indices(rank)
    tp_index, dp_index, cp_index = where["tp"], where["dp"], where["cp"]
    ep_index = dp_index % cfg.ep
    dp_group = tp_group = fsdp_mesh = ep_group = edp_group = cp_group = None
    if world > 1 or cfg.offload_params:
        mesh, dp_mesh, fsdp_mesh = par.plan_mesh(device.type, cfg)
        dp_group, tp_group = dp_mesh.get_group(), mesh["tp"].get_group()
        if cfg.ep > 1:
            ep_group, edp_group = mesh["ep"].get_group(), mesh["edp"].get_group()
        if cfg.cp > 1:
            cp_group = mesh["cp"].get_group()
    # 1. the rank program: the traced graph with the plan's per-op strategies on local tensors
    from autoplan.runtime.emit import connect, emit
    rp = emit(model, plan, graph, example_inputs=example_inputs,
              example_targets=example_targets, loss_fn=loss_fn, t=cfg.tp, tp_rank=tp_index,
              device=device, seed=seed, ep=(cfg.ep, ep_index), cp=cfg.cp)
    connect(rp.program.comm_slot, tp=(tp_group, cfg.tp, tp_index),
            dp=(dp_group, cfg.grad_degree, dp_index * cfg.cp + cp_index),
            ep=(ep_group, cfg.ep, ep_index), cp_slot=rp.program.cp_slot,
            cp=(cp_group, cfg.cp, cp_index))
    from autoplan.runtime.experts import expert_parameters
    experts = expert_parameters([rp.module], graph, cfg.ep)     # before FSDP wraps the rest
    program = rp.module
    # 2. activation recomputation per layer
    par.apply_recompute(program, {p: pol for p, pol in plan.recompute.items()
                                  if p in set(rp.layers)})
    # 3. data parallelism / ZeRO over the dp group; parameter offload is FSDP2's CPU offload,
    #    also over a dp axis of one rank
    use_fsdp = cfg.uses_fsdp
    whole_grads: list[DataParallelGrads] = []
    if use_fsdp:
        mp = None
        if precision_dtype is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mp = MixedPrecisionPolicy(param_dtype=precision_dtype, reduce_dtype=torch.float32)
        # the weights the plan keeps whole (dp_whole) stay out of FSDP like scalars
        scalars = par.apply_fsdp(program, rp.layers, fsdp_mesh, reshard=cfg.zero_stage == 3,
                                 mp_policy=mp, offload=cfg.offload_params,
                                 experts=experts.values(),
                                 expert_mesh=mesh["edp"] if experts else None,
                                 whole=par.whole_parameters(program, cfg.keeps_whole))
        if scalars and cfg.grad_degree > 1:
            whole_grads.append(DataParallelGrads(scalars, dp_group, cfg.grad_degree))
    tp_grads = (TensorParallelGrads([program], rp.program.step_params, tp_group)
                if cfg.tp > 1 and rp.program.step_params else None)
    if experts and not (use_fsdp and par.shards_experts(mesh["edp"])):
        # the experts' gradients hold every ep peer's tokens: averaged over the ranks that
        # hold the same experts, not by DDP over all of dp (FSDP does it in its units)
        whole_grads.append(DataParallelGrads(list(experts.values()), edp_group, cfg.dp))
    for grads in whole_grads:        # sent behind the last backward, as DDP's buckets
        grads.overlap_with_backward()
    if cfg.grad_degree > 1 and not use_fsdp:
        program = par.ddp(program, dp_group, {id(p) for p in experts.values()})
    params = [p for p in program.parameters() if p.requires_grad]
    factory = optimizer
    if cfg.offload_optimizer and not cfg.offload_params:   # FSDP's offload carries the state
        factory = partial(HostOffloadOptimizer, factory=optimizer)
    if cfg.grad_degree > 1 and cfg.zero_stage == 1:
        opt = TensorShardedOptimizer(params, factory, dp_group,
                                     groups={id(p): edp_group for p in experts.values()})
        # the updated weights arrive behind the next forward, layer by layer (as priced)
        opt.overlap_with_forward([rp.module], [rp.module.get_submodule(p) for p in rp.layers])
    else:
        opt = factory(params)
    # under FSDP too: its mixed precision casts the weights, but a traced graph keeps the casts
    # the model made when it was traced in fp32 (HF's RMSNorm upcasts and casts back to the
    # traced dtype), and only autocast reconciles those with the bf16 weights
    autocast = precision_dtype
    return Trainer(model=program, optimizer=opt, loss_fn=loss_fn, plan=plan, rank=rank,
                   dp_index=dp_index, dp_group=dp_group, tp_grads=tp_grads,
                   loss_in_program=rp.with_loss, device=device, autocast_dtype=autocast,
                   tp_comm=rp.program.comm_slot.comm, placements=rp.program.state,
                   aliases=rp.aliases, health=for_job(rank, world),
                   experts=frozenset(experts), ep_comm=rp.program.comm_slot.ep,
                   whole_grads=tuple(whole_grads), token_loss=token_mean_loss(graph),
                   cp_index=cp_index)


def _weights(loss: TokenMeanLoss | None, batch: Sequence[torch.Tensor], dp_index: int,
             cfg: Any) -> list[float] | None:
    """Per micro-batch of this rank, the factor on its mean loss (``graph/loss.py``)."""
    if loss is None or loss.target_input >= len(batch):
        return None
    return step_weights(loss, batch[loss.target_input], dp_index, cfg.dp,
                        cfg.micro_batch_size)


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
