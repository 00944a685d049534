"""Fewer garbage-collector passes while autoplan traces and plans.

CPython's cycle collector runs a young-generation pass every 700 net allocations of container
objects (``gc.get_threshold()[0]``), and every tenth and hundredth of them scans the older
generations: the whole heap. Tracing a model (torch.export, which also imports torch._dynamo
on first use) and planning it allocate hundreds of thousands of small objects that reference
counting frees (op strategies, cost entries, ILP rows) while the heap holds millions. On
Llama-3-8B on 64 H100 (`python benchmarks/search_time.py llama3-8b`) the collector's passes
took 0.45 s of the 1.35 s trace and 0.22 s of the 0.97 s search; with a young-generation
threshold of 10,000 or more they take nearly nothing. mypy raises the threshold for the same
reason.

:func:`fewer_collections` raises the threshold for the duration of a call and restores it
after; cycles are still collected, less often. A threshold the user set higher is kept. It
also freezes the objects that exist when it starts (``gc.freeze``: the model, the traced
graph) so that the older generations' passes inside it scan only what the call made (GPT-3
175B on 64 A100, `python benchmarks/search_time.py --sweep`: the full passes took 0.44 s of
the planning, 0.26 s with the freeze), and unfreezes them after; a process that froze objects
itself (a pre-forking server) is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

GEN0_THRESHOLD = 20_000         # container allocations between young-generation passes

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None
_froze = False

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the collector's young-generation threshold to ``GEN0_THRESHOLD`` inside the block
    (nested and concurrent blocks share one raise; the outermost restores it)."""
    global _depth, _saved, _froze
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            if _saved[0] and _saved[0] < GEN0_THRESHOLD:   # 0: the user disabled collection
                gc.set_threshold(GEN0_THRESHOLD, *_saved[1:])
            if not gc.get_freeze_count():     # (a user's own freeze is left alone)
                gc.freeze()      # what exists already is not scanned again until the block ends
                _froze = True
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                if _froze:
                    gc.unfreeze()
                    _froze = False
                gc.set_threshold(*_saved)
                _saved = None


def with_fewer_collections(fn: F) -> F:
    """``fn`` run inside :func:`fewer_collections`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with fewer_collections():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
