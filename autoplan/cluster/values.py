"""Validation of the values cluster and device files hold: each refusal names the file's place,
the value and what to write instead."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from autoplan.errors import ClusterError

def check_keys(data: Any, allowed: tuple[str, ...], where: str, *, required: tuple[str, ...] = ()) -> None:
    """Raise ClusterError unless ``data`` is a mapping whose keys are all in ``allowed``."""
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    for key in data:
        if key not in allowed:
            raise ClusterError(
                f"{where}: unknown key {key!r}; allowed keys are {', '.join(allowed)} "
                "(check the spelling)"
            )
    missing = [key for key in required if key not in data]
    if missing:
        raise ClusterError(f"{where}: missing required key(s) {', '.join(missing)}; add them")


def number(value: Any, what: str, where: str, *, positive: bool = True, at_most: float | None = None) -> float:
    """Coerce a YAML/JSON value to a finite float (numeric strings such as ``"1.5e12"`` accepted,
    because YAML 1.1 reads exponents without a sign as strings) and range-check it."""
    if isinstance(value, bool):
        raise ClusterError(f"{where}: {what} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise ClusterError(f"{where}: {what} must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClusterError(f"{where}: {what} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ClusterError(f"{where}: {what} must be > 0, got {value!r}; give the real figure")
    if not positive and value < 0:
        raise ClusterError(f"{where}: {what} must be >= 0, got {value!r}")
    if at_most is not None and value > at_most:
        raise ClusterError(f"{where}: {what} must be <= {at_most}, got {value!r}")
    return float(value)


# Cluster sizes autoplan describes (a 131,072-device cluster builds in about 3 s); larger
# numbers are refused rather than left to exhaust memory.
MAX_NODES = 16_384
MAX_DEVICES_PER_NODE = 1_024
MAX_WORLD_SIZE = 131_072
MAX_LOCAL_PROCESSES = 1_024


def integer(value: Any, what: str, where: str, *, minimum: int = 1,
            maximum: int | None = None) -> int:
    """Coerce to int (integral floats such as ``8.0`` or ``4e9`` allowed) within bounds."""
    if isinstance(value, bool):
        raise ClusterError(f"{where}: {what} must be an integer, got {value!r}")
    if isinstance(value, (str, float)):
        as_float = number(value, what, where, positive=False)
        if as_float != int(as_float):
            raise ClusterError(f"{where}: {what} must be a whole number, got {value!r}")
        value = int(as_float)
    if not isinstance(value, int):
        raise ClusterError(f"{where}: {what} must be an integer, got {value!r}")
    if value < minimum:
        raise ClusterError(f"{where}: {what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ClusterError(f"{where}: {what} must be at most {maximum:,}, got {value:,} "
                           "(autoplan's documented limit)")
    return value


def text(value: Any, what: str, where: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise ClusterError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value


