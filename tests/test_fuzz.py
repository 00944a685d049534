"""Every file format fails cleanly: 300 mutants per format (plan, cluster YAML and JSON,
profile, OpGraph, checkpoint description), each read as autoplan reads it and, when accepted,
used. None may raise an untyped exception, hang, or run code. The mutations and outcomes are ``benchmarks/fuzz.py``'s,
which runs 10,000 per format and prints the counts."""

import importlib.util
from pathlib import Path


def _fuzz():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("autoplan_fuzz", path)
    mod = importlib.util.module_from_spec(spec)
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
