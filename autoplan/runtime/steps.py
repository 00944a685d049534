"""The compiled plan on one rank: ``Trainer.step(batch)`` trains one global batch.

One Trainer for every plan. What differs between a plan with pipelines and one without is how
the rank's slice of the batch goes through its stages, so that part is a runner:

- ``LocalSteps`` (no pipeline): the slice in micro-batches, gradients accumulated (DDP's
  all-reduce held back until the last one), the losses averaged as one device averages them;
- ``PipelineSteps`` (pp > 1): the slice handed to the plan's schedule
  (``torch.distributed.pipelining``), whose last stage computes the loss, broadcast over the
  pipeline.

The rest is the same for both and runs in this order: the batch checked against the traced one
(``batch_check``), the rank's data-parallel slice taken, the runner's forward and backward, the
gradient reductions no wrapper did (tensor-parallel partial gradients, whole weights, tied
weights across pipeline ranks, expert slabs), the update (``grads.finish_step``: fp16 loss
scaling, clipping, the optimizer, LR schedules), the loss averaged over data parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import AutoplanError, PlanError
from autoplan.graph.loss import TokenMeanLoss, step_weights
from autoplan.graph.trace import float_outputs, sixteen_bit_inputs
from autoplan.runtime.batch_check import BatchSpec, check_batch
from autoplan.runtime.checkpoint import Checkpointing
from autoplan.runtime.grads import GradientStep, LossScaler, finish_step
from autoplan.runtime.optim import local_tensor, wait_gathers
from autoplan.runtime.master_weights import grad_of
from autoplan.runtime.experts import gather_slabs
from autoplan.runtime.parallelize import full_state_dict, keep_gathered
from autoplan.runtime.state import gather_tensor_parallel


@dataclass
class LocalSteps:
    """A plan without pipelines: the rank's slice in micro-batches through its one stage."""

    module: nn.Module                  # the rank program (maybe DDP-wrapped), user's FQNs
    loss_in_program: bool              # the program computes the loss itself
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    overlapped: tuple[Any, ...] = ()   # gradient syncs sent behind the last backward
    token_loss: TokenMeanLoss | None = None     # micro-batches weighted by counted targets
    weights_dtype: torch.dtype | None = None    # 16-bit weights: 16-bit inputs, fp32 loss

    @property
    def model(self) -> nn.Module:
        return self.module

    def forward_backward(self, trainer: Trainer, batch: list[torch.Tensor],
                         mine: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``mine``; this rank's mean loss."""
        cfg = trainer.config
        mbs = cfg.micro_batch_size
        chunks = [[t[k * mbs:(k + 1) * mbs] for t in mine] for k in range(len(mine[0]) // mbs)]
        # summed where the loss is (float64, as Python floats sum): reading it per micro-batch
        # would wait for the device before the next micro-batch's kernels are queued
        total = torch.zeros((), dtype=torch.float64, device=mine[0].device)
        no_sync = getattr(self.module, "no_sync", None)
        weights = _weights(self.token_loss, batch, trainer.dp_index, cfg)
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            if last:                  # their buckets go out as the last backward fills them
                for grads in self.overlapped:
                    grads.arm()
            if cfg.dp_shares is not None:
                fsdp_once_a_step(self.module, first=k == 0, last=last,
                                 zero3=cfg.zero_stage == 3 or cfg.offload_params)
            elif cfg.zero_stage == 2 and not cfg.offload_params:
                keep_gathered(self.module, last=last)
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            f = trainer.loss_scale * weights[k] if weights else trainer.loss_scale
            # context parallelism: each cp rank's gradient is its tokens' part, and the dp x cp
            # average divides by cp as well (``sharding/context_axis.py``)
            f *= cfg.cp
            with ctx:
                with trainer.autocast():
                    loss = self._loss(chunk)
                (loss * (f / len(chunks)) if f != 1.0 else loss / len(chunks)).backward()
            total += loss.detach().to(torch.float64) * (weights[k] if weights else 1.0)
        return total / len(chunks)

    def _loss(self, chunk: list[torch.Tensor]) -> torch.Tensor:
        sixteen = self.weights_dtype
        if self.loss_in_program or self.loss_fn is None:
            if sixteen is not None:      # (the targets too without a loss: the model's own)
                last = [] if self.loss_fn is None else chunk[-1:]
                chunk = [*sixteen_bit_inputs(chunk[:len(chunk) - len(last)], sixteen), *last]
            return self.module(*chunk)
        if sixteen is None:
            return self.loss_fn(self.module(*chunk[:-1]), chunk[-1])
        out = self.module(*sixteen_bit_inputs(chunk[:-1], sixteen))
        return self.loss_fn(float_outputs(out), chunk[-1])

    def mean_loss(self, trainer: Trainer, local: torch.Tensor) -> torch.Tensor:
        return local


@dataclass
class PipelineSteps:
    """A pipelined plan: the rank's slice through the plan's schedule over its chunks."""

    chunks: dict[int, nn.Module]          # chunk index -> this rank's module
    schedule: Any
    loss_out: Any                         # the schedule's loss function (LossPassesThrough)
    pp_group: Any
    last_stage_rank: int                  # global rank holding the last chunk in this group
    # when one weight sits in two of this rank's chunks (V schedules: the LM head tied to the
    # embedding), torch's per-stage scaling would divide its gradient twice: these are then
    # averaged over the micro-batches here, once each, and the schedule scales nothing
    average_here: list[nn.Parameter] = field(default_factory=list)
    weights_dtype: torch.dtype | None = None    # 16-bit weights: 16-bit inputs to chunk 0

    @property
    def model(self) -> nn.ModuleList:
        return nn.ModuleList(self.chunks[c] for c in sorted(self.chunks))

    def forward_backward(self, trainer: Trainer, batch: list[torch.Tensor],
                         mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """The schedule over this rank's slice; the last stage's micro-batch losses."""
        cfg = trainer.config
        micro_batches = len(mine[0]) // cfg.micro_batch_size
        n_chunks = cfg.pp * cfg.virtual_stages
        args = mine if 0 in self.chunks else []     # the targets ride to the loss
        if args and self.weights_dtype is not None:
            args = [*sixteen_bit_inputs(args[:-1], self.weights_dtype), args[-1]]
        losses: list[torch.Tensor] = []
        kw: dict[str, Any] = {"return_outputs": False}
        if n_chunks - 1 in self.chunks:
            kw.update(target=mine[-1], losses=losses)
        # context parallelism: each cp rank's gradient is its tokens' part, and the dp x cp
        # average divides by cp as well (``sharding/context_axis.py``)
        self.loss_out.scale = trainer.loss_scale * cfg.cp
        self.loss_out.weigh(batch[-1], cfg.dp, micro_batches, cfg.dp_shares)
        with trainer.autocast():
            self.schedule.step(*args, **kw)
        if cfg.dp_shares is None:        # (uneven shares: the loss divided, as scaled)
            for p in self.average_here:
                if grad_of(p) is not None:
                    local_tensor(grad_of(p)).div_(micro_batches)
        return losses

    def mean_loss(self, trainer: Trainer, losses: list[torch.Tensor]) -> torch.Tensor:
        """The micro-batches' mean loss, from the last stage to every rank of the pipeline."""
        mean = torch.zeros((), dtype=torch.float64)
        if losses:
            # (under uneven dp shares each loss was divided by the micro-batches: a sum)
            mean += (sum(float(local_tensor(x).detach()) for x in losses) / len(losses)
                     * self.loss_out.per_loss / self.loss_out.scale)
        if self.pp_group is not None:
            t = mean.reshape(1)
            dist.broadcast(t, src=self.last_stage_rank, group=self.pp_group)
            mean = t[0]
        return mean


@dataclass
class Trainer(Checkpointing, GradientStep):
    """A compiled plan on this rank: ``step(batch)`` trains one global batch; ``save(dir)``
    checkpoints it (``checkpoint.py``)."""

    runner: LocalSteps | PipelineSteps
    optimizer: Any
    plan: Any
    rank: int
    dp_index: int
    dp_group: Any                     # the ranks that average gradients: dp (x cp)
    grad_syncs: list[Any]             # reductions no wrapper does, in order (``build.py``)
    device: torch.device
    autocast_dtype: torch.dtype | None
    cp_index: int = 0                          # this rank's piece of the sequence (cp > 1)
    tp_comm: Any = None                        # the tensor-parallel axis (for state dicts)
    placements: dict[str, Any] = field(default_factory=dict)    # FQN -> tp placement
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    health: Any = None                         # names a dead peer (runtime/rank_failure.py)
    steps_done: int = 0
    samples_seen: int = 0             # samples trained on: the data position (a re-plan may
                                      # change the global batch, so not steps x batch)
    lr_schedulers: list[Any] = field(default_factory=list)
    checkpointer: Any = None
    max_grad_norm: float | None = None
    loss_scaler: LossScaler | None = None
    last_grad_norm: float | None = None
    shared_elsewhere: frozenset[str] = frozenset()   # tied weights a lower pp rank holds
    experts: frozenset[str] = frozenset()     # expert weights split over the ep group
    ep_comm: Any = None                        # the expert-parallel group (ep > 1)
    batch_spec: BatchSpec | None = None        # what step() takes (runtime/batch_check.py)
    stale_prediction: str = ""                 # the plan was made for other hardware
    # activation offload: the bytes this rank's hooks copied to the host and back
    # (``runtime/activation_offload.OffloadCounter``), None when the plan offloads none
    activation_offload: Any = None
    # called after each optimizer step and checkpoint load (the weights changed): FSDP's fp8
    # all-gather scales (``float8.Float8Scales``)
    after_weights_update: tuple[Callable[[], None], ...] = ()

    @property
    def config(self):
        return self.plan.config

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def stage_modules(self) -> list[nn.Module]:
        """The modules holding this rank's parameters, in pipeline order (DDP unwrapped):
        its chunks, or its one program."""
        if isinstance(self.runner, PipelineSteps):
            return [self.runner.chunks[c] for c in sorted(self.runner.chunks)]
        m = self.runner.module
        return [m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m]

    def autocast(self) -> Any:
        """The plan's ``torch.autocast`` (a null context for fp32 plans)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, batch: Sequence[torch.Tensor] | torch.Tensor) -> float:
        """Forward, backward and optimizer step on the global ``batch`` (inputs..., targets);
        returns the loss averaged over the global batch (the same on every rank). If a peer
        rank dies, raises ``RankFailure`` naming it."""
        return guarded(self, self._step, check_batch(self.batch_spec, batch))

    def _step(self, batch: Sequence[torch.Tensor] | torch.Tensor) -> float:
        if isinstance(batch, torch.Tensor):
            if isinstance(self.runner, PipelineSteps):
                raise PlanError("a pipelined plan needs (inputs..., targets): the last stage "
                                "computes the loss")
            batch = (batch,)
        batch = list(batch)
        rows = batch[0].shape[0]
        if rows != self.plan.training.global_batch_size:
            raise PlanError(f"step() got a batch of {rows} samples; the plan is for a global "
                            f"batch of {self.plan.training.global_batch_size}")
        lo, per = self.config.replica_rows(rows, self.dp_index)    # (dp_shares: uneven)
        mine = [t[lo:lo + per].to(self.device) for t in batch]
        local = self.runner.forward_backward(self, batch, mine)
        for sync in self.grad_syncs:
            sync.all_reduce()
        finish_step(self)
        mean = self.runner.mean_loss(self, local)
        if self.dp_group is not None and self.config.grad_degree > 1:
            t = mean.to(torch.float64).reshape(1)
            dist.all_reduce(t, group=self.dp_group)      # cp ranks hold the same loss
            mean = t[0] / self.config.grad_degree
        return float(mean)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers as full tensors (gathered over dp, tp and ep), on the CPU,
        on every rank of this rank's pipeline stage (a collective: every rank calls it)."""
        wait_gathers(self.optimizer)
        modules = (self.runner.chunks[c] for c in sorted(self.runner.chunks)) \
            if isinstance(self.runner, PipelineSteps) else (self.runner.module,)
        out: dict[str, torch.Tensor] = {}
        for m in modules:                  # (DDP-wrapped: the state dict API unwraps it)
            out.update(full_state_dict(m))
        out = gather_slabs(out, self.experts, self.ep_comm)
        return gather_tensor_parallel(out, self.placements, self.aliases, self.tp_comm)


def guarded(trainer: Any, step: Callable[[Any], float], batch: Any) -> float:
    """Run one step; a collective that fails because a peer stopped becomes a RankFailure
    naming that peer (``rank_failure.py``)."""
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
    trainer.samples_seen += trainer.plan.training.global_batch_size
    return loss


def _peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "peer", "socket"))


def _weights(loss: TokenMeanLoss | None, batch: Sequence[torch.Tensor], dp_index: int,
             cfg: Any) -> list[float] | None:
    """Per micro-batch of this rank, the factor on its mean loss (``graph/loss.py``): the
    share of the global batch's counted targets it holds, or under ``dp_shares`` without a
    token mean, ``dp x share / sum(shares)`` (the gradients are averaged over dp, each rank's
    over its own micro-batches: so weighted, they average to the global batch's mean). None:
    every factor is 1."""
    shares = cfg.dp_shares
    if loss is not None and loss.target_input < len(batch):
        w = step_weights(loss, batch[loss.target_input], dp_index, cfg.dp,
                         cfg.micro_batch_size, shares)
        if w is not None:
            return w
    if shares is None:
        return None
    return [cfg.dp * shares[dp_index] / sum(shares)] * shares[dp_index]


def fsdp_once_a_step(module: nn.Module, *, first: bool, last: bool, zero3: bool) -> None:
    """Under ``dp_shares`` the dp ranks run different numbers of micro-batches, so FSDP2 must
    meet its peers the same number of times whatever the count: it gathers the weights in the
    first micro-batch's forward and keeps them whole until the last one (no reshard after a
    forward or backward before it), and reduce-scatters the gradients, accumulated unsharded
    meanwhile, in the last backward only (as torch's pipelining does for its micro-batches).
    Every rank's last micro-batch then runs exactly as with even shares. The price: a rank
    with several micro-batches holds the whole weights and their gradients until its last
    backward. Nothing for a module FSDP does not shard (DDP, ZeRO-0/1)."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(module, FSDPModule) or not (first or last):
        return
    module.set_is_last_backward(last)
    module.set_requires_gradient_sync(last)
    module.set_reshard_after_backward(last)
    if zero3:
        module.set_reshard_after_forward(last)
