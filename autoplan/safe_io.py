"""One hardened reader for every file autoplan reads: plans, cluster files (YAML or JSON),
profiles and OpGraphs.

Hostile or broken input is refused, never executed, and never allowed to hang or exhaust
memory: the size is checked before reading, the bytes must be UTF-8, JSON is parsed with hooks
that refuse duplicate keys, NaN/Infinity and over-long numbers, YAML with a safe loader that
refuses duplicate keys, custom tags and alias bombs, and the result is walked iteratively for
depth and string length. Every problem raises the format's own error (``PlanError``,
``ClusterError``, ``ProfileError``, ``TraceError``) naming the file.

``number`` / ``integer`` / ``text`` check a value inside a parsed document, naming its path
(``fabric.num_nodes``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoplan.errors import AutoplanError


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 64 << 20         # refuse larger files before reading them
    max_depth: int = 64               # nesting of lists and objects
    max_string_chars: int = 1 << 20   # any one string or key
    max_number_chars: int = 40        # characters of one number (20 digits fit any int64)
    max_aliases: int = 1000           # YAML alias uses (anchors themselves are fine)
    max_nodes: int = 5_000_000        # values in the whole document


DEFAULT = Limits()


def read_text(path: str | os.PathLike[str], *, what: str, error: type[AutoplanError],
              limits: Limits = DEFAULT) -> str:
    """The file's text, refused when missing, too large or not UTF-8."""
    path = os.fspath(path)
    try:
        size = os.stat(path).st_size
        if size > limits.max_bytes:
            raise error(f"{what} {path!r} is {size:,} bytes, over the {limits.max_bytes:,}-byte "
                        "limit")
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except FileNotFoundError:
        raise error(f"no {what} at {path!r}") from None
    except IsADirectoryError:
        raise error(f"{what} {path!r} is a directory, not a file") from None
    except OSError as e:
        raise error(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    return decode(data, what=f"{what} {path!r}", error=error, limits=limits)


def decode(data: bytes | bytearray | str, *, what: str, error: type[AutoplanError],
           limits: Limits = DEFAULT) -> str:
    if isinstance(data, str):
        text = data
    elif isinstance(data, (bytes, bytearray)):
        if len(data) > limits.max_bytes:
            raise error(f"{what}: {len(data):,} bytes, over the {limits.max_bytes:,}-byte limit")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what}: not UTF-8 text (invalid byte at offset {e.start})") from None
    else:
        raise error(f"{what}: expected text or bytes, got {type(data).__name__}")
    if len(text) > limits.max_bytes:
        raise error(f"{what}: {len(text):,} characters, over the {limits.max_bytes:,} limit")
    return text


def parse_json(text: str, *, what: str, error: type[AutoplanError],
               limits: Limits = DEFAULT) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{what}: duplicate key {clip(k)!r} in one JSON object; each key "
                            "may appear once")
            out[k] = v
        return out

    def no_constant(name: str) -> Any:
        raise error(f"{what}: {name} is not allowed (numbers must be finite)")

    def finite_float(s: str) -> float:
        if len(s) > limits.max_number_chars:
            raise error(f"{what}: number {s[:20]}... has {len(s)} characters; the limit is "
                        f"{limits.max_number_chars}")
        value = float(s)
        if not math.isfinite(value):
            raise error(f"{what}: number {s} overflows to infinity; numbers must be finite")
        return value

    def bounded_int(s: str) -> int:
        if len(s) > limits.max_number_chars:
            raise error(f"{what}: integer {s[:20]}... has {len(s)} digits; the limit is "
                        f"{limits.max_number_chars}")
        return int(s)
    try:
        obj = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant,
                         parse_float=finite_float, parse_int=bounded_int)
    except json.JSONDecodeError as e:
        ended = e.pos >= len(text.rstrip()) - 1 or e.msg.startswith("Unterminated string")
        hint = "the text ends early: the file looks truncated" if ended else \
            "fix the JSON syntax"
        raise error(f"{what}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno}); "
                    f"{hint}") from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply (limit {limits.max_depth})") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise error(f"{what}: not a valid JSON document: {e}") from None
    check_shape(obj, what=what, error=error, limits=limits)
    return obj


def parse_yaml(text: str, *, what: str, error: type[AutoplanError],
               limits: Limits = DEFAULT) -> Any:
    """YAML through a safe loader: no custom tags, no duplicate keys, bounded aliases."""
    import yaml

    class Loader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                Loader.aliases += 1
                if Loader.aliases > limits.max_aliases:
                    raise error(f"{what}: more than {limits.max_aliases} YAML aliases (an "
                                "alias bomb?); write the values out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hashable = hash(key) is not None
                except TypeError:
                    hashable = False
                if hashable and key in seen:
                    raise error(f"{what}: duplicate key {clip(key)!r} (line "
                                f"{key_node.start_mark.line + 1}); each key may appear once")
                if hashable:
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)
    Loader.aliases = 0
    try:
        obj = yaml.load(text, Loader=Loader)     # noqa: S506 (a SafeLoader subclass)
    except AutoplanError:
        raise
    except yaml.YAMLError as e:
        raise error(f"{what}: not valid YAML: {str(e).splitlines()[0][:300]}") from None
    except RecursionError:
        raise error(f"{what}: YAML nested too deeply (limit {limits.max_depth})") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise error(f"{what}: not a valid YAML document: {e}") from None
    check_shape(obj, what=what, error=error, limits=limits)
    return obj


def check_shape(obj: Any, *, what: str, error: type[AutoplanError],
                limits: Limits = DEFAULT) -> None:
    """Depth, size, string length and finite numbers, iteratively (no recursion on hostile
    input). Shared subtrees (YAML aliases) count once per use."""
    stack = [(obj, 1)]
    nodes = 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise error(f"{what}: more than {limits.max_nodes:,} values")
        if depth > limits.max_depth:
            raise error(f"{what}: nested deeper than {limits.max_depth} levels")
        if isinstance(v, str):
            if len(v) > limits.max_string_chars:
                raise error(f"{what}: a string of {len(v):,} characters (limit "
                            f"{limits.max_string_chars:,})")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise error(f"{what}: {v} is not allowed (numbers must be finite)")
        elif isinstance(v, int) and not isinstance(v, bool):
            if abs(v) >= 10 ** limits.max_number_chars:
                raise error(f"{what}: an integer of more than {limits.max_number_chars} digits")
        elif isinstance(v, Mapping):
            stack.extend((k, depth) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v)
        elif v is not None and not isinstance(v, bool):
            raise error(f"{what}: a value of type {type(v).__name__} (only strings, numbers, "
                        "booleans, null, lists and mappings)")


# ---- values inside a parsed document ------------------------------------------------------------

def clip(v: Any, n: int = 60) -> Any:
    s = repr(v) if not isinstance(v, str) else v
    return s if len(s) <= n else s[:n] + "..."


def integer(v: Any, path: str, *, error: type[AutoplanError], lo: int = 0,
            hi: int | None = None) -> int:
    """An int (not a bool, float or string) within [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise error(f"{path}: expected an integer, got {type(v).__name__} {clip(v)!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo:,} and {hi:,}" if hi is not None else f"at least {lo:,}"
        raise error(f"{path}: {v:,} is out of range; it must be {bound}")
    return v


def number(v: Any, path: str, *, error: type[AutoplanError], lo: float = 0.0,
           hi: float | None = None) -> float:
    """A finite int or float (not a bool or string) within [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise error(f"{path}: expected a number, got {type(v).__name__} {clip(v)!r}")
    try:
        x = float(v)
    except OverflowError:
        raise error(f"{path}: {clip(v)} is too large") from None
    if not math.isfinite(x) or x < lo or (hi is not None and x > hi):
        bound = f"between {lo:g} and {hi:g}" if hi is not None else f"at least {lo:g}"
        raise error(f"{path}: {clip(v)} is out of range; it must be finite and {bound}")
    return x


def text(v: Any, path: str, *, error: type[AutoplanError], limit: int = 4096) -> str:
    if not isinstance(v, str):
        raise error(f"{path}: expected a string, got {type(v).__name__} {clip(v)!r}")
    if len(v) > limit:
        raise error(f"{path}: a string of {len(v):,} characters (limit {limit:,})")
    return v
