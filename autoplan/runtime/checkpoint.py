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
must be on a file system every rank sees (as DCP's ``FileSystemWriter`` requires). Finding,
reading, checking and exporting checkpoint directories is ``checkpoint_files.py``; which job
and which run may write into a root, ``checkpoint_dir.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import DTensor

from autoplan.errors import CheckpointError
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.runtime.checkpoint_files import (DTYPES, FORMAT, LATEST, META_FILE, VERSION,
                                               model_mismatch, prune, read_meta, remove_step,
                                               resolve, step_dir, write_atomic)
from autoplan.runtime.checkpoint_pieces import Layout, Pieces, layout_of
from autoplan.runtime.lowbit_optim import plain_state, requantize
from autoplan.runtime.optim import (wait_gathers, HostOffloadOptimizer, TensorShardedOptimizer,
                                    local_tensor as _local)
from autoplan.runtime.master_weights import MasterWeightsOptimizer
from autoplan.runtime.checkpoint_masters import SIXTEEN_BIT, weights_to_load, weights_to_save
from autoplan.runtime.checkpoint_dir import claim



# ---- what a rank holds -------------------------------------------------------------------------

@dataclass
class Held:
    """One state tensor this rank holds, under its checkpoint name."""

    fqn: str
    tensor: torch.Tensor          # the live tensor (a Parameter, buffer, or FSDP2 DTensor)
    placement: Any                # its tensor-parallel placement (None: replicated)


def program_modules(trainer: Any) -> list[nn.Module]:
    """The modules holding this rank's parameters (DDP unwrapped; pipeline chunks)."""
    return list(trainer.stage_modules)


def canonical_name(name: str, aliases: dict[str, tuple[str, ...]]) -> str:
    return min(aliases.get(name, (name,)))


def held_state(trainer: Any) -> dict[str, Held]:
    """Parameters and persistent buffers of this rank by checkpoint name (tied weights once)."""
    out: dict[str, Held] = {}
    for module in program_modules(trainer):
        for name, t in module.state_dict(keep_vars=True).items():
            name = name.replace("_checkpoint_wrapped_module.", "")
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            fqn = canonical_name(name, trainer.aliases)
            p = trainer.placements.get(name)
            if p is None:
                p = next((trainer.placements[a] for a in trainer.aliases.get(name, ())
                          if a in trainer.placements), None)
            out.setdefault(fqn, Held(fqn, t, p))
    return out


def optimizer_slots(opt: Any) -> list[tuple[torch.optim.Optimizer, dict[int, torch.Tensor]]]:
    """Each torch optimizer inside ``opt`` with, per tensor it steps (by id), the model
    parameter that tensor stands for (itself, or the one a host-offloaded copy mirrors)."""
    if isinstance(opt, TensorShardedOptimizer):
        return optimizer_slots(opt.inner) if opt.inner is not None else []
    if isinstance(opt, (HostOffloadOptimizer, MasterWeightsOptimizer)):
        inner = optimizer_slots(opt.inner)
        copies = opt.host if isinstance(opt, HostOffloadOptimizer) else opt.masters
        mirror = {id(h): p for h, p in zip(copies, opt.params)}
        return [(o, {k: mirror.get(id(v), v) for k, v in m.items()}) for o, m in inner]
    if isinstance(opt, torch.optim.Optimizer):
        return [(opt, {id(p): p for g in opt.param_groups for p in g["params"]})]
    raise CheckpointError(f"cannot checkpoint an optimizer of type {type(opt).__name__}: "
                          "compile() takes a factory returning a torch.optim.Optimizer")


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


# ---- save ---------------------------------------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, finding a piece of a ``Pieces`` (our state dicts are flat already)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


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


def _tp(trainer: Any) -> tuple[int, int]:
    t = trainer.config.tp
    return t, trainer.config.dims.index(trainer.rank, MeshAxis.TP)


def _expert(trainer: Any, fqn: str) -> tuple[int, int] | None:
    """(ep, this rank's index in its expert-parallel group) for an expert weight, else None."""
    ep = trainer.config.ep
    if ep == 1 or fqn not in trainer.experts:
        return None
    return ep, trainer.dp_index % ep


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_objects(obj: Any) -> list[Any]:
    _, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def state_to_save(trainer: Any, *, copy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the DCP state dict of this rank, this rank's part of the description). ``copy``:
    pieces are copied to host memory (an async save writes them while training goes on)."""
    t, tp_rank = _tp(trainer)
    held = held_state(trainer)
    sd: dict[str, Any] = {}

    layouts = {fqn: layout_of(h.tensor, h.placement, t, tp_rank, _expert(trainer, fqn))
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
    rank, _ = _world()
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
        rank, world = _world()
        step = trainer.steps_done
        final = step_dir(self.root, step)
        partial = self.root / f".{final.name}.partial"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        sd, desc = state_to_save(trainer, copy=async_save)
        descs = _gather_objects(desc)
        meta = _describe(trainer, _merge(descs), world)
        if not async_save:
            dcp.save(sd, storage_writer=FileSystemWriter(partial), planner=_SavePlanner())
            _barrier()
            if rank == 0:
                self._commit(partial, final, meta)
            _barrier()
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


# ---- load --------------------------------------------------------------------------------------



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
    t, tp_rank = _tp(trainer)
    held = held_state(trainer)
    layouts = {fqn: layout_of(h.tensor, h.placement, t, tp_rank, _expert(trainer, fqn))
               for fqn, h in held.items()}
    _check_same_model(step, meta, held, layouts)
    slots = optimizer_slots(trainer.optimizer)
    _check_same_optimizer(step, meta, slots)
    into, rounded = weights_to_load(trainer, held)
    sd: dict[str, Any] = {f"model.{fqn}": layouts[fqn].pieces(t) for fqn, t in into.items()}
    hparams = _empty_optimizer_state(step, meta, slots, held, layouts, sd)
    rank, _ = _world()
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
    for part in _gather_objects(live):
        everything.update(part)
    what = model_mismatch(meta["model"], everything)
    if what:
        raise CheckpointError(f"checkpoint {step} is of another model: {what}")


def _check_same_optimizer(step: Path, meta: dict[str, Any], slots: list[Any]) -> None:
    """CheckpointError when the checkpoint holds optimizer state of other optimizer classes
    than this run's (over all ranks)."""
    saved_opt = meta["optimizer"]
    classes = sorted({type(o).__name__ for o, _ in slots})
    all_classes = sorted({c for part in _gather_objects(classes) for c in part})
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
        if _world()[0] == 0:
            try:
                claim(root, resumed_from=self.__dict__.get("_resumed_from"),
                      overwrite=overwrite)
            except CheckpointError as e:
                refusal = str(e)
        refusal = _gather_objects(refusal)[0]
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
