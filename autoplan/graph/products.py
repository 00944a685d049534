"""The products as einsum equations: which dims of which operands meet in each matmul-like op.

One ``ProductSpec`` describes every matmul-like op family (``linear``, ``addmm``, ``mm``,
``bmm``, ``baddbmm``, ``matmul``, ``einsum``, the experts' grouped product), as DTensor's
``_mm_like_strategy("mk,kn->mn")`` does: the subscripts of its two factors and of its output,
read from the op's call and its tensors' ranks. The dims then fall into classes by where their
letter appears (``EinsumDims``):

- ``batch``: in both factors and the output (``b`` of ``bmk,bkn->bmn``);
- ``lhs_free`` / ``rhs_free``: in one factor and the output (``m``, ``n``);
- ``contracted``: in both factors, not the output (``k``: a split leaves partial sums);
- ``grouped``: in one factor only, selecting which of its slices multiplies each run of the
  other factor's rows (``torch._grouped_mm``'s experts: ``mk,ekn->mn`` with row offsets).

The sharding rule (``sharding/products.py``) enumerates its strategies from these classes, and
the experts finder (``graph/experts.py``) reads a weight's ``batch`` or ``grouped`` dim as its
expert dim: a stack of experts applied with ``bmm``/``einsum`` is split over expert-parallel
ranks like a grouped product's. A new product op is one registered spec function here
(``register_product``); everything else follows from its equation.

A letter ``.`` marks a size-1 dim that broadcasts (it belongs to no class and never splits).
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass

from autoplan.graph.opgraph import Op, OpGraph, opname

BROADCAST = "."


@dataclass(frozen=True)
class EinsumDims:
    """The letters of a two-factor product by class, each in order of first appearance."""

    batch: tuple[str, ...]
    lhs_free: tuple[str, ...]
    rhs_free: tuple[str, ...]
    contracted: tuple[str, ...]
    grouped: tuple[str, ...]


@dataclass(frozen=True)
class ProductSpec:
    """One call of a product: its two factors (input slots and subscripts) and its output's
    subscripts. ``grouped``: the letter of a grouped product's experts, ``offsets`` the slot of
    its cumulative row offsets. ``weight_call``: how the Megatron kernels (``sp_linear``,
    ``gathered_weight``) read the call with a weight second: "linear" (``linear(x, W, b)``,
    ``W`` (out, in)), "xw" (``x @ W``, ``addmm(b, x, W)``), "" where they cannot."""

    lhs_slot: int
    lhs: str
    rhs_slot: int
    rhs: str
    out: str
    offsets: int | None = None
    grouped: str = ""
    weight_call: str = ""

    @property
    def equation(self) -> str:
        return f"{self.lhs},{self.rhs}->{self.out}"

    def subscripts(self, slot: int) -> str:
        """The subscripts of input ``slot`` ("" for an input that is no factor)."""
        return self.lhs if slot == self.lhs_slot else self.rhs if slot == self.rhs_slot else ""

    def dims(self) -> EinsumDims:
        lhs, rhs, out = (set(s) - {BROADCAST} for s in (self.lhs, self.rhs, self.out))
        order = [c for c in self.lhs + self.rhs if c != BROADCAST]
        letters = list(dict.fromkeys(order))

        def pick(keep: Callable[[str], bool]) -> tuple[str, ...]:
            return tuple(c for c in letters if keep(c))
        return EinsumDims(
            batch=pick(lambda c: c in lhs and c in rhs and c in out),
            lhs_free=pick(lambda c: c in lhs and c not in rhs and c in out),
            rhs_free=pick(lambda c: c in rhs and c not in lhs and c in out),
            contracted=pick(lambda c: c in lhs and c in rhs and c not in out),
            grouped=tuple(self.grouped))


SpecFn = Callable[[OpGraph, Op], "ProductSpec | None"]
_SPECS: dict[str, SpecFn] = {}


def register_product(*names: str) -> Callable[[SpecFn], SpecFn]:
    """Register the spec function of the product ops named ``names`` (overload packets)."""
    def deco(fn: SpecFn) -> SpecFn:
        for n in names:
            if n in _SPECS:
                raise ValueError(f"product {n!r} is registered twice")
            _SPECS[n] = fn
        return fn
    return deco


def product_names() -> frozenset[str]:
    """The ops with a product spec."""
    return frozenset(_SPECS)


def product_spec(graph: OpGraph, op: Op) -> ProductSpec | None:
    """``op`` as an einsum (None: no product, or a call the specs do not describe, such as a
    1-D factor of ``bmm``). Read once per graph and op."""
    fn = _SPECS.get(opname(op))
    if fn is None:
        return None
    cache = graph.__dict__.setdefault("_autoplan_product_specs", {})
    if op.name not in cache:
        cache[op.name] = fn(graph, op)
    return cache[op.name]


def _shapes(graph: OpGraph, op: Op) -> list[tuple[int, ...]]:
    return [graph.value(n).meta.shape for n in op.inputs]


def _letters(n: int, skip: str = "") -> str:
    return "".join(c for c in string.ascii_letters if c not in skip)[:n]


@register_product("linear")
def _linear(graph: OpGraph, op: Op) -> ProductSpec | None:
    """``linear(x, w, b?)``: ``...k,nk->...n`` (the weight keeps (out, in))."""
    s = _shapes(graph, op)
    if len(s) < 2 or len(s[0]) < 1 or len(s[1]) != 2:
        return None
    lead = _letters(len(s[0]) - 1, "kn")
    return ProductSpec(0, lead + "k", 1, "nk", lead + "n", weight_call="linear")


@register_product("mm")
def _mm(graph: OpGraph, op: Op) -> ProductSpec | None:
    s = _shapes(graph, op)
    if len(s) != 2 or len(s[0]) != 2 or len(s[1]) != 2:
        return None
    return ProductSpec(0, "mk", 1, "kn", "mn", weight_call="xw")


@register_product("addmm")
def _addmm(graph: OpGraph, op: Op) -> ProductSpec | None:
    """``addmm(bias, x, w)``: ``mk,kn->mn`` on slots 1 and 2."""
    s = _shapes(graph, op)
    if len(s) != 3 or len(s[1]) != 2 or len(s[2]) != 2:
        return None
    return ProductSpec(1, "mk", 2, "kn", "mn", weight_call="xw")


@register_product("bmm")
def _bmm(graph: OpGraph, op: Op) -> ProductSpec | None:
    s = _shapes(graph, op)
    if len(s) != 2 or len(s[0]) != 3 or len(s[1]) != 3:
        return None
    return ProductSpec(0, "bmk", 1, "bkn", "bmn")


@register_product("baddbmm")
def _baddbmm(graph: OpGraph, op: Op) -> ProductSpec | None:
    s = _shapes(graph, op)
    if len(s) != 3 or len(s[1]) != 3 or len(s[2]) != 3:
        return None
    return ProductSpec(1, "bmk", 2, "bkn", "bmn")


@register_product("matmul")
def _matmul(graph: OpGraph, op: Op) -> ProductSpec | None:
    """``matmul(a, b)`` of two factors of 2 dims or more, numpy-broadcast over the leading
    dims (a size-1 dim that broadcasts is ``.``)."""
    s = _shapes(graph, op)
    if len(s) != 2 or len(s[0]) < 2 or len(s[1]) < 2:
        return None
    lead = max(len(s[0]), len(s[1])) - 2
    batch = _letters(lead, "mkn")

    def sub(shape: tuple[int, ...], core: str) -> str:
        own = len(shape) - 2
        return "".join(BROADCAST if shape[j] == 1 else batch[lead - own + j]
                       for j in range(own)) + core
    return ProductSpec(0, sub(s[0], "mk"), 1, sub(s[1], "kn"), batch + "mn", weight_call="xw")


@register_product("einsum")
def _einsum(graph: OpGraph, op: Op) -> ProductSpec | None:
    """``einsum(equation, [a, b])`` with two factors, no ellipsis and no repeated letter."""
    args = json.loads(op.args)["args"]
    if not args or not isinstance(args[0], str) or len(op.inputs) != 2:
        return None
    eq = args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.split("->")
    factors = ins.split(",")
    if len(factors) != 2 or any(len(set(f)) != len(f) for f in factors + [out]):
        return None
    shapes = _shapes(graph, op)
    if any(len(f) != len(sh) for f, sh in zip(factors, shapes)):
        return None
    if (set(factors[0]) ^ set(factors[1])) - set(out) or set(out) - set(factors[0] + factors[1]):
        return None             # a sum over one factor's own dim, or an output dim of neither
    return ProductSpec(0, factors[0], 1, factors[1], out)


@register_product("grouped_mm_fallback", "_grouped_mm", "grouped_mm")
def _grouped_mm(graph: OpGraph, op: Op) -> ProductSpec | None:
    """Experts' grouped product: rows ``(tokens, in)`` sorted by expert, weights ``(experts,
    in, out)``, offsets ``(experts,)``: ``mk,ekn->mn``, ``e`` grouped."""
    s = _shapes(graph, op)
    if len(s) != 3 or len(s[0]) != 2 or len(s[1]) != 3:
        return None
    return ProductSpec(0, "mk", 1, "ekn", "mn", offsets=2, grouped="e")


def weight_slot(graph: OpGraph, op: Op, spec: ProductSpec) -> int | None:
    """The factor that is a weight (a parameter of two dims or more; the left one where both
    are), else None."""
    for k in (spec.lhs_slot, spec.rhs_slot):
        v = graph.value(op.inputs[k])
        if v.kind == "param" and len(v.meta.shape) >= 2:
            return k
    return None


def expert_dim(graph: OpGraph, op: Op) -> int | None:
    """Where ``op`` multiplies by a stack of experts: the dim of its right factor that is a
    ``batch`` or ``grouped`` letter of the product (dim 0 only: expert parallelism splits the
    leading dim of the stacked weight), else None."""
    spec = product_spec(graph, op)
    if spec is None or not spec.rhs:
        return None
    d = spec.dims()
    lead = spec.rhs[0]
    if lead in d.grouped or (lead in d.batch and spec.lhs.index(lead) == 0
                             and spec.out.index(lead) == 0):
        return 0
    return None
