"""Expert parallelism on one rank: a grouped product over this rank's experts only, its rows
sent to and brought back from the ranks that hold their experts.

Every rank of an ``ep``-way group holds ``experts / ep`` consecutive experts (rank ``j``:
experts ``j * E/ep`` to ``(j + 1) * E/ep - 1``) and routes its own tokens. A grouped product
(rows sorted by expert, cumulative row offsets per expert) then runs as Megatron-Core's and
DeepSpeed-MoE's all-to-all dispatcher does:

1. the per-expert row counts are all-gathered over the group (each rank learns what it
   receives from each peer);
2. dispatch: ``all_to_all_single`` sends each peer the rows of its experts (a contiguous
   block, since rows are sorted by expert);
3. the received rows (peer-major) are put expert-major, the grouped product runs over the
   local experts with the local offsets, and the rows are put back peer-major;
4. combine: the reverse ``all_to_all_single`` returns each row to its token's rank, in the
   order it left.

Both exchanges are ``all_to_all_single_autograd`` (torch's functional collectives, as
torchtitan's MoE uses), which autograd runs backwards (gradients of the rows go the reverse
way). On gloo, torch 2.13 runs
``all_to_all_single`` with uneven splits (checked in tests); on NCCL it is the native
all-to-all. The expert weights' gradients then hold the contributions of every peer's tokens
and are averaged over the ranks holding the same experts (``trainer``).
"""

from __future__ import annotations

from typing import Any

import torch

from autoplan.runtime import tp_comm
from autoplan.runtime.kernels import _get, _set


def _operands(op: Any, args: list, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else _get(op, args, kwargs, "offs")
    return x, w, offs


def expert_grouped_mm(op: Any, args: list, kwargs: dict, comm: Any) -> torch.Tensor:
    """``op(x, w, offs)`` with ``w`` holding this rank's ``E / ep`` experts and ``x`` this
    rank's rows sorted over all ``E`` experts; returns the rows of ``x`` multiplied by their
    experts, in ``x``'s order."""
    x, w, offs = _operands(op, args, kwargs)
    if comm is None or isinstance(comm, tp_comm.ShapeComm):
        # shape check on fake tensors: the rows keep their order and count
        return x @ w[0]
    e, me = comm.size, comm.rank
    local = w.shape[0]
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())      # (E,)
    all_counts = comm.all_gather(counts).cpu()                               # (e, E)
    counts = counts.cpu()
    send = counts.view(e, local).sum(1).tolist()                # rows to each peer
    mine = all_counts[:, me * local:(me + 1) * local]           # (peer, local expert)
    recv = mine.sum(1).tolist()
    rows = _exchange(x, recv, send, comm.group)
    # peer-major (peer, expert) blocks -> expert-major (expert, peer)
    starts = torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)
    order = [torch.arange(int(starts[p * local + k]), int(starts[p * local + k] + mine[p, k]))
             for k in range(local) for p in range(e)]
    index = torch.cat(order).to(x.device) if order else torch.zeros(0, dtype=torch.long,
                                                                     device=x.device)
    local_offs = torch.cumsum(mine.sum(0), 0).to(device=offs.device, dtype=offs.dtype)
    args, kwargs = list(args), dict(kwargs)
    args[0] = rows.index_select(0, index)
    if len(args) > 2:
        args[2] = local_offs
    else:
        args, kwargs = _set(op, args, kwargs, "offs", local_offs)
    y = op(*args, **kwargs)
    back = torch.empty_like(index)
    back[index] = torch.arange(index.numel(), device=index.device)
    y = y.index_select(0, back)
    return _exchange(y, send, recv, comm.group)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: Any) -> torch.Tensor:
    """Rows of ``x`` (``in_splits[j]`` to peer ``j``) exchanged: ``out_splits[j]`` rows from
    peer ``j``, in peer order; differentiable (the backward is the reverse exchange)."""
    from torch.distributed._functional_collectives import (all_to_all_single_autograd,
                                                           wait_tensor)
    y = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return wait_tensor(y)
