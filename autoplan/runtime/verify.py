"""One rank of ``autoplan verify``: train a shrunk plan a few steps, compare with one device.

``torchrun ... -m autoplan.runtime.verify --plan shrunk.json --model M --layers K --out R``:
every rank builds the shrunk model (seeded: the same weights everywhere), compiles the plan and
trains ``--steps`` AdamW steps on one fixed batch; the parameters are gathered to rank 0, which
then trains the same model on one device and writes the comparison to ``--out`` (JSON): per
parameter group (layer indices folded to ``*``) the worst relative error, and both loss curves.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
from torch import nn

from autoplan.errors import AutoplanError
from autoplan.process_exit import exit_now
from autoplan.models import load_user_example, build_example, get_config
from autoplan.models.registry import layer_overrides
from autoplan.planner.planfile import plan_from_file
from autoplan.runtime.packed_data import packed_run_examples
from autoplan.runtime.trainer import compile


def truncate_layers(model: nn.Module, layers: int) -> int:
    """Keep the first ``layers`` layers of every layer stack (an ``nn.ModuleList`` of two or
    more modules of one type); Hugging Face configs are told too. Returns how many stacks the
    model has."""
    stacks = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (isinstance(child, nn.ModuleList) and len(child) >= 2
                    and len({type(m) for m in child}) == 1):
                stacks += 1
                if len(child) > layers:
                    setattr(module, name, nn.ModuleList(list(child)[:layers]))
    config = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        if config is not None and isinstance(getattr(config, attr, None), int):
            setattr(config, attr, min(getattr(config, attr), layers))
    return stacks


def no_dropout(model: nn.Module) -> None:
    """Dropout off: its random masks depend on the tensor layout, so a sharded run draws other
    ones than one device (``nn.Dropout`` modules, and the float rates Hugging Face attention
    reads from its config or its own attributes)."""
    holders = [model] + list(model.modules())
    config = getattr(model, "config", None)
    if config is not None:
        holders.append(config)
    for obj in holders:
        if isinstance(obj, nn.Dropout):
            obj.p = 0.0
        for attr, value in list(vars(obj).items()):
            if (isinstance(value, float) and not isinstance(value, bool)
                    and ("dropout" in attr or "pdrop" in attr)):
                try:
                    setattr(obj, attr, 0.0)
                except (AttributeError, TypeError, ValueError):   # a frozen config
                    pass


def build(spec: str, *, layers: int, batch: int, seq_len: int | None, device: str = "cpu"):
    """The Example named ``spec`` with ``layers`` layers and ``batch`` rows, seeded, dropout
    off."""
    ex = _build(spec, layers=layers, batch=batch, seq_len=seq_len, device=device)
    no_dropout(ex.model)
    return ex


def user_example(spec: str, *, batch: int | None, layers: int | None = None):
    """A user's ``package.module:function`` model, seeded (every rank builds the same weights),
    its first ``layers`` layers when given, with ``batch`` rows of inputs and targets (theirs
    repeated and varied; None: theirs as they are)."""
    import dataclasses

    torch.manual_seed(0)
    ex = load_user_example(spec)
    if layers is not None and not truncate_layers(ex.model, layers):
        raise AutoplanError(f"{spec}: no layer stack (an nn.ModuleList of modules of one "
                            "type) to shrink")
    if batch is None:
        return ex
    return dataclasses.replace(ex, example_inputs=tuple(_rows(t, batch)
                                                        for t in ex.example_inputs),
                               targets=_rows(ex.targets, batch))


def _build(spec: str, *, layers: int, batch: int, seq_len: int | None, device: str):
    torch.manual_seed(0)
    if ":" in spec:
        return user_example(spec, batch=batch, layers=layers)
    kw: dict[str, Any] = dict(batch_size=batch, seed=0, seq_len=seq_len, device=device)
    known = {f for f in getattr(get_config(spec), "__dataclass_fields__", {})}
    shrink = layer_overrides(spec, layers, strict=False)
    kw.update(shrink)
    if "dropout" in known:
        kw["dropout"] = 0.0
    ex = build_example(spec, **kw)
    if not shrink and not truncate_layers(ex.model, layers):
        raise AutoplanError(f"{spec}: no layer count to shrink")
    return ex


def _rows(t: Any, n: int) -> Any:
    """``n`` rows from the example's: repeated, and varied so that no two copies are equal."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if t.shape[0] >= n:
        return t[:n]
    parts = []
    for k in range(-(-n // t.shape[0])):
        if t.is_floating_point():
            parts.append(t + 0.01 * k)
        elif t.dtype in (torch.int64, torch.int32) and k:
            top = int(t.max()) + 1
            parts.append((t + k) % max(top, 1))
        else:
            parts.append(t)
    return torch.cat(parts)[:n]


def group_of(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per parameter group, the worst relative error (Frobenius norm of the difference over
    the reference's); missing or extra tensors are listed."""
    groups: dict[str, float] = {}
    for k, r in ref.items():
        if k not in got or not r.is_floating_point():
            continue
        g = got[k].to(r.dtype).reshape(r.shape)
        err = float((g - r).norm() / r.norm().clamp_min(1e-12))
        groups[group_of(k)] = max(groups.get(group_of(k), 0.0), err)
    return {"groups": groups, "missing": sorted(set(ref) - set(got)),
            "extra": sorted(set(got) - set(ref))}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoplan.runtime.verify")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    torch.set_num_threads(1)
    plan = plan_from_file(args.plan)
    gbs = plan.training.global_batch_size
    documents = plan.training.length_histogram()     # a plan for packed documents, or None
    unpacked = build(args.model, layers=args.layers, batch=1, seq_len=args.seq_len)

    def rows() -> tuple[Any, Any]:
        """(the global batch's rows, the traced example): packed as the plan's documents where
        it has them, as `autoplan run` packs them (``packed_data.py``)."""
        data = build(args.model, layers=args.layers, batch=gbs, seq_len=args.seq_len)
        return ((data, unpacked) if documents is None
                else packed_run_examples(data, unpacked, documents))
    ex, small = rows()
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=gbs, plan=plan)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch) for _ in range(args.steps)]
    state = {k: v.detach().cpu() for k, v in trainer.full_state_dict().items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, state)          # pipeline ranks hold their stages
        for part in parts:
            state.update(part)
    if trainer.rank == 0:
        ref, _ = rows()
        opt = _optimizer(ref.model.parameters())
        ref_losses = []
        for _ in range(args.steps):
            loss = ref.loss_fn(ref.model(*ref.example_inputs), ref.targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        report = compare(state, {k: v.detach() for k, v in ref.model.state_dict().items()})
        report.update(losses=losses, reference_losses=ref_losses)
        with open(args.out, "w") as f:
            json.dump(report, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())         # without the interpreter's teardown: seconds per rank
