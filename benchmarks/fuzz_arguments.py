"""Fuzz the arguments of every CLI sub-command and of the main API functions.

    python benchmarks/fuzz_arguments.py                 # every generated case, then 2,000 random
    python benchmarks/fuzz_arguments.py --random 0 --group cli
    python benchmarks/fuzz.py --arguments               # the file formats, then these

Each case is a call with one bad argument (or a few, in the random mix) put into a call that
is otherwise valid and cheap: numbers out of range or of the wrong type, sizes far too large,
missing, unreadable and unwritable paths, files of another format, ``module:function`` specs
that name no function, ``--force``/``--pin`` items that name nothing, clusters that do not
exist, training batches of the wrong shape, dtype, arity or device. The CLI runs in a forked
child (``autoplan.cli.main.main``), killed with its process group when over the time limit;
the API runs in this process under ``SIGALRM`` (its calls are ``fuzz_api.py``'s). The limit
is a hang guard, not a speed test.

Outcomes: ``refused`` (autoplan's own typed error; for the CLI exit 1 or 2 with a message),
``usage`` (argparse's exit 2: malformed command-line syntax), ``accepted`` (the value was
valid after all), ``untyped`` (any other exception: a bug), ``hang`` (over the limit: a bug).
``tests/test_fuzz.py`` runs every API case and two values of every CLI slot; this script
runs them all and adds random mixes.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import io
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _sibling(name: str) -> Any:
    """A module of this folder, loaded by its path (the folder is no package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"autoplan_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_api = _sibling("fuzz_api")
api_calls, clusters, step_calls = _api.api_calls, _api.clusters, _api.step_calls

GROUPS = ("cli", "api", "step")


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang()


@dataclass(frozen=True)
class Case:
    """One call: a CLI argv, or an API call ``fn()``, with a name for the report."""

    group: str
    name: str
    argv: tuple[str, ...] = ()
    fn: Callable[[], Any] | None = None


# ---- fixtures ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fixtures:
    """Files the cases point at, in a temporary folder, and a compiled one-process trainer."""

    tmp: str
    graph: str          # an OpGraph JSON (mlp-tiny)
    plan: str           # a plan for mlp-tiny on local:2
    cluster: str        # a cluster YAML
    empty: str          # an empty file
    binary: str         # bytes that are no format
    folder: str         # a folder
    text: str           # a plain text file (a folder's name under it cannot exist)
    api: dict[str, Any]


def fixtures() -> Fixtures:
    import warnings

    import torch
    from torch import nn

    import autoplan
    from autoplan import Cluster
    warnings.simplefilter("ignore")
    os.environ.setdefault("AUTOPLAN_AUTO_CALIBRATE", "0")
    tmp = tempfile.mkdtemp(prefix="autoplan-fuzz-args-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    from autoplan.models import build_example
    ex = build_example("mlp-tiny", batch_size=1, seed=0, device="cpu")
    graph = autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                           name="mlp-tiny")
    plan = autoplan.plan(graph, Cluster.local(2), global_batch_size=8, precision="fp32",
                         profile=None, max_pp=1, name="mlp-tiny")
    paths = {k: os.path.join(tmp, v) for k, v in
             dict(graph="graph.json", plan="plan.json", cluster="cluster.yaml",
                  empty="empty.json", binary="binary.json", folder="folder",
                  text="notes.txt").items()}
    with open(paths["graph"], "w") as f:
        f.write(graph.to_json())
    plan.save(paths["plan"])
    with open(paths["cluster"], "w") as f:
        f.write("preset: dgx-h100\nnum_nodes: 1\n")
    open(paths["empty"], "w").close()
    with open(paths["binary"], "wb") as f:
        f.write(bytes(range(256)) * 4)
    os.mkdir(paths["folder"])
    with open(paths["text"], "w") as f:
        f.write("not a folder\n")
    # a small model the API cases plan, estimate and compile (one process: no ranks)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    g = autoplan.trace(model, (x,), loss_fn=nn.functional.cross_entropy, targets=y)
    one = autoplan.plan(g, Cluster.local(1), global_batch_size=8, precision="fp32",
                        profile=None)
    api = dict(model=model, x=x, y=y, graph=g, plan=one, loss_fn=nn.functional.cross_entropy)
    return Fixtures(tmp=tmp, api=api, **paths)


# ---- bad values, by kind -------------------------------------------------------------------------

INT_SYNTAX = ["abc", "1.5", "", "2e3", "0x10"]               # argparse's type=int refuses these
COUNTS = ["0", "-1", "-7", "99999999999999999999"]
SIZES = COUNTS + ["1000000000", "1000000000000"]
FLOATS = ["nan", "inf", "-inf", "-1", "0", "1e400", "x"]


def _in_paths(fx: Fixtures, other_format: str) -> list[str]:
    """Inputs that are not what the option reads."""
    return [os.path.join(fx.tmp, "missing.json"), fx.folder, fx.empty, fx.binary, "/dev/null",
            other_format, "", os.path.join(fx.text, "x.json")]


def _out_paths(fx: Fixtures, suffix: str) -> list[str]:
    """Outputs that cannot be written: a folder, a missing folder, under a file, /proc, the
    wrong extension, an empty name."""
    return [fx.folder, os.path.join(fx.tmp, "no", "such", "dir", "out" + suffix),
            os.path.join(fx.text, "out" + suffix), "/proc/autoplan-fuzz" + suffix, "",
            os.path.join(fx.tmp, "out.unsupported")]


def _models(fx: Fixtures) -> list[str]:
    """MODEL arguments that name nothing buildable."""
    return ["no-such-model", "os:sep", "os:getcwd", ":", ":f", "json:", "json:dumps",
            "autoplan_no_such_module_xyz:f", "os.path:join", "autoplan.models:Example",
            "a:b:c", "builtins:object", "gpt-tiny:", "json:decoder", ".:x", "..os:sep",
            os.path.join(fx.tmp, "missing.json"), fx.empty, fx.plan]


FORCE = ["bogus=1", "tp", "=2", "tp=", "tp=x", "tp=0", "tp=-1", "zero_stage=9", "schedule=x",
         "chunk_layers=a,b", "micro_batch_size=0", "tp=99999999999999999999", "precision=fp8",
         "Tp=2", " =1", "dp_whole=", "stage_recompute=bogus", "dp_shares=0,1",
         "dp_shares=x"]
PINS = ["x", "=y", "x=", "nomatch:op=linear", "*:linear=no_such_strategy", "=", "a=b=c"]


# ---- CLI cases -----------------------------------------------------------------------------------

def cli_slots(fx: Fixtures) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """Per sub-command: a valid, cheap argv, and per option (or positional index) its bad
    values. An option's values replace its value in the base, or are appended."""
    model_opts = {"--batch-size": SIZES + INT_SYNTAX, "--seq-len": SIZES + INT_SYNTAX,
                  "--max-positions": SIZES, "--layers": SIZES + INT_SYNTAX,
                  "--device": ["gpu", ""]}
    return {
        "trace": (["trace", "mlp-tiny"],
                  {"@1": _models(fx), **model_opts, "-o": _out_paths(fx, ".json"),
                   "--ops": ["-1"] + INT_SYNTAX}),
        "cluster": (["cluster", "show", "local:2"],
                    {"@2": clusters(fx), "--nodes": COUNTS + INT_SYNTAX,
                     "--png": _out_paths(fx, ".png")}),
        "estimate": (["estimate", fx.graph, "--cluster", "local:2", "--global-batch", "8"],
                     {"@1": _models(fx), "--cluster": clusters(fx),
                      "--global-batch": SIZES + INT_SYNTAX,
                      "--dp": COUNTS, "--tp": COUNTS, "--pp": COUNTS, "--ep": COUNTS,
                      "--cp": COUNTS, "--mbs": SIZES, "--virtual-stages": COUNTS,
                      "--zero": ["4", "-1"], "--schedule": ["x"],
                      "--stage-recompute": ["bogus", ",", "full,x"],
                      "--chunk-layers": ["a,b", "0", "-1,-1", ",", "99999999999999999999"],
                      "--dp-shares": ["1", "0,8", "a,b", ",", "99999999999999999999,1"],
                      "--expert-capacity-factor": FLOATS,
                      "--seq-lengths": _in_paths(fx, fx.cluster)}),
        "plan": (["plan", fx.graph, "--cluster", "local:1", "--global-batch", "8",
                  "-o", os.path.join(fx.tmp, "plan-out.json"), "-q"],
                 {"@1": _models(fx), "--cluster": clusters(fx),
                  "--global-batch": SIZES + INT_SYNTAX, "-o": _out_paths(fx, ".json"),
                  "--top-k": ["-1"] + INT_SYNTAX, "--max-tp": COUNTS, "--max-pp": COUNTS,
                  "--force": FORCE, "--pin": PINS, "--expert-capacity-factor": FLOATS,
                  "--objective": ["speed", ""], "--max-gpus": COUNTS + INT_SYNTAX,
                  "--tokens": COUNTS + ["abc", "", "1.5", "1e400", "nan"],
                  "--deadline": FLOATS, "--budget-usd": FLOATS,
                  "--usd-per-gpu-hour": FLOATS, "--tdp-watt": FLOATS,
                  "--pareto-png": _out_paths(fx, ".png"),
                  "--seq-lengths": _in_paths(fx, fx.cluster)}),
        "inspect": (["inspect", fx.plan],
                    {"@1": _in_paths(fx, fx.cluster), "--timeline": _out_paths(fx, ".png"),
                     "--memory": _out_paths(fx, ".png"), "--model": _models(fx),
                     "--topology": _out_paths(fx, ".png"),
                     "--cluster": clusters(fx)}),
        "diff": (["diff", fx.plan, fx.plan],
                 {"@1": _in_paths(fx, fx.graph), "@2": _in_paths(fx, fx.cluster)}),
        "export": (["export", os.path.join(fx.tmp, "missing-ckpt"), "-o",
                    os.path.join(fx.tmp, "model.safetensors")],
                   {"@1": [fx.folder, fx.empty, fx.plan, ""],
                    "-o": _out_paths(fx, ".safetensors")}),
        "run": (["run", fx.plan, "--model", "mlp-tiny", "--print-command"],
                {"@1": _in_paths(fx, fx.graph), "--model": _models(fx),
                 "--nnodes": COUNTS, "--nproc-per-node": COUNTS, "--steps": COUNTS,
                 "--lr": FLOATS, "--checkpoint-every": ["-1"],
                 "--max-restarts": ["-1"], "--master-port": ["-1", "70000"],
                 "--node-rank": ["-1", "5"]}),
        "verify": (["verify", fx.plan, "--model", "mlp-tiny", "--ranks", "0"],
                   {"--ranks": ["0", "-1", "99999999999999999999"], "@1": _in_paths(fx, fx.graph),
                    "--steps": ["0", "-1"], "--tolerance": ["nan", "-1", "0", "x"]}),
        "calibrate": (["calibrate", fx.plan, "--model", "mlp-tiny", "--steps", "1"],
                      {"--steps": ["0", "1", "-1"], "--warmup": ["0", "-1"],
                       "@1": _in_paths(fx, fx.graph)}),
        "profile": (["profile", "mlp-tiny", "--repeats", "0"],
                    {"--repeats": ["0", "-1"], "--warmup": ["-1"], "--batch-size": ["0", "-1"]}),
        "demo": (["demo", "--ranks", "0"],
                 {"--ranks": ["0", "-1", "99999999"], "--steps": ["0", "-1"]}),
    }


def _with(base: list[str], slot: str, value: str) -> list[str]:
    """``base`` with ``slot`` set to ``value``: ``@N`` is the positional argument at index N
    of the argv, anything else an option (replaced where the base has it, else appended)."""
    argv = list(base)
    if slot.startswith("@"):
        argv[int(slot[1:])] = value
    elif slot in argv:
        argv[argv.index(slot) + 1] = value
    else:
        argv += [slot, value]
    return argv


# commands whose valid runs are long (training, profiling): their bases are refused, so that a
# mutant that leaves them valid stays cheap; for the others a mutant may be accepted
_SYNTAX = [["--bogus-option"], ["--global-batch"], ["extra-positional", "another"], ["-"],
           ["--help=3"]]


def cli_cases(fx: Fixtures, per_slot: int | None = None, seed: int = 0) -> list[Case]:
    """Every bad value of every slot of every sub-command, and malformed syntax; with
    ``per_slot``, that many values of each slot and one syntax error per sub-command, drawn
    with ``seed`` (every slot is still tried)."""
    rng = random.Random(seed)
    out = []
    for cmd, (base, slots) in cli_slots(fx).items():
        for slot, values in slots.items():
            if per_slot is not None and len(values) > per_slot:
                values = rng.sample(values, per_slot)
            for v in values:
                argv = _with(base, slot, v)
                out.append(Case("cli", f"autoplan {_show(argv)}", argv=tuple(argv)))
        for extra in _SYNTAX if per_slot is None else [rng.choice(_SYNTAX)]:
            argv = base + extra
            out.append(Case("cli", f"autoplan {_show(argv)}", argv=tuple(argv)))
    out.append(Case("cli", "autoplan plan (no arguments)", argv=("plan",)))
    out.append(Case("cli", "autoplan no-such-command", argv=("no-such-command",)))
    return out


def random_cli_cases(fx: Fixtures, rng: random.Random, n: int) -> list[Case]:
    """Two or three bad values at once, on random sub-commands."""
    table = cli_slots(fx)
    out = []
    for _ in range(n):
        cmd = rng.choice(sorted(table))
        base, slots = table[cmd]
        argv = list(base)
        for slot in rng.sample(sorted(slots), min(len(slots), rng.randint(2, 3))):
            argv = _with(argv, slot, rng.choice(slots[slot]))
        out.append(Case("cli", f"autoplan {_show(argv)}", argv=tuple(argv)))
    return out


def _show(argv) -> str:
    import shlex
    return shlex.join(argv)[:160]


def run_cli(argv: tuple[str, ...], time_limit_s: float) -> tuple[str, str]:
    """Run ``autoplan ARGV`` in a forked child (its own process group, output captured);
    (outcome, the last lines of its error output or the traceback)."""
    import select
    read_fd, write_fd = os.pipe()
    err_path = tempfile.mktemp(prefix="autoplan-fuzz-err-")
    pid = os.fork()
    if pid == 0:                                                    # the child
        os.close(read_fd)
        outcome, detail = "untyped", ""
        try:
            os.setpgid(0, 0)
            import torch
            torch.set_num_threads(1)
            err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(err, 2)
            sys.stdout, sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False)), \
                io.TextIOWrapper(os.fdopen(2, "wb", closefd=False))
            from autoplan.cli.main import main
            try:
                rc = main(list(argv))
                outcome = "accepted" if rc == 0 else "refused"
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                outcome = "usage" if code == 2 else "accepted" if code == 0 else "untyped"
            except BaseException:
                outcome, detail = "untyped", traceback.format_exc(limit=-4)
            with contextlib.suppress(Exception):
                sys.stderr.flush()
                sys.stdout.flush()
        finally:
            os.write(write_fd, f"{outcome}\n{detail}".encode()[:60000])
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + time_limit_s
    chunks = []
    done = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if ready:
            data = os.read(read_fd, 65536)
            if not data:
                done = True
                break
            chunks.append(data)
    os.close(read_fd)
    if not done:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    err = ""
    with contextlib.suppress(OSError):
        err = open(err_path, errors="replace").read()
        os.remove(err_path)
    text = b"".join(chunks).decode(errors="replace")
    if not done or not text:
        return "hang", f"over {time_limit_s} s"
    outcome, _, detail = text.partition("\n")
    if outcome == "refused" and not err.strip():
        return "untyped", "refused without a message"
    if outcome == "refused" and "Traceback" in err:
        return "untyped", err[-2000:]
    return outcome, detail or err.strip()[-400:]


def run_api(fn: Callable[[], Any], time_limit_s: float) -> tuple[str, str]:
    import logging

    from autoplan.errors import AutoplanError
    # torch logs a failed export at ERROR before autoplan refuses it: the refusal is the answer
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit_s)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            fn()
        return "accepted", ""
    except Hang:
        return "hang", f"over {time_limit_s} s"
    except AutoplanError as e:
        return "refused", str(e)
    except Exception:
        return "untyped", traceback.format_exc(limit=-4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        quiet.setLevel(level)


# ---- running -------------------------------------------------------------------------------------

def _preload() -> None:
    """Import what the sub-commands import, once, so that each forked child need not."""
    import importlib
    from autoplan.cli.main import build_parser
    build_parser()
    for name in ("autoplan.planner.explain", "autoplan.planner.figures",
                 "autoplan.planner.plan_diff", "autoplan.runtime.checkpoint_files",
                 "autoplan.runtime.trainer", "matplotlib.pyplot"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run(groups=GROUPS, random_cases: int = 0, seed: int = 0, time_limit_s: float = 60.0,
        per_slot: int | None = None, report: Callable[[str], None] | None = None,
        answers: Callable[[Case, str, str], None] | None = None
        ) -> dict[str, collections.Counter]:
    """Counts of outcomes per group; ``report`` gets a line per bug, ``answers`` every case's
    outcome and message. ``per_slot``: CLI values per slot (all when None)."""
    import warnings
    warnings.simplefilter("ignore")
    os.environ.setdefault("AUTOPLAN_AUTO_CALIBRATE", "0")
    fx = fixtures()
    _preload()
    cwd = os.getcwd()
    os.chdir(fx.tmp)              # outputs a mutant accepts land in the temporary folder
    counts: dict[str, collections.Counter] = {}
    try:
        for group in groups:
            if group == "cli":
                cases = cli_cases(fx, per_slot, seed) + random_cli_cases(
                    fx, random.Random(seed), random_cases)
            else:
                calls = api_calls(fx) if group == "api" else step_calls(fx)
                cases = [Case(group, name, fn=fn) for name, fn in calls]
            c = counts[group] = collections.Counter()
            for case in cases:
                outcome, detail = (run_cli(case.argv, time_limit_s) if case.argv
                                   else run_api(case.fn, time_limit_s))
                c[outcome] += 1
                if answers:
                    answers(case, outcome, detail)
                if outcome in ("untyped", "hang") and report:
                    report(f"{case.name}: {outcome}\n{detail}")
    finally:
        os.chdir(cwd)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", choices=GROUPS, action="append")
    ap.add_argument("--random", type=int, default=2000,
                    help="random CLI mixes of two or three bad values (2,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-slot", type=int, default=None,
                    help="CLI values per slot (default: every one)")
    ap.add_argument("--answers", action="store_true", help="print every case and its answer")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bugs: list[str] = []

    def show(case: Case, outcome: str, detail: str) -> None:
        if args.answers:
            line = detail.strip().splitlines()[-1] if detail.strip() else ""
            print(f"{outcome:9s} {case.name}\n          {line[:300]}", flush=True)
    counts = run(args.group or GROUPS, args.random, args.seed, per_slot=args.per_slot,
                 report=bugs.append, answers=show)
    print(f"{'group':8s} {'cases':>6s} {'refused':>8s} {'usage':>6s} {'accepted':>9s} "
          f"{'untyped':>8s} {'hang':>5s}")
    for group, c in counts.items():
        print(f"{group:8s} {sum(c.values()):6d} {c['refused']:8d} {c['usage']:6d} "
              f"{c['accepted']:9d} {c['untyped']:8d} {c['hang']:5d}")
    print(f"{time.perf_counter() - t0:.1f} s")
    for b in bugs[:40]:
        print(b)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
