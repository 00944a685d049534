"""Placements: how one tensor lies on one mesh axis. Small frozen values whose text parses back.

- ``R``     replicated: every rank of the axis holds the whole tensor;
- ``S(d)``  sharded: tensor dim ``d`` is split evenly over the axis;
- ``P``     partial: every rank holds a summand; an all-reduce (or reduce-scatter) makes it whole.

The same vocabulary as ``torch.distributed.tensor`` (Replicate / Shard(d) / Partial), so the
runtime maps a placement to its DTensor counterpart one to one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autoplan.errors import AutoplanError

_TEXT = re.compile(r"^(R|P|S\((\d{1,2})\))$")


@dataclass(frozen=True, order=True)
class Placement:
    kind: str            # "R" | "S" | "P"
    dim: int = -1        # the sharded dim for "S"; -1 otherwise

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P"):
            raise AutoplanError(f"placement kind must be R, S or P, got {self.kind!r}")
        if (self.kind == "S") != (self.dim >= 0):
            raise AutoplanError(f"placement {self.kind} with dim {self.dim}: S needs a dim >= 0, "
                                "R and P take none")

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @staticmethod
    def parse(text: str) -> Placement:
        m = _TEXT.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise AutoplanError(f"cannot parse placement {text!r}: write R, P or S(d) with d a "
                                "tensor dim such as S(0)")
        if m.group(1) == "R":
            return REPLICATE
        if m.group(1) == "P":
            return PARTIAL
        return Placement("S", int(m.group(2)))


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int) -> Placement:
    return Placement("S", dim)
