"""``process_exit.exit_now``: the end of every rank and ``autoplan`` command. It keeps what an
exit must do (the status, ``atexit`` handlers, buffered output, a running non-daemon thread's
work) and skips the module teardown. Each case is a small Python child that loads the module
from its file (not the ``autoplan`` package, which imports torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "autoplan" / "process_exit.py"

PRELUDE = f"""
import atexit, importlib.util, sys, threading, time
spec = importlib.util.spec_from_file_location("process_exit", {str(MODULE)!r})
process_exit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(process_exit)

class Held:                      # a module global: the teardown deletes it, os._exit does not
    def __del__(self):
        print("teardown ran", flush=True)

held = Held()
"""


def _child(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_the_status_handlers_and_buffered_output_survive_and_the_teardown_is_skipped():
    out = _child("""
        atexit.register(lambda: print("handler ran"))
        sys.stdout.write("buffered, no newline;")        # a pipe: block-buffered
        sys.stderr.write("to stderr")
        process_exit.exit_now(3)
        print("not reached")
    """)
    assert out.returncode == 3
    assert out.stdout == "buffered, no newline;handler ran\n"   # no "teardown ran"
    assert out.stderr == "to stderr"


def test_the_ordinary_exit_shows_the_teardown_this_test_looks_for():
    """The same child under ``sys.exit``: its teardown deletes ``held`` (so the check above
    that ``exit_now`` skips it can fail)."""
    out = _child("""
        sys.exit(3)
    """)
    assert out.returncode == 3 and "teardown ran" in out.stdout


def test_a_running_non_daemon_thread_finishes_its_work_first():
    out = _child("""
        def work():
            time.sleep(0.3)
            print("thread finished", flush=True)

        threading.Thread(target=work).start()
        process_exit.exit_now(0)
    """)
    assert out.returncode == 0
    assert "thread finished" in out.stdout
