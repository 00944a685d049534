"""Where fp8 pays, linear by linear (``ParallelConfig.fp8_skip``): each linear layer torchao
would convert, priced at the shapes it runs with on one rank (its micro-batch rows, its tp
shard) in 16 bits and in fp8 (``cost/float8.py``). fp8 pays where its faster GEMMs outweigh
its casts: not for small GEMMs (their time is mostly the kernel's fixed part, and each cast
adds kernels) nor for tp-sliced ones whose input is cast whole while the GEMM is a slice. The
linears where it does not pay are the plan's ``fp8_skip`` (torchao's ``module_filter_fn``
leaves them in 16 bits) and ``autoplan inspect`` shows the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autoplan.estimate.cost_inputs import CostInputs, op_work


@dataclass(frozen=True)
class Float8Choice:
    """One linear layer: its module path, its (M, N, K) on one rank, and one micro-batch's
    forward plus backward seconds in 16 bits and in fp8."""

    linear: str
    sides: tuple[float, float, float]
    bf16_s: float
    fp8_s: float

    @property
    def pays(self) -> bool:
        return self.fp8_s < self.bf16_s

    def to_dict(self) -> dict:
        return {"linear": self.linear, "m": self.sides[0], "n": self.sides[1],
                "k": self.sides[2], "bf16_s": self.bf16_s, "fp8_s": self.fp8_s,
                "pays": self.pays}


def fp8_choices(ci: CostInputs) -> tuple[Float8Choice, ...]:
    """Every convertible linear of ``ci``'s graph (``ComputeModel.fp8_linears``, empty where
    the config's fp8 is off or the device has no fp8 rate) priced both ways, in graph order."""
    compute, ops = ci.compute, ci.graph.ops
    out = []
    for i in sorted(compute.fp8_linears):
        scale, split = op_work(ci, i)
        c16 = compute.cost16(i, scale, split)
        c8 = compute.float8_cost(i, scale, split)
        out.append(Float8Choice(linear=ops[i].module_path,
                                sides=compute.product_sides(i, scale, split),
                                bf16_s=c16.fwd_s + c16.bwd_s, fp8_s=c8.fwd_s + c8.bwd_s))
    return tuple(out)


def fp8_skip(choices: tuple[Float8Choice, ...]) -> tuple[str, ...]:
    """The module paths (or patterns) of the linears where fp8 does not pay: a layer index
    becomes ``*`` where every linear of that pattern is skipped (``layers.*.mlp.down_proj``)."""
    skipped = {c.linear for c in choices if not c.pays}
    by_pattern: dict[str, set[str]] = {}
    for c in choices:
        by_pattern.setdefault(_pattern(c.linear), set()).add(c.linear)
    out = set()
    for pattern, paths in by_pattern.items():
        if len(paths) > 1 and paths <= skipped:
            out.add(pattern)
        else:
            out |= paths & skipped
    return tuple(sorted(out))


def _pattern(path: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", path)
