"""Which actions pace a pipeline schedule: the critical path of its simulation.

A schedule's step, without collectives, is the longest chain of actions that wait on one
another: each action (``pipeline_sim``) starts when its rank is free or when its input has
arrived, whichever is later, so walking back from the last action to end, each step to the
predecessor that ended exactly when it started, gives a chain whose durations (and the sends it
crosses) add up to the makespan. As a count of each chunk's forwards and backwards on that
chain and of the sends over each boundary, it prices the step linearly in the chunks' times:
exactly at the times it was found with, and as a lower bound at any other times (the makespan
is the longest of all chains), exact again wherever that chain stays the longest. The
pipelined sharding ILP (``planner/pipe_problem.py``) prices its step with it, so that its
objective is the simulated step, where a closed form (one micro-batch through every other rank)
misses the idle time of a first rank that paces the pipeline, or of a V's first rank holding
both ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autoplan.estimate.config import chunk_ranks
from autoplan.estimate.pipeline_sim import W_FRACTION, simulate


@dataclass(frozen=True)
class CriticalPath:
    """Per chunk, its forwards and backwards on the chain (in whole backwards: a split
    schedule's input-gradient B counts ``1 - W_FRACTION`` of one, its W ``W_FRACTION``), and per
    chunk boundary the sends the chain crosses; ``makespan_s``, its length where it was found
    (not part of its identity: two chains of the same counts are one)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    sends: tuple[float, ...]
    makespan_s: float = field(compare=False, default=0.0)

    def length_s(self, fwd_s: Sequence[float], bwd_s: Sequence[float],
                 send_s: Sequence[float] = ()) -> float:
        """The chain's length at other chunk times (a lower bound on their makespan)."""
        return (sum(a * x for a, x in zip(self.fwd, fwd_s))
                + sum(b * x for b, x in zip(self.bwd, bwd_s))
                + sum(s * x for s, x in zip(self.sends, send_s)))


def critical_path(*, schedule: str, p: int, v: int, m: int, fwd_s: Sequence[float],
                  bwd_s: Sequence[float], send_s: Sequence[float] = ()) -> CriticalPath:
    """The critical path of the schedule simulated with these chunk times and sends (per
    chunk ``fwd_s``/``bwd_s``, per boundary ``send_s``; no collectives)."""
    n = p * v
    sends = list(send_s) or [0.0] * (n - 1)
    result = simulate(schedule=schedule, p=p, v=v, m=m, fwd_s=fwd_s, bwd_s=bwd_s,
                      send_s=sends)
    ranks = chunk_ranks(schedule, p, v)
    sent = [0.0 if ranks[c] == ranks[c + 1] else x for c, x in enumerate(sends)]
    by_rank: list[list] = [[] for _ in range(p)]
    for e in result.events:
        by_rank[e.rank].append(e)
    where = {}                     # (kind, mb, chunk) -> (rank, index on the rank)
    for r, evs in enumerate(by_rank):
        for i, e in enumerate(evs):
            where[(e.kind, e.microbatch, e.chunk)] = (r, i)
    split = {(mb, c) for kind, mb, c in where if kind == "W"}
    fwd, bwd, crossed = [0.0] * n, [0.0] * n, [0.0] * (n - 1)
    tol = 1e-12 * max(1.0, result.makespan_s)
    r, i = max(((r, len(evs) - 1) for r, evs in enumerate(by_rank) if evs),
               key=lambda ri: by_rank[ri[0]][ri[1]].end_s)
    while True:
        e = by_rank[r][i]
        c, mb = e.chunk, e.microbatch
        if e.kind == "F":
            fwd[c] += 1.0
            dep, boundary = ((("F", mb, c - 1), c - 1) if c else (None, None))
        elif e.kind == "W":
            bwd[c] += W_FRACTION
            dep, boundary = None, None
        else:
            bwd[c] += (1.0 - W_FRACTION) if (mb, c) in split else 1.0
            dep, boundary = ((("F", mb, c), None) if c == n - 1
                             else (("B", mb, c + 1), c))
        if e.start_s <= tol:
            break
        if dep is not None:
            dr, di = where[dep]
            ready = by_rank[dr][di].end_s + (sent[boundary] if boundary is not None else 0.0)
            if abs(ready - e.start_s) <= tol:
                if boundary is not None and ranks[boundary] != ranks[boundary + 1]:
                    crossed[boundary] += 1.0
                r, i = dr, di
                continue
        if i == 0 or abs(by_rank[r][i - 1].end_s - e.start_s) > tol:
            raise AssertionError(f"{schedule}: no predecessor ends when {e} starts")
        i -= 1
    return CriticalPath(tuple(fwd), tuple(bwd), tuple(crossed), result.makespan_s)
