"""Checkpoint directories as files: find the latest complete one, read and check its
description (``autoplan.json``, through the hardened reader), and export its model as one plain
state dict. The layout is described in ``checkpoint.py``; nothing here needs a process group.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from autoplan.errors import CheckpointError
from autoplan.safe_io import parse_json, read_text, integer, number, text

FORMAT = "autoplan-checkpoint"
VERSION = 1
META_FILE = "autoplan.json"
LATEST = "latest"

DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.uint8, torch.bool)}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- find and describe -------------------------------------------------------------------------

def step_number(step: Path) -> int | None:
    """The step a ``step-NNNNNNNN`` directory holds (None for any other name)."""
    digits = step.name.removeprefix("step-")
    return int(digits) if step.name.startswith("step-") and digits.isdigit() else None


def complete_steps(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (their description is down), oldest step first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if step_number(p) is not None and (p / META_FILE).exists()]
    return sorted(done, key=step_number)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The step directory ``path`` names: a step directory itself, or a checkpoint root, whose
    newest complete step is taken. That is the step ``latest`` names, except after a crash
    between a save's rename and its ``latest`` update, when ``latest`` still names the one
    before: the newer complete step is then the one to resume (a folder holds one run's
    checkpoints, ``checkpoint_dir.py``, so the highest step is the newest)."""
    path = Path(path)
    if (path / META_FILE).exists():
        return path
    done = complete_steps(path)
    if done:
        return done[-1]
    latest = path / LATEST
    if latest.exists():
        with open(latest, "rb") as f:                 # a step name, nothing more
            name = f.read(256).decode("utf-8", errors="replace").strip()
        raise CheckpointError(f"{latest} names {name[:60]!r}, which is not a complete "
                              f"checkpoint in {path}, and no other step there is complete")
    if path.exists():
        partial = sorted(path.glob(".step-*.partial"))
        hint = (f" ({partial[-1].name} is a save that never finished)" if partial else "")
        raise CheckpointError(f"no complete checkpoint in {path}{hint}")
    raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")


def remove_step(step: Path) -> None:
    """Delete a step directory so that no reader ever sees half of it: it is renamed out of
    the ``step-*`` names first, then removed."""
    gone = step.with_name(f".{step.name}.deleting")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(step, gone)
    shutil.rmtree(gone, ignore_errors=True)


def prune(root: Path, *, keep_last: int, just_written: Path) -> list[Path]:
    """Delete all but ``keep_last`` complete checkpoints: the one just written always stays
    (``latest`` names it), with the ``keep_last - 1`` highest others. Returns the deleted."""
    others = [p for p in complete_steps(root) if p.name != just_written.name]
    gone = others[:max(0, len(others) - (keep_last - 1))]
    for step in gone:
        remove_step(step)
    return gone


def read_meta(step: Path) -> dict[str, Any]:
    """The checkpoint's description, read with the hardened reader and checked all through
    (a hand-edited or damaged file is refused with where it is wrong)."""
    what = "checkpoint description"
    meta = parse_json(read_text(step / META_FILE, what=what, error=CheckpointError), what=what,
                      error=CheckpointError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{step / META_FILE} is not an autoplan checkpoint description")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{step} is checkpoint format version {meta.get('version')!r}; "
                              f"this autoplan reads version {VERSION}")
    check_meta(meta, str(step / META_FILE))
    return meta


def check_meta(meta: dict[str, Any], where: str) -> None:
    """Every field ``load`` and ``export`` read has the type and range they need."""
    err = CheckpointError

    def obj(v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise err(f"{where}: {path} must be an object, got {type(v).__name__}")
        return v

    def shape(v: Any, path: str) -> None:
        if not isinstance(v, list) or len(v) > 16:
            raise err(f"{where}: {path} must be a list of at most 16 sizes")
        for i, n in enumerate(v):
            integer(n, f"{where}: {path}[{i}]", error=err, hi=2 ** 40)

    def dtype(v: Any, path: str) -> None:
        if not isinstance(v, str) or v not in DTYPES:
            raise err(f"{where}: {path} is {v!r}; one of {sorted(DTYPES)}")
    integer(meta.get("step"), f"{where}: step", error=err)
    integer(meta.get("world_size"), f"{where}: world_size", error=err, lo=1)
    for fqn, info in obj(meta.get("model"), "model").items():
        text(fqn, f"{where}: model key", error=err)
        info = obj(info, f"model.{fqn}")
        shape(info.get("shape"), f"model.{fqn}.shape")
        dtype(info.get("dtype"), f"model.{fqn}.dtype")
    for fqn, names in obj(meta.get("aliases", {}), "aliases").items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise err(f"{where}: aliases.{fqn} must be a list of names")
    opt = obj(meta.get("optimizer"), "optimizer")
    classes = opt.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise err(f"{where}: optimizer.classes must be a list of names")
    for fqn, kinds in obj(opt.get("state", {}), "optimizer.state").items():
        for key, k in obj(kinds, f"optimizer.state.{fqn}").items():
            k = obj(k, f"optimizer.state.{fqn}.{key}")
            if k.get("kind") not in ("elementwise", "scalar"):
                raise err(f"{where}: optimizer.state.{fqn}.{key}.kind must be 'elementwise' "
                          "or 'scalar'")
            dtype(k.get("dtype"), f"optimizer.state.{fqn}.{key}.dtype")
            shape(k.get("shape"), f"optimizer.state.{fqn}.{key}.shape")
    for fqn, hp in obj(opt.get("hparams", {}), "optimizer.hparams").items():
        for k, v in obj(hp, f"optimizer.hparams.{fqn}").items():
            if not (v is None or isinstance(v, (bool, int, float, str))
                    or (isinstance(v, list) and all(isinstance(x, (int, float)) for x in v))):
                raise err(f"{where}: optimizer.hparams.{fqn}.{k} is not a plain value")
    if meta.get("lr_scheduler") is not None:
        obj(meta["lr_scheduler"], "lr_scheduler")
    if meta.get("loss_scaler") is not None:
        ls = obj(meta["loss_scaler"], "loss_scaler")
        number(ls.get("scale"), f"{where}: loss_scaler.scale", error=err, lo=1e-30)
        integer(ls.get("good_steps"), f"{where}: loss_scaler.good_steps", error=err)


def model_mismatch(saved: dict[str, Any], live: dict[str, Any]) -> str:
    missing = sorted(set(saved) - set(live))
    extra = sorted(set(live) - set(saved))
    shapes = [f"{k}: saved {saved[k].get('shape')}, this model {live[k]['shape']}"
              for k in sorted(set(saved) & set(live)) if saved[k].get("shape") != live[k]["shape"]]
    parts = []
    if missing:
        parts.append(f"{len(missing)} saved tensor(s) this model lacks ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''})")
    if extra:
        parts.append(f"{len(extra)} tensor(s) of this model not in the checkpoint "
                     f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")
    if shapes:
        parts.append(f"{len(shapes)} shape(s) differ ({'; '.join(shapes[:3])})")
    return "; ".join(parts)


# ---- export ------------------------------------------------------------------------------------

def export(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the checkpoint's model as one plain ``state_dict`` that loads into the
    unparallelized model (``model.load_state_dict``): safetensors when ``out`` ends in
    ``.safetensors``, else ``torch.save``. One process, no process group; tied weights under
    every name. Returns a summary (step, tensors, bytes)."""
    step = resolve(path)
    meta = read_meta(step)
    sd: dict[str, torch.Tensor] = {}
    for fqn, info in sorted(meta["model"].items()):
        dtype = DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if dtype is None or not isinstance(shape, list):
            raise CheckpointError(f"{step / META_FILE}: model entry {fqn!r} is malformed")
        sd[f"model.{fqn}"] = torch.empty(shape, dtype=dtype)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # "assuming a single process"
        dcp.load(sd, storage_reader=FileSystemReader(step), no_dist=True)
    model = {k.removeprefix("model."): v for k, v in sd.items()}
    aliases = meta.get("aliases") or {}
    for fqn in list(model):
        for other in aliases.get(fqn, []):
            if isinstance(other, str) and other not in model:
                model[other] = model[fqn]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError("writing .safetensors needs the safetensors package (pip "
                                  "install safetensors); or export to a .pt file") from None
        save_file({k: v.contiguous().clone() for k, v in model.items()}, str(tmp),
                  metadata={"format": "pt", "step": str(meta["step"])})
    else:
        torch.save(model, tmp)
    os.replace(tmp, out)
    return {"step": meta["step"], "tensors": len(model), "path": str(out),
            "bytes": sum(v.numel() * v.element_size() for v in sd.values())}
