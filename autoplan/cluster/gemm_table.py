"""A device's measured GEMM rate by shape: how fast its vendor library runs an M x K by K x N
16-bit matrix product, relative to a large one.

A product's rate falls when any side is small: few rows leave SMs idle (a tile wave is not
filled), a short contraction leaves the tensor cores waiting on loads, and every product pays
its tile set-up. A roofline with one efficiency prices a 2,048-wide layer's GEMMs as fast as a
12,288-wide one's; a measured table does not.

``GemmShapeTable`` holds the fractions on a grid of sides (the same points for M, N and K),
relative to the grid's largest product. Between points the fraction interpolates linearly in
the logarithm of each side (trilinear); beyond the grid each side holds at its end, so products
larger than the grid run at its largest point's rate, the rate ``matmul_efficiency`` describes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoplan.cluster.values import number
from autoplan.errors import ClusterError


@dataclass(frozen=True)
class GemmShapeTable:
    """Fractions of the large-product rate on a grid: ``fractions[(i * n + j) * n + l]`` is the
    product with M = sides[i], N = sides[j], K = sides[l] (n = len(sides))."""

    sides: tuple[float, ...]
    fractions: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.sides)
        if n < 2 or any(b <= a for a, b in zip(self.sides, self.sides[1:])) or self.sides[0] <= 0:
            raise ClusterError(f"GEMM shape table: sides must be at least two rising positive "
                               f"numbers, got {list(self.sides)}")
        if len(self.fractions) != n ** 3:
            raise ClusterError(f"GEMM shape table: {n} sides need {n ** 3} fractions "
                               f"(M x N x K), got {len(self.fractions)}")

    def fraction(self, m: float, n: float, k: float) -> float:
        """The rate of an ``m`` x ``k`` by ``k`` x ``n`` product as a fraction of the largest's."""
        size = len(self.sides)
        at = [self._locate(x) for x in (m, n, k)]
        out = 0.0
        for corner in range(8):
            w = 1.0
            idx = []
            for d in range(3):
                lo, frac = at[d]
                hi = corner >> d & 1
                w *= frac if hi else 1.0 - frac
                idx.append(min(lo + hi, size - 1))
            if w:
                out += w * self.fractions[(idx[0] * size + idx[1]) * size + idx[2]]
        return out

    def _locate(self, x: float) -> tuple[int, float]:
        """(lower grid index, weight of the upper one) of side ``x`` in log space."""
        s = self.sides
        if x <= s[0]:
            return 0, 0.0
        if x >= s[-1]:
            return len(s) - 1, 0.0
        for i in range(len(s) - 1):
            if x <= s[i + 1]:
                return i, math.log(x / s[i]) / math.log(s[i + 1] / s[i])
        return len(s) - 1, 0.0                      # unreachable

    def to_value(self) -> dict[str, Any]:
        """The YAML/JSON form: the sides and the fractions nested [M][N][K]."""
        n = len(self.sides)
        f = self.fractions
        return {"sides": list(self.sides),
                "fractions": [[list(f[(i * n + j) * n:(i * n + j + 1) * n]) for j in range(n)]
                              for i in range(n)]}

    @staticmethod
    def from_value(value: Any, where: str) -> GemmShapeTable:
        what = "matmul_shape_efficiency"
        if not isinstance(value, dict) or set(value) != {"sides", "fractions"}:
            raise ClusterError(f"{where}: {what} must be a mapping with 'sides' (a list of "
                               f"sizes) and 'fractions' (nested [M][N][K] lists), got {value!r}")
        sides = value["sides"]
        if isinstance(sides, (str, bytes)) or not isinstance(sides, (list, tuple)):
            raise ClusterError(f"{where}: {what}.sides must be a list of sizes, got {sides!r}")
        sides_f = tuple(number(x, f"{what}.sides[{i}]", where) for i, x in enumerate(sides))
        n = len(sides_f)
        flat = []

        def rows(x: Any, label: str) -> list:
            if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)) or len(x) != n:
                raise ClusterError(f"{where}: {what}.fractions{label} must be a list of {n} "
                                   f"entries (one per side), got {x!r}")
            return list(x)
        for i, plane in enumerate(rows(value["fractions"], "")):
            for j, line in enumerate(rows(plane, f"[{i}]")):
                for k, x in enumerate(rows(line, f"[{i}][{j}]")):
                    flat.append(number(x, f"{what}.fractions[{i}][{j}][{k}]", where,
                                       at_most=2.0))
        return GemmShapeTable(sides_f, tuple(flat))
