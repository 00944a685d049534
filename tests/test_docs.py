"""Every command and snippet in README.md and docs/*.md runs as written.

Each page's fenced blocks run in order in a fresh folder of their own (the files one block
writes, the next reads, as a reader following the page would), which links ``examples/`` to
the repository's (the pages' commands run from the repository root):

- ```bash blocks, one command at a time (continuation lines joined, ``#`` comments dropped):
  ``autoplan ...`` runs in this process (``autoplan.cli.main.main``) and must exit 0;
  ``torchrun ...`` runs as a subprocess (``python -m torch.distributed.run``), as does
  ``python SCRIPT`` for a script the page wrote. ``autoplan run`` and ``torchrun`` commands
  that name no ``--master-port`` get a free one, so this test can run beside others.
- ```python blocks run in this process (one namespace per page, as one Python session; the
  page's folder as the current one and on ``sys.path``). A block after ``<!-- docs-test: file NAME -->`` is written to NAME
  instead, for the commands after it to run.
- ``<!-- docs-test: each-node -->``: a multi-node command; each ``autoplan run`` in it runs with
  ``--print-command`` for NODE_RANK 0 and 1, and the printed torchrun command must carry that
  node's rank, the node count and the rendezvous address.
- ``<!-- docs-test: parse-only (WHY) -->``: commands too slow for the suite, each page saying
  why and which test runs the same: the docs pages' rank launches (``autoplan run``, ``verify``,
  ``calibrate``, ``demo``, a compiled run, ``examples/hf_architectures.py``; the README's own
  launches all run), ``autoplan profile``, the benchmark scripts and fuzzers. Here every
  ``autoplan`` command must parse with the real argument parser and every script it names must
  exist; nothing more. ``AUTOPLAN_DOCS_FULL=1`` runs these blocks fully as well
  (``test_every_block_runs_fully``: the command-line pages take about 10 minutes on 2 cores, the
  benchmark scripts tens of minutes more).
- ``<!-- docs-test: gpu (WHY) -->``: needs a CUDA GPU; checked as parse-only, never run here.
- ``make demo`` / ``make test`` are only checked to be Makefile targets: the first runs
  ``autoplan demo`` (tests/test_cli_smoke.py runs it at 2 ranks, 4 steps, ``--quick``), the
  second is this suite.

Outputs of identical ``autoplan plan``/``trace`` commands on several pages are computed once and
reused. Any other fenced language (```text, ```yaml) is not run; ```sh, ```shell and ```console
are refused, so that no command hides from this test. docs/cli.md's reference must be what
``docs/cli_reference.py`` generates from the parsers, and examples/my_model.py and
examples/train.py must be the README's blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FULL = os.environ.get("AUTOPLAN_DOCS_FULL") == "1"
MARK = re.compile(r"<!--\s*docs-test:\s*(?P<mode>[\w-]+)\s*(?P<arg>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")    # in a list item too
HIDDEN = ("sh", "shell", "console", "zsh")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    mode: str = "run"           # run | file | each-node | parse-only | gpu
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, with the docs-test mark on the line before each."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body, indent = i, [], len(m["indent"])
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.search(prev)
        out.append(Block(page=page, line=start + 1, lang=m["lang"], text="\n".join(body) + "\n",
                         mode=mark["mode"] if mark else "run", arg=mark["arg"] if mark else ""))
    return out


def commands(block: Block, env: dict[str, str] | None = None) -> list[list[str]]:
    """The commands of a bash block, split as the shell would (``$NAME`` from ``env``)."""
    joined = block.text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        for k, word in enumerate(argv):
            for name in re.findall(r"\$(\w+)", word):
                if env is None or name not in env:
                    raise AssertionError(f"{block.where}: ${name} has no value in this test")
                word = word.replace(f"${name}", env[name])
            argv[k] = word
        out.append(argv)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MEMO: dict[tuple[str, ...], dict[str, bytes]] = {}     # plan/trace argv -> files it wrote


def _output_flag(argv: list[str]) -> str | None:
    for k, a in enumerate(argv):
        if a in ("-o", "--output") and k + 1 < len(argv):
            return argv[k + 1]
    return None


def run_autoplan(argv: list[str], cwd: Path, where: str) -> str:
    """``autoplan ARGV`` in this process, in ``cwd``; its stdout. Exit status 0 or a failure."""
    from autoplan.cli.main import main
    out_name = _output_flag(argv)
    key = tuple(argv) if argv and argv[0] in ("plan", "trace") and out_name else None
    if key in _MEMO:
        for name, data in _MEMO[key].items():
            (cwd / name).write_bytes(data)
        return ""
    if argv[:1] == ["run"] and "--master-port" not in argv and "--print-command" not in argv:
        argv = [*argv, "--master-port", str(free_port())]
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        os.chdir(old)
        _no_process_group()
    assert rc == 0, (f"{where}: autoplan {shlex.join(argv)} exited {rc}\n"
                     f"{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}")
    if key is not None:
        _MEMO[key] = {out_name: (cwd / out_name).read_bytes()}
    return out.getvalue()


def _no_process_group() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _script(path: str, cwd: Path, where: str) -> Path:
    for base in (cwd, ROOT):
        if (base / path).is_file():
            return base / path
    raise AssertionError(f"{where}: {path} does not exist (in the page's folder or the "
                         "repository)")


def run_subprocess(argv: list[str], cwd: Path, where: str) -> None:
    """``torchrun ...`` or ``python SCRIPT ...`` as a subprocess in ``cwd``."""
    if argv[0] == "torchrun":
        flags = [] if any(a.startswith("--master-port") for a in argv) else \
            [f"--master-port={free_port()}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags, *argv[1:]]
    else:
        cmd = [sys.executable, *argv[1:]]
    script = _script(argv[1] if argv[0] == "python" else
                     next(a for a in argv[1:] if a.endswith(".py")), cwd, where)
    if not script.is_relative_to(cwd):
        cwd = ROOT          # the repository's scripts read their data relative to it
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (f"{where}: {shlex.join(argv)} exited {out.returncode}\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def parse_only(argv: list[str], cwd: Path, where: str) -> None:
    """The command parses (autoplan) or names files that exist (scripts, make targets)."""
    tool = argv[0]
    if tool == "autoplan":
        from autoplan.cli.main import build_parser
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as e:
            raise AssertionError(f"{where}: autoplan {shlex.join(argv[1:])} does not parse "
                                 f"({e})") from None
    elif tool in ("python", "bash"):
        _script(argv[1], cwd, where)
    elif tool == "torchrun":
        _script(next(a for a in argv[1:] if a.endswith(".py")), cwd, where)
    elif tool == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), f"{where}: make {argv[1:]}: no such target"
    else:
        raise AssertionError(f"{where}: {tool!r}: this test does not know how to check it")


def run_command(argv: list[str], cwd: Path, where: str, *, full: bool) -> None:
    tool = argv[0]
    if not full or tool in ("make", "bash"):
        return parse_only(argv, cwd, where)
    if tool == "autoplan":
        run_autoplan(argv[1:], cwd, where)
    elif tool in ("torchrun", "python"):
        run_subprocess(argv, cwd, where)
    else:
        raise AssertionError(f"{where}: {tool!r}: this test does not know how to run it")


def run_python(block: Block, cwd: Path, namespace: dict) -> None:
    """The block in ``namespace`` (one per page: a page's snippets go on from each other, as
    in one Python session)."""
    old_cwd, old_path = os.getcwd(), list(sys.path)
    before = set(sys.modules)
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    try:
        code = compile(block.text, block.where, "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
    finally:
        os.chdir(old_cwd)
        sys.path[:] = old_path
        _no_process_group()
        for name in set(sys.modules) - before:      # the page's own modules (my_model)
            if getattr(sys.modules[name], "__file__", "") and \
                    str(cwd) in (sys.modules[name].__file__ or ""):
                del sys.modules[name]


def each_node(block: Block, cwd: Path) -> None:
    for rank in (0, 1):
        for argv in commands(block, {"NODE_RANK": str(rank)}):
            assert argv[:2] == ["autoplan", "run"], f"{block.where}: {argv}"
            printed = run_autoplan([*argv[1:], "--print-command"], cwd, block.where)
            assert f"--node-rank={rank}" in printed, printed
            nnodes = argv[argv.index("--nnodes") + 1]
            addr = argv[argv.index("--master-addr") + 1]
            assert f"--nnodes={nnodes}" in printed and f"--master-addr={addr}" in printed, \
                printed
            assert "autoplan.runtime.worker" in printed, printed


def run_page(page: Path, cwd: Path, *, full: bool) -> None:
    (cwd / "examples").symlink_to(ROOT / "examples")    # the pages run from the repository
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(page):
        assert block.lang not in HIDDEN, \
            f"{block.where}: use ```bash for commands (this test runs ```bash blocks only)"
        if block.mode == "file":
            assert block.lang == "python" and block.arg, block.where
            (cwd / block.arg).write_text(block.text)
            continue
        if block.lang == "python":
            if block.mode in ("parse-only", "gpu") and not (full and block.mode != "gpu"):
                compile(block.text, block.where, "exec")
            else:
                run_python(block, cwd, namespace)
        elif block.lang == "bash":
            if block.mode == "each-node":
                each_node(block, cwd)
                continue
            assert block.mode in ("run", "parse-only", "gpu"), \
                f"{block.where}: unknown docs-test mark {block.mode!r}"
            for argv in commands(block):
                run_command(argv, cwd, block.where,
                            full=block.mode == "run" or (full and block.mode != "gpu"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_on_the_page_runs(page, tmp_path):
    run_page(page, tmp_path, full=False)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="AUTOPLAN_DOCS_FULL=1 runs the parse-only blocks too")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_fully(page, tmp_path):
    run_page(page, tmp_path, full=True)


def test_the_cli_reference_is_what_the_parsers_say():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import cli_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    text = cli_reference.PAGE.read_text()
    assert cli_reference.page_with_reference(text) == text, \
        "docs/cli.md is stale: run python docs/cli_reference.py"
    from autoplan.cli.main import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in sub.choices:                                    # every sub-command is there
        assert f"`autoplan {name}`" in text, name


def test_the_examples_are_the_readme_blocks():
    files = {b.arg: b.text for b in blocks(ROOT / "README.md") if b.mode == "file"}
    assert set(files) == {"my_model.py", "train.py"}
    for name, text in files.items():
        assert (ROOT / "examples" / name).read_text() == text, \
            f"examples/{name} differs from the README's block"


def test_every_page_is_linked_from_the_readme_or_the_docs_index():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"{page.name}" in readme + index, f"docs/{page.name} is linked from nowhere"
