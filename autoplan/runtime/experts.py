"""Expert parallelism on one rank: a grouped product over this rank's experts only, its rows
sent to and brought back from the ranks that hold their experts.

Every rank of an ``ep``-way group holds ``experts / ep`` consecutive experts (rank ``j``:
experts ``j * E/ep`` to ``(j + 1) * E/ep - 1``) and routes its own tokens. A grouped product
(rows sorted by expert, cumulative row offsets per expert) then runs as Megatron-Core's and
DeepSpeed-MoE's all-to-all dispatcher does:

1. ``dispatch``: the per-expert row counts are all-gathered over the group (each rank learns
   what it receives from each peer); ``all_to_all_single`` sends each peer the rows of its
   experts (a contiguous block, since rows are sorted by expert); the received rows
   (peer-major) are put expert-major;
2. ``local_experts``: the grouped product over the local experts with the local offsets; the
   row-wise ops between an MoE block's grouped products run on these rows too
   (``sharding/expert_regions.py`` says which);
3. ``combine``: the rows are put back peer-major and the reverse ``all_to_all_single``
   returns each to its token's rank, in the order it left.

A stack of experts applied with ``bmm``/``einsum`` (expert-choice routing: rows ``(experts,
capacity, in)``, weights ``(experts, in, out)``) exchanges evenly instead: ``dispatch_stacked``
sends each peer the slices of its experts and stacks what it receives along the rows
(``(experts / ep, ep * capacity, in)``), the product runs on this rank's experts, and
``combine`` sends every slice back.

Both exchanges are ``all_to_all_single_autograd`` (torch's functional collectives, as
torchtitan's MoE uses), which autograd runs backwards (gradients of the rows go the reverse
way). On gloo, torch 2.13 runs
``all_to_all_single`` with uneven splits (checked in tests); on NCCL it is the native
all-to-all. The expert weights' gradients then hold the contributions of every peer's tokens
and are averaged over the ranks holding the same experts (``trainer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoplan.runtime import tp_comm
from autoplan.runtime.kernels import set_arg
from autoplan.graph.experts import find_experts
from autoplan.runtime.tp_comm import no_grad_gather
from autoplan.sharding.placement import shard


@dataclass
class Dispatched:
    """How one exchange placed the rows: what each peer sent and received, where the received
    rows went (expert-major order) and the local experts' offsets."""

    send: list[int]
    recv: list[int]
    index: torch.Tensor | None             # expert-major position -> received (peer-major) row
    local_offs: torch.Tensor | None
    group: Any = None
    stacked: int = 0                       # ep of an even exchange of stacked rows (0: sorted)


def dispatch(x: torch.Tensor, offs: torch.Tensor, experts: int, comm: Any
             ) -> tuple[torch.Tensor, Dispatched]:
    """Send the rows of ``x`` (sorted by expert; ``offs``: cumulative rows per expert over all
    experts) to the ranks of their experts; returns the rows this rank's ``experts`` local
    experts received, expert-major, and how to send them back."""
    if isinstance(comm, tp_comm.ShapeComm):      # shape check on fake tensors
        return x, Dispatched([], [], None, None)
    e, me = comm.size, comm.rank
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())      # (E,)
    all_counts = comm.all_gather(counts).cpu()                               # (e, E)
    send = counts.cpu().view(e, experts).sum(1).tolist()          # rows to each peer
    mine = all_counts[:, me * experts:(me + 1) * experts]       # (peer, local expert)
    recv = mine.sum(1).tolist()
    rows = _exchange(x, recv, send, comm.group)
    # peer-major (peer, expert) blocks -> expert-major (expert, peer)
    flat = mine.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).tolist()
    sizes = flat.tolist()
    order = [torch.arange(starts[p * experts + k], starts[p * experts + k] + sizes[p * experts + k])
             for k in range(experts) for p in range(e)]
    index = torch.cat(order).to(x.device)
    local_offs = torch.cumsum(mine.sum(0), 0).to(device=offs.device, dtype=offs.dtype)
    return rows.index_select(0, index), Dispatched(send, recv, index, local_offs, comm.group)


def dispatch_stacked(x: torch.Tensor, comm: Any) -> tuple[torch.Tensor, Dispatched]:
    """Send the slices of ``x`` (``(experts, rows, ...)``) to the ranks of their experts;
    returns ``(experts / ep, ep * rows, ...)``: this rank's experts, every peer's rows
    (peer-major), and how to send them back. Shape checks skip the exchange only."""
    e = comm.size
    group = None
    if not isinstance(comm, tp_comm.ShapeComm):
        group = comm.group
        x = _exchange(x, [x.shape[0] // e] * e, [x.shape[0] // e] * e, group)
    n, rows = x.shape[0] // e, x.shape[1]
    y = x.reshape(e, n, *x.shape[1:]).transpose(0, 1).reshape(n, e * rows, *x.shape[2:])
    return y, Dispatched([], [], None, None, group, stacked=e)


def local_experts(op: Any, args: list, kwargs: dict, d: Dispatched,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``op(rows, w, offs)`` on dispatched rows, ``w`` holding this rank's experts (a stacked
    product: ``op`` on the stacked rows and weights), in the traced ``dtype``
    (``_one_dtype``)."""
    if d.stacked:
        return stacked_product(op, args, kwargs, dtype)
    if d.local_offs is None:                     # shape check: rows keep their count
        return args[0] @ args[1][0]
    args, kwargs = _one_dtype(list(args), dtype), dict(kwargs)
    if len(args) > 2:
        args[2] = d.local_offs
    else:
        args, kwargs = set_arg(op, args, kwargs, "offs", d.local_offs)
    return op(*args, **kwargs)


def grouped_product(op: Any, args: list, kwargs: dict,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """A grouped product on all experts (no expert parallelism), its operands in the traced
    ``dtype``."""
    return op(*_one_dtype(list(args), dtype), **kwargs)


def stacked_product(op: Any, args: list, kwargs: dict,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """A stacked experts' product (``bmm(x, w)``, ``einsum(eq, [x, w])``), its factors in the
    traced ``dtype``."""
    args = list(args)
    if len(args) == 2 and isinstance(args[1], (list, tuple)):           # einsum(eq, operands)
        args[1] = _one_dtype(list(args[1]), dtype)
        return op(*args, **kwargs)
    return op(*_one_dtype(args, dtype), **kwargs)


def _one_dtype(args: list, dtype: torch.dtype | None) -> list:
    """Rows and weight of an experts' product in ``dtype``: the dtype of the product's output
    in the program exported under the step's autocast, which is what one device computes it
    in. Under mixed precision the operands can differ from the trace's: FSDP gathers the
    weight in bf16 where a traced cast keeps the rows in fp32, or ZeRO-1's fp32 weight meets
    bf16 rows. The autocast dtype is not the rule: autocast reaches neither HF's grouped product
    (a custom op) nor ``torch._grouped_mm`` (no autocast kernel on any device), so one device
    multiplies HF's experts in fp32 (HF casts the rows to the fp32 weight's dtype); run in
    bf16, HF Qwen3-MoE under tp 2 ended 1.7 times as far from fp32 training as eager autocast.
    ``dtype`` None (no traced dtype): the autocast dtype where autocast is on, else the
    rows'."""
    x, w = args[0], args[1]
    dtype = dtype or tp_comm.autocast_dtype(x) or x.dtype
    if x.dtype != dtype or w.dtype != dtype:
        args[0], args[1] = x.to(dtype), w.to(dtype)
    return args


def combine(y: torch.Tensor, d: Dispatched) -> torch.Tensor:
    """Rows of ``y`` (expert-major, as ``dispatch`` left them) back to their tokens' ranks, in
    the order they left."""
    if d.stacked:
        e = d.stacked
        n, rows = y.shape[0], y.shape[1] // e
        back = y.reshape(n, e, rows, *y.shape[2:]).transpose(0, 1).reshape(
            n * e, rows, *y.shape[2:])
        return back if d.group is None else _exchange(back, [n] * e, [n] * e, d.group)
    if d.index is None:
        return y
    back = torch.empty_like(d.index)
    back[d.index] = torch.arange(d.index.numel(), device=d.index.device)
    return _exchange(y.index_select(0, back), d.send, d.recv, d.group)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: Any) -> torch.Tensor:
    """Rows of ``x`` (``in_splits[j]`` to peer ``j``) exchanged: ``out_splits[j]`` rows from
    peer ``j``, in peer order; differentiable (the backward is the reverse exchange)."""
    from torch.distributed._functional_collectives import (all_to_all_single_autograd,
                                                           wait_tensor)
    y = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return wait_tensor(y)


def expert_parameters(modules: Any, graph: Any, ep: int) -> dict[str, torch.nn.Parameter]:
    """The expert weights (by FQN, checkpoint wrappers dropped) whose slab ``modules`` hold,
    trainable ones only; none when ``ep`` is 1."""
    if ep == 1:
        return {}
    found = find_experts(graph)
    names = set(found.params) if found is not None else set()
    out: dict[str, torch.nn.Parameter] = {}
    for m in modules:
        for k, p in m.named_parameters(remove_duplicate=False):
            k = k.replace("_checkpoint_wrapped_module.", "")
            if k in names and p.requires_grad:
                out.setdefault(k, p)
    return out


def gather_slabs(sd: dict[str, torch.Tensor], names: Any, comm: Any) -> dict[str, torch.Tensor]:
    """``sd`` with each expert weight in ``names`` gathered whole over the expert-parallel
    group (a collective over it)."""
    if comm is None:
        return sd
    out = dict(sd)
    for name in sorted(set(names) & set(sd)):
        out[name] = no_grad_gather(sd[name].contiguous(), comm, shard(0))
    return out
