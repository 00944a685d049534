"""Every import points downward, no module imports itself round a circle, and planning never
loads the runtime.

The layers, bottom up (``LAYER``): graph -> sharding -> cluster -> cost -> machine -> estimate
-> planner -> runtime, with the CLI on top. ``cluster`` sits below ``cost``: it describes
hardware (datasheet specs in ``cost_models/``, topology, the links' collective times, the
measured figures of a device in a ``ProfileDB``, this machine as its OS reports it), and
``cost`` prices ops on such a description; a cluster imports nothing of the cost formulas.
``machine`` measures this machine (calibration, op profiles, the first-use calibration
``Cluster.local()`` runs as a program of its own) with both below it.

What counts as an import: every ``import``/``from ... import`` of an autoplan module anywhere in
a file, at module level, under ``if TYPE_CHECKING:`` or inside a function. ``from P import n``
is an import of ``P.n`` where that is a module, else of ``P``; the package ``__init__`` files
Python runs on the way are not counted. An import inside a function (made when first needed) is
kept only for a reason written beside it: import time of ``autoplan``, an optional dependency.
Such an import may close a circle only when its line says so, with a comment holding
``lazily:`` and the reason (``from autoplan.x import y  # lazily: ...``); none does today.
Outside ``cli/`` every import of an autoplan module inside a function carries such a reason.

What a module's neighbours use it exports under a public name: no module takes a private name
(``_x``, not ``__x__``) of another, by ``from autoplan.m import _x`` or as ``m._x``.
"""

import ast
import functools
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "autoplan"
LAYER = {"version": 0, "errors": 0, "safe_io": 0.5, "gc_pause": 0.5, "plotting": 0.5,
         "process_exit": 0.5, "torchao_quiet": 0.5, "models": 1, "graph": 1,
         "sharding": 2, "cluster": 3, "cost": 4, "cost_models": 4, "profiles": 4, "machine": 5,
         "estimate": 6, "planner": 7, "runtime": 8, "cli": 9, "__init__": 10}
# (importing file, imported package): each with its reason
ALLOWED = {
    # the torchrun worker of `autoplan run` builds the example model it was named
    ("runtime/worker.py", "models"),
}
LAZY_REASON = "lazily:"


@functools.lru_cache(maxsize=None)
def _parse(source: str) -> ast.Module:
    """The syntax tree of ``source``, parsed once for all the checks of this file (keyed by
    the text itself, so an edited file is parsed again; no check changes a tree)."""
    return ast.parse(source)


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file, for every module of the package at ``root``."""
    found = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = f
    return found


def _imports(root: pathlib.Path = ROOT):
    """(importing module, imported module, file, line, marked) for every import of a module of
    the package at ``root``; ``marked``: the line gives a reason to import lazily."""
    modules = _modules(root)
    for name, f in modules.items():
        source = f.read_text()
        lines = source.splitlines()
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(_parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            marked = LAZY_REASON in lines[node.lineno - 1]
            for target in dict.fromkeys(targets):
                if target in modules and target != name:
                    yield name, target, f.relative_to(root).as_posix(), node.lineno, marked


def _private_uses(root: pathlib.Path = ROOT) -> list[str]:
    """Every use of another module's private name in the package at ``root``: imported
    (``from autoplan.m import _x``) or read off an imported module (``m._x``)."""
    modules = _modules(root)
    out = []
    for name, f in modules.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        tree = _parse(f.read_text())
        aliases: dict[str, str] = {}          # local name -> the autoplan module it is
        rel = f.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in modules and base != name and _private(a.name):
                        out.append(f"{rel}:{node.lineno} imports {a.name} from {base}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name.partition(".")[0]] = (
                            a.name if a.asname else a.name.partition(".")[0])
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in aliases:
                target = ".".join([aliases[v.id], *reversed(chain)])
                if target in modules and target != name:
                    out.append(f"{rel}:{node.lineno} reads {node.attr} of {target}")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(root: pathlib.Path = ROOT) -> list[str]:
    out = []
    for src, dst, rel, line, _ in _imports(root):
        here, there = _layer_of(src), _layer_of(dst)
        if here != there and LAYER[there] >= LAYER[here] and (rel, there) not in ALLOWED:
            out.append(f"{rel}:{line} ({here}) imports {dst} ({there})")
    return out


def _circles(root: pathlib.Path = ROOT) -> list[list[str]]:
    """The import circles among the modules at ``root``: each strongly connected set of two or
    more modules (Tarjan's algorithm), with the imports that join it."""
    edges: dict[str, list[tuple[str, str]]] = {}
    for src, dst, rel, line, marked in _imports(root):
        if not marked:
            edges.setdefault(src, []).append((dst, f"{rel}:{line} imports {dst}"))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                inside = set(members)
                found.append(sorted(why for m in members for w, why in edges.get(m, ())
                                    if w in inside))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_imports_point_downward():
    upward = _upward()
    assert not upward, "imports that point up (or sideways):\n" + "\n".join(upward)


def test_no_module_imports_itself_round_a_circle():
    circles = _circles()
    assert not circles, ("import circles (cut one import of each: move what both sides need "
                         "below them):\n" + "\n\n".join("\n".join(c) for c in circles))


def test_modules_use_only_each_others_public_names():
    private = _private_uses()
    assert not private, ("private names used across modules (make them public where a "
                         "neighbour needs them, or move the code to where it is used):\n"
                         + "\n".join(private))


def _functions(root: pathlib.Path):
    """(file relative to ``root``, its lines, a function node) for every function of every
    module under ``root``."""
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(_parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(root).as_posix(), lines, node


def _unexplained_lazy_imports(root: pathlib.Path = ROOT) -> list[str]:
    """Imports of the package's own modules made inside a function without a ``lazily:``
    reason on their line, outside ``cli/`` (whose commands import what they run when they run:
    its package docstring says why)."""
    out = []
    for rel, lines, f in _functions(root):
        if rel.startswith("cli/"):
            continue
        for node in ast.walk(f):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                    == root.name and LAZY_REASON not in lines[node.lineno - 1]):
                out.append(f"{rel}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_imports_inside_functions_say_why():
    """An import made when first needed hides an edge of the import graph from a reader: it is
    kept only where its line says why (``# lazily: import time of autoplan``, an optional
    dependency); everything else imports at the top of its module."""
    lazy = _unexplained_lazy_imports()
    assert not lazy, ("imports inside functions without a '# lazily: <reason>' (move them to "
                      "the top of the module, or say why):\n" + "\n".join(lazy))


def test_the_lazy_import_check_sees_one(tmp_path):
    pkg = tmp_path / "autoplan"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from autoplan import b\n")
    (pkg / "b.py").write_text("def f():\n    from autoplan import a  # lazily: a test\n")
    (pkg / "cli" / "c.py").write_text("def f():\n    from autoplan import a\n")
    assert _unexplained_lazy_imports(pkg) == ["a.py:2 from autoplan import b"]


MAX_FUNCTION_LINES = 80       # an orchestration function past this wants named steps


def _long_functions(root: pathlib.Path) -> list[str]:
    out = []
    for rel, _, f in _functions(root):
        length = f.end_lineno - f.lineno + 1
        if length > MAX_FUNCTION_LINES:
            out.append(f"{rel}:{f.lineno} {f.name} ({length} lines)")
    return out


def test_no_function_is_longer_than_80_lines():
    """Long functions read as one step each (issue 38): split a function past the limit into
    steps whose names say their job, with typed values between them."""
    long = _long_functions(ROOT)
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 80)
    assert _long_functions(tmp_path) == ["m.py:1 f (81 lines)"]


def test_the_checks_see_circles_and_arrows_up(tmp_path):
    """The two checks above find what they are for, in a package made to have both."""
    pkg = tmp_path / "autoplan"
    for rel, text in {
            "__init__.py": "",
            "graph/__init__.py": "",
            "graph/a.py": "from autoplan.graph import b\n",
            "graph/b.py": "def f():\n    from autoplan.graph.c import x\n",
            "graph/c.py": "from autoplan.graph.a import y\nimport autoplan.planner.p\n",
            "graph/d.py": "def g():\n    from autoplan.graph import a  # lazily: a test\n",
            "planner/__init__.py": "",
            "planner/p.py": "from autoplan.graph.d import g\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert _circles(pkg) == [["graph/a.py:1 imports autoplan.graph.b",
                              "graph/b.py:2 imports autoplan.graph.c",
                              "graph/c.py:1 imports autoplan.graph.a"]]
    assert _upward(pkg) == ["graph/c.py:2 (graph) imports autoplan.planner.p (planner)"]


def test_the_check_sees_private_names_across_modules(tmp_path):
    pkg = tmp_path / "autoplan"
    for rel, text in {
            "__init__.py": "",
            "graph/__init__.py": "",
            "graph/a.py": "_x = 1\n__all__ = []\ndef _f():\n    return _x\n",
            "graph/b.py": "from autoplan.graph.a import _x, __all__\n",
            "graph/c.py": "from autoplan.graph import a\nimport autoplan.graph.a as aa\n"
                          "y = a._f() + aa._x + a.__all__\n",
            "graph/d.py": "import autoplan.graph.a\nz = autoplan.graph.a._x\n",
            "graph/e.py": "from .a import _f\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert sorted(_private_uses(pkg)) == [
        "graph/b.py:1 imports _x from autoplan.graph.a",
        "graph/c.py:3 reads _f of autoplan.graph.a",
        "graph/c.py:3 reads _x of autoplan.graph.a",
        "graph/d.py:2 reads _x of autoplan.graph.a",
        "graph/e.py:1 imports _f from autoplan.graph.a"]


def test_planning_does_not_load_the_runtime():
    code = ("import sys, autoplan\n"
            "from autoplan.models import build_example\n"
            "ex = build_example('gpt-tiny', device='meta')\n"
            "g = autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, "
            "targets=ex.targets)\n"
            "autoplan.plan(g, autoplan.Cluster.local(2), global_batch_size=4, profile=None)\n"
            "bad = [m for m in sys.modules if m.startswith('autoplan.runtime')]\n"
            "print(bad)\n"
            "from autoplan.process_exit import exit_now\n"
            "exit_now(0)\n")              # without the teardown of the traced graph: seconds
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
