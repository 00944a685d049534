"""Activation offload: the tensors a layer's forward saves for backward go to host memory and
come back when its backward needs them (``ParallelConfig.offload_activations``).

A ``saved_tensors_hooks`` context spans each chosen layer's forward (a forward pre-hook enters
it, a forward hook leaves it, even on an exception). Around a checkpointed layer (``full``
recomputation) the only tensors the context sees are the checkpoint's inputs: torch's
non-reentrant checkpoint saves them before it installs its own hooks, and the tensors of the
recomputed forward never reach ours. So a recomputed layer offloads what it keeps.

What is not offloaded: weights and their views and casts (autocast's 16-bit copies: the model
state holds them, the estimate prices them there), and the layer's inputs that need no gradient
(a mask, rotary tables: made once outside the layers and read by all of them). Each storage
goes once per layer call (views of it are rebuilt on the device).

On CUDA the copies go to pinned host memory on a side stream, each waited for by an event, so
they overlap the compute (as Megatron-Core's fine-grained activation offloading does); the
device tensor is held until its copy is done, and a layer's tensors are fetched back on the side
stream when the first of them is asked for, while the next layer's prefetch is issued
behind it. On a CPU rank the host copy is a plain copy: it moves nothing across a link, but the
hooks run and ``OffloadCounter`` counts the bytes, which tests compare with the prediction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# autograd nodes a weight passes through unchanged in value before an op saves it (views and
# casts): a saved tensor reached from a weight through them alone is the weight
_WEIGHT_PATH = frozenset({"TBackward0", "ToCopyBackward0", "ViewBackward0", "PermuteBackward0",
                          "TransposeBackward0", "ExpandBackward0", "UnsafeViewBackward0",
                          "AliasBackward0", "SliceBackward0", "SelectBackward0",
                          "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
                          "ReshapeAliasBackward0", "AsStridedBackward0"})


@dataclass
class OffloadCounter:
    """Bytes this rank's hooks copied to the host and back, per layer path (since ``reset``)."""

    to_host_bytes: dict[str, int] = field(default_factory=dict)
    to_device_bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.to_host_bytes.clear()
        self.to_device_bytes.clear()

    @property
    def total_to_host_bytes(self) -> int:
        return sum(self.to_host_bytes.values())

    @property
    def total_to_device_bytes(self) -> int:
        return sum(self.to_device_bytes.values())


def is_weight(t: torch.Tensor) -> bool:
    """Whether ``t`` is a leaf that requires grad, or reached from one through views and casts
    only: a parameter, or a pipeline stage's received input (torch's pipelining makes it such
    a leaf and holds it for the stage's backward): either stays on the device whatever the
    hooks do, so neither is copied (the estimate moves neither)."""
    if isinstance(t, nn.Parameter) or (t.grad_fn is None and t.requires_grad):
        return True
    node = t.grad_fn
    while node is not None and type(node).__name__ in _WEIGHT_PATH:
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


class _Packed:
    """One host copy of a storage's tensor (the base), and how a saved view is cut from it."""

    __slots__ = ("host", "device", "fetched", "group")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _LayerCall) -> None:
        self.host, self.device, self.group = host, device, group
        self.fetched: torch.Tensor | None = None


class _LayerCall:
    """The tensors one forward call of one layer packed (its storages, once each). The
    autograd graph holds it (through its packed tensors); the offloader only refers to it, so
    a forward whose graph is dropped unrun frees its host copies."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.bases: dict[int, _Packed] = {}
        # the device tensors copied, held until the layer's forward ends: a storage freed
        # earlier could have its address reused within the call, and the address keys ``bases``
        self.live: list[torch.Tensor] = []


class ActivationOffloader:
    """The hooks of every offloading layer of one rank, and their byte counter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter = OffloadCounter()
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.calls: list[Any] = []      # weak references to the calls, forward order

    # -- the context around one layer's forward --------------------------------------------

    def attach(self, module: nn.Module, path: str) -> None:
        """Offload what ``module``'s forward saves (its checkpoint's inputs, if checkpointed)."""
        state: dict[str, Any] = {}

        def enter(_mod: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            call = _LayerCall(path)
            self.calls = [r for r in self.calls if r() is not None] + [weakref.ref(call)]
            shared = {t.untyped_storage().data_ptr()
                      for t in (*args, *(kwargs or {}).values())
                      if isinstance(t, torch.Tensor) and not t.requires_grad}
            ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, call, shared), self._unpack)
            ctx.__enter__()
            state["ctx"], state["call"] = ctx, call

        def leave(_mod: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
            ctx = state.pop("ctx", None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
                state.pop("call").live.clear()
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)

    def _pack(self, t: torch.Tensor, call: _LayerCall, shared: set[int]) -> Any:
        if (type(t) is not torch.Tensor or t.is_sparse or t.device.type == "meta"
                or is_weight(t)):
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in shared:
            return t
        base = t._base if t._base is not None else t
        packed = call.bases.get(ptr)
        if packed is None:
            packed = self._to_host(base, call)
            call.bases[ptr] = packed
            call.live.append(base)
        return (packed, tuple(t.size()), tuple(t.stride()),
                t.storage_offset() - base.storage_offset(), t.dtype, t.requires_grad)

    def _to_host(self, base: torch.Tensor, call: _LayerCall) -> _Packed:
        host = torch.empty_strided(base.size(), base.stride(), dtype=base.dtype,
                                   device="cpu", pin_memory=self.cuda)
        nbytes = base.untyped_storage().nbytes()
        self.counter.to_host_bytes[call.path] = (
            self.counter.to_host_bytes.get(call.path, 0) + nbytes)
        if not self.cuda:
            host.copy_(base)
            return _Packed(host, base.device, call)
        # the copy waits for the kernel that made ``base``, then runs beside the compute;
        # ``base`` is held until it is done (``keep``), its memory not reused meanwhile
        self.stream.wait_stream(torch.cuda.current_stream(base.device))
        with torch.cuda.stream(self.stream):
            host.copy_(base, non_blocking=True)
        base.record_stream(self.stream)
        return _Packed(host, base.device, call)

    def _unpack(self, item: Any) -> torch.Tensor:
        if isinstance(item, torch.Tensor):
            return item
        packed, size, stride, offset, dtype, _grad = item
        if packed.fetched is None:
            self._fetch(packed.group)
        base = packed.fetched
        if self.cuda:
            current = torch.cuda.current_stream(packed.device)
            current.wait_stream(self.stream)
            base.record_stream(current)
        return base.as_strided(size, stride, base.storage_offset() + offset)

    def _fetch(self, call: _LayerCall) -> None:
        """Bring back every storage of ``call``, and on CUDA issue the prefetch of the call
        packed before it (the layer whose backward runs next)."""
        i = next((k for k, r in enumerate(self.calls) if r() is call), None)
        self._copy_back(call)
        if i is not None:
            self.calls.pop(i)
            before = self.calls[i - 1]() if self.cuda and i > 0 else None
            if before is not None:
                self._copy_back(before)

    def _copy_back(self, call: _LayerCall) -> None:
        for packed in call.bases.values():
            if packed.fetched is not None:
                continue
            self.counter.to_device_bytes[call.path] = (
                self.counter.to_device_bytes.get(call.path, 0)
                + packed.host.untyped_storage().nbytes())
            if not self.cuda:           # a CPU rank: the host copy is on its device already
                packed.fetched = packed.host
                continue
            with torch.cuda.stream(self.stream):
                packed.fetched = packed.host.to(packed.device, non_blocking=True)


def apply_activation_offload(model: nn.Module, paths: list[str], device: torch.device,
                             offloader: ActivationOffloader | None = None
                             ) -> ActivationOffloader | None:
    """Attach the offload hooks to the layers at ``paths`` of ``model`` (after their checkpoint
    wrappers, before FSDP: the context then spans the checkpoint and stays inside FSDP's
    gathers), sharing ``offloader`` (one per rank; made here at the first layer)."""
    if not paths:
        return offloader
    offloader = offloader or ActivationOffloader(device)
    for path in paths:
        offloader.attach(model.get_submodule(path), path)
    return offloader
