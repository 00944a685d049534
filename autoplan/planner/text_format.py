"""Numbers and names as the plan's text prints them: seconds, bytes, percentages, rank ranges,
natural sort order. Shared by ``inspect`` (``explain.py``), ``diff``, the comparison with
Megatron-LM and the figures."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


def fmt_s(x: float) -> str:
    if x == 0:
        return "0 s"
    if x >= 100:
        return f"{x:,.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    if x >= 1e-6:
        return f"{x * 1e6:.1f} us"
    return f"{x * 1e9:.0f} ns"


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def fmt_pct(x: float) -> str:
    return f"{x * 100:.1f}%" if x * 100 >= 0.1 or x == 0 else f"{x * 100:.2g}%"


def fmt_change(a: float, b: float) -> str:
    if a == 0:
        return "same" if b == 0 else "new"
    return f"{(b - a) / a * 100:+.1f}%"


def fmt_ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> "0-3,8-9"."""
    out: list[str] = []
    for v in sorted(values):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) + 1 == v:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        elif out and "-" not in out[-1] and int(out[-1]) + 1 == v:
            out[-1] = f"{out[-1]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out) or "none"


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key: "layers.10" after "layers.9", "gpu10" after "gpu2"."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))
