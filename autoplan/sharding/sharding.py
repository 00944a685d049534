"""A sharding: one strategy per op on one mesh axis, and everything that follows from it.

``Sharding`` is what the cost model reads (work per rank, collectives, where each tensor lies,
how each parameter is stored) and what the runtime executes op by op. Two ways to get one:
- ``megatron_sharding``: the Megatron-LM rule, by propagation: a linear whose input is whole
  goes column-parallel, one whose input is split goes row-parallel; embeddings vocab-parallel;
  the loss vocab-parallel; everything in between keeps the placement it is given. With
  ``sequence_parallel`` the replicated stretches become sequence-sharded;
- the ILP (``autoplan.planner``) picks a strategy per op; ``Sharding.build`` expands it.

Resharding between where a value lies and where a consumer needs it (``reshard_kind``):
same -> free; R -> S(d) -> free (a local slice); S -> R -> all-gather; S -> another split ->
all-to-all; P -> R -> all-reduce; P -> S -> reduce-scatter; and the reverse for the gradient of
values that carry one. Parameters and buffers are stored in the placement their first reader
needs; a later reader that needs another one reshards them the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.strategies import strategies
from autoplan.sharding.strategy import Comm, OpStrategy, replicate

STATE_KINDS = ("param", "buffer")


@dataclass(frozen=True)
class Reshard:
    """A collective inserted between a producer and a consumer op (on the consumer's side)."""

    op_index: int       # the consuming op
    value: str
    phase: str          # "fwd" | "bwd"
    kind: str           # "all_gather" | "all_to_all" | "all_reduce" | "reduce_scatter"
    scale: float = 1.0


def reshard_kind(src: Placement, dst: Placement) -> tuple[str, float] | None:
    """The collective that turns ``src`` into ``dst`` (and its byte scale), None when free."""
    if src == dst or (dst.kind == "S" and src.kind == "R"):
        return None
    if src.kind == "S" and dst.kind == "R":
        return "all_gather", 1.0
    if src.kind == "S" and dst.kind == "S":
        return "all_to_all", -1.0     # -1: bytes one rank sends = the full size / t
    if src.kind == "P" and dst.kind == "S":
        return "reduce_scatter", 1.0
    return "all_reduce", 1.0          # partial -> whole


def mutates_input(op_target: str) -> bool:
    """aten's in-place ops end in ``_`` and write their first input."""
    parts = op_target.split(".")
    name = parts[1] if len(parts) > 2 else parts[-1]
    return name.endswith("_") and not name.startswith("_")


@dataclass(frozen=True)
class Sharding:
    t: int
    op_strategy: tuple[OpStrategy, ...]          # one per graph op
    value_placement: dict[str, Placement]        # where each op output lies
    reshards: tuple[Reshard, ...]
    state: dict[str, Placement]                  # parameter/buffer FQN -> stored placement

    # ---- derived views -------------------------------------------------------------------
    def work_divisor(self, i: int) -> int:
        return self.op_strategy[i].work_divisor

    def input_placement(self, graph: OpGraph, i: int, name: str) -> Placement:
        op = graph.ops[i]
        s = self.op_strategy[i]
        for k, n in enumerate(op.inputs):
            if n == name and k < len(s.inputs):
                return s.inputs[k]
        return REPLICATE

    def param_placement(self, graph: OpGraph) -> dict[str, Placement]:
        """Each parameter's stored placement (FQN -> placement; tied aliases as their owner)."""
        out = {}
        for v in graph.param_values:
            owner = graph.value(v.base).fqn
            if owner in self.state:
                out[v.fqn] = self.state[owner]
        return out

    def param_placement_text(self, graph: OpGraph) -> dict[str, str]:
        """Every parameter FQN (tied aliases too, as their storage's) -> its stored placement on
        the tp axis as the plan file writes it ("R", "S(0)", ...), sorted by FQN."""
        placed = self.param_placement(graph)
        by_base = {v.base: placed[v.fqn] for v in graph.param_values if v.fqn in placed}
        out = {}
        for v in sorted(graph.param_values, key=lambda v: v.fqn):
            p = placed.get(v.fqn, by_base.get(v.base))
            out[v.fqn] = str(p) if p is not None else "R"
        return out

    def placement_of(self, graph: OpGraph, name: str) -> Placement:
        """Where value ``name`` lies: op outputs as placed, state as stored, inputs whole."""
        if name in self.value_placement:
            return self.value_placement[name]
        v = graph.value(name)
        if v.kind in STATE_KINDS:
            return self.state.get(graph.value(v.base).fqn, REPLICATE)
        return REPLICATE

    def reshards_in(self, start: int, stop: int) -> list[Reshard]:
        """Reshards whose consuming op lies in ops[start:stop] (indexed once, then bisected)."""
        idx = self.__dict__.get("_reshard_index")
        if idx is None:
            idx = [r.op_index for r in self.reshards]
            object.__setattr__(self, "_reshard_index", idx)
        return list(self.reshards[bisect.bisect_left(idx, start):bisect.bisect_left(idx, stop)])

    def comms(self, start: int = 0, stop: int | None = None):
        """(op index, Comm) for the strategies' own collectives in ops[start:stop]."""
        stop = len(self.op_strategy) if stop is None else stop
        for i in range(start, stop):
            for c in self.op_strategy[i].comms:
                yield i, c

    def module_styles(self, graph: OpGraph) -> dict[str, str]:
        """Style per module path that owns parameters (the first op reading one decides)."""
        styles: dict[str, str] = {}
        for op, s in zip(graph.ops, self.op_strategy):
            if s.style not in ("local",) and op.params and op.module_path:
                styles.setdefault(op.module_path, s.style)
        return dict(sorted(styles.items()))

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def build(graph: OpGraph, t: int, chosen: Sequence[OpStrategy]) -> Sharding:
        placement: dict[str, Placement] = {}
        state: dict[str, Placement] = {}
        reshards: list[Reshard] = []
        for i, (op, s) in enumerate(zip(graph.ops, chosen)):
            if not op.outputs:
                continue              # metadata checks: they take their inputs as they come
            for k, n in enumerate(op.inputs):
                v = graph.value(n)
                dst = s.inputs[k] if k < len(s.inputs) else REPLICATE
                if v.kind in STATE_KINDS:
                    src = state.setdefault(graph.value(v.base).fqn, dst)
                elif v.kind == "activation":
                    src = placement.get(n, REPLICATE)
                else:
                    continue          # inputs and constants: whole on every rank, sliced free
                fwd = reshard_kind(src, dst)
                if fwd is not None:
                    reshards.append(Reshard(i, n, "fwd", fwd[0], fwd[1]))
                if v.requires_grad:
                    bwd = reshard_kind(dst, src)
                    if bwd is not None:
                        reshards.append(Reshard(i, n, "bwd", bwd[0], bwd[1]))
            for k, n in enumerate(op.outputs):
                placement[n] = s.outputs[k] if k < len(s.outputs) else REPLICATE
        chosen = _mixed_weight_grads(graph, list(chosen))
        return Sharding(t=t, op_strategy=tuple(chosen), value_placement=placement,
                        reshards=tuple(reshards), state=state)


def _mixed_weight_grads(graph: OpGraph, chosen: list[OpStrategy]) -> list[OpStrategy]:
    """A replicated weight whose gradient is partial on some readers and whole on others
    cannot be all-reduced once per step (the whole parts would be summed ``t`` times): those
    readers all-reduce their part in backward instead."""
    step_readers: dict[str, set[int]] = {}
    readers: dict[str, set[int]] = {}
    for i, (op, s) in enumerate(zip(graph.ops, chosen)):
        for n in op.inputs:
            v = graph.value(n)
            if v.kind == "param" and v.requires_grad:
                readers.setdefault(v.base, set()).add(i)
        for c in s.comms:
            if c.phase == "step":
                step_readers.setdefault(graph.value(c.value).base, set()).add(i)
    for base, steps in step_readers.items():
        if steps == readers.get(base, steps):
            continue
        for i in steps:
            s = chosen[i]
            comms = tuple(Comm(c.kind, c.value, "bwd", c.scale)
                          if c.phase == "step" and graph.value(c.value).base == base else c
                          for c in s.comms)
            chosen[i] = OpStrategy(s.name, s.inputs, s.outputs, s.work_divisor, comms, s.style,
                                   s.kernel, s.local_inputs, s.local_outputs)
    return chosen


def built_once(graph: OpGraph, key: tuple, build: Any) -> Sharding:
    """The sharding ``build()`` makes, made once per graph and ``key`` (the planner asks for
    the same ones for every mesh, micro-batch and baseline; shardings are frozen)."""
    cache = graph.__dict__.setdefault("_autoplan_shardings", {})
    sh = cache.get(key)
    if sh is None:
        sh = cache[key] = build()
    return sh


def replicated(graph: OpGraph) -> Sharding:
    return replicated_on(graph, 1)


def replicated_on(graph: OpGraph, t: int) -> Sharding:
    """Every op replicated on a t-way axis (each rank of the group does all the work)."""
    return built_once(graph, ("replicated", t), lambda: Sharding.build(
        graph, t, [replicate(op) for op in graph.ops]))


def as_inputs_come(graph: OpGraph, op: Any, options: Sequence[OpStrategy],
                   placement: Mapping[str, Placement]) -> OpStrategy:
    """The strategy of ``op`` that takes its activations as they are (``placement``: what was
    chosen for every value so far; weights count as free), for an op whose own choice does not
    exist here."""
    cur = [placement.get(n) if graph.value(n).kind == "activation" else None for n in op.inputs]
    return _pick(list(options), cur) or options[0]


def _pick(options: list[OpStrategy], want: Sequence[Placement | None]) -> OpStrategy | None:
    """The strategy that takes the inputs as they are, or with free slicing (R -> S(d)); the one
    matching most inputs exactly wins (then the earlier). None entries (weights) match any."""
    best, best_exact = None, -1
    for s in options:
        exact, ok = 0, True
        for k, w in enumerate(want):
            if w is None:
                continue
            need = s.inputs[k] if k < len(s.inputs) else REPLICATE
            if need == w:
                exact += 1
            elif not (w.kind == "R" and need.kind == "S"):
                ok = False
                break
        if ok and exact > best_exact:
            best, best_exact = s, exact
    return best


_STARTS_SPLIT = ("colwise", "colwise_sp", "embed_dim")
_ENDS_SPLIT = ("rowwise", "rowwise_sp", "vocab", "vocab_sp")


def megatron_sharding(graph: OpGraph, t: int, sequence_parallel: bool = False) -> Sharding:
    """Megatron-LM tensor (and sequence) parallelism, by propagation over the graph."""
    if t == 1:
        return replicated(graph)
    return built_once(graph, ("megatron", t, bool(sequence_parallel)),
                       lambda: _megatron_sharding(graph, t, sequence_parallel))


def _megatron_sharding(graph: OpGraph, t: int, sequence_parallel: bool) -> Sharding:
    placement: dict[str, Placement] = {}
    model_split: set[str] = set()      # values split across features/heads (not batch/sequence)
    chosen: list[OpStrategy] = []
    tokens = analyze(graph).batch_dependent
    for op in graph.ops:
        options = strategies(graph, op, t)
        by_name = {s.name: s for s in options}
        cur = [placement.get(n) if graph.value(n).kind == "activation" else None
               for n in op.inputs]
        split = any(n in model_split for n in op.inputs)
        s: OpStrategy | None = None
        if op.kind == "matmul" and any(graph.value(n).kind == "param" for n in op.inputs):
            if split:
                s = by_name.get("rowwise_sp" if sequence_parallel else "rowwise")
            else:
                s = _colwise(by_name, sequence_parallel)
        elif op.kind == "embedding" and op.params and len(op.inputs) > 1 \
                and op.inputs[1] in tokens:      # word embeddings; position tables stay whole
            s = by_name.get("vocab_sp" if sequence_parallel and "vocab_sp" in by_name else "vocab")
        elif op.kind == "loss" and split:
            s = by_name.get("vocab")
        elif op.kind == "norm" and sequence_parallel and not split:
            s = by_name.get("seq")
        if s is None:
            s = _pick(options, cur) or options[0]
        chosen.append(s)
        starts_split = s.name.split("_blocks")[0] in _STARTS_SPLIT
        ends_split = s.name in _ENDS_SPLIT
        for k, n in enumerate(op.outputs):
            p = s.outputs[k] if k < len(s.outputs) else REPLICATE
            placement[n] = p
            if p.kind == "S" and (split or starts_split) and not ends_split:
                model_split.add(n)
    return _repair(graph, t, chosen)


def context_sharding(graph: OpGraph, t: int) -> Sharding:
    """Context parallelism on the t-way axis: every op that has one takes its sequence split
    (``seq``: activations split on the sequence, weights whole; attention as ring attention),
    the rest take their inputs as they come; weights' gradients are summed over the axis once
    a step, as data parallelism's are. None when the graph has no ring attention to run."""
    if t == 1:
        return replicated(graph)
    return built_once(graph, ("context", t), lambda: _context_sharding(graph, t))


def _context_sharding(graph: OpGraph, t: int) -> Sharding | None:
    placement: dict[str, Placement] = {}
    chosen: list[OpStrategy] = []
    rings = 0
    for op in graph.ops:
        options = strategies(graph, op, t)
        cur = [placement.get(n) if graph.value(n).kind == "activation" else None
               for n in op.inputs]
        seq = [o for o in options if o.name == "seq"]
        # where no sequence split takes the inputs, one that keeps the weights whole
        whole = [o for o in options if all(o.inputs[k].kind == "R" for k, n in
                                           enumerate(op.inputs) if k < len(o.inputs)
                                           and graph.value(n).kind == "param")]
        s = (_pick(seq, cur) if seq else None) or _pick(whole, cur) or options[0]
        rings += s.kernel == "ring_attention"
        chosen.append(s)
        for k, n in enumerate(op.outputs):
            placement[n] = s.outputs[k] if k < len(s.outputs) else REPLICATE
    return _repair(graph, t, chosen) if rings else None


def _colwise(by_name: dict[str, OpStrategy], sequence_parallel: bool) -> OpStrategy | None:
    """Column-parallel, in blocks when the output is cut into blocks later (fused q/k/v)."""
    base = "colwise_sp" if sequence_parallel and "colwise_sp" in by_name else "colwise"
    blocked = sorted(n for n in by_name if n.startswith(base + "_blocks"))
    return by_name.get(blocked[0]) if blocked else by_name.get(base)


def _repair(graph: OpGraph, t: int, chosen: list[OpStrategy]) -> Sharding:
    """Where a parameter-free op needs a placement its producer module could emit directly,
    switch the module to the strategy that emits it (e.g. a position embedding sharded on the
    sequence for SP), saving the reshard."""
    sh = Sharding.build(graph, t, chosen)
    for _round in range(4):
        producer = {n: i for i, op in enumerate(graph.ops) for n in op.outputs}
        changed = False
        for r in sh.reshards:
            if graph.ops[r.op_index].params:
                continue
            p = producer.get(r.value)
            if p is None or not graph.ops[p].params:
                continue
            want = sh.input_placement(graph, r.op_index, r.value)
            pos = graph.ops[p].outputs.index(r.value)
            # a module may reshard its own input, so only its output has to match; the one
            # with the fewest collectives per micro-batch wins
            fits = [alt for alt in strategies(graph, graph.ops[p], t)
                    if pos < len(alt.outputs) and alt.outputs[pos] == want]
            if fits:
                chosen[p] = min(fits, key=lambda s: sum(c.phase != "step" for c in s.comms))
                changed = True
        if not changed:
            break
        sh = Sharding.build(graph, t, chosen)
    return sh


__all__ = ["Comm", "Reshard", "Sharding", "context_sharding", "megatron_sharding", "mutates_input", "replicated",
           "replicated_on", "reshard_kind"]
