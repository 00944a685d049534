"""The `autoplan` command line. Each sub-command lives in its own module; this one wires them."""

from __future__ import annotations

import argparse
import logging
import sys

from autoplan.version import __version__
from autoplan.errors import AutoplanError
from autoplan.process_exit import exit_now

_COMMANDS = ("demo_cmd", "trace_cmd", "cluster_cmd", "profile_cmd", "estimate_cmd", "plan_cmd",
             "inspect_cmd", "diff_cmd", "run_cmd", "export_cmd", "verify_cmd",
             "calibrate_cmd", "emulate_cmd")


def build_parser() -> argparse.ArgumentParser:
    import importlib
    parser = argparse.ArgumentParser(
        prog="autoplan",
        description="Automatic parallelization planner for PyTorch training: trace a model, "
                    "describe a cluster, profile ops, estimate a configuration, search and "
                    "save the best plan, inspect and compare plans.")
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="what autoplan's modules log to stderr: WARNING (default) only "
                             "what a user should act on, INFO also progress notes (such as a "
                             "CPU's first-use calibration), DEBUG everything")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"autoplan.cli.{name}")
        before = set(sub.choices)
        module.add_parser(sub)
        for cmd in set(sub.choices) - before:   # modules that do not set func themselves
            if sub.choices[cmd].get_default("func") is None:
                sub.choices[cmd].set_defaults(func=module.run)
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Format(logging.Formatter):
    """``autoplan: note``, ``autoplan: warning: ...``; with the module's name at DEBUG."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        kind = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        where = f"[{record.name}] " if logging.getLogger("autoplan").level <= logging.DEBUG else ""
        return f"autoplan: {where}{kind}{text}"


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes (not the one at
    setup: tests and callers that capture stderr replace it)."""

    @property
    def stream(self):                    # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str) -> None:
    """Send the ``autoplan`` loggers' records at ``level`` and above to stderr. The library
    itself configures nothing (a program importing autoplan decides; without a handler Python
    prints warnings and above). Records still propagate to the root logger's handlers, which
    the command line leaves without any."""
    log = logging.getLogger("autoplan")
    log.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in log.handlers):   # main() twice in one process
        handler = _Stderr()
        handler.setFormatter(_Format("%(message)s"))
        log.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AutoplanError as e:
        print(f"autoplan {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:          # `autoplan ... | head`: the reader has what it wanted
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> None:
    """The ``autoplan`` console script: ``main``, then the process ends without the
    interpreter's teardown (``process_exit``: seconds after a command that traced a model)."""
    exit_now(main())


if __name__ == "__main__":
    entry()
