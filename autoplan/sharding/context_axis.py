"""Context parallelism on a mesh axis of its own (``ParallelConfig.cp``): the sequence of every
micro-batch split over ``cp`` ranks, under whatever the tensor-parallel axis does.

On the cp axis every op takes the context sharding (``context_sharding``: activations split on
the sequence, weights whole, attention as ring attention over the cp ranks); on the tp axis each
op takes the plan's own strategy. The rank program applies both, cp outer (DTensor's order on a
(cp, tp) mesh): a tensor split on one dim by both holds piece ``tp_index`` of its cp piece
(``cp_index * tp + tp_index`` in the contiguous layout; under zigzag the cp piece is two chunks).

Not every tp strategy composes with the cp one. ``tp_conflict`` says why one does not, and the
sharding ILP offers only those that do (the rank program checks the same):
- one local kernel per op: where both axes name one, only the pairs in ``COMPOSED`` run (the
  cp kernel around the tp one: a loss over the sequence shards around a vocabulary-parallel
  cross entropy, or one split loss over both axes' ranks);
- the outer axis never moves a dim the inner one splits: a slice or gather of the sequence on
  cp of a tensor that tp holds split on the sequence would take the wrong rows. So a value the
  cp axis moves on dim ``d`` is never split on ``d`` by tp where it is moved;
- both splits together must be even.

Gradients. Weights are whole on the cp axis. A weight read by an op split over cp gets each cp
rank's part of its gradient (its tokens'); one read by an op not split over cp gets the whole
gradient on every cp rank. The runtime averages gradients over the dp x cp ranks, with every
rank's backward seeded by ``cp``: the parts then sum to the gradient, and the whole ones are
scaled by ``1 / cp`` where they are read (``whole_weight_readers``).

Costs (``estimate``, the ILP): an op's work is divided by both axes (``op_scale``); a value the
cp axis splits weighs ``1 / cp`` of its bytes wherever tp moves it (``value_scale``). Ring
attention's share is its slowest rank's (``ring_work.critical_share``): under the contiguous
layout a causal ring's last rank does ``(2c - 1) / c^2`` of the work, under ``zigzag``
(``layout``: every split dim cut into ``2c`` chunks, rank ``r`` holding chunks ``r`` and
``2c - 1 - r``; the runtime's cp axis slices and gathers so) every rank ``1 / c``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from autoplan.errors import AutoplanError, ConfigError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding.placement import REPLICATE, Placement, local_shape
from autoplan.sharding.ring_work import CP_LAYOUTS, causal_at, critical_share
from autoplan.sharding.sharding import STATE_KINDS, Sharding, context_sharding
from autoplan.sharding.strategy import OpStrategy, input_action, needs_grad, output_action

# (cp kernel, tp kernel) pairs the rank program runs as one (the cp one around the tp one)
COMPOSED = frozenset({("split_loss", "vocab_cross_entropy"), ("split_loss", "split_loss")})
# tp kernels that work on whatever piece of the sequence the cp axis leaves them
_TP_KERNELS_ANY_PIECE = frozenset({"", "vocab_embedding", "vocab_cross_entropy", "split_loss",
                                   "bias_after_reduce", "sp_linear", "gathered_weight"})


@dataclass(frozen=True, eq=False)
class ContextAxis:
    """The cp axis of ``c`` ranks over ``graph``: its sharding, and what it implies for the tp
    axis and the costs."""

    graph: OpGraph
    c: int
    sharding: Sharding
    layout: str = "contiguous"          # ``ParallelConfig.cp_layout``
    # what does not depend on the layout (tp conflicts, moved dims, value scales), kept per
    # axis and shared by its layouts (``in_layout``)
    caches: dict[str, Any] = field(default_factory=dict, repr=False)

    def in_layout(self, layout: str) -> ContextAxis:
        """The same axis with the sequence laid out as ``layout``: only ring attention's work
        differs (``op_scale``), so it shares this one's sharding and caches."""
        return replace(self, layout=layout)

    def _cached(self, name: str, make: Any) -> Any:
        found = self.caches.get(name)
        if found is None:
            found = self.caches[name] = make()
        return found

    def placement(self, name: str) -> Placement:
        """Where value ``name`` lies on the cp axis before a consumer moves it: weights and
        buffers are stored whole (a reader that wants a piece slices it), inputs whole."""
        if self.graph.value(name).kind in STATE_KINDS:
            return REPLICATE
        return self.sharding.placement_of(self.graph, name)

    def strategy(self, i: int) -> OpStrategy:
        return self.sharding.op_strategy[i]

    def value_scale(self, name: str) -> float:
        """The share of ``name``'s bytes one cp rank holds (``1 / c`` where cp splits it)."""
        return self._cached("value_scales", self._value_scales).get(name, 1.0)

    def op_scale(self, i: int) -> float:
        """The share of op ``i``'s work one cp rank does: the slowest rank's, for ring
        attention (module docstring)."""
        if self.strategy(i).kernel == "ring_attention":
            return critical_share(self.c, self.layout, self.causal(i))
        return 1.0 / self.sharding.work_divisor(i)

    def causal(self, i: int) -> bool:
        """Whether attention op ``i`` is causal as the ring runs it (``ring_work``)."""
        return causal_at(self.graph, i)

    def rings(self) -> list[int]:
        """The ops that run as ring attention over the axis."""
        return [i for i, s in enumerate(self.sharding.op_strategy)
                if s.kernel == "ring_attention"]

    def uneven_for_layout(self) -> list[str]:
        """The values split over the axis whose split dim does not cut into the layout's
        chunks (zigzag: ``2c`` per block)."""
        if self.layout != "zigzag":
            return []
        out = []
        for n, p in self.sharding.value_placement.items():
            if p.kind == "S":
                size = self.graph.value(n).meta.shape[p.dim]
                if size % (2 * self.c * p.blocks):
                    out.append(f"{n} (dim {p.dim} of {size})")
        return out

    def held_scale(self, i: int, name: str) -> float:
        """The share of value ``name`` one cp rank holds where op ``i`` reads or makes it (a
        reader may slice a whole value: a tp collective there moves the slice)."""
        found = share_at(self.graph.ops[i], self.strategy(i), name, self.c)
        return self.value_scale(name) if found is None else found

    def _value_scales(self) -> dict[str, float]:
        return {n: 1.0 / self.c for n, p in self.sharding.value_placement.items()
                if p.kind == "S"}

    @property
    def moved_dims(self) -> dict[str, frozenset[int]]:
        """Per value, the dims the cp axis moves it on somewhere (a consumer's transition, or
        an op's own gather or scatter of it): tp must not split them where it is moved."""
        return self._cached("moved_dims", self._moved_dims)

    def _moved_dims(self) -> dict[str, frozenset[int]]:
        out: dict[str, set[int]] = {}
        graph = self.graph
        for i, op in enumerate(graph.ops):
            if not op.outputs:             # metadata checks: they run on no tensor
                continue
            s = self.strategy(i)
            for k, n in enumerate(op.inputs):
                if k >= len(s.inputs):
                    continue
                src, want, local = self.placement(n), s.inputs[k], s.local_input(k)
                for a, b in ((src, want), (want, local)):
                    if a != b:
                        out.setdefault(n, set()).update(p.dim for p in (a, b) if p.kind == "S")
            for k, n in enumerate(op.outputs):
                if k < len(s.outputs) and s.outputs[k] != s.local_output(k):
                    out.setdefault(n, set()).update(
                        p.dim for p in (s.outputs[k], s.local_output(k)) if p.kind == "S")
        return {n: frozenset(d) for n, d in out.items()}

    def tp_conflict(self, i: int, s: OpStrategy, t: int) -> str:
        """Why tp strategy ``s`` of op ``i`` cannot run under this cp axis ("" when it can);
        decided once per op class (``_op_classes``: one op of every layer) and what of ``s``
        it reads (every sharding the search costs asks again for all of its ops)."""
        cache = self.caches.setdefault("tp_conflicts", {})
        key = (self._cached("op_classes", self._op_classes)[i], t, s.kernel, s.inputs,
               s.outputs, s.local_inputs, s.local_outputs)
        why = cache.get(key)
        if why is None:
            why = cache[key] = self._tp_conflict(i, s, t)
        head, side, k, tail = why
        if not side:
            return head
        op = self.graph.ops[i]
        return head + (op.inputs if side == "in" else op.outputs)[k] + tail

    def _op_classes(self) -> list[int]:
        """Per op, the class of ops alike in all ``_tp_conflict`` reads of them but their
        values' names (the cp strategy; per value its kind, shape and the dims cp moves it on):
        the ops at one place in every instance of a repeated layer, mostly."""
        graph, moved, ids, out = self.graph, self.moved_dims, {}, []
        for i, op in enumerate(graph.ops):
            c = self.strategy(i)
            ins = tuple((v.kind in STATE_KINDS, tuple(v.meta.shape), moved.get(n))
                        for n in op.inputs for v in (graph.value(n),))
            outs = tuple((tuple(graph.value(n).meta.shape), moved.get(n)) for n in op.outputs)
            sig = (c.kernel, c.split, c.inputs, c.outputs, c.local_inputs, c.local_outputs,
                   ins, outs)
            out.append(ids.setdefault(sig, len(ids)))
        return out

    def _tp_conflict(self, i: int, s: OpStrategy, t: int) -> tuple[str, str, int, str]:
        """``tp_conflict``'s answer as (text, "in" or "out" or "", slot, text): the value's
        name, where it names one, goes between (ops of one class differ in their names)."""
        graph, op, c = self.graph, self.graph.ops[i], self.strategy(i)
        if not op.outputs:
            return "", "", 0, ""
        if c.kernel and s.kernel and (c.kernel, s.kernel) not in COMPOSED:
            return f"both axes run a kernel ({c.kernel} on cp, {s.kernel} on tp)", "", 0, ""
        if c.kernel == "ring_attention" and s.kernel:
            return "ring attention over cp runs the attention itself", "", 0, ""
        if s.kernel not in _TP_KERNELS_ANY_PIECE and c.split:
            return f"the tp kernel {s.kernel} needs the whole sequence", "", 0, ""
        moved = self.moved_dims
        for k, n in enumerate(op.inputs):
            if k >= len(s.inputs):
                continue
            # a weight or buffer is stored as its first reader takes it on tp, and the cp axis
            # slices it from there; the op's own cp gather works on the tp-local input
            dims = set(moved.get(n, ())) if graph.value(n).kind in STATE_KINDS else set()
            held = [s.inputs[k], s.local_input(k)] if dims else []
            if c.inputs[k] != c.local_input(k):
                dims.update(p.dim for p in (c.inputs[k], c.local_input(k)) if p.kind == "S")
                held.append(s.local_input(k))
            if any(p.kind == "S" and p.dim in dims for p in held):
                return "cp moves input ", "in", k, " on a dim tp splits"
            if not _even(graph.value(n).meta.shape, c.inputs[k], self.c, s.inputs[k], t):
                return "input ", "in", k, " does not split evenly over both axes"
        for k, n in enumerate(op.outputs):
            if k >= len(s.outputs):
                continue
            p = s.outputs[k]
            if p.kind == "S" and p.dim in moved.get(n, frozenset()):
                return "cp moves output ", "out", k, f" on dim {p.dim}, which tp splits"
            if not _even(graph.value(n).meta.shape, c.local_output(k), self.c,
                         s.local_output(k), t):
                return "output ", "out", k, " does not split evenly over both axes"
        return "", "", 0, ""

    def conflicts(self, sh: Sharding) -> list[str]:
        """Why tp sharding ``sh`` cannot run under this cp axis, op by op (empty when it can;
        kept per sharding)."""
        cache = self.caches.setdefault("conflicts", {})
        hit = cache.get(id(sh))
        if hit is None or hit[0] is not sh:
            found = [f"op {self.graph.ops[i].name}: {why}"
                     for i, st in enumerate(sh.op_strategy)
                     if (why := self.tp_conflict(i, st, sh.t))] if sh.t > 1 else []
            hit = cache[id(sh)] = (sh, found)
        return hit[1]

    def whole_weight_readers(self) -> frozenset[tuple[int, int]]:
        """(op, input slot) where a trained weight is read by an op not split over cp: its
        gradient is whole on every cp rank, scaled by ``1 / c`` there (module docstring)."""
        out = set()
        for i, op in enumerate(self.graph.ops):
            s = self.strategy(i)
            if s.split:
                continue
            for k, n in enumerate(op.inputs):
                if self.graph.value(n).kind == "param" and needs_grad(self.graph, op, k):
                    out.add((i, k))
        return frozenset(out)

    def problems(self) -> list[str]:
        """What the cp axis itself cannot run on this graph (no tp axis involved)."""
        out = []
        for i, op in enumerate(self.graph.ops):
            s = self.strategy(i)
            for k, n in enumerate(op.inputs):
                v = self.graph.value(n)
                if v.kind == "param" and k < len(s.inputs) and s.inputs[k].kind == "S":
                    out.append(f"op {op.name} reads weight {v.fqn} split over the sequence")
            if s.kernel in ("sync_batch_norm", "mean_partial"):
                out.append(f"op {op.name} ({op.target}) needs the {s.kernel} kernel over cp")
            try:                              # a placement change no collective makes
                for k in range(min(len(op.outputs), len(s.outputs))):
                    output_action(self.graph, op, s, k)
                for k in range(min(len(op.inputs), len(s.inputs))):
                    input_action(self.graph, op, s, k)
            except AutoplanError as e:
                out.append(str(e))
        return out


def share_at(op: Op, s: OpStrategy, name: str, t: int) -> float | None:
    """The share of value ``name`` one rank of a ``t``-way axis holds where ``op`` (under
    strategy ``s``) reads or makes it; None where the op does neither."""
    for k, n in enumerate(op.inputs):
        if n == name and k < len(s.inputs):
            return 1.0 / t if s.inputs[k].kind == "S" else 1.0
    for k, n in enumerate(op.outputs):
        if n == name and k < len(s.outputs):
            return 1.0 / t if s.local_output(k).kind == "S" else 1.0
    return None


def _even(shape: tuple[int, ...], outer: Placement, c: int, inner: Placement, t: int) -> bool:
    mid = local_shape(tuple(shape), outer, c)
    return mid is not None and local_shape(mid, inner, t) is not None


def context_axis(graph: OpGraph, c: int, layout: str = "contiguous") -> ContextAxis | None:
    """The cp axis of ``c`` ranks over ``graph`` with its sequence ``layout`` (None for c =
    1); ConfigError where the model cannot run context-parallel (no attention to run as ring
    attention, or an op that needs the whole sequence in a way the runtime does not run), or
    not in that layout (a split dim that does not cut into ``2c`` chunks)."""
    if c == 1:
        return None
    if layout not in CP_LAYOUTS:
        raise ConfigError(f"cp_layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    cache = graph.__dict__.setdefault("_autoplan_context_axes", {})
    key = (c, layout)
    if key in cache:
        found = cache[key]
        if isinstance(found, str):
            raise ConfigError(found)
        return found
    if layout != "contiguous":
        # the same axis as the contiguous one (its errors too), laid out anew: share its work
        ax = context_axis(graph, c).in_layout(layout)
        uneven = ax.uneven_for_layout()
        why = (f"cp={c} with cp_layout='zigzag' cuts every split dim into {2 * c} chunks "
               f"per block, and {', '.join(uneven[:3])} does not divide so; use "
               f"cp_layout='contiguous' or a sequence length divisible by {2 * c}"
               ) if uneven else ""
        cache[key] = why or ax
        if why:
            raise ConfigError(why)
        return ax
    sh = context_sharding(graph, c)
    why = ""
    if sh is None:
        why = (f"cp={c}: the model has no attention that can run as ring attention over "
               f"{c} ranks (self-attention through scaled_dot_product_attention, sequence "
               f"divisible by {c}, no dropout on it); use cp=1")
    else:
        ax = ContextAxis(graph=graph, c=c, sharding=sh, layout=layout)
        problems = ax.problems()
        if problems:
            why = (f"cp={c}: the sequence cannot be split over its own axis: "
                   + "; ".join(problems[:3]) + "; use cp=1")
    if why:
        cache[key] = why
        raise ConfigError(why)
    cache[key] = ax
    return ax


def tp_allowed(ax: ContextAxis | None, i: int, options: list[OpStrategy], t: int
               ) -> list[OpStrategy]:
    """Of ``options`` (op ``i``'s tp strategies), those that run under ``ax``."""
    if ax is None or t == 1:
        return options
    return [s for s in options if not ax.tp_conflict(i, s, t)]


__all__ = ["COMPOSED", "ContextAxis", "context_axis", "share_at", "tp_allowed"]
