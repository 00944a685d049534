"""Gradient synchronization and optimizer placements the plan can ask for.

- ``DataParallelGrads``: gradients averaged over a dp group in buckets, after backward (pipeline
  chunks under ZeRO-0/1 with the zero-bubble schedule) or each bucket behind the rest of the
  last backward (the weights FSDP leaves whole, expert slabs DDP leaves out);
- ``TensorParallelGrads``: weights replicated over the tp axis but read by split computations
  have partial gradients there: summed once per step;
- ``TensorShardedOptimizer``: ZeRO-1 by whole tensors: each dp rank keeps optimizer state for
  the tensors it owns, steps them, and broadcasts the updated tensors to its dp peers. The
  broadcasts run behind the next forward (Megatron-LM's ``--overlap-param-gather``): issued
  asynchronously after the step, each waited for just before the first module that reads it.
- ``HostOffloadOptimizer``: optimizer state (and the fp32 master copy the step updates) kept in
  host memory; gradients go down, updated weights come back; bytes moved are counted.
All work on local tensors (a weight is this rank's tensor-parallel shard; under FSDP2 a
``DTensor`` over dp, whose ``to_local()`` they use).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.runtime.master_weights import clear_grad, grad_of


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (a DTensor's local shard; a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


class DataParallelGrads:
    """Averages the gradients of ``params`` over a data-parallel group, in buckets of about
    ``BUCKET_BYTES`` (DDP's default cap), one flattened all-reduce each: after backward, or
    (``overlap_with_backward``, then ``arm`` before the last micro-batch's backward) each
    bucket sent as soon as its gradients are complete, as DDP does, and waited for in
    ``all_reduce``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Any, dp: int):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp = dp
        self._hooks: list[Any] = []
        self._armed = False
        self._ready: list[torch.Tensor] = []          # complete, not sent yet
        self._sent: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._sent_ids: set[int] = set()

    def overlap_with_backward(self) -> None:
        """Hook every parameter: once armed, its complete gradient joins the open bucket."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._complete)
                           for p in self.params]

    def arm(self) -> None:
        """The next backward is the step's last: send the buckets as they fill."""
        self._armed = bool(self._hooks)

    def _complete(self, p: torch.nn.Parameter) -> None:
        if not self._armed or grad_of(p) is None:
            return
        g = local_tensor(grad_of(p))
        if self._ready and (g.dtype != self._ready[0].dtype or g.device != self._ready[0].device
                            or _nbytes(self._ready) + _nbytes([g]) > BUCKET_BYTES):
            self._send()
        self._ready.append(g)
        self._sent_ids.add(id(p))

    def _send(self) -> None:
        bucket, self._ready = self._ready, []
        flat = torch.cat([g.reshape(-1) for g in bucket])
        self._sent.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))

    def all_reduce(self) -> None:
        """Average every gradient: wait for the buckets sent during backward, then the rest."""
        rest = [p for p in self.params if id(p) not in self._sent_ids]
        if self._armed:
            if self._ready:
                self._send()
            for work, flat, bucket in self._sent:
                work.wait()
                _scatter(flat.div_(self.dp), bucket)
        self._sent, self._sent_ids, self._armed = [], set(), False
        grads = [local_tensor(grad_of(p)) for p in rest if grad_of(p) is not None]
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            _scatter(flat.div_(self.dp), bucket)


def _nbytes(grads: Sequence[torch.Tensor]) -> int:
    return sum(g.numel() * g.element_size() for g in grads)


def _scatter(flat: torch.Tensor, bucket: Sequence[torch.Tensor]) -> None:
    offset = 0
    for g in bucket:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


BUCKET_BYTES = 25 * 2 ** 20


def _buckets(grads: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive same-dtype, same-device gradients in buckets of at most ``cap_bytes`` (a
    larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        b = g.numel() * g.element_size()
        if (not out or size + b > cap_bytes or out[-1][0].dtype != g.dtype
                or out[-1][0].device != g.device):
            out.append([])
            size = 0
        out[-1].append(g)
        size += b
    return out


class TensorParallelGrads:
    """Sums, over the tensor-parallel group, the gradients of weights that are replicated there
    but read by split computations (each rank holds a partial sum), once per step, in one
    flattened all-reduce per dtype."""

    def __init__(self, modules: Sequence[torch.nn.Module], fqns: Sequence[str], group: Any):
        clean = {}
        for m in modules:
            for k, v in m.named_parameters(remove_duplicate=False):
                clean.setdefault(k.replace("_checkpoint_wrapped_module.", ""), v)
        missing = [f for f in fqns if f not in clean]
        if missing:
            raise RuntimeError(f"tensor-parallel gradient sync: no parameters {missing[:3]}")
        self.params = list({id(clean[f]): clean[f] for f in fqns}.values())   # tied: once
        self.group = group

    def all_reduce(self) -> None:
        grads = [local_tensor(grad_of(p)) for p in self.params if grad_of(p) is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


class TensorShardedOptimizer:
    """ZeRO-1 over a dp group, partitioned by whole parameter tensors (balanced by size).
    ``groups`` maps some parameters (by id) to another group they are sharded over instead
    (expert weights: the ranks holding the same experts)."""

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 factory: Callable[[Any], torch.optim.Optimizer], group: Any,
                 groups: dict[int, Any] | None = None):
        self.params = list(params)
        self.group = group
        self.groups = [(groups or {}).get(id(p), group) for p in self.params]
        owner = [0] * len(self.params)
        mine = []
        for g in list(dict.fromkeys(self.groups)):      # each group's tensors, balanced
            idx = [i for i, gi in enumerate(self.groups) if gi is g]
            n = dist.get_world_size(g)
            loads = [0] * n
            for i in sorted(idx, key=lambda i: (-local_tensor(self.params[i]).numel(), i)):
                k = min(range(n), key=lambda r: (loads[r], r))
                owner[i] = k
                loads[k] += local_tensor(self.params[i]).numel()
            me = dist.get_rank(g)
            mine += [i for i in idx if owner[i] == me]
        self.owner = owner
        mine = [self.params[i] for i in sorted(mine)]
        self.inner = factory(mine) if mine else None
        self.src = [dist.get_global_rank(g, o) for g, o in zip(self.groups, owner)]
        self._overlap = False
        self._pending: dict[int, Any] = {}        # id(param) -> its broadcast in flight

    def step(self) -> None:
        self.wait_gathers()              # a tensor still in flight must not be stepped
        if self.inner is not None:
            self.inner.step()
        with torch.no_grad():
            for p, src, g in zip(self.params, self.src, self.groups):
                work = dist.broadcast(local_tensor(p).data, src=src, group=g, async_op=True)
                if self._overlap:
                    self._pending[id(p)] = work
                else:
                    work.wait()

    def overlap_with_forward(self, roots: Sequence[torch.nn.Module],
                             layers: Sequence[torch.nn.Module]) -> None:
        """Wait for the updated tensors lazily: each of ``layers`` waits for its own before its
        forward, each of ``roots`` (the program, or a pipeline rank's chunks) for the rest
        (embeddings, head) before its forward. ``wait_gathers`` finishes them for anything
        else that reads the weights (a checkpoint, an export)."""
        in_layer: set[int] = set()
        for m in layers:
            mine = [id(p) for p in m.parameters()]
            in_layer.update(mine)
            m.register_forward_pre_hook(self._waiter(mine))
        for root in roots:
            rest = [id(p) for p in root.parameters() if id(p) not in in_layer]
            root.register_forward_pre_hook(self._waiter(rest))
        self._overlap = True

    def _waiter(self, ids: Sequence[int]) -> Callable[..., None]:
        def wait(*_: Any) -> None:
            for i in ids:
                work = self._pending.pop(i, None)
                if work is not None:
                    work.wait()
        return wait

    def wait_gathers(self) -> None:
        """Finish every broadcast still in flight (they were issued in parameter order)."""
        for work in self._pending.values():
            work.wait()
        self._pending.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            clear_grad(p)
        if self.inner is not None:      # (a master-weights optimizer's masters)
            self.inner.zero_grad(set_to_none=True)

    @property
    def param_groups(self):
        return self.inner.param_groups if self.inner is not None else []


def wait_gathers(opt: Any) -> None:
    """Before anything but the forward reads the weights: finish ZeRO-1's overlapped
    parameter broadcasts (a no-op for other optimizers)."""
    finish = getattr(opt, "wait_gathers", None)
    if finish is not None:
        finish()


def vectorised_on_host(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` (an optimizer over CPU tensors) as the vectorised CPU Adam the host's rate
    prices (``cpu_adam_params_per_s``, ZeRO-Offload's CPU-Adam): torch's Adam or AdamW made
    with ``fused=True`` where the user's factory chose no implementation (torch's default on
    CPU tensors is the per-tensor loop, 4.4-4.8x slower than the fused step in
    ``benchmarks/data/host_adam_states.txt``); any other optimizer, or one whose
    implementation was chosen, as it is. It steps before any state exists, so nothing is lost:
    the same hyper-parameters, per param group."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state or any(
            g.get("fused") is not None or g.get("foreach") is not None
            or g.get("differentiable") or g.get("capturable") for g in opt.param_groups):
        return opt
    groups = [{**g, "fused": True, "foreach": None} for g in opt.param_groups]
    return type(opt)(groups)


class HostOffloadOptimizer:
    """Runs the optimizer ``factory`` builds on fp32 host copies of the weights: its state and
    the master weights live in host memory; gradients go down, updated weights come back.
    Torch's Adam and AdamW run fused there (``vectorised_on_host``), as the host's rate prices
    the step."""

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 factory: Callable[[Any], torch.optim.Optimizer]):
        self.params = list(params)
        self.host = [local_tensor(p).detach().to("cpu", torch.float32, copy=True).requires_grad_(True)
                     for p in self.params]
        self.inner = vectorised_on_host(factory(self.host))
        self.bytes_moved = 0

    def step(self) -> None:
        with torch.no_grad():
            for p, h in zip(self.params, self.host):
                if grad_of(p) is None:
                    h.grad = None
                    continue
                g = local_tensor(grad_of(p))
                h.grad = g.to("cpu", torch.float32, copy=True)
                self.bytes_moved += g.numel() * g.element_size()
            self.inner.step()
            for p, h in zip(self.params, self.host):
                local = local_tensor(p)
                local.copy_(h.to(local.device, local.dtype))
                self.bytes_moved += local.numel() * local.element_size()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            clear_grad(p)
        for h in self.host:
            h.grad = None

    @property
    def param_groups(self):
        return self.inner.param_groups
