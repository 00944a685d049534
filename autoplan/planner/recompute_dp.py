"""Which layers to recompute, and how: a dynamic program over the chain of layers.

Problem (one pipeline stage; rotor's chain model, Beaumont et al. 2019, with one level):
    layers l = 0..n-1 in model order, each with policies j (``none``, ``selective``, ``ops``,
    ``full``) and, per policy,
        a[l][j]  kept bytes per micro-batch: what the layer holds from its forward to its
                 backward (its input, and what the policy stores);
        r[l][j]  recompute seconds per micro-batch: the forward the policy replays in backward;
        w[l][j]  working bytes: what the layer's backward needs at once beyond what it keeps
                 (a checkpointed layer rebuilds its activations there).
    Choose one policy x_l per layer to
        minimise    sum_l r[l][x_l]
        subject to  F * sum_l a[l][x_l] + max_l w[l][x_l] <= B         (memory)
    with F the micro-batches the stage holds in flight at its peak and B the stage's budget:
    the device memory less the model states, the other transients, the activations outside
    the layers and the margin (``planner/recompute_choice.py`` derives them from an estimate).

Method. The max is handled exactly: for each value W the largest working set can take (the
distinct w's), only policies with w <= W are allowed and what is left is a knapsack over the
chain, min sum r subject to sum a <= (B - W) / F. The knapsack is a Pareto dynamic program:
after layer l, the non-dominated (kept bytes, recompute seconds) pairs of the prefix; a pair
over the budget or dominated (more bytes and no less time) is dropped. That is exact. Where a
front grows past ``max_states`` pairs (long chains of unlike layers), it is thinned on a grid
of ``max_states / 2`` cells over the budget, each cell keeping its fastest and its smallest
pair: the smallest pair of the prefix always survives (so a feasible chain is always found
when one exists), and the time lost is bounded by what one cell's bytes can buy per layer.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): with ``max_segment > 1`` a
run of up to that many consecutive layers may share one checkpoint, keeping only the first
layer's input (``ChainLayer.input_bytes``), replaying all their forwards, and rebuilding all
their activations at once in backward (its working set: the sum of their ``none`` bytes). On a
uniform chain of n layers whose inputs are as large as their activations, the smallest memory
at one extra forward is then 2 sqrt(n) layers' worth, with runs of about sqrt(n) layers:
Chen's sqrt(n) schedule, as a special case (tests/test_recompute_dp.py). The runtime wraps
one layer per checkpoint, so the planner solves with ``max_segment=1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LayerOption:
    """One policy of one layer: its kept bytes, recompute seconds and working bytes."""

    policy: str
    kept_bytes: float
    recompute_s: float
    working_bytes: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ChainLayer:
    """A layer of the chain: its policies; for Chen's segments, the bytes of its input and the
    seconds of its forward (a segment keeps the first input, replays every forward)."""

    options: tuple[LayerOption, ...]
    input_bytes: float = 0.0
    fwd_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.options:
            raise ConfigError("a chain layer needs at least one recompute option")

    @property
    def none_bytes(self) -> float:
        """The bytes it keeps recomputing nothing: its most (what a segment rebuilds)."""
        return max(o.kept_bytes for o in self.options)


@dataclass(frozen=True, kw_only=True)
class ChainSolution:
    """The chosen policy per layer, with its totals. ``segments``: the runs of layers sharing
    one checkpoint (``max_segment > 1``), as (first, stop) pairs; single layers are not
    listed."""

    policies: tuple[str, ...]
    recompute_s: float
    kept_bytes: float               # per micro-batch
    working_bytes: float            # the largest working set
    memory_bytes: float             # in_flight * kept_bytes + working_bytes
    segments: tuple[tuple[int, int], ...] = ()


# a state of the prefix: (kept bytes, recompute seconds, the state before it, its step)
_State = tuple[float, float, object, object]


def solve_chain(layers: Sequence[ChainLayer], *, budget_bytes: float,
                in_flight: float = 1.0, max_states: int = 4096,
                max_segment: int = 1) -> ChainSolution | None:
    """The policies of ``layers`` that recompute least within ``budget_bytes`` (see the module
    docstring); None when even the most frugal choice does not fit."""
    if in_flight <= 0:
        raise ConfigError(f"in_flight must be positive, got {in_flight}")
    if max_states < 4 or max_segment < 1:
        raise ConfigError(f"max_states must be >= 4 and max_segment >= 1, got {max_states}, "
                          f"{max_segment}")
    if not layers:
        return ChainSolution(policies=(), recompute_s=0.0, kept_bytes=0.0, working_bytes=0.0,
                             memory_bytes=0.0)
    best: ChainSolution | None = None
    for w_cap in _working_caps(layers, max_segment):
        room = (budget_bytes - w_cap) / in_flight
        if room < 0:
            continue
        got = _knapsack(layers, room, w_cap, max_states, max_segment)
        if got is None:
            continue
        sol = _solution(layers, got, in_flight)
        if best is None or (sol.recompute_s, sol.memory_bytes) < (best.recompute_s,
                                                                  best.memory_bytes):
            best = sol
    return best


def _working_caps(layers: Sequence[ChainLayer], max_segment: int) -> list[float]:
    """The values the largest working set can take: every option's, and every segment's."""
    caps = {o.working_bytes for layer in layers for o in layer.options}
    if max_segment > 1:
        for i in range(len(layers)):
            run = layers[i].none_bytes
            for j in range(i + 1, min(len(layers), i + max_segment)):
                run += layers[j].none_bytes
                caps.add(run)
    return sorted(caps)


def _knapsack(layers: Sequence[ChainLayer], room: float, w_cap: float, max_states: int,
              max_segment: int) -> _State | None:
    """The fastest state of the whole chain keeping at most ``room`` bytes, with no working
    set over ``w_cap``; None if none fits."""
    n = len(layers)
    fronts: list[list[_State]] = [[] for _ in range(n + 1)]
    fronts[0] = [(0.0, 0.0, None, None)]
    for i in range(n):
        front = _pareto(fronts[i], room, max_states)
        fronts[i] = front
        if not front:
            return None
        for o in layers[i].options:
            if o.working_bytes <= w_cap:
                fronts[i + 1].extend((st[0] + o.kept_bytes, st[1] + o.recompute_s, st,
                                      o.policy) for st in front)
        if max_segment > 1:
            _segments_from(layers, i, front, fronts, w_cap, max_segment)
    final = _pareto(fronts[n], room, max_states)
    return final[-1] if final else None     # the fastest: times fall as bytes grow


def _segments_from(layers: Sequence[ChainLayer], i: int, front: list[_State],
                   fronts: list[list[_State]], w_cap: float, max_segment: int) -> None:
    """Chen's segments starting at layer ``i``: layers i..j-1 under one checkpoint."""
    kept = layers[i].input_bytes
    replay = layers[i].fwd_s
    working = layers[i].none_bytes
    for j in range(i + 1, min(len(layers), i + max_segment)):
        replay += layers[j].fwd_s
        working += layers[j].none_bytes
        if working > w_cap:
            break
        fronts[j + 1].extend((st[0] + kept, st[1] + replay, st, ("segment", i, j + 1))
                             for st in front)


def _pareto(states: list[_State], room: float, max_states: int) -> list[_State]:
    """``states`` within ``room`` bytes, dominated ones dropped, by growing bytes (so falling
    time); thinned on a grid of the budget past ``max_states`` (the module docstring)."""
    out: list[_State] = []
    best_t = float("inf")
    for st in sorted((s for s in states if s[0] <= room * (1 + 1e-12) + 1e-9),
                     key=lambda s: (s[0], s[1])):
        if st[1] < best_t:
            out.append(st)
            best_t = st[1]
    if len(out) <= max_states:
        return out
    cells = max_states // 2
    width = room / cells if room > 0 else 1.0
    kept: dict[int, list[_State]] = {}
    for st in out:
        kept.setdefault(min(int(st[0] / width), cells), []).append(st)
    thin = []
    for cell in sorted(kept):
        group = kept[cell]
        thin.append(group[0])                 # the smallest of the cell
        if len(group) > 1:
            thin.append(group[-1])            # and its fastest
    return thin


def _solution(layers: Sequence[ChainLayer], last: _State, in_flight: float) -> ChainSolution:
    """Walk the states back to the policy of every layer."""
    steps = []
    st: object = last
    while st is not None and st[2] is not None:     # type: ignore[index]
        steps.append(st[3])                         # type: ignore[index]
        st = st[2]                                  # type: ignore[index]
    steps.reverse()
    policies: list[str] = []
    segments = []
    working = 0.0
    for step in steps:
        if isinstance(step, tuple):
            _, i, j = step
            segments.append((i, j))
            policies += ["full"] * (j - i)
            working = max(working, sum(layers[k].none_bytes for k in range(i, j)))
        else:
            opt = next(o for o in layers[len(policies)].options if o.policy == step)
            working = max(working, opt.working_bytes)
            policies.append(step)
    kept, time_s = last[0], last[1]
    return ChainSolution(policies=tuple(policies), recompute_s=time_s, kept_bytes=kept,
                         working_bytes=working, memory_bytes=in_flight * kept + working,
                         segments=tuple(segments))


def uniform_best(layers: Sequence[ChainLayer], *, budget_bytes: float,
                 in_flight: float = 1.0) -> ChainSolution | None:
    """The fastest single policy for every layer that fits (the search's uniform choice), for
    comparison with ``solve_chain``; None if none fits."""
    names = [o.policy for o in layers[0].options] if layers else []
    best = None
    for name in names:
        opts = [next((o for o in layer.options if o.policy == name), None) for layer in layers]
        if any(o is None for o in opts):
            continue
        kept = sum(o.kept_bytes for o in opts)
        working = max(o.working_bytes for o in opts)
        mem = in_flight * kept + working
        if mem > budget_bytes:
            continue
        sol = ChainSolution(policies=(name,) * len(layers),
                            recompute_s=sum(o.recompute_s for o in opts), kept_bytes=kept,
                            working_bytes=working, memory_bytes=mem)
        if best is None or sol.recompute_s < best.recompute_s:
            best = sol
    return best
