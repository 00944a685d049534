"""An event-driven simulation of a pipeline schedule: per-rank timelines and memory over time.

Inputs: ``p`` pipeline ranks, ``v`` model chunks per rank (chunk ``c`` runs on rank ``c % p``),
``m`` micro-batches, the forward and backward time of each chunk, the time of the
point-to-point send across each chunk boundary, and the activation bytes each chunk keeps per
micro-batch. Each rank executes its schedule's action list in order; an action starts when the
rank is free and its input has arrived:

- F(mb, c) needs F(mb, c-1) finished plus the send time when c-1 lives on another rank;
- B(mb, c) needs B(mb, c+1) finished plus the send time (the last chunk's backward follows its
  own forward).

Schedules (action orders per rank):
- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards;
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): ``p - r - 1`` warm-up forwards, then one
  forward / one backward, then the remaining backwards;
- ``interleaved_1f1b`` (Narayanan et al. 2021, Sec. 2.2): the same over ``v`` chunks per rank,
  micro-batches taken in groups of ``p`` per chunk, ``2(p - r - 1) + (v - 1) p`` warm-up steps.
- ``zero_bubble`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1 on interleaved
  chunks): the interleaved order, each backward split into B (input gradient, which the
  previous chunk waits for) and W (weight gradient, which nobody waits for). A rank runs its
  deferred W's whenever the next F or B would otherwise wait and a W fits in the gap, and the
  rest at the end; at most ``p * v`` W's wait at once (their activations stay alive).
  ``w_fraction`` of each backward is W (1/2 for matmul layers: dX and dW cost the same).
On uniform chunks with free sends this reproduces the bubble fraction (p-1)/(m+p-1) of GPipe
and 1F1B exactly, and the interleaved schedule's bubble time divided by v
(tests/test_pipeline_sim.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from autoplan.errors import ConfigError


W_FRACTION = 0.5    # zero_bubble: the weight-gradient share of a backward
W_KEEPS = 0.5       # zero_bubble: the share of a chunk's activations alive until its W


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str          # "F" | "B" | "W" (zero_bubble: B is the input gradient, W the weights')
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    makespan_s: float
    events: tuple[Event, ...]
    busy_s: tuple[float, ...]                  # per rank: time spent computing
    peak_activation_bytes: tuple[float, ...]   # per rank
    memory_timeline: tuple[tuple[tuple[float, float], ...], ...]   # per rank: (time, bytes)

    def bubble_fraction(self, rank: int | None = None) -> float:
        r = max(range(len(self.busy_s)), key=lambda i: self.busy_s[i]) if rank is None else rank
        return 1.0 - self.busy_s[r] / self.makespan_s if self.makespan_s else 0.0


def _orders(schedule: str, p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the ordered actions (kind, micro-batch, chunk)."""
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    if schedule == "gpipe":
        for r in range(p):
            for c in range(r, p * v, p):
                orders[r] += [("F", mb, c) for mb in range(m)]
            for c in reversed(range(r, p * v, p)):
                orders[r] += [("B", mb, c) for mb in range(m)]
        return orders
    if schedule in ("1f1b", "zero_bubble") and v == 1:
        for r in range(p):
            warm = min(p - r - 1, m)
            fwd = [("F", mb, r) for mb in range(m)]
            bwd = [("B", mb, r) for mb in range(m)]
            seq = fwd[:warm]
            for k in range(m - warm):
                seq += [fwd[warm + k], bwd[k]]
            seq += bwd[m - warm:]
            orders[r] = seq
        return orders
    if schedule in ("interleaved_1f1b", "1f1b", "zero_bubble"):
        if m % p:
            raise ConfigError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple "
                              f"of the pipeline ranks ({p})")
        total = m * v

        def fwd_action(r: int, k: int) -> tuple[str, int, int]:
            group, within = divmod(k, p * v)
            local_chunk = within // p
            return ("F", group * p + within % p, local_chunk * p + r)

        def bwd_action(r: int, k: int) -> tuple[str, int, int]:
            group, within = divmod(k, p * v)
            local_chunk = v - 1 - within // p
            return ("B", group * p + within % p, local_chunk * p + r)
        for r in range(p):
            warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            seq = [fwd_action(r, k) for k in range(warm)]
            for k in range(total - warm):
                seq += [fwd_action(r, warm + k), bwd_action(r, k)]
            seq += [bwd_action(r, k) for k in range(total - warm, total)]
            orders[r] = seq
        return orders
    raise ConfigError(f"unknown pipeline schedule {schedule!r}; use gpipe, 1f1b, "
                      "interleaved_1f1b or zero_bubble")


def simulate(*, schedule: str, p: int, v: int, m: int, fwd_s: Sequence[float],
             bwd_s: Sequence[float], send_s: Sequence[float] = (),
             activation_bytes: Sequence[float] = ()) -> PipelineResult:
    """Run the schedule; ``fwd_s``/``bwd_s``/``activation_bytes`` per chunk (p*v), ``send_s`` per
    boundary (chunk c to c+1, p*v-1 entries; default free). Results are memoized: the planner
    simulates the same stages under many ZeRO / offload variants."""
    return _simulate(schedule, p, v, m, tuple(fwd_s), tuple(bwd_s), tuple(send_s),
                     tuple(activation_bytes))


@lru_cache(maxsize=512)
def _simulate(schedule: str, p: int, v: int, m: int, fwd_s: tuple[float, ...],
              bwd_s: tuple[float, ...], send_s: tuple[float, ...],
              activation_bytes: tuple[float, ...]) -> PipelineResult:
    n = p * v
    if len(fwd_s) != n or len(bwd_s) != n:
        raise ConfigError(f"need forward and backward times for {n} chunks, got "
                          f"{len(fwd_s)} and {len(bwd_s)}")
    send = list(send_s) or [0.0] * (n - 1)
    acts = list(activation_bytes) or [0.0] * n
    orders = _orders(schedule, p, v, m)
    split = schedule == "zero_bubble"
    w_share = W_FRACTION if split else 0.0
    max_deferred = p * v
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    free = [0.0] * p
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(p)]   # W's not yet run
    events: list[Event] = []

    def run(r: int, kind: str, mb: int, c: int, start: float, dur: float) -> None:
        done[(kind, mb, c)] = start + dur
        free[r] = start + dur
        events.append(Event(r, kind, mb, c, start, start + dur))

    def run_w(r: int) -> None:
        mb, c = deferred[r].pop(0)
        run(r, "W", mb, c, free[r], bwd_s[c] * w_share)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                if kind == "F":
                    dep = None if c == 0 else ("F", mb, c - 1)
                    hop = 0.0 if c == 0 else send[c - 1]
                else:
                    dep = ("F", mb, c) if c == n - 1 else ("B", mb, c + 1)
                    hop = 0.0 if c == n - 1 else send[c]
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + hop if dep is not None else 0.0
                # fill the wait with deferred weight gradients that fit in it
                while deferred[r] and free[r] + bwd_s[deferred[r][0][1]] * w_share <= ready:
                    run_w(r)
                if kind == "F":
                    run(r, "F", mb, c, max(free[r], ready), fwd_s[c])
                else:
                    run(r, "B", mb, c, max(free[r], ready), bwd_s[c] * (1.0 - w_share))
                    if split:
                        deferred[r].append((mb, c))
                        if len(deferred[r]) > max_deferred:
                            run_w(r)
                pos[r] += 1
                remaining -= 1
                progressed = True
            if pos[r] == len(orders[r]):
                while deferred[r]:
                    run_w(r)
        if not progressed:
            raise ConfigError(f"schedule {schedule!r} deadlocked (p={p}, v={v}, m={m})")
    busy = [0.0] * p
    deltas: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    for e in events:
        busy[e.rank] += e.end_s - e.start_s
        if e.kind == "F":
            deltas[e.rank].append((e.end_s, acts[e.chunk]))     # kept until its backward
        else:      # zero bubble: B frees what only the input gradient needs, W the rest
            freed = 1.0 if not split else W_KEEPS if e.kind == "W" else 1.0 - W_KEEPS
            deltas[e.rank].append((e.end_s, -acts[e.chunk] * freed))
    timelines, peaks = [], []
    for r in range(p):
        level, peak, line = 0.0, 0.0, [(0.0, 0.0)]
        for t, d in sorted(deltas[r], key=lambda x: (x[0], x[1])):
            level += d
            peak = max(peak, level)
            line.append((t, level))
        timelines.append(tuple(line))
        peaks.append(peak)
    makespan = max(e.end_s for e in events) if events else 0.0
    events.sort(key=lambda e: (e.rank, e.start_s))
    return PipelineResult(makespan_s=makespan, events=tuple(events), busy_s=tuple(busy),
                          peak_activation_bytes=tuple(peaks), memory_timeline=tuple(timelines))
