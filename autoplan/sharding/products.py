"""The strategies of every matmul-like op on one ``t``-way mesh axis, from one einsum rule, and
the helpers the other rules share.

Each product is an einsum (``graph/products.py``: ``linear`` is ``...k,nk->...n``, ``bmm``
``bmk,bkn->bmn``, the grouped product ``mk,ekn->mn``, ...). One rule (``_product``) splits
its letters by class, as DTensor's ``gen_einsum_strategies`` does: a letter kept in the output
splits both factors that have it and the output; a contracted letter splits both factors and
leaves partial sums (reduced after the op). What the split is called, and the kernels that
make it cheaper, depend on the factors:

- a weight (a parameter) times an activation: Megatron-LM's names. The weight's output features
  split: ``colwise`` (also in blocks, for fused projections), ``colwise_sp`` (the input
  arrives sequence-split and is gathered: kernel ``sp_linear``); the contraction: ``rowwise``
  (partial output reduced; a bias added once after: ``bias_after_reduce``), ``rowwise_sp``
  (reduce-scattered to sequence shards); the activation's rows: ``batch`` / ``seq``, and
  ``batch_gathered`` / ``seq_gathered`` (the weight stored split and gathered for the product,
  FSDP-style on this axis: kernel ``gathered_weight``);
- a stack of experts (a grouped letter, or a batch letter leading both a stacked weight and
  the output: ``graph/experts.py``): the experts are expert parallelism's (``ep``) to split,
  the axis splits each expert's output features (``colwise``) or its contraction
  (``rowwise``);
- two activations: every output dim (``batch``, ``heads``, ``dim<d>`` for leading dims,
  ``rows``, ``cols``) and the contraction (``contract``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import Op, OpGraph, TensorMeta, Value
from autoplan.graph.products import (ProductSpec, expert_dim, product_names, product_spec,
                                     weight_slot)
from autoplan.sharding.blocks import block_counts
from autoplan.sharding.placement import PARTIAL, REPLICATE, Placement, shard
from autoplan.sharding.registry import declare_kernel, register_op_strategy
from autoplan.sharding.strategy import (BIAS_AFTER_REDUCE, Comm, OpStrategy, bias_slot, make,
                                        opname)
from autoplan.graph.analysis import analyze
from autoplan.sharding.passthrough import RESHAPES

SP_LINEAR = declare_kernel(
    "sp_linear", "a product with a weight whose sequence-split input is gathered inside it and "
    "again in backward (Megatron's sequence parallelism: only the shard is kept)")
GATHERED_WEIGHT = declare_kernel(
    "gathered_weight", "a product on a batch- or sequence-split input with a weight stored "
    "split over the ranks: gathered for the product and again in backward, its gradient "
    "reduce-scattered back to the shards (FSDP on this axis)")


def is_activation(v: Value) -> bool:
    """A value computed per batch (an activation or a graph input), not a weight."""
    return v.kind in ("activation", "input")


def divides(size: int, t: int, blocks: int = 1) -> bool:
    """Whether a dim of ``size`` splits evenly over ``t`` ranks in ``blocks`` blocks."""
    return size >= t * blocks and size % (t * blocks) == 0


def _blocks(graph: OpGraph) -> Callable[[str, int], tuple[int, ...]]:
    counts = block_counts(graph)
    return lambda value, d: counts.get((value, d), ())


def merged_rows(graph: OpGraph, name: str) -> tuple[int, int] | None:
    """(samples, positions) where value ``name`` is a reshape merging its input's first two
    dims into its rows (``(b, s, h) -> (b * s, h)``), else None. Rows split by positions
    arrive as one block per sample (``dims.reshape_placement``): the products and losses on
    such rows offer that split as ``seq`` and the split of the samples as ``batch``, under the
    same names at every batch size."""
    i = analyze(graph).producer.get(name)
    if i is None or opname(graph.ops[i]) not in RESHAPES or not graph.ops[i].inputs:
        return None
    x = graph.value(graph.ops[i].inputs[0]).meta.shape
    out = graph.value(name).meta.shape
    if len(x) < 2 or not out or x[0] * x[1] != out[0] or tuple(x[2:]) != tuple(out[1:]):
        return None
    return x[0], x[1]


def row_splits(rows: int, merged: tuple[int, int] | None, t: int
               ) -> list[tuple[str, Placement]]:
    """The splits of a tensor's rows (dim 0) over ``t`` ranks, by name: ``batch`` (plain), and
    for merged rows (``merged_rows``) ``batch`` over the samples and ``seq`` over each
    sample's positions."""
    if merged is None:
        return [("batch", shard(0))] if divides(rows, t) else []
    samples, positions = merged
    return [(label, p) for label, p, ok in (("batch", shard(0), divides(samples, t)),
                                            ("seq", shard(0, samples), divides(positions, t)))
            if ok]


def seq_dim(shape: tuple[int, ...]) -> int:
    """The token dim sequence parallelism splits: the sequence of (b, s, h), the rows of
    (tokens, h)."""
    return 1 if len(shape) >= 3 else 0


# ---- the one rule ------------------------------------------------------------------------------

@register_op_strategy(*sorted(product_names()))
def _product(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """Every matmul-like op (``graph/products.py``): its strategies from its einsum."""
    spec = product_spec(graph, op)
    if spec is None or not op.outputs:
        return []
    if spec.dims().grouped or _stacked_experts(graph, op):
        return _expert_product(graph, op, spec, t)
    w = weight_slot(graph, op, spec)
    if w is not None:
        return _weight_product(graph, op, spec, w, t)
    return _act_product(graph, op, spec, t)


def _stacked_experts(graph: OpGraph, op: Op) -> bool:
    """Whether ``op`` multiplies by a stack of expert weights (read from the graph's experts
    only where its equation allows one: a batch letter leading everything)."""
    if expert_dim(graph, op) is None:
        return False
    found = find_experts(graph)
    return found is not None and graph.op_index(op.name) in found.ops


class _Factors:
    """Where each letter of a product sits in its inputs and output, and the placements that
    split one letter (every tensor that has it, split on its dim; the rest whole)."""

    def __init__(self, graph: OpGraph, op: Op, spec: ProductSpec, bias: int | None):
        self.graph, self.op, self.spec, self.bias = graph, op, spec, bias
        self.out = graph.value(op.outputs[0]).meta.shape

    def size(self, letter: str) -> int:
        spec = self.spec
        for slot, sub in ((spec.lhs_slot, spec.lhs), (spec.rhs_slot, spec.rhs)):
            if letter in sub:
                return self.graph.value(self.op.inputs[slot]).meta.shape[sub.index(letter)]
        return self.out[spec.out.index(letter)]

    def inputs(self, letter: str, blocks: int = 1, *, bias: Placement | None = None
               ) -> tuple[Placement, ...]:
        spec = self.spec
        out = []
        for k in range(len(self.op.inputs)):
            sub = spec.subscripts(k)
            if k == self.bias:
                out.append(bias if bias is not None else
                           shard(0, blocks) if spec.out.endswith(letter) else REPLICATE)
            elif letter in sub:
                out.append(shard(sub.index(letter), blocks))
            else:
                out.append(REPLICATE)
        return tuple(out)

    def output(self, letter: str, blocks: int = 1) -> Placement:
        return shard(self.spec.out.index(letter), blocks)


def _expert_product(graph: OpGraph, op: Op, spec: ProductSpec, t: int) -> list[OpStrategy]:
    """A product with a stack of experts: their dim is expert parallelism's; the axis splits
    each expert's output features or its contraction."""
    d = spec.dims()
    if len(d.rhs_free) != 1 or len(d.contracted) != 1:
        return []
    f = _Factors(graph, op, spec, None)
    n, k = d.rhs_free[0], d.contracted[0]
    res = []
    if divides(f.size(n), t):
        res.append(make(graph, op, "colwise", f.inputs(n), (f.output(n),), t, style="colwise"))
    if divides(f.size(k), t):
        res.append(make(graph, op, "rowwise", f.inputs(k), (REPLICATE,), t, style="rowwise",
                        local_outputs=(PARTIAL,)))
    return res


def _act_product(graph: OpGraph, op: Op, spec: ProductSpec, t: int) -> list[OpStrategy]:
    """A product of two activations: each output dim a factor has, then each contraction."""
    b = bias_slot(graph, op)
    if b in (spec.lhs_slot, spec.rhs_slot):
        b = None
    f = _Factors(graph, op, spec, b)
    r = len(f.out)
    res = []
    for d, letter in enumerate(spec.out):
        if letter not in spec.lhs and letter not in spec.rhs or not divides(f.out[d], t):
            continue
        name = ("rows" if d == r - 2 else "cols" if d == r - 1 else
                "batch" if d == 0 else "heads" if d == 1 else f"dim{d}")
        res.append(make(graph, op, name, f.inputs(letter), (f.output(letter),), t))
    for j, k in enumerate(spec.dims().contracted):
        if divides(f.size(k), t):
            res.append(make(graph, op, "contract" if j == 0 else f"contract_{k}",
                            f.inputs(k, bias=REPLICATE), (REPLICATE,), t,
                            kernel=BIAS_AFTER_REDUCE if b is not None else "",
                            local_outputs=(PARTIAL,)))
    return res


@dataclass(frozen=True)
class _WeightCall:
    """One weight-times-activation product, as the splits below read it: which input is the
    weight (``w``), the activation (``x``) and the bias (``b``), the weight's output letter
    ``n`` and contracted letter ``k``, and the sequence split the kernels can run."""

    graph: OpGraph
    op: Op
    spec: ProductSpec
    t: int
    w: int
    x: int
    b: int | None
    n: str
    k: str
    f: Any                      # _Factors
    megatron: bool              # the weight-call kernels can run it
    sp_p: Placement             # the token split sequence parallelism keeps
    can_sp: bool
    merged: Any                 # merged_rows of a 2-D activation, or None

    @property
    def x_meta(self) -> TensorMeta:
        return self.graph.value(self.op.inputs[self.x]).meta

    @property
    def rank(self) -> int:
        return len(self.f.out)

    def placements(self, x_p: Placement, w_p: Placement, b_p: Placement
                   ) -> tuple[Placement, ...]:
        """The op's input placements: x_p on the activation, w_p on the weight, b_p on the
        bias, every other input whole."""
        return tuple(x_p if i == self.x else w_p if i == self.w else b_p if i == self.b
                     else REPLICATE for i in range(len(self.op.inputs)))


def _weight_product(graph: OpGraph, op: Op, spec: ProductSpec, w: int, t: int
                    ) -> list[OpStrategy]:
    """A weight (2-D) times an activation: Megatron's splits, then the activation's rows.
    The variants with a kernel (``sp_linear``, ``gathered_weight``; ``rowwise_sp`` with them)
    are offered where the kernels read the call (``ProductSpec.weight_call``)."""
    c = _weight_call(graph, op, spec, w, t)
    if c is None:
        return []
    tokens = _token_placements(c)
    return (_column_splits(c) + _row_splits(c) + _token_splits(c, tokens)
            + _gathered_weight_splits(c, tokens))


def _weight_call(graph: OpGraph, op: Op, spec: ProductSpec, w: int, t: int
                 ) -> _WeightCall | None:
    """The product read as a weight call, or None where no weight rule applies (the other
    factor is not an activation, the weight is not 2-D with one output and one contracted
    letter, or a bias lies along the activation's dim)."""
    x = spec.lhs_slot if w == spec.rhs_slot else spec.rhs_slot
    if not is_activation(graph.value(op.inputs[x])):
        return None
    sub_w, sub_x = spec.subscripts(w), spec.subscripts(x)
    d = spec.dims()
    n = [c for c in sub_w if c in spec.out]
    k = [c for c in sub_w if c in d.contracted]
    if len(sub_w) != 2 or len(n) != 1 or len(k) != 1:
        return None
    megatron = w == spec.rhs_slot and spec.weight_call != ""      # the kernels can run it
    b = bias_slot(graph, op)
    if b in (x, w):
        b = None
    if b is not None and not megatron:
        return None             # a bias along the activation's dim: no rule splits it here
    f = _Factors(graph, op, spec, b)
    xm = graph.value(op.inputs[x]).meta
    # the token split sequence parallelism keeps: the sequence of (b, s, h), the rows of
    # (tokens, h), one block per sample where the rows are (b, s) merged
    sp = seq_dim(xm.shape)
    can_sp = (megatron and len(xm.shape) >= 2 and divides(xm.shape[sp], t)
              and len(xm.shape) == len(f.out) and sub_x[sp] in spec.out)
    merged = merged_rows(graph, op.inputs[x]) if len(xm.shape) == 2 else None
    sp_p = shard(sp)
    if merged is not None:
        sp_p = shard(0, merged[0])
        can_sp = can_sp and divides(merged[1], t)
    return _WeightCall(graph=graph, op=op, spec=spec, t=t, w=w, x=x, b=b, n=n[0], k=k[0], f=f,
                       megatron=megatron, sp_p=sp_p, can_sp=can_sp, merged=merged)


def _column_splits(c: _WeightCall) -> list[OpStrategy]:
    """The weight's output letter split (whole, or in fused blocks): ``colwise``, and
    Megatron's sequence-parallel linear where it can run."""
    graph, op, f, t = c.graph, c.op, c.f, c.t
    res = []
    for blocks in (1,) + _blocks(graph)(op.outputs[0], c.spec.out.index(c.n)):
        if not divides(f.size(c.n), t, blocks):
            continue
        sfx = "" if blocks == 1 else f"_blocks{blocks}"
        col_in = f.inputs(c.n, blocks)
        res.append(make(graph, op, "colwise" + sfx, col_in, (f.output(c.n, blocks),), t,
                        style="colwise"))
        if c.can_sp:
            # Megatron's sequence-parallel linear: the input is gathered inside the product
            # and again in backward, so only its shard is kept for backward
            regather = ((Comm("all_gather", op.inputs[c.x], "bwd"),)
                        if graph.value(op.inputs[c.w]).requires_grad else ())
            res.append(make(graph, op, "colwise_sp" + sfx,
                            c.placements(c.sp_p, col_in[c.w],
                                         col_in[c.b] if c.b is not None else REPLICATE),
                            (f.output(c.n, blocks),), t, style="colwise_sp",
                            local_inputs=col_in, kernel=SP_LINEAR, extra=regather))
    return res


def _row_splits(c: _WeightCall) -> list[OpStrategy]:
    """The contracted letter split: partial sums reduced after the product (``rowwise``), or
    reduce-scattered onto the sequence (``rowwise_sp``)."""
    graph, op, f, t = c.graph, c.op, c.f, c.t
    if not divides(f.size(c.k), t):
        return []
    row_in = f.inputs(c.k, bias=REPLICATE)
    kernel = BIAS_AFTER_REDUCE if c.b is not None else ""
    res = [make(graph, op, "rowwise", row_in, (REPLICATE,), t, style="rowwise",
                kernel=kernel, local_outputs=(PARTIAL,))]
    xm, out, rank = c.x_meta, f.out, c.rank
    sp = seq_dim(xm.shape)
    if c.can_sp or (c.megatron and len(xm.shape) == rank and rank >= 2
                    and divides(out[sp], t) and c.merged is None
                    and c.spec.subscripts(c.x)[sp] in c.spec.out):
        res.append(make(graph, op, "rowwise_sp", row_in, (c.sp_p,), t,
                        style="rowwise_sp", kernel=kernel, local_outputs=(PARTIAL,)))
    return res


def _token_placements(c: _WeightCall) -> list[tuple[str, Placement, Placement]]:
    """(label, activation placement, output placement) of each token split: the batch, the
    sequence (the rows of a 2-D input: ``row_splits``)."""
    spec, out, rank, t = c.spec, c.f.out, c.rank, c.t
    sub_x = spec.subscripts(c.x)
    if len(c.x_meta.shape) != rank:
        return []
    if rank == 2 and sub_x.find(spec.out[0]) == 0:
        return [(label, p, p) for label, p in row_splits(out[0], c.merged, t)]
    if rank >= 3:
        return [(label, shard(sub_x.index(spec.out[j])), shard(j))
                for j, label in ((0, "batch"), (1, "seq"))
                if spec.out[j] in sub_x and divides(out[j], t)]
    return []


def _token_splits(c: _WeightCall, tokens: list[tuple[str, Placement, Placement]]
                  ) -> list[OpStrategy]:
    """The activation's tokens split, the weight whole."""
    return [make(c.graph, c.op, label, c.placements(p_x, REPLICATE, REPLICATE), (p_out,), c.t,
                 style=label) for label, p_x, p_out in tokens]


def _gathered_weight_splits(c: _WeightCall, tokens: list[tuple[str, Placement, Placement]]
                            ) -> list[OpStrategy]:
    """The token splits with the weight stored split, gathered for the product (FSDP on this
    axis) and again in backward."""
    weight = c.graph.value(c.op.inputs[c.w])
    if not (c.megatron and weight.kind == "param" and divides(weight.meta.shape[0], c.t)):
        return []
    regather = ((Comm("all_gather", c.op.inputs[c.w], "bwd"),) if weight.requires_grad
                else ())
    return [make(c.graph, c.op, f"{label}_gathered", c.placements(p_x, shard(0), REPLICATE),
                 (p_out,), c.t, style=label, kernel=GATHERED_WEIGHT,
                 local_inputs=c.placements(p_x, REPLICATE, REPLICATE), extra=regather)
            for label, p_x, p_out in tokens]
