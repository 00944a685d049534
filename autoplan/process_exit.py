"""Ending a command's process without the interpreter's teardown.

A process that imported torch and traced a model ends, under ``sys.exit``, by clearing every
module and collecting the millions of objects they hold: 3.4 s of wall time and about 1.6 s of
CPU for a torchrun rank of gpt-tiny (``autoplan.runtime.worker``, 2 steps, one process, on a
2-core machine), after its last line was printed. Every rank, every ``autoplan`` command and
every ``autoplan run`` paid it; ``torchrun`` waits for its slowest rank's.

:func:`exit_now` does what that exit must still do and skips the rest: it runs the ``atexit``
handlers (logging's flush, torch's own: a compile worker pool's shutdown), flushes stdout and
stderr, and ends the process with ``os._exit`` (the same rank: 0.07 s). Where a non-daemon
thread is still running, the ordinary exit waits for it, so ``exit_now`` takes that exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with exit status ``code`` as ``sys.exit`` would, without the module
    teardown: ``atexit`` handlers run and the standard streams are flushed first."""
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread()
           for t in threading.enumerate()):
        sys.exit(code)                      # the ordinary exit joins that thread
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):   # a closed pipe (`| head`), a closed stream
                pass
        os._exit(code)
