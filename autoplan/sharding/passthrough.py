"""Ops that carry a sharding through: element-wise ops, views, copies, reductions, softmax.

Every op here is known by name (or by torch's ``pointwise`` tag) and has an exact rule for
where a split dim goes; an op that is not listed is never sharded (``strategies`` replicates
it). That is deliberate: an op guessed to be element-wise that is not (``tril`` on the split
rows, an ``outer`` product, a cumulative sum along the split dim) computes wrong numbers on
shards, the worst thing a parallelizer can do.

- element-wise (with broadcasting): any output dim; each input takes the dim it broadcasts to,
  or stays replicated where it has size 1 there;
- views, permutes, expands, slices, splits, selects: the split dim moves with the data
  (``dims``); an op that cuts through the split dim cannot carry it, except a split of a
  block-sharded dim into its blocks;
- copies (contiguous, clone, dtype casts, dropout), repeats, pads, flips, triangular masks,
  concatenation: every dim they do not act on;
- reductions and softmax: every dim they do not reduce; a sum over the split dim leaves partial
  sums (all-reduced), a mean too (scaled by the split); other reductions over it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding import dims
from autoplan.sharding.placement import PARTIAL, REPLICATE, Placement, local_size, shard
from autoplan.sharding.registry import declare_kernel
from autoplan.sharding.strategy import OpStrategy, call_args, make, opname

MEAN_PARTIAL = declare_kernel("mean_partial",
                              "mean over the rank's shard of a split dim, scaled to a partial sum")

RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze",
                      "squeeze", "view_as", "_reshape_alias"})
SAME_SHAPE = frozenset({"contiguous", "clone", "_to_copy", "to", "type_as", "alias", "detach",
                        "lift_fresh_copy", "dropout", "native_dropout", "feature_dropout",
                        "type_as",
                        "alpha_dropout", "_to_dtype", "_conj", "conj", "positive"})
SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod",
                     "logcumsumexp", "_safe_softmax"})
SUMS = frozenset({"sum", "nansum"})
MEANS = frozenset({"mean", "nanmean"})
OTHER_REDUCTIONS = frozenset({"amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
                              "argmax", "argmin", "prod", "var_mean", "std_mean", "any", "all",
                              "count_nonzero", "linalg_vector_norm"})
NOT_ELEMENTWISE = frozenset({"outer"})     # tagged or listed as pointwise elsewhere, but not
LIKE_OTHER = frozenset({"type_as", "expand_as", "view_as"})   # the second tensor gives only
                                                               # a dtype or a shape


def _arg(args: list, kwargs: dict, i: int, name: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def dim_arg(op: Op, rank: int, i: int = 1, name: str = "dim", default: int = 0) -> int:
    args, kwargs = call_args(op)
    a = _arg(args, kwargs, i, name, default)
    if isinstance(a, list):
        a = a[0] if a else 0
    return a % rank if rank else 0


def _ok(shape, p: Placement, t: int) -> bool:
    return p.kind != "S" or (p.dim < len(shape) and local_size(shape[p.dim], p, t) is not None)


# ---- one activation input: where its split goes ----------------------------------------------

class UnaryCall(NamedTuple):
    """One question to a unary rule: where does input split ``p`` go through ``op``?"""

    op: Op
    x: tuple[int, ...]                  # the input's shape
    outs: list[tuple[int, ...]]         # the outputs' shapes
    p: Placement                        # the input's split
    t: int                              # the axis's ranks
    args: list                          # the op's arguments (``call_args``)
    kwargs: dict


# op name -> its rule: the placement every output takes (None: the op cannot run on that split;
# ``PARTIAL``: partial sums). One rule per op family, registered beside its definition; a name
# listed twice keeps its first rule.
UNARY_RULES: dict[str, Callable[[UnaryCall], Placement | None]] = {}


def _unary_rule(*names: str):
    def register(fn: Callable[[UnaryCall], Placement | None]):
        for n in names:
            UNARY_RULES.setdefault(n, fn)
        return fn
    return register


def unary_map(graph: OpGraph, op: Op, slot: int, p: Placement, t: int
              ) -> tuple[Placement, ...] | None:
    """Per output, its placement when input ``slot`` arrives placed ``p`` (other inputs stay
    whole); ``None`` when the op cannot run on that split. ``P`` marks a partial sum."""
    outs = [graph.value(n).meta.shape for n in op.outputs]
    if not outs:
        return None
    rule = UNARY_RULES.get(opname(op))
    if rule is None:
        return None
    args, kwargs = call_args(op)
    q = rule(UnaryCall(op, graph.value(op.inputs[slot]).meta.shape, outs, p, t, args, kwargs))
    if q is None or not all(_ok(o, q, t) for o in outs):
        return None
    return tuple(q for _ in outs)


@_unary_rule(*RESHAPES)
def _reshape(c: UnaryCall) -> Placement | None:
    return dims.reshape_placement(c.x, c.outs[0], c.p, c.t)


@_unary_rule("expand", "expand_as")
def _expand(c: UnaryCall) -> Placement | None:
    d, off = c.p.dim, len(c.outs[0]) - len(c.x)
    return c.p.with_dim(d + off) if c.x[d] == c.outs[0][d + off] else None


@_unary_rule("transpose", "swapaxes")
def _transpose(c: UnaryCall) -> Placement | None:
    return c.p.with_dim(dims.transpose_dim(len(c.x), c.args[1], c.args[2], c.p.dim))


@_unary_rule("t")
def _t(c: UnaryCall) -> Placement | None:
    d = c.p.dim
    return c.p.with_dim(dims.transpose_dim(len(c.x), 0, 1, d) if len(c.x) == 2 else d)


@_unary_rule("permute")
def _permute(c: UnaryCall) -> Placement | None:
    return c.p.with_dim(dims.permute_dim(c.args[1], c.p.dim))


@_unary_rule("movedim", "moveaxis")
def _movedim(c: UnaryCall) -> Placement | None:
    rank = len(c.x)
    src, dst = c.args[1], c.args[2]
    src, dst = ([src], [dst]) if isinstance(src, int) else (src, dst)
    perm = [i for i in range(rank) if i not in [s % rank for s in src]]
    for s_, d_ in sorted(zip([s % rank for s in src], [x_ % rank for x_ in dst]),
                         key=lambda z: z[1]):
        perm.insert(d_, s_)
    return c.p.with_dim(perm.index(c.p.dim))


@_unary_rule(*SAME_SHAPE)
def _same_shape(c: UnaryCall) -> Placement | None:
    return c.p if all(o == c.x for o in c.outs) else None


@_unary_rule("view_as_complex")
def _view_as_complex(c: UnaryCall) -> Placement | None:
    return c.p if c.p.dim < len(c.x) - 1 else None      # (..., 2) real pairs -> (...) complex


@_unary_rule("view_as_real")
def _view_as_real(c: UnaryCall) -> Placement | None:
    return c.p


@_unary_rule(*SPLITS)
def _split(c: UnaryCall) -> Placement | None:
    name, d = opname(c.op), c.p.dim
    axis = dim_arg(c.op, len(c.x), i=1 if name == "unbind" else 2)
    if d != axis:
        if name == "unbind":
            return c.p.with_dim(d - 1 if d > axis else d)
        return c.p
    if c.p.blocks > 1 and len(c.outs) == c.p.blocks and all(o == c.outs[0] for o in c.outs) \
            and name != "unbind":
        return shard(d)     # each block is one piece: plain splits of the pieces
    return None


@_unary_rule("slice", "narrow", "index_select")
def _slice(c: UnaryCall) -> Placement | None:
    return c.p if c.p.dim != dim_arg(c.op, len(c.x), default=0) else None


@_unary_rule("select")
def _select(c: UnaryCall) -> Placement | None:
    d, axis = c.p.dim, dim_arg(c.op, len(c.x))
    return c.p.with_dim(d - 1 if d > axis else d) if d != axis else None


@_unary_rule(*SOFTMAX)
def _softmax(c: UnaryCall) -> Placement | None:
    return c.p if c.p.dim != dim_arg(c.op, len(c.x), default=-1) else None


@_unary_rule("tril", "triu")
def _triangle(c: UnaryCall) -> Placement | None:
    return c.p if c.p.dim < len(c.x) - 2 else None


@_unary_rule("flip", "roll")
def _flip(c: UnaryCall) -> Placement | None:
    rank = len(c.x)
    which = _arg(c.args, c.kwargs, 1 if opname(c.op) == "flip" else 2, "dims", None)
    if which is None or (isinstance(which, list) and not which):
        return None                     # roll without dims acts on the flattened tensor
    which = [w % rank for w in (which if isinstance(which, list) else [which])]
    return c.p if c.p.dim not in which else None


@_unary_rule("constant_pad_nd")
def _pad(c: UnaryCall) -> Placement | None:
    rank, d = len(c.x), c.p.dim
    pad = c.args[1] if len(c.args) > 1 else c.kwargs.get("pad", [])
    padded = {rank - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    return c.p if d not in padded and c.outs[0][d] == c.x[d] else None


@_unary_rule("repeat")
def _repeat(c: UnaryCall) -> Placement | None:
    reps, d = c.args[1], c.p.dim
    off = len(reps) - len(c.x)
    return c.p.with_dim(d + off) if c.p.blocks == 1 and reps[d + off] == 1 else None


@_unary_rule("repeat_interleave")
def _repeat_interleave(c: UnaryCall) -> Placement | None:
    if _arg(c.args, c.kwargs, 2, "dim") is None or c.p.blocks > 1:
        return None                     # without dim it flattens the tensor
    return c.p


@_unary_rule(*SUMS, *MEANS, *OTHER_REDUCTIONS)
def _reduction(c: UnaryCall) -> Placement | None:
    """Every dim it does not reduce; over the split dim, partial sums (a sum or mean with one
    output), else it cannot run."""
    name, args, kwargs = opname(c.op), c.args, c.kwargs
    at = 2 if name in ("norm", "linalg_vector_norm") else 1   # (x, p/ord, dim, keepdim)
    dims_arg = _arg(args, kwargs, at, "dim")
    if not (dims_arg is None or isinstance(dims_arg, int) or (
            isinstance(dims_arg, list) and all(isinstance(x, int) for x in dims_arg))):
        return None          # not a reduction over dims (max(a, b), a dtype argument)
    if c.op.target.split(".")[-1] in ("other", "binary"):
        return None
    keep = _arg(args, kwargs, at + 1, "keepdim", False)
    if name in ("var", "std", "var_mean", "std_mean"):      # (x, dim, unbiased, keepdim)
        keep = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
    od = dims.reduced_dim(len(c.x), dims_arg, bool(keep), c.p.dim)
    if od is not None:
        return c.p.with_dim(od)
    if name in SUMS | MEANS and len(c.outs) == 1:
        return PARTIAL
    return None


def _candidates(graph: OpGraph, op: Op, slot: int, t: int,
                blocks: Callable[[str, int], tuple[int, ...]]) -> list[Placement]:
    shape = graph.value(op.inputs[slot]).meta.shape
    out = []
    for d in range(len(shape)):
        for k in (1,) + blocks(op.inputs[slot], d):
            p = shard(d, k)
            if local_size(shape[d], p, t) is not None:
                out.append(p)
    return out


def _name(p: Placement) -> str:
    return f"shard{p.dim}" + (f"_blocks{p.blocks}" if p.blocks > 1 else "")


def unary(graph: OpGraph, op: Op, slot: int, t: int,
          blocks: Callable[[str, int], tuple[int, ...]]) -> list[OpStrategy]:
    """Strategies of a one-activation-input op: every split of that input the op carries."""
    res = []
    for p in _candidates(graph, op, slot, t, blocks):
        mapped = unary_map(graph, op, slot, p, t)
        if mapped is None:
            continue
        ins = tuple(p if i == slot else REPLICATE for i in range(len(op.inputs)))
        name = opname(op)
        if mapped == (PARTIAL,):
            kernel = MEAN_PARTIAL if name in MEANS else ""
            res.append(make(graph, op, _name(p), ins, (REPLICATE,), t, kernel=kernel,
                            local_outputs=(PARTIAL,)))
            continue
        divisor = 1 if op.kind == "view" else None
        res.append(make(graph, op, _name(p), ins, mapped, t, divisor=divisor))
    return res


# ---- element-wise ops over several inputs, and concatenation ----------------------------------

def is_elementwise(graph: OpGraph, op: Op) -> bool:
    name = opname(op)
    return op.kind in ("pointwise", "dropout") and name not in NOT_ELEMENTWISE \
        and name not in SOFTMAX and name not in SAME_SHAPE


def elementwise(graph: OpGraph, op: Op, t: int,
                blocks: Callable[[str, int], tuple[int, ...]]) -> list[OpStrategy]:
    """Any output dim; inputs follow by broadcasting (replicated where they have size 1)."""
    out = graph.value(op.outputs[0]).meta.shape
    if any(graph.value(n).meta.shape != out for n in op.outputs):
        return []
    res = []
    for d in range(len(out)):
        ks = {1}
        for n in op.inputs + op.outputs[:1]:
            m = graph.value(n).meta.shape
            bd = dims.broadcast_dim(m, out, d)
            if bd is not None and m[bd] == out[d]:
                ks.update(blocks(n, bd))
        for k in sorted(ks):
            p = shard(d, k)
            if local_size(out[d], p, t) is None:
                continue
            ins = []
            for n in op.inputs:
                m = graph.value(n).meta.shape
                bd = dims.broadcast_dim(m, out, d)
                ins.append(p.with_dim(bd) if bd is not None and m[bd] == out[d] else REPLICATE)
            if all(q.kind == "R" for q in ins):
                continue        # only broadcast inputs: nothing to split locally
            res.append(make(graph, op, _name(p), tuple(ins), tuple(p for _ in op.outputs), t))
    return res


def concat(graph: OpGraph, op: Op, t: int) -> list[OpStrategy]:
    """cat / stack: any dim but the one they join along."""
    out = graph.value(op.outputs[0]).meta.shape
    rank_in = len(graph.value(op.inputs[0]).meta.shape)
    if any(len(graph.value(n).meta.shape) != rank_in for n in op.inputs):
        return []
    name = opname(op)
    axis = dim_arg(op, len(out) if name == "stack" else rank_in)
    res = []
    for d in range(rank_in):
        if d == axis and name == "cat":
            continue
        od = d + 1 if name == "stack" and d >= axis else d
        p = shard(od)
        if local_size(out[od], p, t) is None:
            continue
        res.append(make(graph, op, _name(shard(d)), tuple(shard(d) for _ in op.inputs),
                        (p,), t))
    return res


def has_rule(op: Op) -> bool:
    """Whether the passthrough rules know ``op`` (so ``unary`` may be tried)."""
    name = opname(op)
    return (name in RESHAPES or name in SAME_SHAPE or name in SPLITS or name in SOFTMAX
            or name in SUMS or name in MEANS or name in OTHER_REDUCTIONS
            or name in ("view_as_complex", "view_as_real", "expand", "expand_as", "transpose", "swapaxes", "t", "permute",
                        "movedim", "moveaxis", "slice", "narrow", "index_select", "select",
                        "tril", "triu", "flip", "roll", "constant_pad_nd", "repeat",
                        "repeat_interleave"))


def like_other(graph: OpGraph, op: Op, t: int,
               blocks: Callable[[str, int], tuple[int, ...]]) -> list[OpStrategy]:
    """``x.type_as(y)``, ``x.expand_as(y)``, ``x.view_as(y)``: where ``x``'s split goes; ``y``
    (read for its dtype or shape only) lies the same way when it has ``x``'s shape."""
    x = graph.value(op.inputs[0]).meta.shape
    res = []
    for s in unary(graph, op, 0, t, blocks):
        ins = tuple(s.inputs[0] if i == 0 or graph.value(n).meta.shape == x else q
                    for i, (n, q) in enumerate(zip(op.inputs, s.inputs)))
        res.append(make(graph, op, s.name, ins, s.outputs, t, divisor=s.work_divisor))
    return res
