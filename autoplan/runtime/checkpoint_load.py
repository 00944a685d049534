"""Loading a checkpoint into a trainer, whatever plan saved it (``load``): the checks that it
holds this model and optimizer (every rank refuses alike), this rank's pieces of each tensor and
its optimizer state made empty in the saved kinds and dtypes for DCP to fill, then what DCP does
not hold in tensors (hyper-parameters, host copies, RNG, step, LR schedulers, loss scaler).
Saving is ``checkpoint.py``; the layout of a checkpoint is described there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from autoplan.errors import CheckpointError
from autoplan.runtime.checkpoint_files import DTYPES, META_FILE, model_mismatch, read_meta, resolve
from autoplan.runtime.checkpoint_held import (Held, expert_place, gather_objects, held_state,
                                              optimizer_slots, rank_world, tp_place)
from autoplan.runtime.checkpoint_pieces import Layout, Pieces, layout_of
from autoplan.runtime.lowbit_optim import requantize
from autoplan.runtime.optim import (wait_gathers, HostOffloadOptimizer, TensorShardedOptimizer,
                                    local_tensor as _local)
from autoplan.runtime.checkpoint_masters import SIXTEEN_BIT, weights_to_load


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading into the pieces of a ``Pieces``; nothing to initialize (the
    default's meta-tensor initialization would drop objects it does not know)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def load(trainer: Any, path: str | os.PathLike[str], *,
         lr_schedulers: list[Any] | None = None) -> Path:
    """Load the checkpoint at ``path`` into ``trainer``, whatever plan saved it (a collective:
    every rank calls it). Refuses a checkpoint of another model or optimizer, saying what
    differs.

    In order: nothing in flight may overwrite what is loaded (pending gathers waited for); the
    checks, each an all-gather so every rank refuses alike; the state dict to fill (this rank's
    pieces of each tensor, its optimizer state made empty in the saved kinds and dtypes, its
    RNG); DCP's load, which reshards from whatever plan saved it; then what DCP does not hold
    in tensors (hyper-parameters, host copies, RNG, step, schedulers, loss scaler)."""
    step = resolve(path)
    meta = read_meta(step)
    wait_gathers(trainer.optimizer)
    t, tp_rank = tp_place(trainer)
    held = held_state(trainer)
    layouts = {fqn: layout_of(h.tensor, h.placement, t, tp_rank, expert_place(trainer, fqn))
               for fqn, h in held.items()}
    _check_same_model(step, meta, held, layouts)
    slots = optimizer_slots(trainer.optimizer)
    _check_same_optimizer(step, meta, slots)
    into, rounded = weights_to_load(trainer, held)
    sd: dict[str, Any] = {f"model.{fqn}": layouts[fqn].pieces(t) for fqn, t in into.items()}
    hparams = _empty_optimizer_state(step, meta, slots, held, layouts, sd)
    rank, _ = rank_world()
    src = rank if rank < meta["world_size"] else 0
    rng = torch.empty_like(torch.get_rng_state())
    sd[f"rng.rank{src}"] = rng
    dcp.load(sd, storage_reader=FileSystemReader(step), planner=_LoadPlanner())
    _set_hparams(hparams)
    with torch.no_grad():
        for weight, value in rounded:       # 16-bit weights from their fp32 values
            weight.copy_(value.to(weight.device))
    for opt, _ in slots:                 # fp32 values back into 8-bit moments
        requantize(opt)
    _refresh_host_copies(trainer.optimizer)
    for update in trainer.after_weights_update:    # (FSDP's fp8 all-gather scales)
        update()
    torch.set_rng_state(rng)
    _restore_counters(trainer, step, meta, lr_schedulers)
    return step


def _check_same_model(step: Path, meta: dict[str, Any], held: dict[str, Held],
                      layouts: dict[str, Layout]) -> None:
    """CheckpointError unless the checkpoint holds the model every rank holds (names, global
    shapes, dtypes; gathered, so each rank sees the whole model)."""
    live = {fqn: {"shape": list(layouts[fqn].global_shape),
                  "dtype": str(h.tensor.dtype).removeprefix("torch.")}
            for fqn, h in held.items()}
    everything: dict[str, Any] = {}
    for part in gather_objects(live):
        everything.update(part)
    what = model_mismatch(meta["model"], everything)
    if what:
        raise CheckpointError(f"checkpoint {step} is of another model: {what}")


def _check_same_optimizer(step: Path, meta: dict[str, Any], slots: list[Any]) -> None:
    """CheckpointError when the checkpoint holds optimizer state of other optimizer classes
    than this run's (over all ranks)."""
    saved_opt = meta["optimizer"]
    classes = sorted({type(o).__name__ for o, _ in slots})
    all_classes = sorted({c for part in gather_objects(classes) for c in part})
    saved_classes = saved_opt.get("classes") or []
    saved_state = saved_opt.get("state") or {}
    if any(saved_state.values()) and all_classes != saved_classes:
        raise CheckpointError(f"checkpoint {step} holds {'/'.join(saved_classes)} state; this "
                              f"run's optimizer is {'/'.join(all_classes) or 'none'}. Resume with "
                              "the optimizer that saved it")


def _empty_optimizer_state(step: Path, meta: dict[str, Any], slots: list[Any],
                           held: dict[str, Held], layouts: dict[str, Layout],
                           sd: dict[str, Any]) -> list[tuple[dict, dict]]:
    """Each held parameter's optimizer state as the checkpoint describes it, made empty in
    ``opt.state`` and entered in ``sd`` for DCP to fill (elementwise state as this rank's
    pieces, scalars whole). Returns the (param group, saved hyper-parameters) pairs to set
    once loaded."""
    saved_opt = meta["optimizer"]
    saved_state = saved_opt.get("state") or {}
    by_id = {id(h.tensor): h for h in held.values()}
    hparams: list[tuple[dict, dict]] = []
    for opt, mirror in slots:
        for group in opt.param_groups:
            for key_tensor in group["params"]:
                h = by_id.get(id(mirror[id(key_tensor)]))
                if h is None:
                    continue
                kinds = saved_state.get(h.fqn) or {}
                if not isinstance(kinds, dict):
                    raise CheckpointError(f"{step / META_FILE}: optimizer state of {h.fqn} is "
                                          "malformed")
                state = _empty_state_of(step, h.fqn, kinds, key_tensor, layouts[h.fqn], sd)
                if state:
                    opt.state[key_tensor] = state
                hp = (saved_opt.get("hparams") or {}).get(h.fqn)
                if isinstance(hp, dict):
                    hparams.append((group, hp))
    return hparams


def _empty_state_of(step: Path, fqn: str, kinds: dict[str, Any], key_tensor: torch.Tensor,
                    layout: Layout, sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's optimizer state tensors, empty, in the saved dtypes (entered in ``sd``)."""
    state: dict[str, torch.Tensor] = {}
    for key, k in sorted(kinds.items()):
        dtype = DTYPES.get(k.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{step / META_FILE}: {fqn}.{key} has dtype "
                                  f"{k.get('dtype')!r}")
        if k.get("kind") == "elementwise":
            state[key] = torch.zeros_like(key_tensor, dtype=dtype)
            sd[f"optim.{fqn}.{key}"] = layout.pieces(state[key])
        else:
            device = key_tensor.device if k.get("on_param_device") else "cpu"
            state[key] = torch.zeros(k.get("shape") or [], dtype=dtype, device=device)
            sd[f"optim.{fqn}.{key}"] = state[key]
    return state


def _set_hparams(hparams: list[tuple[dict, dict]]) -> None:
    """The saved hyper-parameters (learning rate, betas, ...) into their param groups; a
    tensor-valued one in place."""
    for group, hp in hparams:
        for k, v in hp.items():
            if k in group and not isinstance(group[k], torch.Tensor):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
            elif k in group:
                group[k].fill_(v)


def _restore_counters(trainer: Any, step: Path, meta: dict[str, Any],
                      lr_schedulers: list[Any] | None) -> None:
    """The step count, the LR schedulers' and the loss scaler's state, from the description."""
    trainer.steps_done = meta["step"]
    seen = meta.get("samples_seen")       # older checkpoints: every step at this batch
    trainer.samples_seen = (int(seen) if isinstance(seen, int) else
                            meta["step"] * trainer.plan.training.global_batch_size)
    sched = meta.get("lr_scheduler")
    if lr_schedulers and isinstance(sched, dict):
        for s in lr_schedulers:
            s.load_state_dict(dict(sched))
    scaler = getattr(trainer, "loss_scaler", None)
    if scaler is not None and isinstance(meta.get("loss_scaler"), dict):
        try:
            scaler.load_state_dict(meta["loss_scaler"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{step / META_FILE}: loss_scaler is malformed ({e})") from None


def _refresh_host_copies(opt: Any) -> None:
    """Host-offloaded master weights take the loaded fp32 parameters' values (a 16-bit
    weight's host copy is its master, read from the checkpoint itself)."""
    if isinstance(opt, TensorShardedOptimizer):
        if opt.inner is not None:
            _refresh_host_copies(opt.inner)
        return
    if isinstance(opt, HostOffloadOptimizer):
        with torch.no_grad():
            for p, h in zip(opt.params, opt.host):
                if _local(p).dtype not in SIXTEEN_BIT:
                    h.copy_(_local(p).to(h.device, h.dtype))
