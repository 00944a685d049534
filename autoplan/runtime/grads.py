"""What happens to the gradients between backward and the optimizer step, across any sharding:
clipping by the global norm, and fp16's dynamic loss scaling.

Both need one number over the whole model, which no rank holds: each rank adds what it alone
contributes and one all-reduce over the job sums it. A rank counts a gradient tensor when it is
the one copy of that piece: split over the tensor-parallel axis (every tp rank holds its own
piece) or tp rank 0 for a replicated one; an FSDP2 shard (every dp rank its own piece) or dp
rank 0 for a DDP/ZeRO-1 replica; and, for a weight two pipeline ranks share (a tied LM head),
only the first of them. Gradients have been synchronized by then (DDP, FSDP2's reduce-scatter,
the tensor-parallel and tied-weight all-reduces), so every copy of a replica is equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.runtime.checkpoint_held import held_state
from autoplan.runtime.master_weights import grad_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class GradSet:
    """Every trainable parameter of this rank, and which of them this rank counts."""

    params: list[torch.nn.Parameter]
    counted: list[bool]

    def local_sum_of_squares(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for p, c in zip(self.params, self.counted):
            if c and grad_of(p) is not None:
                g = _local(grad_of(p))
                total += g.detach().to(torch.float64).pow(2).sum().cpu()
        return total

    def any_non_finite(self) -> bool:
        for p in self.params:
            if grad_of(p) is not None and not torch.isfinite(_local(grad_of(p))).all():
                return True
        return False

    def scale_(self, factor: float) -> None:
        with torch.no_grad():
            for p in self.params:
                if grad_of(p) is not None:
                    _local(grad_of(p)).mul_(factor)


def grad_set(trainer: Any, *, shared_elsewhere: set[str] = frozenset()) -> GradSet:
    """The parameters of ``trainer`` (this rank) with the counting rule above.
    ``shared_elsewhere``: names of weights a lower pipeline rank also holds."""
    cfg = trainer.config
    tp_index = cfg.dims.index(trainer.rank, MeshAxis.TP)
    dp_index = trainer.dp_index
    experts = trainer.experts
    params, counted = [], []
    for fqn, h in held_state(trainer).items():
        p = h.tensor
        if not isinstance(p, torch.nn.Parameter) or not p.requires_grad:
            continue
        split_tp = h.placement is not None and h.placement.kind == "S" and cfg.tp > 1
        sharded_dp = isinstance(p, DTensor)
        params.append(p)
        # an expert weight's slab: once per expert-parallel group (the first group counts)
        first_dp = dp_index < cfg.ep if fqn in experts else dp_index == 0
        first_dp = first_dp and getattr(trainer, "cp_index", 0) == 0   # cp ranks: replicas
        counted.append((split_tp or tp_index == 0) and (sharded_dp or first_dp)
                       and fqn not in shared_elsewhere)
    return GradSet(params, counted)


def _all_reduce(t: torch.Tensor, op: Any = None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def global_grad_norm(grads: GradSet) -> float:
    """The L2 norm of all gradients of the model, the same on every rank (a collective)."""
    return math.sqrt(float(_all_reduce(grads.local_sum_of_squares())))


def clip_grad_norm(grads: GradSet, max_norm: float) -> float:
    """Scale every gradient by ``max_norm / norm`` when the global norm exceeds it (as
    ``torch.nn.utils.clip_grad_norm_`` on one device); returns the norm before clipping."""
    norm = global_grad_norm(grads)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        grads.scale_(coef)
    return norm


class LossScaler:
    """fp16's dynamic loss scaling, agreed by every rank: the loss is multiplied by ``scale``
    before backward; after the gradients are synchronized they are divided by it and checked for
    inf/NaN on every rank, the verdict all-reduced (a max), so either every rank steps or every
    rank skips. A skip halves the scale; ``growth_interval`` good steps in a row double it (the
    schedule of ``torch.amp.GradScaler``)."""

    def __init__(self, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1):
            raise PlanError("loss scaling needs init_scale > 0, growth_factor > 1, "
                            "0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def unscale_and_check(self, grads: GradSet) -> bool:
        """Divide the gradients by the scale; True when every rank's are finite."""
        bad = torch.tensor([1.0 if grads.any_non_finite() else 0.0])
        _all_reduce(bad, dist.ReduceOp.MAX if dist.is_available() else None)
        if bad.item() > 0:
            return False
        grads.scale_(1.0 / self.scale)
        return True

    def update(self, stepped: bool) -> None:
        if stepped:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
        else:
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale *= self.backoff_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def finish_step(trainer: Any) -> bool:
    """After backward and the gradient syncs: unscale and check (fp16), clip, step the
    optimizer and the LR schedulers, clear the gradients. Returns whether the step was taken
    (an fp16 overflow skips it on every rank)."""
    grads = trainer.grad_set()
    stepped = True
    scaler = trainer.loss_scaler
    if scaler is not None:
        stepped = scaler.unscale_and_check(grads)
    if stepped and trainer.max_grad_norm is not None:
        trainer.last_grad_norm = clip_grad_norm(grads, trainer.max_grad_norm)
    if stepped:
        trainer.optimizer.step()
        for update in getattr(trainer, "after_weights_update", ()):
            update()
    trainer.optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update(stepped)
    if stepped:
        for s in trainer.lr_schedulers:
            s.step()
    return stepped


class GradientStep:
    """What the trainers (``trainer.py``, ``pipeline.py``) share for the update: they hold
    ``max_grad_norm``, ``loss_scaler``, ``last_grad_norm`` and ``shared_elsewhere``."""

    def grad_set(self) -> GradSet:
        cached = getattr(self, "_grads", None)
        if cached is None:
            cached = self._grads = grad_set(self, shared_elsewhere=self.shared_elsewhere)
        return cached

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0
