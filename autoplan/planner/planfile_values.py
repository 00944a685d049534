"""The small checkers of the plan file's rules (``planfile_check``, ``objectives_check``):
each returns the value or raises PlanError naming the JSON path of the problem."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from autoplan.errors import PlanError

MAX_STRING_CHARS = 1 << 20        # any one string or key
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---- small checkers: each returns the value or raises PlanError naming the path -----------
def fail(path: str, msg: str) -> None:
    raise PlanError(f"{path or 'top level'}: {msg}")


def closed_keys(d: Any, path: str, known: Any) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        fail(path, f"expected a JSON object, got {kind(d)}")
    unknown = [k for k in d if k not in known]
    if unknown:
        fail(path, f"unknown key(s) {', '.join(sub(path, clip(k)) for k in sorted(unknown))}; "
              f"the keys are {', '.join(known)}")
    missing = [k for k in known if k not in d]
    if missing:
        fail(path, f"missing key(s) {', '.join(sub(path, k) for k in missing)}")
    return d


def a_map(d: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        fail(path, f"expected a JSON object, got {kind(d)}")
    for k in d:
        if not k:
            fail(path, "an empty key; keys are module, op or parameter names")
    return d


def a_list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        fail(path, f"expected a JSON array, got {kind(v)}")
    return list(v)


def an_int(v: Any, path: str, *, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(path, f"expected an integer, got {kind(v)}")
    if v < lo:
        fail(path, f"must be >= {lo}, got {v}")
    return v


def a_num(v: Any, path: str, *, none_ok: bool = False) -> float | None:
    if v is None and none_ok:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(path, f"expected a number{' or null' if none_ok else ''}, got {kind(v)}")
    if not math.isfinite(v) or v < 0:
        fail(path, f"must be a finite number >= 0, got {v!r}")
    return v


def a_str(v: Any, path: str, *, choices: Any = None, pattern: Any = None,
         limit: int = MAX_STRING_CHARS, one_line: bool = False) -> str:
    if not isinstance(v, str):
        fail(path, f"expected a string, got {kind(v)}")
    if len(v) > limit:
        fail(path, f"a string of {len(v):,} characters; the limit is {limit:,}")
    if choices is not None and v not in choices:
        fail(path, f"{clip(v)!r} is not one of {', '.join(choices)}")
    if pattern is not None and not pattern.match(v):
        fail(path, f"{clip(v)!r} does not match {pattern.pattern}")
    if one_line and ("\n" in v or "\r" in v):
        fail(path, "must be one line")
    return v


def a_bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        fail(path, f"expected true or false, got {kind(v)}")
    return v


def sub(path: str, key: str) -> str:
    if _IDENT.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def clip(v: Any, n: int = 80) -> Any:
    return v[:n] + "..." if isinstance(v, str) and len(v) > n else v


def kind(v: Any) -> str:
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, (list, tuple)):
        return "an array"
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
             type(None): "null"}
    return f"{names.get(type(v), type(v).__name__)} {clip(repr(v), 60)}"
