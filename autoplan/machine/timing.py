"""Timing a call on this machine's device: the primitives ``profiler`` (op timings) and
``calibration`` (device figures) both measure with.

``measure`` takes ``warmup`` untimed calls, then ``repeats`` samples of ``inner`` back-to-back
calls (as many as make a sample last ``min_time_s``; fewer samples where they would take more
than ``max_time_s``) and keeps the median and the samples' coefficient of variation.
``steady_measure`` measures again while the samples vary by more than a bound. ``Clock`` times
with ``time.perf_counter`` on CPU and CUDA events (after a synchronize) on CUDA.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from autoplan.errors import ProfileError


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as torch names it, if autoplan can measure on it here (CPU, or a CUDA device
    torch sees; a bare "cuda" is the current one)."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ProfileError(f"can profile on 'cpu' or 'cuda', got device {str(device)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("device 'cuda' was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}); profile with --device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Clock:
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls (events + sync on CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def time(self, fn: Callable[[], Any], inner: int, reset: Callable[[], None] | None) -> float:
        if reset is not None:
            reset()
        if self.cuda:
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


class Stats(NamedTuple):
    median_s: float      # median seconds per call
    cv: float            # coefficient of variation of the samples
    samples: int
    net_s: float         # median of (sample - paired baseline sample); median_s without baseline


def measure(clock: Clock, fn: Callable[[], Any], *, warmup: int, repeats: int,
            min_time_s: float, max_time_s: float, reset: Callable[[], None] | None = None,
            baseline: Callable[[], Any] | None = None) -> Stats:
    """Time ``fn``; with ``baseline``, each sample is followed by a baseline sample of as many
    calls, and ``net_s`` is the median difference (pairing cancels slow drifts of the machine)."""
    estimate = math.inf
    spent = 0.0
    for _ in range(max(1, warmup)):
        t = clock.time(fn, 1, reset)
        estimate = min(estimate, t)
        spent += t
        if spent > max_time_s:
            break
    inner = 1 if reset is not None else \
        min(1000, max(1, math.ceil(min_time_s / max(estimate, 1e-9))))
    n = repeats
    if estimate * inner * n > max_time_s:
        n = max(min(3, repeats), int(max_time_s / (estimate * inner)))
    samples: list[float] = []
    nets: list[float] = []
    for _ in range(n):
        t = clock.time(fn, inner, reset)
        samples.append(t)
        if baseline is not None:
            nets.append(t - clock.time(baseline, inner, None))
    median = statistics.median(samples)
    mean = statistics.fmean(samples)
    cv = statistics.pstdev(samples) / mean if mean > 0 and n > 1 else 0.0
    return Stats(median, cv, n, statistics.median(nets) if nets else median)


def steady_measure(clock: Clock, fn: Callable[[], Any], *, retries: int, max_cv: float,
                   **kw: Any) -> Stats:
    """``measure``, repeated up to ``retries`` times while the samples vary by more than
    ``max_cv``; the attempt with the steadiest samples wins. Another process taking a core for a
    while (a test run, a compile) makes one attempt noisy, rarely all of them."""
    best = measure(clock, fn, **kw)
    for _ in range(retries):
        if best.cv <= max_cv:
            break
        again = measure(clock, fn, **kw)
        if again.cv < best.cv:
            best = again
    return best
