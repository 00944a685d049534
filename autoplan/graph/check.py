"""Checking an OpGraph read from a file before anything uses it.

A graph file (``autoplan trace -o``) is checked as a whole: every field has its type, every
number is a non-negative integer within bounds (shapes, FLOPs, bytes: NaN and infinity cannot
appear), every name an op or the graph refers to is a value of the graph, each value is produced
once, a view's storage owner exists, ops consume what earlier ops made, and block instances
cover valid op ranges. Any problem is a ``TraceError`` naming the path in the file
(``ops[12].inputs[1]``). What passes can be estimated and planned without an untyped error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from autoplan import safe_io
from autoplan.errors import TraceError
from autoplan.graph.vocabulary import ITEMSIZE, OP_KINDS, VALUE_KINDS

MAX_DIM = 1 << 40                  # one dimension of a tensor
MAX_NUMEL = 1 << 60                # elements of one tensor
MAX_COUNT = 10 ** 30               # FLOPs or bytes of one op
MAX_RANK = 16
GRAPH_LIMITS = safe_io.Limits(max_bytes=1 << 30, max_depth=32, max_string_chars=1 << 20,
                              max_nodes=100_000_000)
TOP_KEYS = ("schema_version", "name", "batch_size", "inputs", "outputs", "meta", "values", "ops",
            "blocks")
OP_KEYS = ("name", "target", "kind", "inputs", "outputs", "args", "fwd_flops", "bwd_flops",
           "bytes_read", "bytes_written", "params", "module_path", "module_type", "saved",
           "saved_internal", "differentiable")
VALUE_KEYS = ("name", "kind", "meta", "base", "requires_grad", "fqn")


def _fail(path: str, msg: str) -> None:
    raise TraceError(f"malformed OpGraph: {path}: {msg}")


def _keys(d: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> Mapping:
    if not isinstance(d, Mapping):
        _fail(path, f"expected an object, got {type(d).__name__}")
    unknown = [k for k in d if k not in allowed]
    if unknown:
        _fail(path, f"unknown key {safe_io.clip(unknown[0])!r}")
    missing = [k for k in required if k not in d]
    if missing:
        _fail(path, f"missing key {missing[0]!r}")
    return d


def _int(v: Any, path: str, hi: int, lo: int = 0) -> int:
    return safe_io.integer(v, path, error=TraceError, lo=lo, hi=hi)


def _str(v: Any, path: str, limit: int = 4096) -> str:
    return safe_io.text(v, path, error=TraceError, limit=limit)


def _names(v: Any, path: str) -> list[str]:
    if not isinstance(v, list):
        _fail(path, f"expected a list, got {type(v).__name__}")
    return [_str(x, f"{path}[{i}]") for i, x in enumerate(v)]


def _meta(v: Any, path: str) -> None:
    if not isinstance(v, list) or len(v) != 2:
        _fail(path, "expected [shape, dtype]")
    shape, dtype = v
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        _fail(f"{path}[0]", f"expected a shape list of at most {MAX_RANK} dims")
    numel = 1
    for i, d in enumerate(shape):
        numel *= _int(d, f"{path}[0][{i}]", MAX_DIM)
    if numel > MAX_NUMEL:
        _fail(f"{path}[0]", f"{numel:,} elements, over the limit of {MAX_NUMEL:,}")
    if _str(dtype, f"{path}[1]") not in ITEMSIZE:
        _fail(f"{path}[1]", f"unknown dtype {safe_io.clip(dtype)!r}")


def check_graph_dict(d: Any) -> None:
    """Raise TraceError unless ``d`` is a well-formed OpGraph document (see the module doc)."""
    _keys(d, "top level", TOP_KEYS, TOP_KEYS[:-1])
    _str(d["name"], "name")
    _int(d["batch_size"], "batch_size", MAX_DIM, lo=1)
    if not isinstance(d.get("meta", {}), Mapping):
        _fail("meta", "expected an object")
    values: dict[str, str] = {}          # name -> kind
    raw_values = d["values"]
    if not isinstance(raw_values, list):
        _fail("values", "expected a list")
    bases = []
    for i, v in enumerate(raw_values):
        p = f"values[{i}]"
        _keys(v, p, VALUE_KEYS, ("name", "kind", "meta", "base"))
        name = _str(v["name"], f"{p}.name")
        if name in values:
            _fail(f"{p}.name", f"value {safe_io.clip(name)!r} is defined twice")
        kind = _str(v["kind"], f"{p}.kind")
        if kind not in VALUE_KINDS:
            _fail(f"{p}.kind", f"{safe_io.clip(kind)!r} is not one of {VALUE_KINDS}")
        _meta(v["meta"], f"{p}.meta")
        bases.append((_str(v["base"], f"{p}.base"), f"{p}.base"))
        if not isinstance(v.get("requires_grad", False), bool):
            _fail(f"{p}.requires_grad", "expected true or false")
        _str(v.get("fqn", ""), f"{p}.fqn")
        values[name] = kind
    for base, p in bases:
        if base not in values:
            _fail(p, f"names no value ({safe_io.clip(base)!r})")
    for key in ("inputs", "outputs"):
        for i, n in enumerate(_names(d[key], key)):
            if n not in values:
                _fail(f"{key}[{i}]", f"names no value ({safe_io.clip(n)!r})")
    made: set[str] = {n for n, k in values.items() if k != "activation"}
    seen_ops: set[str] = set()
    ops = d["ops"]
    if not isinstance(ops, list):
        _fail("ops", "expected a list")
    for i, op in enumerate(ops):
        _check_op(op, f"ops[{i}]", values, made, seen_ops)
    blocks = d.get("blocks", [])        # optional: a graph with no repeated blocks
    if not isinstance(blocks, list):
        _fail("blocks", "expected a list")
    for i, b in enumerate(blocks):
        p = f"blocks[{i}]"
        _keys(b, p, ("name", "module_type", "signature", "instances"),
              ("name", "module_type", "signature", "instances"))
        for k in ("name", "module_type", "signature"):
            _str(b[k], f"{p}.{k}")
        if not isinstance(b["instances"], list) or not b["instances"]:
            _fail(f"{p}.instances", "expected a non-empty list")
        for j, inst in enumerate(b["instances"]):
            q = f"{p}.instances[{j}]"
            if not isinstance(inst, list) or len(inst) != 3:
                _fail(q, "expected [path, start, stop]")
            _str(inst[0], f"{q}[0]")
            start = _int(inst[1], f"{q}[1]", len(ops))
            stop = _int(inst[2], f"{q}[2]", len(ops))
            if stop <= start:
                _fail(q, f"an empty op range [{start}, {stop})")


def _check_op(op: Any, p: str, values: dict[str, str], made: set[str],
              seen_ops: set[str]) -> None:
    _keys(op, p, OP_KEYS, OP_KEYS[:12])          # name ... module_path
    name = _str(op["name"], f"{p}.name")
    if name in seen_ops:
        _fail(f"{p}.name", f"op {safe_io.clip(name)!r} appears twice")
    seen_ops.add(name)
    _str(op["target"], f"{p}.target")
    if _str(op["kind"], f"{p}.kind") not in OP_KINDS:
        _fail(f"{p}.kind", f"{safe_io.clip(op['kind'])!r} is not one of {OP_KINDS}")
    for i, n in enumerate(_names(op["inputs"], f"{p}.inputs")):
        if n not in values:
            _fail(f"{p}.inputs[{i}]", f"names no value ({safe_io.clip(n)!r})")
        if n not in made:
            _fail(f"{p}.inputs[{i}]", f"{safe_io.clip(n)!r} is read before an op makes it")
    for i, n in enumerate(_names(op["outputs"], f"{p}.outputs")):
        if n not in values or values[n] != "activation":
            _fail(f"{p}.outputs[{i}]", f"names no activation value ({safe_io.clip(n)!r})")
        if n in made:
            _fail(f"{p}.outputs[{i}]", f"{safe_io.clip(n)!r} is made twice")
        made.add(n)
    for i, n in enumerate(_names(op.get("saved", []), f"{p}.saved")):
        if n not in values:
            _fail(f"{p}.saved[{i}]", f"names no value ({safe_io.clip(n)!r})")
    for k in ("fwd_flops", "bwd_flops", "bytes_read", "bytes_written"):
        _int(op[k], f"{p}.{k}", MAX_COUNT)
    _names(op["params"], f"{p}.params")
    _str(op["module_path"], f"{p}.module_path")
    _str(op.get("module_type", ""), f"{p}.module_type")
    if not isinstance(op.get("differentiable", True), bool):
        _fail(f"{p}.differentiable", "expected true or false")
    internal = op.get("saved_internal", [])
    if not isinstance(internal, list):
        _fail(f"{p}.saved_internal", "expected a list")
    for i, m in enumerate(internal):
        _meta(m, f"{p}.saved_internal[{i}]")
    args = _str(op["args"], f"{p}.args", limit=1 << 20)
    parsed = safe_io.parse_json(args, what=f"malformed OpGraph: {p}.args", error=TraceError)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("args"), list) \
            or not isinstance(parsed.get("kwargs"), dict):
        _fail(f"{p}.args", "expected a JSON object with an 'args' list and a 'kwargs' object")
    json.dumps(parsed)      # plain data only (parse_json guarantees it)
