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
from functools import lru_cache

from autoplan.estimate.pipeline_sim import W_FRACTION, FORWARD, WEIGHT_GRAD, run_schedule
from autoplan.sharding.parallel_config import chunk_ranks


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
    sends = tuple(send_s) or (0.0,) * (n - 1)
    return _critical_path(schedule, p, v, m, tuple(fwd_s), tuple(bwd_s), sends)


@lru_cache(maxsize=64)
def _critical_path(schedule: str, p: int, v: int, m: int, fwd_s: tuple[float, ...],
                   bwd_s: tuple[float, ...], sends: tuple[float, ...]) -> CriticalPath:
    n = p * v
    run = run_schedule(schedule, p, v, m, fwd_s, bwd_s, sends, (), keep_deltas=False)
    ranks = chunk_ranks(schedule, p, v)
    sent = [0.0 if ranks[c] == ranks[c + 1] else x for c, x in enumerate(sends)]
    # where each forward and backward (B or BW) ran: (rank, index on the rank), at c * m + mb
    f_at: list[tuple[int, int]] = [(-1, -1)] * (n * m)
    b_at: list[tuple[int, int]] = [(-1, -1)] * (n * m)
    split = [False] * (n * m)            # its backward split in B and W
    for r, evs in enumerate(run.events):
        for i, (kind, mb, c, _, _) in enumerate(evs):
            if kind == FORWARD:
                f_at[c * m + mb] = (r, i)
            elif kind == WEIGHT_GRAD:
                split[c * m + mb] = True
            else:
                b_at[c * m + mb] = (r, i)
    fwd, bwd, crossed = [0.0] * n, [0.0] * n, [0.0] * (n - 1)
    tol = 1e-12 * max(1.0, run.makespan_s)
    r, i = max(((r, len(evs) - 1) for r, evs in enumerate(run.events) if evs),
               key=lambda ri: run.events[ri[0]][ri[1]][4])
    while True:
        kind, mb, c, start, _ = run.events[r][i]
        dep = boundary = None
        if kind == FORWARD:
            fwd[c] += 1.0
            if c:
                dep, boundary = f_at[(c - 1) * m + mb], c - 1
        elif kind == WEIGHT_GRAD:
            bwd[c] += W_FRACTION
        else:
            bwd[c] += (1.0 - W_FRACTION) if split[c * m + mb] else 1.0
            if c == n - 1:
                dep = f_at[c * m + mb]
            else:
                dep, boundary = b_at[(c + 1) * m + mb], c
        if start <= tol:
            break
        if dep is not None:
            ready = run.events[dep[0]][dep[1]][4] + (sent[boundary] if boundary is not None
                                                      else 0.0)
            if abs(ready - start) <= tol:
                if boundary is not None and ranks[boundary] != ranks[boundary + 1]:
                    crossed[boundary] += 1.0
                r, i = dep
                continue
        if i == 0 or abs(run.events[r][i - 1][4] - start) > tol:
            raise AssertionError(f"{schedule}: no predecessor ends when action "
                                 f"{(kind, mb, c)} on rank {r} starts")
        i -= 1
    return CriticalPath(tuple(fwd), tuple(bwd), tuple(crossed), run.makespan_s)
