"""Where a sharded dim goes through shape-changing ops (views, permutes, slices, broadcasts).

Each function maps the dim ``d`` sharded on an op's input to the dim sharded on its output, or
returns ``None`` when the op cannot keep that sharding (the tensor must be gathered first).
``t`` is the number of shards: a target dim must divide evenly.
"""

from __future__ import annotations

from collections.abc import Sequence


def reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, t: int) -> int | None:
    """Group input and output dims whose sizes multiply to the same number; a sharded input dim
    survives when it is the outermost non-trivial dim of its group and the outermost
    non-trivial output dim of that group divides by ``t``."""
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
        if d in gi:
            major_in = next((k for k in gi if k < n_in and in_shape[k] != 1), None)
            if major_in != d:
                return None
            major_out = next((k for k in gj if k < n_out and out_shape[k] != 1), None)
            if major_out is None or out_shape[major_out] % t:
                return None
            return major_out
    return None


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


def reduced_dim(rank: int, dims: Sequence[int], keepdim: bool, d: int) -> int | None:
    """Output dim of input dim ``d`` after reducing ``dims``; None if ``d`` is reduced."""
    dims = sorted(x % rank for x in dims) if dims else list(range(rank))
    if d in dims:
        return None
    if keepdim:
        return d
    return d - sum(1 for x in dims if x < d)
