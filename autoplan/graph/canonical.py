"""The canonical form of an OpGraph, which its fingerprint hashes.

Two traces of one model must get one fingerprint even when Python ran independent parts of the
forward in another order and fx numbered the nodes accordingly: Hugging Face Gemma 3 and
ModernBERT loop over a ``set`` of layer types, whose order follows ``PYTHONHASHSEED``, so the two
rotary-embedding chains swap places (and names) from one process to the next. The canonical form
therefore reads no op or value name and no position:

- a graph input is known by its place among the inputs, a parameter or buffer by its FQN, a
  constant by its shape and dtype;
- an op by a hash of what it computes: target, kind, arguments (each tensor argument by the
  label of its value), module path and type, FLOPs and bytes, output shapes and dtypes, and
  what autograd saves; an op's output by the op's hash and the output's index. Whether an
  output aliases its input (a reshape that is a view or a copy) is left out: it follows the
  strides the device's kernels chose (SDPA's output is laid out (B, S, H, D) on the CPU and
  CUDA, (B, H, S, D) on the meta device, so the reshape after it is a view on one and a copy on
  the other), not what the model computes. Plans written before that (autoplan 0.1, plan
  schemas 6 to 9) hashed it: ``aliasing=True`` gives that form, to match them. The hashes are
  computed in one pass in the graph's topological order (Merkle style: an op's hash covers all
  its ancestors);
- the graph by the sorted multiset of its op hashes, its outputs' labels in order, its leaves,
  and its repeated blocks by instance path and size.

Reordering independent ops changes no hash (each depends only on the op and its ancestors) and
renaming changes none. Two ops that compute the same thing from the same values get one hash
and count twice: they are interchangeable. Cost: one regular-expression pass over the op's
encoded arguments and two sha256 per op.

Per-op keys (:func:`canonical_op_keys`) name each op the same way in every trace, so a plan
made in one process finds its ops in another (whose fx names may sit on other ops): the op's
hash above (what it computes, from what) joined, in a second pass in reverse topological order,
with the keys of what reads its outputs (each reader's key, the output read and the argument
place, and the graph outputs it is), so two ops that compute the same thing from the same values
but feed different consumers get different keys. Ops left equal after both passes compute the
same thing from the same values for readers that are alike in turn: they are interchangeable,
and are numbered ``.1``, ``.2``, ... after the first in the order of the trace.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# a tensor argument as trace() encodes it: {"v":"name"}, or {"node":"name"} for another fx node
_REF = re.compile(r'\{"(v|node)":"((?:[^"\\]|\\.)*)"\}')


def _digest(obj: Any) -> str:
    """sha256 of ``repr(obj)``: ``obj`` holds only tuples, lists, strings, ints, floats, bools
    and None, whose repr is deterministic."""
    return hashlib.sha256(repr(obj).encode()).hexdigest()


def _args(text: str, labels: dict[str, str], op_hashes: dict[str, str]) -> str:
    """The op's encoded arguments with every value reference replaced by the value's label."""
    def label(m: re.Match[str]) -> str:
        table = labels if m.group(1) == "v" else op_hashes
        return '{"%s":"%s"}' % (m.group(1), table.get(m.group(2), "?"))
    return _REF.sub(label, text)


def _leaf_labels(graph: Any) -> tuple[dict[str, str], list[Any]]:
    """Labels of the values no op produces (inputs, parameters, buffers, constants) and their
    canonical descriptions."""
    produced = {n for op in graph.ops for n in op.outputs}
    labels: dict[str, str] = {}
    for i, name in enumerate(graph.inputs):
        labels.setdefault(name, f"input:{i}")
    for v in graph.values:
        if v.name in labels or v.name in produced:
            continue
        labels[v.name] = (f"{v.kind}:{v.fqn}" if v.fqn else
                          f"{v.kind}:{v.meta.dtype}{list(v.meta.shape)}")
    leaves = sorted(
        [labels[v.name], v.kind, v.meta.to_json(), v.requires_grad,
         labels.get(v.base, "?") if v.base != v.name else ""]
        for v in graph.values if v.name not in produced)
    return labels, leaves


def _upward(graph: Any, aliasing: bool) -> tuple[dict[str, str], list[Any], list[str]]:
    """One pass in topological order: the labels of every value, the canonical leaves, and each
    op's hash (what it computes from which values, Merkle style), in the graph's op order;
    ``aliasing``: with what each output is a view of (the older form)."""
    labels, leaves = _leaf_labels(graph)
    values = graph._values_by_name
    op_hashes: dict[str, str] = {}
    hashes: list[str] = []
    for op in graph.ops:
        outs = [values[n] if n in values else None for n in op.outputs]
        core = _digest((
            op.target, op.kind, _args(op.args, labels, op_hashes),
            [labels.get(n, "?") for n in op.inputs], op.params,
            op.module_path, op.module_type, op.fwd_flops, op.bwd_flops, op.bytes_read,
            op.bytes_written, op.differentiable, [m.to_json() for m in op.saved_internal],
            [(v.meta.shape, v.meta.dtype, v.requires_grad) if v is not None else None
             for v in outs]))
        op_hashes[op.name] = core
        for k, name in enumerate(op.outputs):
            labels[name] = f"{core}:{k}"
        saved = [labels.get(n, "?") for n in op.saved]
        if aliasing:
            bases = [labels.get(v.base, "?") if v is not None and v.base != v.name else ""
                     for v in outs]
            hashes.append(_digest((core, bases, saved)))
        else:
            hashes.append(_digest((core, saved)))
    return labels, leaves, hashes


def canonical_fingerprint(graph: Any, aliasing: bool = False) -> str:
    """sha256 of the canonical form of ``graph`` (an OpGraph); see the module docstring."""
    labels, leaves, hashes = _upward(graph, aliasing)
    blocks = sorted([b.name, b.module_type, sorted([i.path, i.stop - i.start] for i in b.instances)]
                    for b in graph.blocks)
    return _digest((("schema_version", graph.schema_version), ("batch_size", graph.batch_size),
                    ("inputs", [labels.get(n, "?") for n in graph.inputs]),
                    ("outputs", [labels.get(n, "?") for n in graph.outputs]),
                    ("leaves", leaves), ("ops", sorted(hashes)), ("blocks", blocks)))


KEY_CHARS = 20            # hex characters of an op key (80 bits: no collision in any graph)


def canonical_op_keys(graph: Any, aliasing: bool = False) -> dict[str, str]:
    """Op name -> a key that names the op alike in every trace of the model, whatever names fx
    gave the ops and whatever order independent ops were traced in (module docstring): 20 hex
    characters, with ``.1``, ``.2``, ... on the second, third, ... of interchangeable ops."""
    _, _, hashes = _upward(graph, aliasing)
    ops = graph.ops
    producer = {n: (i, k) for i, op in enumerate(ops) for k, n in enumerate(op.outputs)}
    index = {op.name: i for i, op in enumerate(ops)}
    readers: list[list[tuple[int, Any, Any]]] = [[] for _ in ops]
    for j, op in enumerate(ops):
        for p, n in enumerate(op.inputs):
            if n in producer:
                i, k = producer[n]
                readers[i].append((j, k, p))
        for group, name in _REF.findall(op.args):
            if group == "node" and name in index and index[name] < j:
                readers[index[name]].append((j, "node", ""))
    for idx, n in enumerate(graph.outputs):
        if n in producer:
            i, k = producer[n]
            readers[i].append((-1, k, idx))
    down = [""] * len(ops)
    for i in reversed(range(len(ops))):
        down[i] = _digest((hashes[i], sorted(
            ("graph output" if j < 0 else down[j], str(k), str(p)) for j, k, p in readers[i])))
    seen: dict[str, int] = {}
    keys: dict[str, str] = {}
    for op, d in zip(ops, down):
        key = d[:KEY_CHARS]
        n = seen.get(key, 0)
        seen[key] = n + 1
        keys[op.name] = f"{key}.{n}" if n else key
    return keys


__all__ = ["KEY_CHARS", "canonical_fingerprint", "canonical_op_keys"]
