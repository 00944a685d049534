"""Keep freed host memory in the process while training or profiling on the CPU.

glibc's malloc serves large blocks with fresh ``mmap`` pages and hands freed memory back to
the kernel, so a CPU training step page-faults in its gradients and activations again on every
step (in a VM each fault also goes to the hypervisor). On this repository's 2-core VM that was
~7,000 faults and a third of the step for the ``mlp`` example. A CUDA caching allocator never
does this, and the cost model assumes it does not happen: ``keep_freed_host_memory`` makes
glibc behave like a caching allocator (blocks up to 32 MiB come from the heap, the heap is not
trimmed below 1 GiB), the same tuning PyTorch's CPU performance guides reach via
``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` or a jemalloc/tcmalloc preload.

The profiler, the calibration and the runtime call it on CPU devices so what is measured and
what runs are the same regime. Set ``AUTOPLAN_HOST_MALLOC=default`` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20    # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Tune glibc malloc once per process; True when the tuning is in effect.

    A no-op (False) off Linux/glibc, or when ``AUTOPLAN_HOST_MALLOC=default``.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("AUTOPLAN_HOST_MALLOC", "").lower() == "default":
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):      # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                    and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied
