"""Pinned strategies: the user fixes how some ops shard, the ILP chooses the rest.

``plan(..., pin={"layers.*.attention.wo:linear": "seq_gathered"})`` (CLI ``--pin
PATTERN=STRATEGY``): each key is an ``fnmatch`` pattern over ``"<module path>:<op>"`` (the op's
innermost module and its aten overload packet, e.g. ``layers.3.attention.wo:linear`` or
``layers.0.attention:scaled_dot_product_attention``), each value a strategy name of
``sharding/strategies.py`` (``inspect`` shows the ones a plan chose). Every op a pattern matches
takes that strategy; the ILP prices the rest around them, as it would its own choice. This is
how a layout from another tool or a hand-written recipe is written in autoplan's terms (e.g.
meta's autoparallel's placements for Llama-3-8B, ``tests/test_autoparallel_placements.py``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from fnmatch import fnmatchcase

from autoplan.errors import ConfigError
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.strategies import strategies
from autoplan.sharding.strategy import opname


def op_key(graph: OpGraph, i: int) -> str:
    op = graph.ops[i]
    return f"{op.module_path}:{opname(op)}"


def resolve(graph: OpGraph, pin: Mapping[str, str]) -> dict[int, str]:
    """Op index -> pinned strategy name; a pattern that matches no op is an error."""
    if not isinstance(pin, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in pin.items()):
        raise ConfigError(f"pin must map 'module.path:op' patterns to strategy names, got "
                          f"{pin!r:.80}")
    out: dict[int, str] = {}
    keys = [op_key(graph, i) for i in range(len(graph.ops))]
    for pattern, name in pin.items():
        hits = [i for i, k in enumerate(keys) if fnmatchcase(k, pattern)]
        if not hits:
            near = difflib.get_close_matches(pattern.replace("*", "0"), sorted(set(keys)), n=3)
            raise ConfigError(f"pin {pattern!r} matches no op of {graph.name!r}: keys are "
                              f"'<module path>:<op>'" + (f", e.g. {', '.join(near)}"
                                                         if near else ""))
        for i in hits:
            out[i] = name
    return out


def unavailable(graph: OpGraph, pinned: Mapping[int, str], t: int) -> str | None:
    """Why the pins cannot hold on a ``t``-way tensor-parallel axis, or None."""
    for i, name in sorted(pinned.items()):
        names = [s.name for s in strategies(graph, graph.ops[i], t)]
        if name not in names:
            return (f"op {graph.ops[i].name} ({op_key(graph, i)}) has no strategy {name!r} at "
                    f"tp={t} (it has {', '.join(names)})")
    return None
