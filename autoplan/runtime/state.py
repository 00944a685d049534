"""Parameters and buffers of one rank: sharded to their stored placement, put back on the
user's modules.

A model built on the meta device is materialized one module at a time (``to_empty`` on the
module alone, then filled as ``meta_init.py`` says), each rank drawing the same values in the same
order, and sliced at once: a rank never holds more than one module's whole weights. Tied
weights (several names, one tensor) stay one tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoplan.errors import PlanError
from autoplan.runtime.meta_init import hf_owners, initialize
from autoplan.runtime.tp_comm import local_piece, no_grad_gather
from autoplan.sharding.placement import Placement, local_shape


class LocalState:
    """Hands out this rank's shard of every parameter and buffer, once per tensor."""

    def __init__(self, model: nn.Module, *, t: int, rank: int, device: torch.device,
                 seed: int, keep: Any = None, experts: tuple[str, ...] = (),
                 ep: tuple[int, int] = (1, 0), dtype: torch.dtype | None = None):
        self.model = model
        self.dtype = dtype          # floating tensors cast to it (16-bit weights), or as they are
        self.keep = keep
        # expert weights (FQNs) hold experts ep_index * E/ep ... of their leading dim
        self.experts, (self.ep, self.ep_index) = frozenset(experts), ep
        self.t, self.rank, self.device, self.seed = t, rank, device, seed
        self.done: dict[str, Any] = {}                      # FQN (every alias) -> local
        self.aliases: dict[int, list[str]] = {}
        # the meta tensors these ids are of, kept alive (they hold no memory): materializing a
        # module replaces all its tensors at once, and a freed one's id, given to a new
        # tensor, named a norm's bias as the tied LM head (one run in three of a meta ZeRO-3
        # plan). Other tensors are looked up only while they are the model's own
        self.originals: list[torch.Tensor] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(name)
            self.originals += [p] if p.is_meta else []
        for name, b in model.named_buffers(remove_duplicate=False):
            self.aliases.setdefault(id(b), []).append(name)
            self.originals += [b] if b.is_meta else []
        self.materialized: set[int] = set()
        self.hf_owners: dict[int, nn.Module] | None = None     # (meta_init.py), at first use
        self.paths: dict[int, str] = {}
        torch.manual_seed(seed)          # the same replicated weights on every rank

    def __call__(self, fqn: str, kind: str, p: Placement) -> Any:
        if fqn in self.done:
            return self.done[fqn]
        owner, _, attr = fqn.rpartition(".")
        module = self.model.get_submodule(owner) if owner else self.model
        full = getattr(module, attr)
        names = self.aliases.get(id(full), [fqn])
        if self.keep is not None and not self.keep(fqn):
            shape = self._experts_of(fqn, local_shape(tuple(full.shape), p, self.t)
                                     or tuple(full.shape))
            dtype = self.dtype if self.dtype is not None and full.is_floating_point() \
                else full.dtype
            other = torch.empty(shape, dtype=dtype, device="meta")   # another rank's
            return other.requires_grad_(kind == "param" and full.requires_grad)
        if full.is_meta:
            self._materialize(module)
            full = getattr(module, attr)
        if local_shape(tuple(full.shape), p, self.t) is None:
            raise PlanError(f"{kind} {fqn} of shape {tuple(full.shape)} cannot be split {p} "
                            f"over {self.t} ranks; re-plan")
        with torch.no_grad():
            data = local_piece(full.detach().to(self.device), p, self.t, self.rank)
            if fqn in self.experts and self.ep > 1:
                if p.kind == "S" and p.dim == 0:
                    raise PlanError(f"expert weight {fqn} is split on its expert dim over the "
                                    "tensor-parallel axis and over ep; re-plan")
                n = data.shape[0] // self.ep
                data = data[self.ep_index * n:(self.ep_index + 1) * n].clone()
            data = data.clone() if data is full else data
            if self.dtype is not None and data.is_floating_point():
                data = data.to(self.dtype)
        local: Any
        if kind == "param":
            local = nn.Parameter(data, requires_grad=full.requires_grad)
        else:
            local = data
        for name in names:
            self._put(name, local, kind)
            self.done[name] = local
        return local

    def _experts_of(self, fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if fqn in self.experts and self.ep > 1:
            return (shape[0] // self.ep,) + tuple(shape[1:])
        return shape

    def _put(self, fqn: str, value: Any, kind: str) -> None:
        owner, _, attr = fqn.rpartition(".")
        module = self.model.get_submodule(owner) if owner else self.model
        if kind == "param":
            module._parameters[attr] = value
        else:
            module._buffers[attr] = value

    def _materialize(self, module: nn.Module) -> None:
        """Allocate and initialize one meta module's own tensors (not its children's)."""
        if id(module) in self.materialized:
            return
        self.materialized.add(id(module))
        # tensors that hold values (buffers computed under autoplan.empty_weights()) keep them
        held = [(table, attr, t) for table in (module._parameters, module._buffers)
                for attr, t in table.items() if t is not None and not t.is_meta]
        module.to_empty(device=self.device, recurse=False)
        if self.hf_owners is None:
            self.hf_owners = hf_owners(self.model)
            self.paths = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        initialize(module, self.paths.get(id(module), ""), self.hf_owners.get(id(module)),
                   held=frozenset(attr for _, attr, _ in held))
        for table, attr, t in held:        # (``to_empty`` fills the module's own tables)
            table[attr] = t


def tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of a parameter or buffer that has several (name -> all its names)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return {n: tuple(names) for names in by_id.values() if len(names) > 1 for n in names}


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """FQNs of the buffers the user's model keeps out of its state dict."""
    return {f"{path}.{b}" if path else b for path, m in model.named_modules()
            for b in m._non_persistent_buffers_set}


def keep_out_of_state_dict(module: nn.Module, names: set[str]) -> None:
    """Buffers the user's model keeps out of its state dict stay out of the program's too."""
    for name in names:
        owner, _, attr = name.rpartition(".")
        try:
            m = module.get_submodule(owner) if owner else module
        except AttributeError:
            continue
        if attr in m._buffers:
            m._non_persistent_buffers_set.add(attr)


def register_aliases(module: nn.Module, aliases: dict[str, tuple[str, ...]]) -> None:
    """Give each tied tensor ``module`` holds all the names the user's model gives it (state
    dicts then list both an LM head and the embedding it is tied to)."""
    for name, group in aliases.items():
        tensor = _lookup(module, name)
        if tensor is None:
            continue
        for other in group:
            if other == name or _lookup(module, other) is not None:
                continue
            owner, _, attr = other.rpartition(".")
            parent = module
            for part in owner.split(".") if owner else []:
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            if isinstance(tensor, nn.Parameter):
                parent.register_parameter(attr, tensor)
            else:
                parent.register_buffer(attr, tensor)


def _lookup(module: nn.Module, name: str) -> torch.Tensor | None:
    owner, _, attr = name.rpartition(".")
    try:
        m = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    t = m._parameters.get(attr)
    return t if t is not None else m._buffers.get(attr)


def gather_tensor_parallel(sd: dict[str, torch.Tensor], placements: dict[str, Placement],
                           aliases: dict[str, tuple[str, ...]], comm: Any) -> dict[str, torch.Tensor]:
    """The state dict with every tensor split over the tensor-parallel axis gathered whole
    (a collective over that axis: every rank of it must call it, in the same order)."""
    out = {}
    for name in sorted(sd):
        t = sd[name]
        p = placements.get(name)
        if p is None:
            p = next((placements[a] for a in aliases.get(name, ()) if a in placements), None)
        if p is not None and p.kind == "S" and comm is not None and comm.size > 1:
            t = no_grad_gather(t.contiguous(), comm, p)
        out[name] = t
    return out
