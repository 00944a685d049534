"""OpGraph: the framework-free operator graph every later stage reads.

An ``OpGraph`` is what ``autoplan.trace`` returns. It holds no torch objects: only names, shapes,
dtypes and numbers, so it is frozen, hashable in content (``fingerprint``), and round-trips
through JSON byte for byte.

Vocabulary
- A *value* is one tensor of the traced program: a graph input, a parameter, a buffer, a
  constant, or an op output. Views do not own memory: a value's ``base`` names the value that
  owns its storage (itself for owners), which is how activation liveness de-duplicates.
- An *op* is one aten call in topological order, with its kind (from the rule registry in
  ``oprules``), forward/backward FLOPs, bytes moved, the parameters it reads, the module path it
  came from, and what autograd keeps for backward (``saved`` values plus internal tensors such as
  dropout masks).
- A *block* is a repeated module (the N layers of a transformer): its instances are contiguous
  op ranges with the same structure, so later stages solve one instance and reuse it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from types import MappingProxyType
from typing import Any

from autoplan import safe_io
from autoplan.errors import TraceError
from autoplan.graph.canonical import canonical_fingerprint, canonical_op_keys
from autoplan.graph.check import GRAPH_LIMITS, check_graph_dict
from autoplan.graph.vocabulary import FLOAT_DTYPES, ITEMSIZE, VALUE_KINDS

SCHEMA_VERSION = 1


def dtype_itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise TraceError(f"unknown dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor (dtype as torch names it, without the ``torch.`` prefix)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def to_json(self) -> list:
        return [list(self.shape), self.dtype]

    @staticmethod
    def from_json(obj: Any) -> TensorMeta:
        shape, dtype = obj
        return TensorMeta(shape=tuple(int(d) for d in shape), dtype=str(dtype))


@dataclass(frozen=True, kw_only=True)
class Value:
    """One tensor of the program. ``base`` is the value owning its storage (itself if owner)."""

    name: str
    kind: str                   # one of VALUE_KINDS
    meta: TensorMeta
    base: str
    requires_grad: bool = False
    fqn: str = ""               # parameters and buffers: the module attribute path

    @property
    def is_view(self) -> bool:
        return self.base != self.name


@dataclass(frozen=True, kw_only=True)
class Op:
    """One aten call. FLOPs are for the traced batch; ``bwd_flops`` is the backward's estimate."""

    name: str
    target: str                 # e.g. "aten.linear.default"
    kind: str                   # rule family, see vocabulary.OP_KINDS
    inputs: tuple[str, ...]     # tensor value names, in argument order
    outputs: tuple[str, ...]    # tensor value names produced
    args: str                   # canonical JSON of the call: tensors as {"v": name}; for profiling
    fwd_flops: int
    bwd_flops: int
    bytes_read: int
    bytes_written: int
    params: tuple[str, ...]     # FQNs of the parameters (and buffers) this op reads directly
    module_path: str            # innermost nn.Module path ("" for the root)
    module_type: str            # its class, e.g. "torch.nn.modules.linear.Linear"
    saved: tuple[str, ...] = ()             # values autograd keeps for this op's backward
    saved_internal: tuple[TensorMeta, ...] = ()  # tensors it keeps that are not graph values
    differentiable: bool = True

    @property
    def is_view(self) -> bool:
        return self.kind == "view"


def opname(op: Op) -> str:
    """The overload packet ("linear" for "aten.linear.default"; higher-order ops as named)."""
    parts = op.target.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


@dataclass(frozen=True, kw_only=True)
class BlockInstance:
    path: str                   # module path of this instance, e.g. "layers.7"
    start: int                  # index of its first op in OpGraph.ops
    stop: int                   # one past its last op


@dataclass(frozen=True, kw_only=True)
class Block:
    """A repeated module: instances share ``signature`` (ops, kinds and shapes in order)."""

    name: str                   # container path, e.g. "layers" or "transformer.h"
    module_type: str
    signature: str
    instances: tuple[BlockInstance, ...]

    @property
    def num_ops(self) -> int:
        first = self.instances[0]
        return first.stop - first.start


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    name: str
    ops: tuple[Op, ...]
    values: tuple[Value, ...]
    inputs: tuple[str, ...]     # user inputs, in call order
    outputs: tuple[str, ...]
    blocks: tuple[Block, ...]
    batch_size: int             # leading dim of the first input at trace time
    meta: Mapping[str, Any] = field(default_factory=dict)  # provenance (torch version, ...)
    schema_version: int = SCHEMA_VERSION

    # ---- look-ups -------------------------------------------------------------------------
    @cached_property
    def _values_by_name(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    @cached_property
    def _op_index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    def value(self, name: str) -> Value:
        try:
            return self._values_by_name[name]
        except KeyError:
            raise KeyError(f"no value {name!r} in graph {self.name!r}") from None

    def op_index(self, name: str) -> int:
        return self._op_index[name]

    @cached_property
    def params(self) -> tuple[Value, ...]:
        """Distinct parameters (a tied weight, e.g. an LM head sharing the embedding, once)."""
        return tuple(v for v in self.values if v.kind == "param" and v.base == v.name)

    @cached_property
    def param_values(self) -> tuple[Value, ...]:
        """Every parameter placeholder, tied aliases included (``base`` names the owner)."""
        return tuple(v for v in self.values if v.kind == "param")

    @cached_property
    def param_reads(self) -> tuple[tuple[int, ...], tuple[tuple[str, str], ...]]:
        """Every parameter an op reads, in op and argument order: the ops' indices (ascending)
        and, beside each, the value read and the storage it is (``base``). For what op ranges
        read (bisect the indices) without walking every op's inputs."""
        index: list[int] = []
        reads: list[tuple[str, str]] = []
        values = self._values_by_name
        for i, op in enumerate(self.ops):
            for n in op.inputs:
                v = values[n]
                if v.kind == "param":
                    index.append(i)
                    reads.append((n, v.base))
        return tuple(index), tuple(reads)

    @cached_property
    def buffers(self) -> tuple[Value, ...]:
        return tuple(v for v in self.values if v.kind == "buffer")

    @property
    def num_params(self) -> int:
        return sum(p.meta.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.meta.nbytes for p in self.params)

    @cached_property
    def fwd_flops(self) -> int:
        return sum(op.fwd_flops for op in self.ops)

    @cached_property
    def bwd_flops(self) -> int:
        return sum(op.bwd_flops for op in self.ops)

    # ---- serialization --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "batch_size": self.batch_size,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "meta": dict(self.meta),
            "values": [_value_to_json(v) for v in self.values],
            "ops": [_op_to_json(op) for op in self.ops],
            "blocks": [_block_to_json(b) for b in self.blocks],
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OpGraph:
        """A graph from its JSON document, checked whole first (``graph/check.py``)."""
        if not isinstance(d, Mapping):
            raise TraceError(f"malformed OpGraph: the top level is a {type(d).__name__}, not "
                             "an object")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"OpGraph schema version {version!r} is not supported (this "
                             f"autoplan reads version {SCHEMA_VERSION}); re-trace the model")
        check_graph_dict(d)
        try:
            return OpGraph(
                name=str(d["name"]),
                batch_size=int(d["batch_size"]),
                inputs=tuple(d["inputs"]),
                outputs=tuple(d["outputs"]),
                meta=dict(d.get("meta", {})),
                values=tuple(_value_from_json(v) for v in d["values"]),
                ops=tuple(_op_from_json(o) for o in d["ops"]),
                blocks=tuple(_block_from_json(b) for b in d.get("blocks", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"malformed OpGraph JSON: {type(e).__name__}: {e}") from e

    @staticmethod
    def from_json(text: str | bytes) -> OpGraph:
        """Read graph JSON with the hardened reader (``autoplan.safe_io``), then check it."""
        text = safe_io.decode(text, what="OpGraph file", error=TraceError, limits=GRAPH_LIMITS)
        d = safe_io.parse_json(text, what="OpGraph file", error=TraceError, limits=GRAPH_LIMITS)
        return OpGraph.from_dict(d)

    def fingerprint(self) -> str:
        """sha256 of the graph's canonical form: the same for two traces of one model whatever
        order its independent ops were traced in and whatever their names (``canonical.py``).
        The graph's name and provenance metadata are left out."""
        return self._cached("_fingerprint", lambda: canonical_fingerprint(self))

    def aliasing_fingerprint(self) -> str:
        """The fingerprint plans of autoplan 0.1 recorded (schemas 6 to 9): the canonical form
        with whether each op's output is a view of its input, which follows the device's kernel
        layouts (``canonical.py``). Kept to match plans written then."""
        return self._cached("_aliasing_fingerprint",
                            lambda: canonical_fingerprint(self, aliasing=True))

    def op_keys(self, aliasing: bool = False) -> Mapping[str, str]:
        """Op name -> the op's canonical key: the same op gets the same key in every trace of
        the model, whatever names and order the trace gave it (``canonical.py``). A plan
        records them, so another process finds the plan's ops among its own. ``aliasing``:
        the keys of plans whose fingerprint is ``aliasing_fingerprint``."""
        return self._cached("_aliasing_op_keys" if aliasing else "_op_keys",
                            lambda: MappingProxyType(canonical_op_keys(self, aliasing)))

    def _cached(self, attr: str, compute: Any) -> Any:
        found = self.__dict__.get(attr)
        if found is None:
            found = compute()
            self.__dict__[attr] = found     # frozen: cached beside the fields
        return found

    def positional_fingerprint(self) -> str:
        """The fingerprint plans recorded before schema 6: sha256 of the graph's JSON in trace
        order, op and value names included (so it changes with PYTHONHASHSEED on some models).
        Kept to match plans written then."""
        d = self.to_dict()
        d.pop("meta")
        d.pop("name")
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
                              ).hexdigest()

    # ---- summary --------------------------------------------------------------------------
    def kind_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for op in self.ops:
            hist[op.kind] = hist.get(op.kind, 0) + 1
        return dict(sorted(hist.items()))

    def summary(self) -> str:
        lines = [
            f"OpGraph {self.name!r}: {len(self.ops)} ops, {len(self.params)} parameter tensors "
            f"({self.num_params:,} parameters), traced batch {self.batch_size}",
            f"  forward {self.fwd_flops / 1e9:,.2f} GFLOP, backward {self.bwd_flops / 1e9:,.2f} GFLOP",
            "  ops by kind: " + ", ".join(f"{k} {n}" for k, n in self.kind_histogram().items()),
        ]
        for b in self.blocks:
            lines.append(f"  repeated block {b.name!r} ({b.module_type.rsplit('.', 1)[-1]}): "
                         f"{len(b.instances)} instances x {b.num_ops} ops")
        if "trace_s" in self.meta:
            lines.append(f"  traced in {self.meta['trace_s']:.2f} s with torch {self.meta.get('torch', '?')}")
        return "\n".join(lines)


# ---- JSON helpers (explicit field lists: the file format is a contract) ---------------------

def _value_to_json(v: Value) -> dict[str, Any]:
    d: dict[str, Any] = {"name": v.name, "kind": v.kind, "meta": v.meta.to_json(), "base": v.base}
    if v.requires_grad:
        d["requires_grad"] = True
    if v.fqn:
        d["fqn"] = v.fqn
    return d


def _value_from_json(d: Mapping[str, Any]) -> Value:
    kind = str(d["kind"])
    if kind not in VALUE_KINDS:
        raise ValueError(f"value kind {kind!r} not in {VALUE_KINDS}")
    return Value(name=str(d["name"]), kind=kind, meta=TensorMeta.from_json(d["meta"]),
                 base=str(d["base"]), requires_grad=bool(d.get("requires_grad", False)),
                 fqn=str(d.get("fqn", "")))


_OP_TUPLE_FIELDS = ("inputs", "outputs", "params", "saved")


def _op_to_json(op: Op) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for f in fields(Op):
        x = getattr(op, f.name)
        if f.name == "saved_internal":
            x = [m.to_json() for m in x]
        elif isinstance(x, tuple):
            x = list(x)
        d[f.name] = x
    return d


def _op_from_json(d: Mapping[str, Any]) -> Op:
    kw = dict(d)
    for name in _OP_TUPLE_FIELDS:
        kw[name] = tuple(str(x) for x in kw.get(name, ()))
    kw["saved_internal"] = tuple(TensorMeta.from_json(m) for m in kw.get("saved_internal", ()))
    return Op(**kw)


def _block_to_json(b: Block) -> dict[str, Any]:
    return {"name": b.name, "module_type": b.module_type, "signature": b.signature,
            "instances": [[i.path, i.start, i.stop] for i in b.instances]}


def _block_from_json(d: Mapping[str, Any]) -> Block:
    return Block(name=str(d["name"]), module_type=str(d["module_type"]),
                 signature=str(d["signature"]),
                 instances=tuple(BlockInstance(path=str(p), start=int(s), stop=int(e))
                                 for p, s, e in d["instances"]))


def unique_storage_bytes(graph: OpGraph, names: Iterable[str]) -> int:
    """Bytes of the distinct storages behind ``names`` (views count their base once)."""
    seen: set[str] = set()
    total = 0
    for n in names:
        base = graph.value(n).base
        if base not in seen:
            seen.add(base)
            total += graph.value(base).meta.nbytes
    return total
