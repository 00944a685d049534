"""Checkpoints: save a training run under one plan, resume it under the same plan or any other.

Layout (``torch.distributed.checkpoint``, DCP): a checkpoint root holds one directory per saved
step, ``step-00000006/``, and a ``latest`` file naming the newest complete one::

    root/
      latest                      "step-00000006"
      step-00000006/
        .metadata, __0_0.distcp…  DCP: every tensor at its global shape, written in pieces
        autoplan.json             what was saved: step, samples seen, plan, parameter shapes,
                                  optimizer class and state layout, LR scheduler (no pickle)

Keys are plan-independent: ``model.<fqn>`` (parameters and persistent buffers, tied weights
once, under their first name), ``optim.<fqn>.<state>`` (an optimizer's per-parameter state:
elementwise tensors lie like their parameter, scalars such as Adam's ``step`` whole) and
``rng.rank<r>``. Each rank writes the pieces it holds (``checkpoint_pieces.py``: tensor-parallel
shards, FSDP2 slabs, the ZeRO-1 owner's state, one pipeline rank's layers, host-offloaded state);
replicas are written once. Loading asks for the pieces the new plan puts on each rank and DCP
reads them from whichever files hold them, so a run saved under one plan resumes under another.

Atomic: DCP writes into ``.step-N.partial/``; only when every rank has finished and the
metadata is down does rank 0 rename it to ``step-N/`` and then replace ``latest`` (an
``os.replace``), so a crash mid-save leaves the previous checkpoint the latest (and a crash
between the rename and ``latest`` leaves the new one complete, which resuming takes: the
newest complete step). Pruning (``keep_last``) never deletes the step just written. The root
must be on a file system every rank sees (as DCP's ``FileSystemWriter`` requires). This module
saves; loading is ``checkpoint_load.py``, what a rank holds ``checkpoint_held.py``. Finding,
reading, checking and exporting checkpoint directories is ``checkpoint_files.py``; which job
and which run may write into a root, ``checkpoint_dir.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from autoplan.errors import CheckpointError
from autoplan.runtime.checkpoint_files import (FORMAT, LATEST, META_FILE, VERSION, prune,
                                               remove_step, resolve, step_dir, write_atomic)
from autoplan.runtime.checkpoint_held import (barrier, expert_place, gather_objects, held_state,
                                              optimizer_slots, rank_world, tp_place)
from autoplan.runtime.checkpoint_load import load
from autoplan.runtime.checkpoint_pieces import Pieces, layout_of
from autoplan.runtime.lowbit_optim import plain_state
from autoplan.runtime.optim import wait_gathers
from autoplan.runtime.checkpoint_masters import weights_to_save
from autoplan.runtime.checkpoint_dir import claim

__all__ = ["Checkpointer", "Checkpointing", "load", "resolve", "state_to_save"]


# ---- save ---------------------------------------------------------------------------------------

def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.to_local().shape if isinstance(t, DTensor) else t.shape)


def _state_kind(value: Any, key_tensor: torch.Tensor, fqn: str, key: str,
                opt: torch.optim.Optimizer) -> dict[str, Any]:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"{type(opt).__name__} keeps {key!r} of {fqn} as a {type(value).__name__}, not a "
            "tensor; checkpoints take optimizers whose state is tensors (Adam, AdamW, SGD, ...)")
    if value.dim() > 0 and _local_shape(value) == _local_shape(key_tensor):
        kind = "elementwise"
    elif value.numel() == 1 and not isinstance(value, DTensor):
        kind = "scalar"
    else:
        raise CheckpointError(
            f"{type(opt).__name__} keeps {key!r} of {fqn} with shape {tuple(value.shape)}, "
            f"neither the parameter's {_local_shape(key_tensor)} nor a scalar; its state "
            "cannot be resharded (use an optimizer with elementwise state: Adam, AdamW, SGD)")
    return {"kind": kind, "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "on_param_device": value.device == key_tensor.device}


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, finding a piece of a ``Pieces`` (our state dicts are flat already)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


def state_to_save(trainer: Any, *, copy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the DCP state dict of this rank, this rank's part of the description). ``copy``:
    pieces are copied to host memory (an async save writes them while training goes on)."""
    t, tp_rank = tp_place(trainer)
    held = held_state(trainer)
    sd: dict[str, Any] = {}

    layouts = {fqn: layout_of(h.tensor, h.placement, t, tp_rank, expert_place(trainer, fqn))
               for fqn, h in held.items()}

    def pieces(tensor: torch.Tensor, fqn: str) -> Pieces:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return layouts[fqn].pieces(local.to("cpu", copy=True) if copy else local)

    model_desc = {}
    for fqn, w in weights_to_save(trainer, held).items():
        if w is None:                   # a master another rank holds (and writes)
            continue
        sd[f"model.{fqn}"] = pieces(w, fqn)
        model_desc[fqn] = {"shape": list(layouts[fqn].global_shape),
                           "dtype": str(w.dtype).removeprefix("torch.")}
    by_id = {id(h.tensor): h for h in held.values()}
    opt_desc: dict[str, Any] = {}
    hparams: dict[str, Any] = {}
    classes = set()
    for opt, mirror in optimizer_slots(trainer.optimizer):
        classes.add(type(opt).__name__)
        for group in opt.param_groups:
            hp = _jsonable_hparams(group)
            for key_tensor in group["params"]:
                h = by_id.get(id(mirror[id(key_tensor)]))
                if h is None:
                    continue
                hparams[h.fqn] = hp
                state = opt.state.get(key_tensor, {})
                kinds = {}
                for key in sorted(state):
                    value = plain_state(state[key])      # 8-bit moments as their fp32 values
                    kinds[key] = _state_kind(value, key_tensor, h.fqn, key, opt)
                    name = f"optim.{h.fqn}.{key}"
                    if kinds[key]["kind"] == "elementwise":
                        sd[name] = pieces(value, h.fqn)
                    else:
                        sd[name] = value.detach().to("cpu", copy=True)
                opt_desc[h.fqn] = kinds
    rank, _ = rank_world()
    sd[f"rng.rank{rank}"] = torch.get_rng_state()
    scheds = getattr(trainer, "lr_schedulers", None) or []
    desc = {"model": model_desc, "state": opt_desc, "hparams": hparams,
            "optimizer": sorted(classes),
            "lr_scheduler": _scheduler_state(scheds[0]) if scheds else None}
    return sd, desc


def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    state = dict(scheduler.state_dict())
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the LR scheduler's state_dict is not plain data ({e}); use a "
                              "torch.optim.lr_scheduler class") from None
    return state


def _jsonable_hparams(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
            out[k] = list(v)
    return out


def _merge(descs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": {}, "state": {}, "hparams": {}, "optimizer": set(),
                           "lr_scheduler": None}
    for d in descs:
        for key in ("model", "state", "hparams"):
            out[key].update(d[key])
        out["optimizer"].update(d["optimizer"])
        if out["lr_scheduler"] is None:
            out["lr_scheduler"] = d["lr_scheduler"]
    out["optimizer"] = sorted(out["optimizer"])
    return out


class Checkpointer:
    """Saves and finds a trainer's checkpoints under one root (every rank holds one)."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = 3):
        self.root = Path(root)
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be at least 1 (or None for all), got "
                                  f"{keep_last}")
        self.keep_last = keep_last
        self.pending: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._group: Any = None

    def save(self, trainer: Any, *, async_save: bool = False) -> Path:
        """Save ``trainer`` (a collective: every rank calls it at the same step). Returns the
        step directory; with ``async_save`` the pieces are copied to host memory now and
        written in the background (``wait()`` or the next save waits for it)."""
        self.wait()
        wait_gathers(trainer.optimizer)      # ZeRO-1's weights may still be on their way
        rank, world = rank_world()
        step = trainer.steps_done
        final = step_dir(self.root, step)
        partial = self.root / f".{final.name}.partial"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        sd, desc = state_to_save(trainer, copy=async_save)
        descs = gather_objects(desc)
        meta = _describe(trainer, _merge(descs), world)
        if not async_save:
            dcp.save(sd, storage_writer=FileSystemWriter(partial), planner=_SavePlanner())
            barrier()
            if rank == 0:
                self._commit(partial, final, meta)
            barrier()
            return final
        if self._group is None and world > 1:
            self._group = dist.new_group(backend="gloo")    # not the training collectives'
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoplan-ckpt")

        def write() -> Path:
            dcp.save(sd, storage_writer=FileSystemWriter(partial), planner=_SavePlanner(),
                     process_group=self._group)
            if rank == 0:     # DCP's save returns on rank 0 only after every rank has written
                self._commit(partial, final, meta)
            return final
        self.pending = self._pool.submit(write)
        return final

    def wait(self) -> None:
        """Wait for an async save to be committed (a collective: every rank calls it)."""
        if self.pending is None:
            return
        fut, self.pending = self.pending, None
        fut.result()
        if self._group is not None:
            dist.barrier(group=self._group)

    def _commit(self, partial: Path, final: Path, meta: dict[str, Any]) -> None:
        """The save becomes the latest: its description, the rename, ``latest``, then pruning,
        which keeps the step just written (a crash between two of these leaves the newest
        complete step the one ``resolve`` finds)."""
        write_atomic(partial / META_FILE, json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():                  # the same step saved again
            remove_step(final)
        os.replace(partial, final)
        write_atomic(self.root / LATEST, final.name + "\n")
        if self.keep_last is not None:
            prune(self.root, keep_last=self.keep_last, just_written=final)


def _describe(trainer: Any, merged: dict[str, Any], world: int) -> dict[str, Any]:
    plan = trainer.plan
    cfg = plan.config
    return {"format": FORMAT, "version": VERSION, "step": trainer.steps_done,
            "samples_seen": trainer.samples_seen,
            "world_size": world,
            "plan": {"model": plan.model.name, "model_fingerprint": plan.model.fingerprint,
                     "config": cfg.to_dict(),
                     "global_batch_size": plan.training.global_batch_size,
                     "summary": cfg.short(),
                     "predicted_step_time_s": plan.predicted.get("step_time_s")},
            "aliases": {k: list(v) for k, v in sorted(trainer.aliases.items())},
            "model": merged["model"], "optimizer": {"classes": merged["optimizer"],
                                                    "state": merged["state"],
                                                    "hparams": merged["hparams"]},
            "lr_scheduler": merged["lr_scheduler"],
            "loss_scaler": (trainer.loss_scaler.state_dict()
                            if getattr(trainer, "loss_scaler", None) is not None else None)}


# ---- the trainers' save and load ---------------------------------------------------------------


class Checkpointing:
    """``save`` / ``load`` / ``wait_for_checkpoint`` for the trainers (``trainer.py``,
    ``pipeline.py``), which hold ``checkpointer`` and ``lr_schedulers``."""

    def save(self, root: str | os.PathLike[str], *, async_save: bool = False,
             keep_last: int | None = 3, overwrite: bool = False) -> Path:
        """Save model, optimizer, step, RNG and LR scheduler state under ``root`` (a collective:
        every rank calls it at the same step). Returns ``root/step-NNNNNNNN``; the previous
        checkpoint stays the latest until this one is complete. ``async_save`` copies the state
        to host memory and writes it in the background; ``keep_last`` checkpoints are kept
        (the one just written always among them).

        The first save into ``root`` claims it (``checkpoint_dir.py``): refused while another
        job writes there, and where another run's checkpoints are, unless this run resumed
        from the newest of them or ``overwrite`` (which deletes them first)."""
        self._claim(Path(root), overwrite=overwrite)
        ck = self.checkpointer
        if ck is None or ck.root != Path(root) or ck.keep_last != keep_last:
            if ck is not None:
                ck.wait()
            ck = self.checkpointer = Checkpointer(root, keep_last=keep_last)
        return ck.save(self, async_save=async_save)

    def _claim(self, root: Path, *, overwrite: bool) -> None:
        """Rank 0 claims ``root`` once per trainer; every rank raises its refusal alike."""
        claimed = self.__dict__.setdefault("_claimed_dirs", set())
        key = str(root.resolve())
        if key in claimed:
            return
        refusal = None
        if rank_world()[0] == 0:
            try:
                claim(root, resumed_from=self.__dict__.get("_resumed_from"),
                      overwrite=overwrite)
            except CheckpointError as e:
                refusal = str(e)
        refusal = gather_objects(refusal)[0]
        if refusal is not None:
            raise CheckpointError(refusal)
        claimed.add(key)

    def wait_for_checkpoint(self) -> None:
        """Block until an async save is complete (a collective)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def load(self, path: str | os.PathLike[str]) -> Path:
        """Resume from the checkpoint at ``path`` (a root: its newest; or a step directory),
        saved under this plan or any other (a collective)."""
        step = load(self, path, lr_schedulers=self.lr_schedulers)
        self.__dict__["_resumed_from"] = step
        return step
