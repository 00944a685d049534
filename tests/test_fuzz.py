"""Every file format fails cleanly: 300 mutants per format (plan, a plan with an objectives
section, cluster YAML and JSON, profile, OpGraph, checkpoint description), each read as autoplan reads it and, when accepted,
used. None may raise an untyped exception, hang, or run code. The mutations and outcomes are ``benchmarks/fuzz.py``'s,
which runs 10,000 per format and prints the counts.

Every bad argument fails cleanly too: each CLI sub-command with two bad values of each of its
options and arguments (out of range, wrong type, too large, unreadable or unwritable paths,
specs naming nothing) and a malformed command line, and the main API functions (``plan``,
``estimate``, ``trace``, ``load_plan``, ``compile``, ``Trainer.step``) with every generated bad
argument. Each must give autoplan's typed error (or argparse's usage exit 2) within the hang
guard. ``benchmarks/fuzz_arguments.py`` runs every CLI value and random mixes of them."""

import importlib.util
import sys
from pathlib import Path


def _fuzz(name="fuzz"):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"autoplan_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_three_hundred_mutants_per_format_fail_cleanly():
    fuzz = _fuzz()
    bugs = []
    counts = fuzz.run(mutants=300, seed=1, report=bugs.append)
    for fmt, c in counts.items():
        assert sum(c.values()) == 300
        assert c["untyped"] == 0 and c["hang"] == 0 and c["executed"] == 0, (fmt, c, bugs[:3])
        assert c["refused"] > 150, (fmt, c)          # the mutations do break files
    assert not bugs


def test_bad_arguments_to_every_command_and_api_function_fail_cleanly():
    fuzz = _fuzz("fuzz_arguments")
    bugs = []
    counts = fuzz.run(per_slot=2, seed=1, report=bugs.append)
    assert not bugs, bugs[:3]
    for group, c in counts.items():
        assert c["untyped"] == 0 and c["hang"] == 0, (group, c)
        # the cases are bad: almost all are refused (a few values turn out valid, e.g. a
        # --max-tp above the world size)
        assert c["refused"] + c["usage"] >= 0.9 * sum(c.values()), (group, c)
    assert sum(counts["cli"].values()) > 100 and counts["cli"]["usage"] > 5
    assert sum(counts["api"].values()) > 150 and sum(counts["step"].values()) > 20
