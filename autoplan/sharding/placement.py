"""Placements: how one tensor lies on one mesh axis. Small frozen values whose text parses back.

- ``R``       replicated: every rank of the axis holds the whole tensor;
- ``S(d)``    sharded: tensor dim ``d`` is split evenly over the axis (rank r holds the r-th
              contiguous slice);
- ``S(d)[k]`` sharded in ``k`` blocks: dim ``d`` is ``k`` equal blocks laid end to end (a fused
              q/k/v projection's output), and each block is split evenly; rank r holds the r-th
              slice of every block, concatenated. Splitting the dim into its ``k`` blocks gives
              plain ``S(d)`` pieces, which is how a fused projection stays head-sharded;
- ``P``       partial: every rank holds a summand; an all-reduce (or reduce-scatter) makes it
              whole.

The same vocabulary as ``torch.distributed.tensor`` (Replicate / Shard(d) / Partial; blocks are
what DTensor's ``_StridedShard`` expresses), so each placement has one runtime meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autoplan.errors import AutoplanError

_TEXT = re.compile(r"^(R|P|S\((\d{1,2})\)(?:\[(\d{1,3})\])?)$")


@dataclass(frozen=True, order=True)
class Placement:
    kind: str            # "R" | "S" | "P"
    dim: int = -1        # the sharded dim for "S"; -1 otherwise
    blocks: int = 1      # "S" only: equal blocks of the dim, each split over the axis

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P"):
            raise AutoplanError(f"placement kind must be R, S or P, got {self.kind!r}")
        if (self.kind == "S") != (self.dim >= 0):
            raise AutoplanError(f"placement {self.kind} with dim {self.dim}: S needs a dim >= 0, "
                                "R and P take none")
        if self.blocks < 1 or (self.blocks > 1 and self.kind != "S"):
            raise AutoplanError(f"placement {self.kind} with {self.blocks} blocks: only S(d) "
                                "takes blocks, at least 1")

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    def with_dim(self, dim: int) -> Placement:
        """The same kind of split on another dim (a view moved the tensor's dims)."""
        return Placement("S", dim, self.blocks)

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S({self.dim})" + (f"[{self.blocks}]" if self.blocks > 1 else "")

    @staticmethod
    def parse(text: str) -> Placement:
        m = _TEXT.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise AutoplanError(f"cannot parse placement {text!r}: write R, P, S(d) with d a "
                                "tensor dim such as S(0), or S(d)[k] for k blocks")
        if m.group(1) == "R":
            return REPLICATE
        if m.group(1) == "P":
            return PARTIAL
        return Placement("S", int(m.group(2)), int(m.group(3) or 1))


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int, blocks: int = 1) -> Placement:
    return Placement("S", dim, blocks)


def local_size(size: int, p: Placement, t: int) -> int | None:
    """Size of a dim of ``size`` elements on one rank when it is sharded by ``p`` over ``t``
    ranks; None when the split is not even."""
    if size % (p.blocks * t):
        return None
    return size // t


def local_shape(shape: tuple[int, ...], p: Placement, t: int) -> tuple[int, ...] | None:
    """One rank's shape of a tensor of ``shape`` placed ``p`` on a ``t``-way axis (None when
    the split is uneven or names a dim the tensor does not have)."""
    if p.kind != "S" or t == 1:
        return tuple(shape)
    if p.dim >= len(shape):
        return None
    n = local_size(shape[p.dim], p, t)
    if n is None:
        return None
    return tuple(shape[:p.dim]) + (n,) + tuple(shape[p.dim + 1:])
