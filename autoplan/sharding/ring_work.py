"""How much of a ring attention's work each rank of a ``c``-way context-parallel axis does, by
sequence layout (``ParallelConfig.cp_layout``), and which attention is causal.

Count the work in units of one chunk's queries against one chunk's keys, a chunk being
``S / 2c`` tokens; a causal diagonal (a chunk against itself) is half a unit. One device's
causal attention is ``(2c)^2 / 2 = 2c^2`` units, its full (non-causal) attention ``4c^2``.

- ``contiguous``: rank ``r`` holds tokens ``r S/c ... (r+1) S/c``, two chunks. With a causal
  mask it computes the blocks of ranks ``0 .. r - 1`` whole (4 units each) and its own
  causally (2 units): ``4r + 2`` units. The ring's critical path is rank ``c - 1``'s
  ``4c - 2`` units, ``(2c - 1) / c^2`` of one device's causal attention against the ideal
  ``1 / c``: 1.5x the ideal at c = 2, 1.75x at 4, 1.875x at 8.
- ``zigzag`` (head-tail; torch's ``context_parallel`` load balancer, ring-flash-attention's
  zigzag): rank ``r`` holds chunks ``r`` and ``2c - 1 - r``. Its own block is causal (2 units);
  against an earlier rank's block both its chunks see that block's first chunk only, against a
  later rank's its second chunk sees the whole block: 2 units each. Every rank: ``2c`` units,
  ``1 / c`` of one device's.

Without a causal mask (a padding or learned mask, or none) every rank computes every block
whole: ``4c`` units either way, ``1 / c``. The runtime's per-step parts
(``runtime/ring_attention.block_parts``) add up to these counts (``tests/test_cp_zigzag.py``).

Which attention is causal: an ``is_causal=True`` call, or one whose mask is built from the
traced shapes alone (it reads no input, weight, buffer or constant, and draws nothing random)
by comparing two position tensors, as Hugging Face causal LMs build theirs under
``torch.export`` (HF BERT's all-visible mask compares positions with a scalar only: not
causal). The runtime proves such a mask causal before it skips blocks
(``runtime/causal_mask.py``); one that is not the causal mask (a sliding window shorter than
the sequence) runs every block, priced here as causal: its critical path is then up to 2x the
price under zigzag.
"""

from __future__ import annotations

import json
from functools import lru_cache

from autoplan.errors import ConfigError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding.config_values import CP_LAYOUTS
_SDPA_IS_CAUSAL = 5          # aten.scaled_dot_product_attention's positional is_causal
_SEEDED_KINDS = frozenset({"dropout"})
_SEEDED_WORDS = ("rand", "bernoulli", "dropout", "multinomial", "normal")
_POSITION_COMPARISONS = frozenset(f"aten.{c}.Tensor" for c in ("le", "lt", "ge", "gt"))


def rank_units(c: int, layout: str, causal: bool) -> tuple[float, ...]:
    """Each rank's attention work in chunk units (module docstring), rank 0 first."""
    if layout not in CP_LAYOUTS:
        raise ConfigError(f"cp_layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    if not causal:
        return tuple(4.0 * c for _ in range(c))
    if layout == "zigzag":
        return tuple(2.0 * c for _ in range(c))
    return tuple(4.0 * r + 2.0 for r in range(c))


def critical_share(c: int, layout: str, causal: bool) -> float:
    """The share of one device's attention work the slowest rank of the ring does (its
    critical path): ``1 / c`` where balanced, ``(2c - 1) / c^2`` for causal contiguous."""
    units = rank_units(c, layout, causal)
    return max(units) / sum(units)


def imbalance(c: int, layout: str, causal: bool) -> float:
    """The slowest rank's work over the mean rank's (1 where balanced)."""
    return critical_share(c, layout, causal) * c


def tp_work_share(graph: OpGraph, i: int, kernel: str, divisor: int) -> float:
    """The share of op ``i``'s work one rank of the tp axis does under a strategy with
    ``kernel`` and ``work_divisor`` ``divisor``: ``1 / divisor``, but for ring attention on the
    tp axis (``sharding="context"``), which runs contiguous pieces: its slowest rank's."""
    if kernel != "ring_attention" or divisor == 1:
        return 1.0 / divisor
    return critical_share(divisor, "contiguous", causal_at(graph, i))


def causal_at(graph: OpGraph, i: int) -> bool:
    """Whether attention op ``i`` of ``graph`` is causal (``is_causal_attention``, kept)."""
    found = graph.__dict__.setdefault("_autoplan_causal_attention", {})
    if i not in found:
        found[i] = is_causal_attention(graph, graph.ops[i])
    return found[i]


def is_causal_attention(graph: OpGraph, op: Op) -> bool:
    """Whether attention ``op`` is causal as the ring runs it (module docstring)."""
    call = json.loads(op.args)
    args, kwargs = call.get("args", []), call.get("kwargs", {})
    flag = kwargs.get("is_causal", args[_SDPA_IS_CAUSAL] if len(args) > _SDPA_IS_CAUSAL
                      else False)
    if flag is True:
        return True
    if len(op.inputs) < 4:
        return False
    return _orders_positions(graph, op.inputs[3])


def _orders_positions(graph: OpGraph, name: str) -> bool:
    """Whether value ``name`` is built from the traced shapes alone (no input, weight, buffer,
    constant or random draw reaches it) and compares two position tensors on the way
    (``q >= k``: ``aten.le/lt/ge/gt.Tensor``), as a causal mask does; an all-visible mask
    (HF BERT's without a padding input) compares positions with a scalar only."""
    producers = _producers(graph)
    seen, todo, compares = set(), [name], False
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        i = producers.get(n)
        if i is None:                    # a leaf: an input, weight, buffer or constant
            return False
        op = graph.ops[i]
        if op.kind in _SEEDED_KINDS or any(w in op.target for w in _SEEDED_WORDS):
            return False
        compares = compares or op.target in _POSITION_COMPARISONS
        todo.extend(op.inputs)
    return compares


def _producers(graph: OpGraph) -> dict[str, int]:
    cache = graph.__dict__.get("_autoplan_producers")
    if cache is None:
        cache = {n: i for i, op in enumerate(graph.ops) for n in op.outputs}
        graph.__dict__["_autoplan_producers"] = cache
    return cache


@lru_cache(maxsize=None)
def describe(c: int, layout: str, causal: bool) -> str:
    """One line on the layout's per-rank attention work, for ``explain``."""
    units = rank_units(c, layout, causal)
    lo, hi = min(units), max(units)
    where = ("head-tail chunks: rank r holds chunks r and 2c-1-r of 2c"
             if layout == "zigzag" else "contiguous pieces: rank r holds piece r of c")
    work = (f"every rank computes {hi / sum(units):.3g} of the attention" if lo == hi else
            f"ranks compute {lo / sum(units):.3g} to {hi / sum(units):.3g} of the causal "
            f"attention, the slowest {imbalance(c, layout, causal):.3g}x the balanced share")
    return f"{layout} ({where}); {work}"


__all__ = ["CP_LAYOUTS", "critical_share", "describe", "imbalance", "is_causal_attention",
           "causal_at", "rank_units", "tp_work_share"]
