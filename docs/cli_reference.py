"""Write the generated half of docs/cli.md from the `autoplan` command's own argparse parsers.

    python docs/cli_reference.py          # rewrite docs/cli.md below its marker line
    python docs/cli_reference.py --check  # exit 1 if docs/cli.md is not what the parsers say

Everything in docs/cli.md after MARKER is generated: every sub-command, its usage line, its
description and a table of its arguments (flag, default, help), read from
``autoplan.cli.main.build_parser()``. tests/test_docs.py fails when the page and the parsers
differ, so the reference cannot drift from the command.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PAGE = pathlib.Path(__file__).resolve().parent / "cli.md"
MARKER = ("<!-- Generated from autoplan's argparse parsers by `python docs/cli_reference.py`: "
          "do not edit below this line. -->")
WIDTH = 100          # only for expanding %(default)s in help texts


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:                       # argparse keeps them nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    return f"`{names} {metavar}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    d = action.default
    if d is None or d is False or d is argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{' '.join(map(str, d)) if isinstance(d, (list, tuple)) else d}`"


def _usage(name: str, parser: argparse.ArgumentParser) -> str:
    """``name [options] --required X ... POSITIONAL``, built from the actions themselves (the
    text argparse wraps differs between Python versions)."""
    parts = [name]
    if any(a.option_strings and not a.required for a in parser._actions
           if not isinstance(a, argparse._HelpAction)):
        parts.append("[options]")
    for a in parser._actions:
        if a.option_strings and a.required:
            parts.append(f"{a.option_strings[0]} {a.metavar or a.dest.upper()}")
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            parts.append(f"{a.metavar or 'COMMAND'} ...")
        elif not a.option_strings:
            word = a.metavar or a.dest
            parts.append({"?": f"[{word}]", "*": f"[{word} ...]", "+": f"{word} [{word} ...]"}
                         .get(a.nargs, word))
    return " ".join(parts)


def _section(name: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{name}`", "", "```text", _usage(name, parser), "```", ""]
    if parser.description:
        out += [parser.description.strip(), ""]
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    rows = [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if rows:
        out += ["| argument | default | what it does |", "|---|---|---|"]
        for a in rows:
            help_text = formatter._expand_help(a) if a.help else ""
            if a.choices and a.option_strings and a.metavar:
                help_text += f" (one of: {', '.join(map(str, a.choices))})"
            out.append(f"| {_flag(a)} | {_default(a)} | {_cell(help_text)} |")
        out.append("")
    for sub_name, sub in _subparsers(parser):
        out += _section(f"{name} {sub_name}", sub, level + 1)
    return out


def generated() -> str:
    """The reference, from the parsers as they are now."""
    from autoplan.cli.main import build_parser
    parser = build_parser()
    lines = [MARKER, "", "## Reference", "",
             "Every sub-command, as `autoplan COMMAND --help` prints it, one table per "
             "command.", ""]
    lines += _section("autoplan", parser, 3)
    return "\n".join(lines).rstrip() + "\n"


def page_with_reference(page_text: str) -> str:
    """``page_text`` with everything from the marker on replaced by the generated reference."""
    head = page_text.split(MARKER, 1)[0]
    return head + generated()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when docs/cli.md differs from the parsers (write nothing)")
    args = ap.parse_args(argv)
    text = PAGE.read_text()
    if MARKER not in text:
        print(f"{PAGE}: no marker line; add {MARKER!r} where the reference starts",
              file=sys.stderr)
        return 1
    new = page_with_reference(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is stale: run python docs/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
