"""Every import points downward: graph -> sharding -> (cluster) -> cost -> estimate -> planner
-> runtime, with the CLI on top; planning never loads the runtime."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "autoplan"
LAYER = {"version": 0, "errors": 0, "safe_io": 0.5, "gc_pause": 0.5, "models": 1, "graph": 1, "sharding": 2, "cluster": 3,
         "cost": 4, "cost_models": 4, "profiles": 4, "estimate": 5, "planner": 6,
         "runtime": 7, "cli": 8, "__init__": 9}
# (importing file, imported package): each with its reason
ALLOWED = {
    # Cluster.local() reads the calibration an installed CPU profile measured (lazily)
    ("cluster/local.py", "cost"),
    # the torchrun worker of `autoplan run` builds the example model it was named
    ("runtime/worker.py", "models"),
}


def _imports():
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        pkg = rel.split("/")[0].removesuffix(".py")
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "autoplan":
                parts = node.module.split(".")
                targets = [parts[1]] if len(parts) > 1 else [
                    a.name if a.name in LAYER else "__init__" for a in node.names]
                for target in targets:
                    if target != pkg:
                        yield rel, pkg, target


def test_imports_point_downward():
    upward = [(rel, target) for rel, pkg, target in _imports()
              if LAYER[target] >= LAYER[pkg] and (rel, target) not in ALLOWED]
    assert not upward, f"imports that point up (or sideways): {upward}"


def test_planning_does_not_load_the_runtime():
    code = ("import sys, autoplan\n"
            "from autoplan.models import build_example\n"
            "ex = build_example('gpt-tiny', device='meta')\n"
            "g = autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, "
            "targets=ex.targets)\n"
            "autoplan.plan(g, autoplan.Cluster.local(2), global_batch_size=4, profile=None)\n"
            "bad = [m for m in sys.modules if m.startswith('autoplan.runtime')]\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
