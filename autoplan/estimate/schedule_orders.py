"""Each pipeline schedule's action order per rank: what ``pipeline_sim`` simulates.

An order is a list of ``(kind, micro-batch, chunk)`` per rank, in the order the rank runs them:
``F`` forward, ``B`` backward (its input-gradient half under a split-backward schedule), ``W``
the weight-gradient half, ``BW`` a full backward inside a split-backward schedule. The schedules
and their sources are described in ``pipeline_sim``'s module doc; the V-shaped ones (ZB-V,
DualPipeV) are the lists torch's ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` hand their
runtime (tests/test_pipeline_sim.py compares them action for action).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from autoplan.errors import ConfigError
from autoplan.sharding.parallel_config import SPLIT_BACKWARD, V_SCHEDULES

W_KEEPS = 0.5       # split backward: the share of a chunk's activations alive until its W


def orders(schedule: str, p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
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
    if schedule == "zbv":
        return [_zbv(p, m, r) for r in range(p)]
    if schedule == "dualpipev":
        if m < 2 * p:
            raise ConfigError(f"dualpipev needs at least 2 x pp = {2 * p} micro-batches, got {m}")
        return [_dualpipev(p, m, r) for r in range(p)]
    raise ConfigError(f"unknown pipeline schedule {schedule!r}; use gpipe, 1f1b, "
                      "interleaved_1f1b, zero_bubble, zbv or dualpipev")


class _VOrder:
    """One rank's action list under a V schedule: its chunks ``r`` (down) and ``2p - 1 - r``
    (up), a forward, input-gradient, weight-gradient and full-backward counter per chunk."""

    def __init__(self, p: int, r: int):
        self.chunk = (r, 2 * p - 1 - r)
        self.f, self.b, self.w = [0, 0], [0, 0], [0, 0]
        self.out: list[tuple[str, int, int]] = []
        self.pending: deque[tuple[int, int]] = deque()   # (mb, chunk) waiting for their W

    def F(self, k: int) -> None:
        self.out.append(("F", self.f[k], self.chunk[k]))
        self.f[k] += 1

    def I(self, k: int, queue: bool = False) -> None:   # noqa: E743 (the paper's name)
        self.out.append(("B", self.b[k], self.chunk[k]))
        if queue:
            self.pending.append((self.b[k], self.chunk[k]))
        self.b[k] += 1

    def W(self, k: int) -> None:
        self.out.append(("W", self.w[k], self.chunk[k]))
        self.w[k] += 1

    def FIW(self, k: int) -> None:   # noqa: N802
        """A forward, then the input and the weight gradient of the oldest one in flight."""
        self.F(k)
        self.I(k)
        self.W(k)

    def full(self, k: int) -> None:
        self.out.append(("BW", self.b[k], self.chunk[k]))
        self.b[k] += 1

    def next_w(self) -> None:
        if self.pending:
            mb, c = self.pending.popleft()
            self.out.append(("W", mb, c))


def _zbv(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """ZB-V on rank ``r``: ``2(p - r) - 1`` forwards down the V, ``r`` pairs up and down, then
    ``p - r`` forward / input / weight triples on the way up; the steady state alternates a
    forward, input and weight gradient on each chunk; the cool-down drains the input gradients
    and then the weights. Planned for at least ``2p - 1`` micro-batches; the actions of the
    ones that do not exist are dropped."""
    o = _VOrder(p, r)
    n = max(2 * p - 1, m)
    for _ in range(2 * (p - r) - 1):
        o.F(0)
    for _ in range(r):
        o.F(1)
        o.F(0)
    for _ in range(p - r):
        o.FIW(1)
    while o.f[1] < o.f[0] or o.f[0] < n:
        if o.f[0] < n:
            o.F(0)
        o.I(0)
        o.W(0)
        o.FIW(1)
    for _ in range(r):
        o.I(0)
        o.I(1)
    for _ in range(p - r):
        o.I(0)
        o.W(0)
    while o.w[1] < o.b[1]:
        o.W(1)
    while o.w[0] < o.b[0]:
        o.W(0)
    return [a for a in o.out if a[1] < m]


def _dualpipev(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """DualPipeV on rank ``r`` (``m >= 2p``): forwards down the V, then both chunks; input
    gradients (their weights queued) while the up-chunk fills; the main phase pairs a forward
    of one chunk with a full backward of the other; the tail splits the backwards again from
    its middle on and drains the queued weight gradients."""
    o = _VOrder(p, r)
    for _ in range(2 * (p - r - 1)):
        o.F(0)
    for _ in range(r + 1):
        o.F(0)
        o.F(1)
    for _ in range(p - r - 1):
        o.I(1, queue=True)
        o.next_w()
        o.F(1)
    for _ in range(m - 2 * p + r + 1):
        o.F(0)
        o.full(1)
        o.F(1)
        o.full(0)
    for _ in range(p - r - 1):
        o.full(1)
        o.F(1)
        o.full(0)
    split = False

    def backward(k: int) -> None:
        if split:
            o.I(k, queue=True)
        else:
            o.full(k)
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0)
    for _ in range(p - r - 1):
        o.next_w()
        backward(0)
    for _ in range(r + 1):
        o.next_w()
    return o.out


# the V schedules reach their steady state (one forward, one backward) within 2p micro-batches:
# from there on a rank's peak no longer grows (tests/test_pipeline_sim.py checks 4p against
# every m up to 12p), so their peaks are read off an order of at most this many per rank
STEADY_MICROBATCHES_PER_RANK = 4


def order_peak_chunks(schedule: str, p: int, v: int, m: int) -> tuple[float, ...]:
    """Per rank, the most chunk-activations its action order keeps alive at once (a forward
    adds one; a backward frees one, or under a split backward its input gradient frees all but
    ``W_KEEPS`` and the weight gradient the rest). Exact for schedules whose orders place every
    action (not zero_bubble's greedy weight gradients)."""
    if schedule in V_SCHEDULES:
        m = min(m, STEADY_MICROBATCHES_PER_RANK * p)
    return _order_peak_chunks(schedule, p, v, m)


@lru_cache(maxsize=64)
def _order_peak_chunks(schedule: str, p: int, v: int, m: int) -> tuple[float, ...]:
    change = {"F": 1.0, "B": -1.0 + W_KEEPS if schedule in SPLIT_BACKWARD else -1.0,
              "W": -W_KEEPS, "BW": -1.0}
    peaks = []
    for order in orders(schedule, p, v, m):
        level = peak = 0.0
        for kind, _, _ in order:
            level += change[kind]
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)
