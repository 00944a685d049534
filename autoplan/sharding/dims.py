"""Where a sharded dim goes through shape-changing ops (views, permutes, slices, broadcasts).

Each function maps the placement (or dim) sharded on an op's input to the one on its output, or
returns ``None`` when the op cannot keep that sharding (the tensor must be gathered first).
``t`` is the number of shards: a target dim must divide evenly. A dim split in ``k`` blocks
(``S(d)[k]``) survives a view that keeps the dim whole, and turns into a plain split of the
next dim when a view cuts the dim into ``(k, ...)`` (a fused q/k/v output viewed as
``(3, heads, head_dim)``: the heads are split).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.sharding.placement import Placement, local_size, shard


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]
                   ) -> list[tuple[list[int], list[int]]] | None:
    """Input and output dims grouped so that each group's sizes multiply to the same number
    (None when the shapes do not have the same number of elements)."""
    groups = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        gi, gj = [i], [j]
        pi = in_shape[i] if i < n_in else 1
        pj = out_shape[j] if j < n_out else 1
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= n_in:
                    return None
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                if j >= n_out:
                    return None
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        groups.append(([k for k in gi if k < n_in], [k for k in gj if k < n_out]))
    return groups


def reshape_placement(in_shape: Sequence[int], out_shape: Sequence[int], p: Placement,
                      t: int) -> Placement | None:
    """A sharded input dim survives a reshape when it is the outermost non-trivial dim of its
    group; it lands on the group's outermost non-trivial output dim, which must divide by
    ``t`` (and by the blocks). A block split whose output group starts with a dim of exactly
    ``blocks`` elements becomes a plain split of the next non-trivial dim. A split dim merged
    into one output dim with the dims before it (``(b, s, h) -> (b * s, h)`` with ``s``
    split) becomes a block split: one block per index of those dims, each split alike."""
    groups = reshape_groups(in_shape, out_shape)
    if groups is None:
        return None
    d = p.dim
    for gi, gj in groups:
        if d not in gi:
            continue
        major_in = next((k for k in gi if in_shape[k] != 1), None)
        outs = [k for k in gj if out_shape[k] != 1]
        if major_in != d:
            if len(outs) != 1:
                return None
            before = 1
            for k in gi:
                if k < d:
                    before *= in_shape[k]
            q = Placement("S", outs[0], p.blocks * before)
            return q if local_size(out_shape[outs[0]], q, t) is not None else None
        if not outs:
            return None
        if p.blocks > 1 and len(outs) > 1 and out_shape[outs[0]] == p.blocks:
            nxt = outs[1]
            return shard(nxt) if local_size(out_shape[nxt], shard(nxt), t) is not None else None
        major_out = outs[0]
        if p.blocks > 1 and len(outs) > 1:
            return None          # the blocks would be cut across dims
        q = p.with_dim(major_out)
        return q if local_size(out_shape[major_out], q, t) is not None else None
    return None


def reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, t: int) -> int | None:
    """The output dim of sharded input dim ``d`` (plain split) after a reshape."""
    q = reshape_placement(in_shape, out_shape, shard(d), t)
    return None if q is None or q.blocks > 1 else q.dim


def permute_dim(perm: Sequence[int], d: int) -> int:
    """Output dim that holds input dim ``d`` after ``permute(perm)``."""
    perm = [p % len(perm) for p in perm]
    return perm.index(d)


def transpose_dim(rank: int, d0: int, d1: int, d: int) -> int:
    d0, d1 = d0 % rank, d1 % rank
    if d == d0:
        return d1
    if d == d1:
        return d0
    return d


def broadcast_dim(in_shape: Sequence[int], out_shape: Sequence[int], d_out: int) -> int | None:
    """Input dim that lines up with output dim ``d_out`` under broadcasting; ``None`` when the
    input does not have it (or has size 1 there: the input stays replicated)."""
    offset = len(out_shape) - len(in_shape)
    d_in = d_out - offset
    if d_in < 0 or in_shape[d_in] == 1:
        return None
    return d_in


def reduced_dim(rank: int, dims: Sequence[int] | int | None, keepdim: bool, d: int) -> int | None:
    """Output dim of input dim ``d`` after reducing ``dims`` (all dims when empty or None);
    None if ``d`` is reduced."""
    if isinstance(dims, int):
        dims = [dims]
    dims = sorted(x % rank for x in dims) if dims else list(range(rank))
    if d in dims:
        return None
    if keepdim:
        return d
    return d - sum(1 for x in dims if x < d)
