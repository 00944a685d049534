"""Collectives on one mesh axis as differentiable functions of local tensors.

The rank program (``program.py``) runs every op on local tensors; between them it calls these.
Each is one placement change with its exact backward (a value's gradient has the value's
placement; ``strategy.derive_comms`` says which function goes where):

- ``gather(x, p)``            S -> R: all-gather; backward keeps this rank's slice;
- ``gather_sp(x, p)``         S -> R into a split op: all-gather; backward reduce-scatters
                              (the op's input gradient is partial: Megatron's sequence parallel);
- ``scatter(x, p)``           R -> S: this rank's slice; backward all-gathers;
- ``reduce(x)``               P -> R: all-reduce; backward passes the gradient on (Megatron's g);
- ``reduce_scatter(x, p)``    P -> S: reduce-scatter; backward all-gathers;
- ``reduce_grad(x)``          R into a split op: identity; backward all-reduces (Megatron's f);
- ``reshard(x, src, dst)``    S -> another split: all-to-all (gather + slice where the backend
                              has none); backward the reverse.

Block splits (``S(d)[k]``) are handled by laying the tensor out rank-major first. Collectives go
through an ``AxisComm``; ``ShapeComm`` stands in for it when the program is only checked for
shapes (no process group, fake tensors).

An axis whose comm says ``zigzag`` (a context-parallel axis with ``cp_layout="zigzag"``) lays
every split dim out head-tail: each block of the dim is cut into ``2t`` chunks and rank ``r``
holds chunks ``r`` and ``2t - 1 - r``, in that order (``zigzag_order``). Every slice, gather and
reduce-scatter on that axis uses it, so all the values split on it agree, and a gather gives
the whole tensor back in its own order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoplan.sharding.placement import Placement

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for all_gather_single /
# reduce_scatter_single (same arguments), with a FutureWarning on every rank a user can do
# nothing about; the torch versions before it that autoplan supports have only the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class AxisComm:
    """A process group over one mesh axis and this rank's index in it."""

    group: Any
    size: int
    rank: int
    zigzag: bool = False        # split dims laid out head-tail (module docstring)

    # rank-major layout: [t, ...] with rank r's piece at index r, contiguous
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        _ALL_GATHER(out.view(-1), x.contiguous().view(-1), group=self.group)
        return out

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tuple(y.shape[1:]), dtype=y.dtype, device=y.device)
        _REDUCE_SCATTER(out.view(-1), y.contiguous().view(-1), group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.group)
        return x

    def all_to_all(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(y)
        dist.all_to_all_single(out, y.contiguous(), group=self.group)
        return out


@dataclass(frozen=True)
class ShapeComm:
    """Shape-correct stand-ins for the collectives (no communication): for checking a program
    on fake tensors before any process group exists."""

    size: int
    rank: int = 0
    zigzag: bool = False

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand((self.size,) + tuple(x.shape)).contiguous()

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        return y[0].clone()

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        return x.clone()

    def all_to_all(self, y: torch.Tensor) -> torch.Tensor:
        return y.clone()


@dataclass(frozen=True)
class Chain:
    """Two axes' groups as one for reductions (a loss split over both the cp and the tp
    axis): all-reduces run over each in turn; ``rank`` is this rank's index over both, outer
    first. Shape checks chain ``ShapeComm`` stand-ins the same way."""

    outer: Any
    inner: Any

    @property
    def size(self) -> int:
        return self.outer.size * self.inner.size

    @property
    def rank(self) -> int:
        return self.outer.rank * self.inner.size + self.inner.rank

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        return self.outer.all_reduce(self.inner.all_reduce(x, op), op)


@dataclass(frozen=True)
class Ranked:
    """Only an index over some axes (a random op's seed offset over the axes that split it)."""

    rank: int


# ---- layouts ---------------------------------------------------------------------------------

def zigzag_order(t: int) -> list[int]:
    """The ``2t`` chunks of a block in the order the ranks of a zigzag axis hold them: rank
    ``r`` holds chunks ``r`` and ``2t - 1 - r`` (``[0, 2t-1, 1, 2t-2, ...]``)."""
    return [c for r in range(t) for c in (r, 2 * t - 1 - r)]


def is_zigzag(comm: Any) -> bool:
    """Whether ``comm``'s axis lays split dims out head-tail (module docstring)."""
    return bool(getattr(comm, "zigzag", False))


def _chunks_in(y: torch.Tensor, dim: int, order: list[int]) -> torch.Tensor:
    index = torch.tensor(order, dtype=torch.long, device=y.device)
    return y.index_select(dim, index)


def rank_major(full: torch.Tensor, p: Placement, t: int, zigzag: bool = False
               ) -> torch.Tensor:
    """[t, ...local] from the whole tensor: piece r is what rank r holds under ``p``."""
    d, k = p.dim, p.blocks
    shape = list(full.shape)
    if zigzag:              # each block's 2t chunks put in the ranks' order first
        m = shape[d] // (k * 2 * t)
        full = _chunks_in(full.reshape(shape[:d] + [k, 2 * t, m] + shape[d + 1:]), d + 1,
                          zigzag_order(t))
    m = shape[d] // (k * t)
    y = full.reshape(shape[:d] + [k, t, m] + shape[d + 1:])
    y = y.movedim(d + 1, 0)
    return y.reshape([t] + shape[:d] + [k * m] + shape[d + 1:])


def from_rank_major(y: torch.Tensor, p: Placement, t: int, zigzag: bool = False
                    ) -> torch.Tensor:
    """The whole tensor from its rank-major pieces (inverse of ``rank_major``)."""
    d, k = p.dim, p.blocks
    local = list(y.shape[1:])
    m = local[d] // k
    z = y.reshape([t] + local[:d] + [k, m] + local[d + 1:])
    z = z.movedim(0, d + 1)
    if zigzag:              # back from the ranks' order of each block's 2t chunks
        order = zigzag_order(t)
        inverse = sorted(range(2 * t), key=order.__getitem__)
        z = _chunks_in(z.reshape(local[:d] + [k, 2 * t, m // 2] + local[d + 1:]), d + 1,
                       inverse)
    return z.reshape(local[:d] + [k * t * m] + local[d + 1:])


def local_piece(full: torch.Tensor, p: Placement, t: int, rank: int, zigzag: bool = False
                ) -> torch.Tensor:
    """This rank's piece of a whole tensor under ``p`` (a copy, contiguous)."""
    if p.kind != "S" or t == 1:
        return full
    return rank_major(full, p, t, zigzag)[rank].contiguous()


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs products in on ``t``'s device, None where it is off: the local
    kernels autocast does not reach (custom autograd functions, grouped products, the ring's
    attention blocks) cast to it themselves."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


# ---- autograd functions ------------------------------------------------------------------------

def _gather(comm, x: torch.Tensor, p: Placement) -> torch.Tensor:
    return from_rank_major(comm.all_gather(x), p, comm.size, is_zigzag(comm))


def _reduce_scatter(comm, x: torch.Tensor, p: Placement) -> torch.Tensor:
    return comm.reduce_scatter(rank_major(x, p, comm.size, is_zigzag(comm)))


rank_major_reduce_scatter = _reduce_scatter


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, p, partial_grad):
        ctx.comm, ctx.p, ctx.partial_grad = comm, p, partial_grad
        return _gather(comm, x, p)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial_grad:
            return _reduce_scatter(ctx.comm, g, ctx.p), None, None, None
        return (local_piece(g, ctx.p, ctx.comm.size, ctx.comm.rank, is_zigzag(ctx.comm)),
                None, None, None)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, p):
        ctx.comm, ctx.p = comm, p
        return local_piece(x, p, comm.size, comm.rank, is_zigzag(comm))

    @staticmethod
    def backward(ctx, g):
        return _gather(ctx.comm, g, ctx.p), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, p):
        ctx.comm, ctx.p = comm, p
        return _reduce_scatter(comm, x, p)

    @staticmethod
    def backward(ctx, g):
        return _gather(ctx.comm, g, ctx.p), None, None


class _ReduceGrad(torch.autograd.Function):
    """Identity forward (``reduce_both``: an all-reduce), all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm, reduce_forward):
        ctx.comm = comm
        return comm.all_reduce(x) if reduce_forward else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g), None, None


def gather(x: torch.Tensor, comm, p: Placement) -> torch.Tensor:
    return _Gather.apply(x, comm, p, False)


def gather_sp(x: torch.Tensor, comm, p: Placement) -> torch.Tensor:
    return _Gather.apply(x, comm, p, True)


def scatter(x: torch.Tensor, comm, p: Placement) -> torch.Tensor:
    return _Scatter.apply(x, comm, p)


def reduce(x: torch.Tensor, comm) -> torch.Tensor:
    return _Reduce.apply(x, comm)


def reduce_scatter(x: torch.Tensor, comm, p: Placement) -> torch.Tensor:
    return _ReduceScatter.apply(x, comm, p)


def reduce_grad(x: torch.Tensor, comm) -> torch.Tensor:
    return _ReduceGrad.apply(x, comm, False)


def reduce_both(x: torch.Tensor, comm) -> torch.Tensor:
    """A sum over the group whose gradient is summed too: every rank's part (a batch norm's
    statistics) feeds every rank's output."""
    return _ReduceGrad.apply(x, comm, True)


def reshard(x: torch.Tensor, comm, src: Placement, dst: Placement) -> torch.Tensor:
    """S(src) -> S(dst): a gather then this rank's slice, each with its exact backward (the
    collective priced as an all-to-all moves the same data one way)."""
    return scatter(gather(x, comm, src), comm, dst)


def no_grad_gather(x: torch.Tensor, comm, p: Placement) -> torch.Tensor:
    """A whole tensor from its pieces, outside autograd (state dicts, checks)."""
    with torch.no_grad():
        return _gather(comm, x, p)
