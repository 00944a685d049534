"""Context parallelism on one rank: attention over a sequence split on the tensor-parallel axis,
the key/value blocks passed around the ring while each block's attention runs (ring attention:
Liu et al. 2023; torch's ``context_parallel`` does the same with DTensor).

Rank ``r`` of ``t`` holds rows ``r * S/t ...`` of the queries, keys and values. For ``t`` steps
it attends its queries to the key/value block it holds (its own first, then the one the rank
before it held), merges the block's output with the running one by their log-sum-exps, and
passes the block on to the next rank, the transfer in flight while the block's attention
computes. With a causal mask, the blocks after its own are skipped (still passed on); with an
explicit mask, each block takes its columns of the rank's mask rows.

Under the zigzag layout (``ParallelConfig.cp_layout="zigzag"``, the comm's ``zigzag``) rank ``r``
holds sequence chunks ``r`` and ``2t - 1 - r`` of ``2t`` (``tp_comm.zigzag_order``), and so does
every key/value block. With a causal mask each step then computes half a block's work on every
rank (``block_parts``): its own block causally; an earlier rank's block (``j < r``): all its
queries against the block's first chunk; a later rank's (``j > r``): its second chunk of
queries against the whole block. Every rank does the same work, where in the contiguous layout
rank ``r`` computes ``r`` blocks and a causal diagonal (``sharding/ring_work.py`` prices both).

The backward runs the ring again: each block's gradients come from the fused attention backward
given the merged output and log-sum-exp (the softmax over all blocks), the query's gradient
adds up here, and the key/value gradients travel with their blocks and come home after one more
step. Blocks use the fused kernels that return a log-sum-exp: on the CPU
``_scaled_dot_product_flash_attention_for_cpu`` (with any mask), on CUDA
``_scaled_dot_product_efficient_attention`` (its ``attn_bias``); memory per rank stays
``O(S/t)``, no score matrix is kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autoplan.runtime import tp_comm
from autoplan.runtime.kernels import get_arg

aten = torch.ops.aten


def ring_attention(op: Any, args: list, kwargs: dict, comm: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` on this rank's rows of a sequence split ``comm.size``
    ways (dropout 0, equal query and key lengths, as the ``seq`` strategy requires)."""
    q, k, v = args[0], args[1], args[2]
    mask = get_arg(op, args, kwargs, "attn_mask")
    causal = bool(get_arg(op, args, kwargs, "is_causal", False))
    scale = get_arg(op, args, kwargs, "scale")
    if isinstance(comm, tp_comm.ShapeComm):       # shape check on fake tensors
        return (q @ k.transpose(-2, -1)) @ v
    # one dtype, as autocast gives attention (the kernels below are outside its lists): under
    # mixed precision a rotary embedding computed in fp32 leaves q and k fp32 beside a bf16 v
    dtype = tp_comm.autocast_dtype(q) or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~mask, torch.finfo(q.dtype).min)
    return _Ring.apply(q, k, v, mask, causal, scale, comm)


def _block(q, k, v, mask, causal, scale):
    """(output, log-sum-exp (B, H, S) in fp32) of one block."""
    if q.device.type == "cuda":
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.float()


def _block_backward(dout, q, k, v, out, lse, mask, causal, scale):
    if q.device.type == "cuda":
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        pad = (-q.shape[2]) % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, mask, out, lse_p.contiguous(), seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(torch.float32), 0.0, causal, attn_mask=mask, scale=scale)


class _Pass:
    """Tensors handed to the next rank of the ring while this one works (async p2p)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], comm: Any):
        t, r = comm.size, comm.rank
        nxt = dist.get_global_rank(comm.group, (r + 1) % t)
        prv = dist.get_global_rank(comm.group, (r - 1) % t)
        self.recv = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors)
        ops = [dist.P2POp(dist.isend, x.contiguous(), nxt, comm.group) for x in tensors]
        ops += [dist.P2POp(dist.irecv, y, prv, comm.group) for y in self.recv]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in self.works:
            w.wait()
        return self.recv


ALL = slice(None)


def block_parts(zigzag: bool, causal: bool, has_mask: bool, t: int, r: int, j: int, rows: int
                ) -> list[tuple[slice, slice, bool]]:
    """What rank ``r`` of ``t`` (``rows`` local query rows) computes against the key/value
    block rank ``j`` held: ``(query rows, key rows, causal)`` parts, none where the block lies
    wholly above the diagonal. With a mask (``has_mask``) every block is computed whole, with
    its columns of the mask (``_mask_columns``)."""
    if has_mask or not causal:
        return [(ALL, ALL, False)]
    if j == r:                    # its own block: causal in either layout (chunks ascend)
        return [(ALL, ALL, True)]
    if not zigzag:
        return [] if j > r else [(ALL, ALL, False)]
    half = rows // 2
    if j < r:                     # chunk j precedes both of r's, chunk 2t-1-j follows both
        return [(ALL, slice(0, half), False)]
    return [(slice(half, None), ALL, False)]   # only chunk 2t-1-r follows both of j's


def _mask_columns(mask, zigzag: bool, t: int, j: int, rows: int):
    """The columns of the rank's mask rows (whole keys, in sequence order) that block ``j``
    holds."""
    if mask is None:
        return None
    if not zigzag:
        return mask[..., j * rows:(j + 1) * rows]
    h = rows // 2
    return torch.cat([mask[..., j * h:(j + 1) * h],
                      mask[..., (2 * t - 1 - j) * h:(2 * t - j) * h]], dim=-1)


def _parts(mask, causal, comm, j, rows):
    """(query rows, key rows, mask, causal) of each part this rank computes against block j."""
    zz = tp_comm.is_zigzag(comm)
    m = _mask_columns(mask, zz, comm.size, j, rows)
    out = []
    for qs, ks, diag in block_parts(zz, causal, mask is not None, comm.size, comm.rank, j,
                                    rows):
        out.append((qs, ks, None if m is None else m[..., qs, ks] if m.shape[-2] > 1
                    else m[..., ks], diag))
    return out


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, comm):
        t, r, rows = comm.size, comm.rank, q.shape[2]
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = (k, v)
        for i in range(t):
            j = (r - i) % t
            pending = _Pass(kv, comm) if i < t - 1 else None
            for qs, ks, m, diag in _parts(mask, causal, comm, j, rows):
                o_i, lse_i = _block(q[:, :, qs].contiguous(), kv[0][:, :, ks].contiguous(),
                                    kv[1][:, :, ks].contiguous(), m, diag, scale)
                old = lse[:, :, qs]
                new = torch.logaddexp(old, lse_i)
                keep = torch.exp(old - new).nan_to_num(0.0).unsqueeze(-1)
                add = torch.exp(lse_i - new).nan_to_num(0.0).unsqueeze(-1)
                out[:, :, qs] = out[:, :, qs] * keep + o_i.float() * add
                lse[:, :, qs] = new
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        ctx.causal, ctx.scale, ctx.comm, ctx.masked = causal, scale, comm, mask is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.masked else None
        comm = ctx.comm
        t, r, rows = comm.size, comm.rank, q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = (k, v)
        # the block's gradient sums travel one step behind it: received from the rank
        # before, this rank's part added, passed on while the next block computes; after
        # the last step they arrive home
        acc = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        inflight = None
        for i in range(t):
            j = (r - i) % t
            pending = _Pass(kv, comm) if i < t - 1 else None
            grads = []
            for qs, ks, m, diag in _parts(mask, ctx.causal, comm, j, rows):
                gq, gk, gv = _block_backward(
                    dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                    kv[0][:, :, ks].contiguous(), kv[1][:, :, ks].contiguous(),
                    out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), m, diag, ctx.scale)
                dq[:, :, qs] += gq.float()
                grads.append((ks, gk.float(), gv.float()))
            if inflight is not None:
                acc = inflight.wait()     # fresh buffers: added to in place
            for ks, gk, gv in grads:
                acc[0][:, :, ks] += gk
                acc[1][:, :, ks] += gv
            inflight = _Pass(acc, comm)
            if pending is not None:
                kv = pending.wait()
        dk, dv = inflight.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
