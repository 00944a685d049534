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

Activation offload (``ParallelConfig.layer_offload``) joins the same choice: a layer's options
are its policies, each with or without sending what it keeps to host memory, as the runtime
runs them (``none``, ``ops``, ``full`` offloaded or not; ``selective`` never offloaded). An
offloaded option's ``kept_bytes`` is what stays on the device, ``moved_bytes`` what goes to the
host per micro-batch, ``offload_s`` the copies' seconds that compute does not hide. With
    m[l][j]  bytes moved to the host per micro-batch (0 unless offloaded), and
    e[l][j]  exposed copy seconds,
the problem becomes
    minimise    sum_l r[l][x_l] + e[l][x_l]
    subject to  F * sum_l a[l][x_l] + max_l w[l][x_l] + max_l m[l][x_l] <= B  (device)
                F * sum_l m[l][x_l] <= H                                      (host)
the device holding one layer's copy in flight on top of its working set, and H the host
memory the stage's devices may fill (their share of the node's, less what the plan already
offloads there). The second max is handled as the first: each value M the largest copy can
take caps the offloaded options, with (B - W - M) / F left to the chain. Where the host budget
can bind (F times the largest moves of every layer exceed it), the fronts are over (kept
bytes, host bytes, seconds), a state dominated when another has no more of any; else host bytes
are left out of the dominance and the fronts stay two-dimensional, as without offload.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): with ``max_segment > 1`` a
run of up to that many consecutive layers may share one checkpoint, keeping only the first
layer's input (``ChainLayer.input_bytes``), replaying all their forwards, and rebuilding all
their activations at once in backward (its working set: the sum of their ``none`` bytes). On a
uniform chain of n layers whose inputs are as large as their activations, the smallest memory
at one extra forward is then 2 sqrt(n) layers' worth, with runs of about sqrt(n) layers:
Chen's sqrt(n) schedule, as a special case (tests/test_recompute_dp.py). The runtime wraps
one layer per checkpoint, so the planner solves with ``max_segment=1``: what is priced runs.
Segments would buy little there (``benchmarks/recompute_segments.py``: 0.1 GiB less at least
for a GPT-3 175B stage with 16 micro-batches in flight, none for Llama-3-8B on one H100), since
they replay what per-layer ``full`` replays and the working set outside the layers floors the
memory.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from autoplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LayerOption:
    """One policy of one layer: its kept bytes (on the device), recompute seconds and working
    bytes; offloaded (``offload``): the bytes it sends to host memory per micro-batch and the
    copies' exposed seconds."""

    policy: str
    kept_bytes: float
    recompute_s: float
    working_bytes: float = 0.0
    offload: bool = False
    moved_bytes: float = 0.0
    offload_s: float = 0.0

    @property
    def time_s(self) -> float:
        """What the option adds to a micro-batch's step: recomputation and exposed copies."""
        return self.recompute_s + self.offload_s


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
    working_bytes: float            # the largest working set (and copy in flight)
    memory_bytes: float             # in_flight * kept_bytes + working_bytes
    segments: tuple[tuple[int, int], ...] = ()
    offloads: tuple[bool, ...] = ()  # per layer: sends what it keeps to the host
    offload_s: float = 0.0          # the copies' exposed seconds per micro-batch
    host_bytes: float = 0.0         # in_flight * the bytes moved per micro-batch

    @property
    def time_s(self) -> float:
        return self.recompute_s + self.offload_s


# a state of the prefix: (kept bytes, host bytes, seconds, the state before it, its step)
_State = tuple[float, float, float, object, object]
_bytes_then_time = itemgetter(0, 2)
_bytes_host_time = itemgetter(0, 1, 2)
_time_then_bytes = itemgetter(2, 0)


def solve_chain(layers: Sequence[ChainLayer], *, budget_bytes: float,
                in_flight: float = 1.0, max_states: int = 512,
                max_segment: int = 1, host_budget_bytes: float | None = None
                ) -> ChainSolution | None:
    """The options of ``layers`` that cost least time within ``budget_bytes`` of device memory
    and ``host_budget_bytes`` of host memory (None: unbounded) (see the module docstring);
    None when even the most frugal choice does not fit."""
    if in_flight <= 0:
        raise ConfigError(f"in_flight must be positive, got {in_flight}")
    if max_states < 4 or max_segment < 1:
        raise ConfigError(f"max_states must be >= 4 and max_segment >= 1, got {max_states}, "
                          f"{max_segment}")
    if not layers:
        return ChainSolution(policies=(), recompute_s=0.0, kept_bytes=0.0, working_bytes=0.0,
                             memory_bytes=0.0)
    host_room = (float("inf") if host_budget_bytes is None
                 else max(host_budget_bytes, 0.0) / in_flight)
    # the host dimension matters only where taking every layer's largest move could bind
    binds = sum(max(o.moved_bytes for o in l.options) for l in layers) > host_room
    best: ChainSolution | None = None
    for w_cap in _working_caps(layers, max_segment):
        for m_cap in _move_caps(layers):
            room = (budget_bytes - w_cap - m_cap) / in_flight
            if room < 0:
                continue
            got = _knapsack(layers, (room, host_room, binds), w_cap, m_cap, max_states,
                            max_segment)
            if got is None:
                continue
            sol = _solution(layers, got, in_flight)
            if best is None or (sol.time_s, sol.memory_bytes) < (best.time_s,
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


def _move_caps(layers: Sequence[ChainLayer]) -> list[float]:
    """The values the largest copy in flight can take: none, and every offloaded option's."""
    return sorted({0.0} | {o.moved_bytes for layer in layers for o in layer.options
                           if o.offload})


def _knapsack(layers: Sequence[ChainLayer], rooms: tuple[float, float, bool], w_cap: float,
              m_cap: float, max_states: int, max_segment: int) -> _State | None:
    """The fastest state of the whole chain keeping at most ``rooms[0]`` device bytes and
    ``rooms[1]`` host bytes (per micro-batch), with no working set over ``w_cap`` and no copy
    over ``m_cap``; None if none fits. ``rooms[2]``: whether host bytes enter the dominance.
    A state over a room is never made (``_fits``), so ``_pareto`` sees only states inside."""
    n = len(layers)
    fits = _fits(rooms)
    fronts: list[list[_State]] = [[] for _ in range(n + 1)]
    fronts[0] = [(0.0, 0.0, 0.0, None, None)]
    for i in range(n):
        front = _pareto(fronts[i], rooms, max_states)
        fronts[i] = front
        if not front:
            return None
        nxt = fronts[i + 1]
        for o in layers[i].options:
            if o.working_bytes <= w_cap and (not o.offload or o.moved_bytes <= m_cap):
                _extend(nxt, front, fits, o.kept_bytes, o.moved_bytes, o.time_s, o)
        if max_segment > 1:
            _segments_from(layers, i, front, fronts, fits, w_cap, max_segment)
    final = _pareto(fronts[n], rooms, max_states)
    return min(final, key=_time_then_bytes) if final else None


def _fits(rooms: tuple[float, float, bool]) -> tuple[float, float]:
    """The most device and host bytes a state may keep: the rooms, with a rounding margin."""
    return (rooms[0] * (1 + 1e-12) + 1e-9, rooms[1] * (1 + 1e-12) + 1e-9)


def _extend(out: list[_State], front: list[_State], fits: tuple[float, float], kept: float,
            moved: float, time_s: float, step: object) -> None:
    """``out`` extended by every state of ``front`` followed by ``step`` (its kept bytes, host
    bytes, seconds) that stays within ``fits``, in the order of ``front``."""
    dev, host = fits
    if moved:
        out.extend((a, h, st[2] + time_s, st, step) for st in front
                   if (a := st[0] + kept) <= dev and (h := st[1] + moved) <= host)
    else:                                 # host bytes unchanged: the front's are inside
        out.extend((a, st[1], st[2] + time_s, st, step) for st in front
                   if (a := st[0] + kept) <= dev)


def _segments_from(layers: Sequence[ChainLayer], i: int, front: list[_State],
                   fronts: list[list[_State]], fits: tuple[float, float], w_cap: float,
                   max_segment: int) -> None:
    """Chen's segments starting at layer ``i``: layers i..j-1 under one checkpoint."""
    kept = layers[i].input_bytes
    replay = layers[i].fwd_s
    working = layers[i].none_bytes
    for j in range(i + 1, min(len(layers), i + max_segment)):
        replay += layers[j].fwd_s
        working += layers[j].none_bytes
        if working > w_cap:
            break
        _extend(fronts[j + 1], front, fits, kept, 0.0, replay, ("segment", i, j + 1))


def _pareto(states: list[_State], rooms: tuple[float, float, bool],
            max_states: int) -> list[_State]:
    """``states`` (all within the rooms), dominated ones dropped, by growing bytes; thinned on
    a grid of the device budget past ``max_states`` (the module docstring)."""
    room, _, binds = rooms
    out: list[_State] = []
    if not binds:                         # two dimensions: times fall as bytes grow
        best_t = float("inf")
        for st in sorted(states, key=_bytes_then_time):
            if st[2] < best_t:
                out.append(st)
                best_t = st[2]
    else:                                 # three: no earlier state has less host and time
        out = _skyline(sorted(states, key=_bytes_host_time))
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
        picks = {id(group[0]): group[0]}                       # the smallest of the cell
        fast = min(group, key=lambda s: s[2])                  # its fastest
        picks[id(fast)] = fast
        if binds:
            light = min(group, key=lambda s: s[1])             # and its lightest on the host
            picks[id(light)] = light
        thin += picks.values()
    return thin


def _skyline(states: list[_State]) -> list[_State]:
    """Of ``states`` sorted by device bytes, those no earlier state matches or beats on both
    host bytes and time. The earlier ones' best times kept as a staircase (host bytes up, times
    down), so each state is one binary search: n log n where comparing with every kept state
    was quadratic (the 3-D fronts of long chains)."""
    hosts: list[float] = []               # the staircase: host bytes rising ...
    times: list[float] = []               # ... and the least time within them falling
    out: list[_State] = []
    for st in states:
        k = bisect_right(hosts, st[1])
        if k and times[k - 1] <= st[2]:
            continue                      # an earlier state has no more host bytes nor time
        out.append(st)
        end = k
        while end < len(hosts) and times[end] >= st[2]:
            end += 1                      # steps it now beats on both
        hosts[k:end] = [st[1]]
        times[k:end] = [st[2]]
    return out


def _solution(layers: Sequence[ChainLayer], last: _State, in_flight: float) -> ChainSolution:
    """Walk the states back to the option of every layer."""
    steps = []
    st: object = last
    while st is not None and st[3] is not None:     # type: ignore[index]
        steps.append(st[4])                         # type: ignore[index]
        st = st[3]                                  # type: ignore[index]
    steps.reverse()
    policies: list[str] = []
    offloads: list[bool] = []
    segments = []
    working = moving = recompute = exposed = 0.0
    for step in steps:
        if isinstance(step, tuple):
            _, i, j = step
            segments.append((i, j))
            policies += ["full"] * (j - i)
            offloads += [False] * (j - i)
            working = max(working, sum(layers[k].none_bytes for k in range(i, j)))
            recompute += sum(layers[k].fwd_s for k in range(i, j))
        else:
            opt: LayerOption = step                 # type: ignore[assignment]
            working = max(working, opt.working_bytes)
            if opt.offload:
                moving = max(moving, opt.moved_bytes)
            policies.append(opt.policy)
            offloads.append(opt.offload)
            recompute += opt.recompute_s
            exposed += opt.offload_s
    kept = last[0]
    return ChainSolution(policies=tuple(policies), recompute_s=recompute, kept_bytes=kept,
                         working_bytes=working + moving,
                         memory_bytes=in_flight * kept + working + moving,
                         segments=tuple(segments), offloads=tuple(offloads),
                         offload_s=exposed, host_bytes=in_flight * last[1])


def uniform_best(layers: Sequence[ChainLayer], *, budget_bytes: float,
                 in_flight: float = 1.0) -> ChainSolution | None:
    """The fastest single option (policy, offloaded or not) for every layer that fits (the
    search's uniform choice), for comparison with ``solve_chain``; None if none fits."""
    names = [(o.policy, o.offload) for o in layers[0].options] if layers else []
    best = None
    for name in names:
        opts = [next((o for o in layer.options if (o.policy, o.offload) == name), None)
                for layer in layers]
        if any(o is None for o in opts):
            continue
        kept = sum(o.kept_bytes for o in opts)
        working = max(o.working_bytes for o in opts) + max(o.moved_bytes for o in opts)
        mem = in_flight * kept + working
        if mem > budget_bytes:
            continue
        sol = ChainSolution(policies=(name[0],) * len(layers),
                            recompute_s=sum(o.recompute_s for o in opts), kept_bytes=kept,
                            working_bytes=working, memory_bytes=mem,
                            offloads=(name[1],) * len(layers),
                            offload_s=sum(o.offload_s for o in opts),
                            host_bytes=in_flight * sum(o.moved_bytes for o in opts))
        if best is None or sol.time_s < best.time_s:
            best = sol
    return best
