"""Pipeline chunks: the model's layers (the children of its layer container) split into
contiguous runs, and the search for the split.

A *unit* is one child of the container that holds the repeated layers (``layers.7``,
``transformer.h.3``), whether or not it is structurally like its neighbours: a stage holds
whole units, so the runtime can cut the model by deleting the other children of the container.
What comes before the first unit (embeddings) goes with the first chunk and what follows the
last (final norm, head, loss) with the last, as Megatron-LM does. Chunk ``c`` runs on pipeline
rank ``ParallelConfig.chunk_rank(c)``: ``c % pp``, or in a V for the V-shaped schedules.

``min_max_split`` is the stage partition (Alpa's and DAPPLE's dynamic program, in its min-max
form): choose where to cut and each chunk's recomputation policy so that the slowest chunk is
as fast as possible while every chunk fits its memory budget. Feasibility of a bound ``T`` is
decided exactly by a greedy that gives each chunk, from the last backwards, the longest run of
units it can hold within ``T`` and its budget (a shorter suffix is never harder to split, so
the greedy is optimal); the least feasible ``T`` is found by bisection. Working from the end
gives the later chunks the longer runs, which is what memory wants: under 1F1B the first stage
keeps ``pp`` micro-batches of activations in flight, the last one.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from autoplan.errors import ConfigError
from autoplan.graph.opgraph import OpGraph
# the units (the layers as the runtime cuts them) are the graph's: re-exported for callers here
from autoplan.graph.units import Unit, main_block, pipeline_units  # noqa: F401


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    stop: int
    layers: tuple[str, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    units: tuple[Unit, ...] = ()


def priced_ops(graph: OpGraph) -> tuple[int, ...]:
    """Per op, the op whose cost the estimate charges for it (``chunk_cost``): a unit's ops
    are priced as the ops at the same place in its ``like`` range, every other op as itself.
    Instances of one block that the ILP folds onto one node are charged as priced here, so
    that were one to cost otherwise than the rest, the ILP and the estimate would still agree
    (a compiled program's fused chains end at every layer's edge,
    ``cost.fused.compiled_regions``, so its first layer prices as the others). Kept on the
    graph."""
    cache = graph.__dict__.get("_autoplan_priced_ops")
    if cache is None:
        out = list(range(len(graph.ops)))
        for u in pipeline_units(graph):
            out[u.start:u.stop] = range(u.like[0], u.like[0] + u.stop - u.start)
        cache = graph.__dict__["_autoplan_priced_ops"] = tuple(out)
    return cache


def even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunks_from_counts(graph: OpGraph, counts: Sequence[int]) -> tuple[Chunk, ...]:
    """Chunks holding ``counts[c]`` consecutive units each (all ops when there are no units);
    made once per graph and split (chunks are frozen)."""
    cache = graph.__dict__.setdefault("_autoplan_chunks", {})
    key = tuple(counts)
    if key not in cache:
        if len(cache) > 4096:
            cache.clear()
        cache[key] = _chunks_from_counts(graph, key)
    return cache[key]


def _chunks_from_counts(graph: OpGraph, counts: Sequence[int]) -> tuple[Chunk, ...]:
    units = pipeline_units(graph)
    if not units:
        if len(counts) == 1:
            return (Chunk(0, 0, len(graph.ops), (), ()),)
        return _split_by_flops(graph, len(counts))
    if sum(counts) != len(units) or min(counts) < 1:
        raise ConfigError(f"chunk_layers {list(counts)} must be positive and add up to the "
                          f"model's {len(units)} layers")
    chunks = []
    first = start = 0
    for c, count in enumerate(counts):
        run = units[first:first + count]
        first += count
        stop = len(graph.ops) if c == len(counts) - 1 else run[-1].stop
        chunks.append(Chunk(c, start, stop, tuple(u.path for u in run),
                            tuple((u.start, u.stop) for u in run), run))
        start = stop
    return tuple(chunks)


def partition(graph: OpGraph, num_chunks: int,
              unit_s: Sequence[float] | None = None, before_s: float = 0.0,
              after_s: float = 0.0) -> tuple[Chunk, ...]:
    """``num_chunks`` chunks of whole units; with ``unit_s`` (seconds per unit) and the seconds
    of the ops before and after the units, the slowest chunk is as fast as it can be, else the
    split is even."""
    units = pipeline_units(graph)
    n = len(units)
    if num_chunks > 1 and units and num_chunks > n:
        raise ConfigError(f"pipeline needs {num_chunks} chunks (pp x virtual_stages) but the "
                          f"model has only {n} layers; lower pp or virtual_stages")
    if not units or num_chunks == 1:
        return chunks_from_counts(graph, [n] if units else [1] * num_chunks)
    if unit_s is None:
        return chunks_from_counts(graph, even_split(n, num_chunks))
    # the split is a function of these numbers alone: kept on the graph (the search costs a
    # pipelined config on the time-balanced split wherever no layout fits, and configs that
    # differ in ZeRO stage, schedule or offload share their unit times)
    cache = graph.__dict__.setdefault("_autoplan_time_splits", {})
    key = (num_chunks, tuple(unit_s), before_s, after_s)
    counts = cache.get(key)
    if counts is None:
        costs = [{"-": UnitChoice(time_s=t)} for t in unit_s]
        split = min_max_split(costs, num_chunks, first=UnitChoice(time_s=before_s),
                              last=UnitChoice(time_s=after_s))
        counts = split.counts if split else tuple(even_split(n, num_chunks))
        if len(cache) > 4096:
            cache.clear()
        cache[key] = counts
    return chunks_from_counts(graph, counts)


# ------------------------------------------------------------------ the min-max split
@dataclass(frozen=True)
class UnitChoice:
    """One unit under one policy, per micro-batch: seconds, activation bytes kept for backward
    and model-state bytes (weights, gradients, optimizer state on one device)."""

    time_s: float
    activation_bytes: float = 0.0
    state_bytes: float = 0.0


@dataclass(frozen=True)
class Split:
    counts: tuple[int, ...]           # units per chunk
    policies: tuple[str, ...]         # policy per chunk
    max_chunk_s: float


def min_max_split(costs: Sequence[Mapping[str, UnitChoice]], parts: int, *,
                  first: UnitChoice = UnitChoice(time_s=0.0),
                  last: UnitChoice = UnitChoice(time_s=0.0),
                  in_flight: Sequence[float] | None = None,
                  budget_bytes: Sequence[float] | None = None,
                  allowed: Sequence[Sequence[str]] | None = None,
                  rel_tol: float = 1e-4) -> Split | None:
    """Cut ``costs`` (per unit: policy -> UnitChoice, policies listed cheapest first) into
    ``parts`` contiguous chunks, choosing each chunk's policy (among ``allowed[c]``, default
    all), to minimize the slowest chunk. Chunk ``c`` holds ``in_flight[c]`` micro-batches of
    activations and must fit ``budget_bytes[c]``; ``first``/``last`` are the fixed ops the
    first/last chunk also run. None when no split fits."""
    n = len(costs)
    if parts < 1 or n < parts:
        return None
    sp = _SplitProblem.of(costs, parts, first=first, last=last, in_flight=in_flight,
                          budget_bytes=budget_bytes, allowed=allowed)
    hi = max(sp.pre[p][0][n] for p in sp.policies) + first.time_s + last.time_s + 1e-12
    runs, _ = sp.greedy(hi)
    if runs is None:
        return None
    runs, hi = sp.least_bound(runs, rel_tol)
    return sp.cheapest_policies(runs, hi)


Run = tuple[int, int, str]      # a chunk: units [start, stop) under a policy


@dataclass(frozen=True)
class _SplitProblem:
    """One ``min_max_split``: per policy the prefix sums of the units' (time, activation bytes,
    state bytes), per chunk what the first and last chunk add, its micro-batches in flight,
    its memory budget and the policies it may take."""

    n: int
    parts: int
    policies: tuple[str, ...]
    pre: dict[str, tuple[list[float], list[float], list[float]]]
    extra: tuple[tuple[float, float, float], ...]
    flight: tuple[float, ...]
    budget: tuple[float, ...]
    options: tuple[tuple[str, ...], ...]
    first: UnitChoice
    last: UnitChoice
    mean_fastest_s: float       # the average chunk, each unit at its fastest policy

    @staticmethod
    def of(costs: Sequence[Mapping[str, UnitChoice]], parts: int, *, first: UnitChoice,
           last: UnitChoice, in_flight: Sequence[float] | None,
           budget_bytes: Sequence[float] | None,
           allowed: Sequence[Sequence[str]] | None) -> _SplitProblem:
        policies = tuple(costs[0])
        pre: dict[str, tuple[list[float], list[float], list[float]]] = {}
        for p in policies:
            col = [u[p] for u in costs]     # running sums, left to right
            pre[p] = (list(accumulate([c.time_s for c in col], initial=0.0)),
                      list(accumulate([c.activation_bytes for c in col], initial=0.0)),
                      list(accumulate([c.state_bytes for c in col], initial=0.0)))
        # what the first and last chunk add (for the bisection in longest())
        extra = [(0.0, 0.0, 0.0) for _ in range(parts)]
        for e, c in ((first, 0), (last, parts - 1)):
            extra[c] = (extra[c][0] + e.time_s, extra[c][1] + e.activation_bytes,
                        extra[c][2] + e.state_bytes)
        return _SplitProblem(
            n=len(costs), parts=parts, policies=policies, pre=pre, extra=tuple(extra),
            flight=tuple(in_flight) if in_flight is not None else (1.0,) * parts,
            budget=(tuple(budget_bytes) if budget_bytes is not None
                    else (float("inf"),) * parts),
            options=(tuple(tuple(p for p in policies if p in set(a)) for a in allowed)
                     if allowed is not None else (policies,) * parts),
            first=first, last=last,
            mean_fastest_s=(sum([min([u[p].time_s for p in policies]) for u in costs])
                            + first.time_s + last.time_s) / parts)

    def cost(self, c: int, i: int, j: int, p: str) -> tuple[float, float]:
        """(seconds, bytes) of chunk ``c`` running units [i, j) under policy ``p``."""
        t, a, s = self.pre[p]
        secs = t[j] - t[i]
        acts = a[j] - a[i]
        state = s[j] - s[i]
        for e, on in ((self.first, c == 0), (self.last, c == self.parts - 1)):
            if on:
                secs += e.time_s
                acts += e.activation_bytes
                state += e.state_bytes
        return secs, state + self.flight[c] * acts

    def fits(self, c: int, i: int, j: int, p: str, bound: float) -> bool:
        """Chunk ``c`` over units [i, j) under ``p`` is within ``bound`` and its budget."""
        if 0 < c < self.parts - 1:         # cost() without the first and last chunk's extras
            t, a, s = self.pre[p]
            return (t[j] - t[i] <= bound
                    and s[j] - s[i] + self.flight[c] * (a[j] - a[i]) <= self.budget[c])
        secs, mem = self.cost(c, i, j, p)
        return secs <= bound and mem <= self.budget[c]

    def longest(self, c: int, j: int, bound: float,
                change: list[float]) -> tuple[int, str] | None:
        """Chunk c ending at unit j: the smallest start (most units) any policy allows.
        Lowers ``change[0]`` to the least bound above ``bound`` at which that would change."""
        if 0 < c < self.parts - 1:
            return self._longest_middle(c, j, bound, change)
        lo_limit = c            # leave one unit for each earlier chunk
        best: tuple[int, str] | None = None
        secs, acts, state = self.extra[c]
        f, cap = self.flight[c], self.budget[c]
        fits, cost = self.fits, self.cost
        for p in self.options[c]:
            if not fits(c, j - 1, j, p, bound):
                alone, mem = cost(c, j - 1, j, p)
                if mem <= cap:
                    change[0] = min(change[0], alone)
                continue
            # time and memory grow as the start moves left: bisect the time's prefix sums for
            # the smallest start within the bound, then the memory's where that overflows, and
            # step over rounding to the exact test
            t, a, s = self.pre[p]
            i = min(bisect_left(t, t[j] + secs - bound, lo_limit, j), j - 1)
            if not fits(c, i, j, p, bound):
                i = max(i, bisect_left(range(self.n + 1),
                                       s[j] + f * a[j] + state + f * acts - cap,
                                       lo_limit, j, key=lambda k: s[k] + f * a[k]))
                i = min(i, j - 1)
            while i > lo_limit and fits(c, i - 1, j, p, bound):
                i -= 1
            while not fits(c, i, j, p, bound):
                i += 1
            if i > lo_limit:
                longer, mem = cost(c, i - 1, j, p)
                if mem <= cap:
                    change[0] = min(change[0], longer)
            if best is None or i < best[0]:
                best = (i, p)
                if i == lo_limit:         # no later policy can start earlier
                    break
        return best

    def _longest_middle(self, c: int, j: int, bound: float,
                        change: list[float]) -> tuple[int, str] | None:
        """``longest`` for a chunk with neither end's extras, ``fits`` and ``cost`` written
        out (the same arithmetic in the same order: the planner's hottest loop)."""
        lo_limit = c
        best: tuple[int, str] | None = None
        f, cap = self.flight[c], self.budget[c]
        for p in self.options[c]:
            t, a, s = self.pre[p]
            tj, aj, sj = t[j], a[j], s[j]
            k = j - 1
            alone, mem = tj - t[k], sj - s[k] + f * (aj - a[k])
            if not (alone <= bound and mem <= cap):
                if mem <= cap and alone < change[0]:
                    change[0] = alone
                continue
            i = bisect_left(t, tj - bound, lo_limit, j)
            if i > k:
                i = k
            if not (tj - t[i] <= bound and sj - s[i] + f * (aj - a[i]) <= cap):
                q = bisect_left(range(self.n + 1), sj + f * aj - cap,
                                lo_limit, j, key=lambda q: s[q] + f * a[q])
                if q > i:
                    i = q
                if i > k:
                    i = k
            while i > lo_limit and (tj - t[i - 1] <= bound
                                    and sj - s[i - 1] + f * (aj - a[i - 1]) <= cap):
                i -= 1
            while not (tj - t[i] <= bound and sj - s[i] + f * (aj - a[i]) <= cap):
                i += 1
            if i > lo_limit:
                longer, mem = tj - t[i - 1], sj - s[i - 1] + f * (aj - a[i - 1])
                if mem <= cap and longer < change[0]:
                    change[0] = longer
            if best is None or i < best[0]:
                best = (i, p)
                if i == lo_limit:
                    break
        return best

    def greedy(self, bound: float) -> tuple[list[Run] | None, float]:
        """The split within ``bound`` (None: none fits), each chunk from the last backwards
        taking the longest run it can hold; and the smallest bound above this one at which
        any of the greedy's choices would change (a chunk could take one more unit, or a unit
        alone starts to fit): every bound below it takes the same path, so when that path
        fails, so do they."""
        change = [float("inf")]
        out = []
        j = self.n
        for c in range(self.parts - 1, -1, -1):
            got = self.longest(c, j, bound, change)
            if got is None:
                return None, change[0]
            i, p = got
            if c == 0 and i > 0:
                return None, change[0]
            out.append((i, j, p))
            j = i
        return out[::-1], change[0]

    def slowest(self, runs: Sequence[Run]) -> float:
        """The seconds of the slowest chunk of ``runs`` (``cost``'s, written out)."""
        pre, last = self.pre, self.parts - 1
        worst = -math.inf
        for c, (i, j, p) in enumerate(runs):
            t = pre[p][0]
            secs = t[j] - t[i]
            if c == 0:
                secs += self.first.time_s
            if c == last:
                secs += self.last.time_s
            if secs > worst:
                worst = secs
        return worst

    def least_bound(self, runs: list[Run], rel_tol: float) -> tuple[list[Run], float]:
        """The split at the least feasible bound (within ``rel_tol``) and that bound: bisect
        between the average chunk (at each unit's fastest policy) and the slowest chunk of the
        best split found so far (a split that fits is one at its own bound)."""
        hi = self.slowest(runs)
        lo = self.mean_fastest_s
        probe: float | None = None
        while hi - lo > rel_tol * hi:
            probing, mid = (True, probe) if probe is not None else (False, (lo + hi) / 2)
            probe = None
            got, change = self.greedy(mid)
            if got is not None:
                runs, hi = got, self.slowest(got)      # <= mid
                if probing:
                    break                         # == mid, and nothing below it fits: optimal
                continue
            # nothing below the next change of this path fits
            lo = max(mid, min(change, hi))
            if lo >= hi:
                break                             # hi is optimal
            if not probing:
                probe = lo                        # try that bound itself, once
        return runs, hi

    def cheapest_policies(self, runs: Sequence[Run], bound: float) -> Split:
        """Each chunk of ``runs`` under its cheapest policy that still fits ``bound`` and its
        memory."""
        chosen = [next((q for q in self.options[c] if self.fits(c, i, j, q, bound)), p)
                  for c, (i, j, p) in enumerate(runs)]
        secs = max(self.cost(c, i, j, p)[0]
                   for c, ((i, j, _), p) in enumerate(zip(runs, chosen)))
        return Split(counts=tuple(j - i for i, j, _ in runs), policies=tuple(chosen),
                     max_chunk_s=secs)


def _split_by_flops(graph: OpGraph, num_chunks: int) -> tuple[Chunk, ...]:
    """No repeated block: cut where the cumulative forward FLOPs cross equal shares."""
    if num_chunks > len(graph.ops):
        raise ConfigError(f"cannot cut {len(graph.ops)} ops into {num_chunks} pipeline chunks")
    total = max(graph.fwd_flops, 1)
    cuts = []
    acc = 0
    target = 1
    for i, op in enumerate(graph.ops):
        acc += op.fwd_flops
        if target < num_chunks and acc >= total * target / num_chunks and i + 1 < len(graph.ops):
            cuts.append(i + 1)
            target += 1
    while len(cuts) < num_chunks - 1:          # degenerate FLOP profiles: cut evenly
        cuts.append(len(graph.ops) * (len(cuts) + 1) // num_chunks)
    bounds = [0] + sorted(set(cuts))[: num_chunks - 1] + [len(graph.ops)]
    return tuple(Chunk(c, bounds[c], bounds[c + 1], (), ()) for c in range(len(bounds) - 1))
