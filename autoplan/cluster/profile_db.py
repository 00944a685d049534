"""ProfileDB: measured op timings of one device, as a schema-versioned JSON file.

A profile database answers "how long does this op take forward and backward on this device",
for ops measured by ``autoplan profile`` (see ``autoplan.machine.profiler``). It is pure data: no
torch import, no pickle, no code in the file.

Keys. ``op_key(graph, op)`` names an op by what determines its run time and nothing else: the
aten target, the shapes/dtypes (and requires_grad flags) of its tensor inputs, and its other
arguments with every tensor replaced by its ``[shape, dtype]``. Value names, module paths and the
device the graph was traced on are left out, so the same op at the same shapes in two layers, or
in two graphs (one traced on CPU, one on the meta device), has one key.

File layout (``save`` writes sorted keys, indent 1, times rounded to 4 significant digits, so
re-saving the same data gives the same bytes)::

    {"schema_version": 1, "device": "cpu-amd-epyc", "device_kind": "cpu", "threads": 2,
     "torch_version": "2.13.0", "sources": ["gpt-tiny@4", ...],
     "calibration": {"matmul_flops_per_s": ..., ...},
     "entries": {"<op key>": {"fwd_s": ..., "bwd_s": ..., "fwd_cv": ..., "bwd_cv": ...,
                              "repeats": 15}, ...}}

Where files are found (``ProfileDB.find``): ``$AUTOPLAN_PROFILE_DIR`` (one or more folders,
``os.pathsep``-separated), then ``~/.cache/autoplan/profiles``, then the profiles shipped in the
package (``autoplan.profiles``, the repository's ``profiles/`` folder). The file name is
``<device>.json``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from autoplan import safe_io
from autoplan.errors import ProfileError

if TYPE_CHECKING:  # only for annotations: this module never needs the graph code at run time
    from autoplan.graph.opgraph import Op, OpGraph

SCHEMA_VERSION = 1
DEVICE_KINDS = ("cpu", "cuda")
PROFILE_DIR_ENV = "AUTOPLAN_PROFILE_DIR"
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


PROFILE_CACHE_ENV = "AUTOPLAN_PROFILE_CACHE"


def default_cache_dir() -> Path:
    """Where ``autoplan profile`` (and first-use calibration) write by default:
    ``$AUTOPLAN_PROFILE_CACHE``, else ``~/.cache/autoplan/profiles``."""
    env = os.environ.get(PROFILE_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "autoplan" / "profiles"


def check_device_name(device: str) -> str:
    """A device name is a file name stem: letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(device, str) or not _DEVICE_NAME.match(device):
        raise ProfileError(f"device name {device!r} is not usable as a profile file name; use "
                           "letters, digits, '.', '_' and '-' only (e.g. 'cpu-amd-epyc')")
    return device


# ---- op keys ----------------------------------------------------------------------------------

def _key_arg(x: Any, meta_of: Callable[[str], list]) -> Any:
    if isinstance(x, list):
        return [_key_arg(a, meta_of) for a in x]
    if isinstance(x, dict):
        if set(x) == {"v"}:
            return meta_of(x["v"])
        if set(x) == {"device"}:
            return {"device": "*"}  # a graph traced on meta replays on the profiled device
        if set(x) == {"node"}:
            return {"node": "*"}    # a non-tensor graph node (e.g. a symbolic size): no name
        return {k: _key_arg(v, meta_of) for k, v in x.items()}
    return x


def op_key(graph: OpGraph, op: Op) -> str:
    """Stable key of ``op``: target | inputs [shape, dtype, requires_grad] | args with tensors
    replaced by their [shape, dtype]. Identical ops in two layers or two graphs share it.

    ``requires_grad`` is part of the key because it decides what the backward computes (the
    first Linear of a model needs no input gradient; the others do).
    """
    def meta_of(name: str) -> list:
        meta = graph.value(name).meta
        return [list(meta.shape), meta.dtype]

    inputs = [meta_of(name) + [bool(graph.value(name).requires_grad)] for name in op.inputs]
    try:
        call = json.loads(op.args)
    except json.JSONDecodeError as e:
        raise ProfileError(f"op {op.name!r} ({op.target}) has malformed args JSON: {e}; "
                           "re-trace the model with this autoplan version") from e
    args = _key_arg(call, meta_of)
    sep = (",", ":")
    return "|".join((op.target, json.dumps(inputs, separators=sep),
                     json.dumps(args, sort_keys=True, separators=sep)))


# profiles of large models hold tens of thousands of entries; anything far larger is refused
FILE_LIMITS = safe_io.Limits(max_bytes=256 << 20, max_depth=16, max_string_chars=1 << 16)


# ---- records ----------------------------------------------------------------------------------

def _check_number(owner: str, name: str, x: Any, *, positive: bool) -> None:
    try:
        finite = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:             # an int too large for a float
        finite = False
    if not finite or x < 0 or (positive and x == 0):
        need = "a positive finite number" if positive else "a finite number >= 0"
        raise ProfileError(f"{owner}.{name} must be {need}, got {x!r}")


@dataclass(frozen=True, kw_only=True)
class OpTiming:
    """Median forward and backward times of one op (``bwd_s`` is 0 for ops without backward);
    ``*_cv`` are coefficients of variation (std / mean) of the timed samples."""

    fwd_s: float
    bwd_s: float
    fwd_cv: float
    bwd_cv: float
    repeats: int

    def __post_init__(self) -> None:
        for f in ("fwd_s", "bwd_s", "fwd_cv", "bwd_cv"):
            _check_number("OpTiming", f, getattr(self, f), positive=False)
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ProfileError(f"OpTiming.repeats must be an int >= 1, got {self.repeats!r}")

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Device figures measured by ``calibration.calibrate``; the cost model's fallback for ops that
    were never profiled."""

    # achieved by the products of a forward and backward pass (operands fresh from the op
    # before, transposed for the backward, gradients written) of calibration's reference
    # network, in matmul_dtype
    matmul_flops_per_s: float
    memory_bandwidth_bytes_per_s: float  # achieved by a large copy: (read + write bytes) / time
    launch_s: float                      # fixed per-op overhead: median of a 1-element op
    optimizer_s_per_param: float         # default torch.optim.AdamW step, per fp32 parameter
    optimizer_s_per_tensor: float        # its fixed cost per parameter tensor (per-tensor loop)
    step_overhead_s: float               # fwd + bwd + step + zero_grad of a 1-parameter model
    matmul_dtype: str = "float32"
    # eager framework time per op and pass outside its kernel (Python modules, autograd, hooks,
    # DTensor dispatch), fitted by `autoplan calibrate` from a measured step; 0 until then
    framework_s_per_op: float = 0.0
    # a product's rate by its size, as a fraction of ``matmul_flops_per_s``: ((size, fraction),
    # ...) with sizes increasing, a size being the cube root of one matrix product's M*K*N
    # (``cost.compute.product_size``); empty: one rate for every size
    matmul_size_efficiency: tuple[tuple[float, float], ...] = ()
    # element-wise functions whose arithmetic (tanh, exp, erf) outlasts their memory traffic on
    # some devices: ((name, forward s per element, backward s per element), ...), names as
    # ``cost.compute.elementwise_key`` gives them; empty: the roofline alone
    elementwise_s_per_element: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("matmul_dtype", "matmul_size_efficiency",
                              "elementwise_s_per_element"):
                _check_number("Calibration", f.name, getattr(self, f.name),
                              positive=f.name != "framework_s_per_op")
        object.__setattr__(self, "matmul_size_efficiency",
                           _size_curve(self.matmul_size_efficiency))
        object.__setattr__(self, "elementwise_s_per_element",
                           _element_rates(self.elementwise_s_per_element))


def _element_rates(rates: Any) -> tuple[tuple[str, float, float], ...]:
    """``Calibration.elementwise_s_per_element`` checked: from ((name, fwd, bwd), ...) or the
    file's {name: [fwd, bwd]}, names sorted, times finite and >= 0."""
    if isinstance(rates, Mapping):
        rates = [(k, *v) if isinstance(v, (list, tuple)) else (k, v) for k, v in rates.items()]
    if not isinstance(rates, (list, tuple)):
        raise ProfileError("Calibration.elementwise_s_per_element must map a name to [forward, "
                           f"backward] seconds per element, got {type(rates).__name__}")
    out = []
    for r in rates:
        if not isinstance(r, (list, tuple)) or len(r) != 3 or not isinstance(r[0], str):
            raise ProfileError("Calibration.elementwise_s_per_element must map a name to "
                               f"[forward, backward] seconds per element, got {r!r:.80}")
        for what, x in zip(("forward", "backward"), r[1:]):
            _check_number("Calibration.elementwise_s_per_element", f"{r[0]}.{what}", x,
                          positive=False)
        out.append((r[0], float(r[1]), float(r[2])))
    return tuple(sorted(out))


def _size_curve(points: Any) -> tuple[tuple[float, float], ...]:
    """``Calibration.matmul_size_efficiency`` checked: pairs of positive finite numbers with
    sizes strictly increasing."""
    if not isinstance(points, (list, tuple)):
        raise ProfileError("Calibration.matmul_size_efficiency must be a list of [size, "
                           f"fraction] pairs, got {type(points).__name__}")
    out: list[tuple[float, float]] = []
    for p in points:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ProfileError("Calibration.matmul_size_efficiency must be a list of [size, "
                               f"fraction] pairs, got {p!r:.80}")
        _check_number("Calibration.matmul_size_efficiency", "size", p[0], positive=True)
        _check_number("Calibration.matmul_size_efficiency", "fraction", p[1], positive=True)
        if out and float(p[0]) <= out[-1][0]:
            raise ProfileError("Calibration.matmul_size_efficiency: sizes must increase, got "
                               f"{out[-1][0]:g} then {p[0]!r}")
        out.append((float(p[0]), float(p[1])))
    return tuple(out)


_TIMING_FIELDS = tuple(f.name for f in fields(OpTiming))
_CALIBRATION_FIELDS = tuple(f.name for f in fields(Calibration))


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _timing_to_json(t: OpTiming) -> dict[str, Any]:
    return {"fwd_s": _round(t.fwd_s), "bwd_s": _round(t.bwd_s), "fwd_cv": round(t.fwd_cv, 3),
            "bwd_cv": round(t.bwd_cv, 3), "repeats": t.repeats}


def _calibration_to_json(c: Calibration) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in _CALIBRATION_FIELDS:
        x = getattr(c, f)
        if f == "matmul_dtype":
            out[f] = x
        elif f == "matmul_size_efficiency":
            if x:
                out[f] = [[_round(n), _round(e)] for n, e in x]
        elif f == "elementwise_s_per_element":
            if x:
                out[f] = {k: [_round(a), _round(b)] for k, a, b in x}
        elif f != "framework_s_per_op" or x:
            out[f] = _round(x)
    return out


# ---- the database -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ProfileDB:
    device: str                          # e.g. "cpu-amd-epyc"; the file is <device>.json
    device_kind: str                     # "cpu" | "cuda"
    threads: int                         # torch.get_num_threads() when measured
    torch_version: str
    calibration: Calibration
    entries: Mapping[str, OpTiming] = field(default_factory=dict)
    sources: tuple[str, ...] = ()        # what was profiled, e.g. ("gpt-tiny@4", "mlp@64")
    schema_version: int = SCHEMA_VERSION
    # links fitted by `autoplan calibrate`: name -> {"bandwidth_bytes_per_s", "latency_s"}
    links: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.device_kind not in DEVICE_KINDS:
            raise ProfileError(f"ProfileDB.device_kind must be one of {DEVICE_KINDS}, "
                               f"got {self.device_kind!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ProfileError(f"ProfileDB.threads must be an int >= 1, got {self.threads!r}")
        for k, t in self.entries.items():
            if not isinstance(k, str) or not isinstance(t, OpTiming):
                raise ProfileError(f"ProfileDB.entries must map str -> OpTiming, got "
                                   f"{type(k).__name__} -> {type(t).__name__}")
        object.__setattr__(self, "entries", MappingProxyType(dict(sorted(self.entries.items()))))
        links = {}
        for name, fig in dict(self.links).items():
            if not isinstance(name, str) or not isinstance(fig, Mapping) or \
                    sorted(fig) != ["bandwidth_bytes_per_s", "latency_s"]:
                raise ProfileError("ProfileDB.links must map a link name to "
                                   "{bandwidth_bytes_per_s, latency_s}")
            _check_number("ProfileDB.links", f"{name}.bandwidth_bytes_per_s",
                          fig["bandwidth_bytes_per_s"], positive=True)
            _check_number("ProfileDB.links", f"{name}.latency_s", fig["latency_s"],
                          positive=False)
            links[name] = MappingProxyType({k: float(v) for k, v in sorted(fig.items())})
        object.__setattr__(self, "links", MappingProxyType(links))
        object.__setattr__(self, "sources", tuple(sorted(set(self.sources))))

    # ---- queries ------------------------------------------------------------------------------
    def lookup(self, graph: OpGraph, op: Op) -> OpTiming | None:
        """The measured timing of ``op``, or None when this database never saw its key."""
        return self.entries.get(op_key(graph, op))

    def coverage(self, graph: OpGraph) -> float:
        """Fraction of ``graph``'s ops that have a measured timing here (1.0 for no ops)."""
        if not graph.ops:
            return 1.0
        return sum(op_key(graph, op) in self.entries for op in graph.ops) / len(graph.ops)

    def compatible_with(self, other: ProfileDB) -> str | None:
        """Why ``other``'s measurements cannot be mixed with these (None when they can)."""
        if other.device != self.device or other.device_kind != self.device_kind:
            return (f"device {other.device!r} ({other.device_kind}) differs from "
                    f"{self.device!r} ({self.device_kind})")
        if other.threads != self.threads:
            return f"measured with {other.threads} threads, not {self.threads}"
        return None

    def merged(self, other: ProfileDB) -> ProfileDB:
        """These entries updated with ``other``'s (``other`` wins on shared keys and gives the
        calibration and torch version: it is taken to be the newer measurement)."""
        why = self.compatible_with(other)
        if why is not None:
            raise ProfileError(f"cannot merge profile databases: {why}. Profile into a separate "
                               "file (-o PATH) or re-profile everything with the same settings")
        entries = dict(self.entries)
        entries.update(other.entries)
        return ProfileDB(device=self.device, device_kind=self.device_kind, threads=self.threads,
                         torch_version=other.torch_version, calibration=other.calibration,
                         entries=entries, sources=self.sources + other.sources,
                         links={**self.links, **other.links})

    # ---- files --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "device": self.device,
            "device_kind": self.device_kind,
            "threads": self.threads,
            "torch_version": self.torch_version,
            "sources": list(self.sources),
            "calibration": _calibration_to_json(self.calibration),
            "entries": {k: _timing_to_json(t) for k, t in self.entries.items()},
            **({"links": {k: dict(v) for k, v in self.links.items()}} if self.links else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write the database to ``path`` (parents created; written to a temp file, then moved,
        so a crash never leaves half a file)."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self.to_json(), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            raise ProfileError(f"cannot write profile database {str(path)!r}: {e}; choose a "
                               "writable path with -o PATH") from e

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> ProfileDB:
        def bad(what: str) -> ProfileError:
            return ProfileError(f"profile database {source} is malformed: {what}; re-create it "
                                "with `autoplan profile` or delete it")

        if not isinstance(d, dict):
            raise bad(f"the top level is a {type(d).__name__}, not an object")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(f"profile database {source} has schema_version {version!r}; this "
                               f"autoplan reads version {SCHEMA_VERSION}. Re-create it with "
                               "`autoplan profile`")
        required = ("device", "device_kind", "threads", "torch_version", "calibration", "entries")
        missing = [k for k in required if k not in d]
        if missing:
            raise bad(f"missing field(s) {missing}")
        cal = d["calibration"]
        if not isinstance(cal, dict):
            raise bad("'calibration' is not an object")
        unknown = sorted(set(cal) - set(_CALIBRATION_FIELDS))
        if unknown:
            raise bad(f"unknown calibration field(s) {unknown}")
        raw_entries = d["entries"]
        if not isinstance(raw_entries, dict):
            raise bad("'entries' is not an object")
        try:
            calibration = Calibration(**cal)
            entries = {}
            for key, e in raw_entries.items():
                if not isinstance(e, dict) or sorted(e) != sorted(_TIMING_FIELDS):
                    raise bad(f"entry {key[:80]!r} needs exactly the fields {_TIMING_FIELDS}, "
                              f"got {e!r:.200}")
                entries[key] = OpTiming(**e)
            sources = d.get("sources", [])
            if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
                raise bad("'sources' is not a list of strings")
            links = d.get("links", {})
            if not isinstance(links, dict):
                raise bad("'links' is not an object")
            return cls(device=d["device"], device_kind=d["device_kind"], threads=d["threads"],
                       torch_version=str(d["torch_version"]), calibration=calibration,
                       entries=entries, sources=tuple(sources), links=links)
        except TypeError as e:  # a missing calibration field
            raise bad(str(e)) from e
        except ProfileError as e:
            if source in str(e):
                raise
            raise bad(str(e)) from e

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfileDB:
        """Read a database file; any problem is a ProfileError naming the file."""
        text = safe_io.read_text(path, what="profile database", error=ProfileError,
                                 limits=FILE_LIMITS)
        return cls.from_text(text, source=repr(str(path)))

    @classmethod
    def from_text(cls, text: str | bytes, *, source: str = "<text>") -> ProfileDB:
        """Parse database text with the hardened reader (``autoplan.safe_io``)."""
        what = f"profile database {source}"
        text = safe_io.decode(text, what=what, error=ProfileError, limits=FILE_LIMITS)
        d = safe_io.parse_json(text, what=what, error=ProfileError, limits=FILE_LIMITS)
        return cls.from_dict(d, source=source)

    @classmethod
    def search_paths(cls, device: str) -> list[Path | Any]:
        """Candidate files for ``device``, in search order (they need not exist)."""
        name = f"{check_device_name(device)}.json"
        out: list[Path | Any] = []
        for folder in os.environ.get(PROFILE_DIR_ENV, "").split(os.pathsep):
            if folder:
                out.append(Path(folder).expanduser() / name)
        out.append(default_cache_dir() / name)
        out.append(packaged_profiles() / name)
        return out

    @classmethod
    def write_path(cls, device: str) -> str:
        """Where a measured profile for ``device`` goes so that ``find`` picks it up first: the
        first ``AUTOPLAN_PROFILE_DIR`` folder, else the user cache."""
        return str(cls.search_paths(device)[0])

    @classmethod
    def find(cls, device: str) -> ProfileDB | None:
        """The first database for ``device`` on the search path, or None if there is none.

        A file that exists but is malformed raises ProfileError (it is never skipped silently).
        """
        for candidate in cls.search_paths(device):
            if candidate.is_file():
                return cls.from_text(candidate.read_bytes(), source=repr(str(candidate)))
        return None


def packaged_profiles():
    """The folder of profiles shipped with autoplan (a Traversable; a Path in editable installs),
    else the repository checkout's ``profiles/`` (autoplan run from its source tree on
    ``PYTHONPATH``, not installed)."""
    try:
        return resources.files("autoplan.profiles")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "profiles"


def list_packaged_devices() -> list[str]:
    """Device names that have a shipped profile."""
    return sorted(p.name[: -len(".json")] for p in packaged_profiles().iterdir()
                  if p.name.endswith(".json"))


def merge_all(dbs: Iterable[ProfileDB]) -> ProfileDB:
    """Fold databases left to right with ``merged`` (later ones win)."""
    out: ProfileDB | None = None
    for db in dbs:
        out = db if out is None else out.merged(db)
    if out is None:
        raise ProfileError("merge_all() needs at least one profile database")
    return out
