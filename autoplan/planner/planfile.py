"""The plan file: the contract between planning and running.

A :class:`Plan` is what the search returns and what the runtime applies. ``plan.json`` is its
canonical text: ``json.dumps(sort_keys=True, indent=1, ensure_ascii=True)``, floats rounded to
6 significant digits, no timestamps and no wall times, so the same inputs give a byte-identical
file. The format is described by ``plan.schema.json`` (JSON Schema 2020-12) next to this module.

Reading is defensive: a file that is truncated, malformed, too large, too deep, or merely from
another schema version raises :class:`~autoplan.errors.PlanError` naming the JSON path of the
problem (e.g. ``mesh.shape``) and what to do. Nothing in a plan file is ever executed: it is
plain JSON read with ``json.loads`` (no pickle, no eval). The reading and every rule of the
format live in ``planfile_check.py``; this module holds the values, the text, and ``load_plan``.

A plan is tied to one model by its fingerprint (``OpGraph.fingerprint()``, a canonical form of
the traced graph) and to the hardware it was made for (``Cluster.hardware()``: device model,
kind and memory, nodes, devices per node, links, network; not the cluster's name). It runs on
any cluster of that hardware; :func:`plan_mismatch` says what differs, and
``allow_cluster_mismatch`` runs it on other hardware of the same world size with its prediction
marked stale (:func:`stale_prediction`). ``load_plan`` checks both and re-plans on request.

``op_strategies`` names ops as the planning process's trace named them; fx's names follow the
order Python ran the forward in, which for some models depends on ``PYTHONHASHSEED`` (a loop
over a ``set``), so another process may give a name to another op. ``op_keys`` records each op's
canonical key (``OpGraph.op_keys()``), and ``op_binding.bind_strategies`` finds the plan's ops
among another trace's by it.
"""

from __future__ import annotations

import json
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from autoplan.cluster.hardware import Difference, Hardware, compare, from_extras
from autoplan.errors import AutoplanError, PlanError
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.placement import Placement
from autoplan.sharding.seq_lengths import histogram_of
from autoplan.planner.planfile_check import (
    MAX_FILE_BYTES,
    OBJECTIVES_SCHEMA,
    PLAN_SCHEMA_VERSION,
    SOLVER_STATUSES,
    TP_DOMAINS,
    check_plan,
    fail,
    parse_json,
    sub,
)

__all__ = ["OBJECTIVES_SCHEMA", "PLAN_SCHEMA_VERSION", "SOLVER_STATUSES", "TP_DOMAINS", "Alternative", "ClusterInfo",
           "MeshInfo", "ModelInfo", "ParamPlacement", "Plan", "SolverReport", "TrainingInfo",
           "cluster_differences", "model_fingerprint", "plan_from_file", "plan_op_keys", "plan_mismatch",
           "predicted_from_estimate", "stale_prediction"]

SIG_DIGITS = 6                    # floats are rounded so re-planning gives identical text


# ================================================================ the values
@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    fingerprint: str            # OpGraph.fingerprint()
    num_params: int
    num_ops: int

    @staticmethod
    def of(graph: Any, *, name: str | None = None) -> ModelInfo:
        """From an OpGraph (``name`` defaults to the graph's name)."""
        return ModelInfo(name=name or graph.name, fingerprint=graph.fingerprint(),
                         num_params=int(graph.num_params), num_ops=len(graph.ops))


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    name: str
    fingerprint: str            # Cluster.fingerprint(): this exact description (provenance)
    world_size: int
    device: str                 # device type name, e.g. "A100-SXM4-80GB"
    num_nodes: int
    devices_per_node: int
    # what the plan is matched to a cluster by (schema 6; None in older plans); the file keeps
    # its fields other than device, num_nodes and devices_per_node under cluster.hardware
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        h = self.hardware
        if isinstance(h, Mapping):
            try:
                h = from_extras(device=self.device, num_nodes=self.num_nodes,
                                devices_per_node=self.devices_per_node, extras=h)
            except TypeError as e:
                raise PlanError(f"ClusterInfo.hardware: {e}") from None
            object.__setattr__(self, "hardware", h)
        if h is not None and (not isinstance(h, Hardware) or (
                h.device, h.num_nodes, h.devices_per_node) != (
                self.device, self.num_nodes, self.devices_per_node)):
            raise PlanError(f"ClusterInfo.hardware {h!r:.200} does not describe the cluster's "
                            f"{self.num_nodes} x {self.devices_per_node} {self.device!r}")

    @staticmethod
    def of(cluster: Any) -> ClusterInfo:
        """``device``: the device type's name, or a heterogeneous cluster's pools
        ("4x A100-SXM4-80GB + 4x H100-SXM5-80GB": nodes of each, ``Hardware.of``)."""
        hardware = cluster.hardware()
        return ClusterInfo(name=cluster.name, fingerprint=cluster.fingerprint(),
                           world_size=cluster.world_size, device=hardware.device,
                           num_nodes=cluster.num_nodes, devices_per_node=cluster.devices_per_node,
                           hardware=hardware)

    def planned_hardware(self) -> Hardware:
        """The hardware the plan was made for (of an older plan: device name and sizes only)."""
        return self.hardware or from_extras(device=self.device, num_nodes=self.num_nodes,
                                            devices_per_node=self.devices_per_node, extras=None)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "hardware"}
        if self.hardware is not None:
            d["hardware"] = self.hardware.extras()
        return d


@dataclass(frozen=True, kw_only=True)
class TrainingInfo:
    global_batch_size: int
    precision: str
    optimizer: str
    # MoE routing imbalance the plan was priced with (estimate()); written when not 1
    expert_capacity_factor: float = 1.0
    # the document lengths the plan was priced for (``--seq-lengths``, packed behind a
    # document mask: sharding/doc_work), as (length, count) bins; written when given
    seq_lengths: tuple[tuple[int, int], ...] = ()

    def length_histogram(self) -> Any:
        """``seq_lengths`` as a LengthHistogram (None where the plan has none): what the plan's
        prices are re-made with."""
        if not self.seq_lengths:
            return None
        return histogram_of(list(self.seq_lengths), source="the plan's seq_lengths")


@dataclass(frozen=True, kw_only=True)
class MeshInfo:
    axes: tuple[str, ...]               # outermost first, e.g. ("pp", "dp", "tp")
    shape: tuple[int, ...]              # sizes in the same order
    rank_to_device: tuple[str, ...]     # cluster device of each rank ("n3.gpu5"), index = rank
    tp_domain: str                      # what joins a TP group, one of TP_DOMAINS

    def __post_init__(self) -> None:
        for name in ("axes", "shape", "rank_to_device"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of ``rank`` (row-major over ``shape``, the last axis fastest)."""
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))


@dataclass(frozen=True, kw_only=True)
class ParamPlacement:
    """How one parameter lies on the mesh: its placement on the TP and on the DP axis (and, for
    an expert weight under expert parallelism, on the ep axis; written only then)."""

    tp: str                     # "R" or "S(d)"
    dp: str                     # "R", or "S(d)" when ZeRO-3 / FSDP shards it
    shape: tuple[int, ...]      # the full (unsharded) shape
    ep: str = "R"               # "S(0)": an expert weight split over the expert-parallel axis

    def __post_init__(self) -> None:
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))
        for name in ("tp", "dp", "ep"):           # canonical text; bad text is reported by Plan
            try:
                object.__setattr__(self, name, str(Placement.parse(getattr(self, name))))
            except AutoplanError:
                pass

    @property
    def tp_placement(self) -> Placement:
        return Placement.parse(self.tp)

    @property
    def dp_placement(self) -> Placement:
        return Placement.parse(self.dp)


@dataclass(frozen=True, kw_only=True)
class Alternative:
    config: ParallelConfig
    step_time_s: float
    peak_memory_bytes: float
    fits: bool
    why_lost: str               # one line: "12% slower: exposed TP all-reduce across nodes"

    def __post_init__(self) -> None:
        _round_fields(self, ("step_time_s", "peak_memory_bytes"))

    @staticmethod
    def of(estimate: Any, why_lost: str) -> Alternative:
        return Alternative(config=estimate.config, step_time_s=estimate.step_time_s,
                           peak_memory_bytes=estimate.peak_memory_bytes, fits=estimate.fits,
                           why_lost=why_lost)


@dataclass(frozen=True, kw_only=True)
class SolverReport:
    solver: str                 # "CBC"
    status: str                 # one of SOLVER_STATUSES
    objective_s: float          # the ILP objective: seconds per step (the step time
                                # where the configuration's own ILP chose, pp 1)
    bound_s: float | None       # best bound (== objective when optimal)
    gap: float | None           # relative gap (0.0 when optimal)
    num_variables: int
    num_constraints: int
    ilps_solved: int            # over the whole search
    candidates_evaluated: int
    # the largest relative gap of every ILP the search solved (0.0 where each was proven
    # optimal or infeasible; None: one stopped at its time limit with no bound to read);
    # written only where the search solved one
    worst_gap: float | None = None
    time_s: float = field(default=0.0, compare=False)   # wall time: never written, 0.0 loaded

    def __post_init__(self) -> None:
        _round_fields(self, ("objective_s", "bound_s", "gap", "worst_gap"))


@dataclass(frozen=True, kw_only=True)
class Plan:
    autoplan_version: str
    model: ModelInfo
    cluster: ClusterInfo
    training: TrainingInfo
    mesh: MeshInfo
    config: ParallelConfig
    param_placements: Mapping[str, ParamPlacement]   # parameter FQN -> placement
    op_strategies: Mapping[str, str]        # op name -> strategy ("colwise", "batch", ...)
    module_styles: Mapping[str, str]        # module FQN -> runtime style ("colwise", ...)
    recompute: Mapping[str, str]            # block instance path -> "none"|"selective"|"full"
    # {"optimizer": bool, "params": bool}, and "activations": [layer paths] when offloaded
    offload: Mapping[str, Any]
    predicted: Mapping[str, Any]            # the chosen Estimate, see predicted_from_estimate
    alternatives: tuple[Alternative, ...]
    solver: SolverReport
    stages: tuple[Mapping[str, Any], ...] = ()   # {"index", "layers", "chunks", "ranks"}
    schema_version: int = PLAN_SCHEMA_VERSION
    # op name -> the op's canonical key (OpGraph.op_keys, schema 7): how a process whose trace
    # named the ops otherwise finds them (planner/op_binding.py); empty: matched by name
    op_keys: Mapping[str, str] = field(default_factory=dict)
    # schema 8: the objectives search (planner/objectives.py): per device count its time, cost
    # and energy, the Pareto front, the winners; None: a plan of the step-time search alone
    objectives: Mapping[str, Any] | None = None
    # schema 9: a plan for a heterogeneous cluster's pools (planner/hetero_check.py): each
    # stage's or dp replica's pool, work and memory, and the cluster as its slowest GPU
    hetero: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name, typ in (("model", ModelInfo), ("cluster", ClusterInfo),
                          ("training", TrainingInfo), ("mesh", MeshInfo),
                          ("config", ParallelConfig), ("solver", SolverReport)):
            if not isinstance(getattr(self, name), typ):
                raise PlanError(f"Plan.{name} must be a {typ.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("param_placements", "op_strategies", "module_styles", "recompute",
                     "offload", "predicted", "op_keys"):
            if not isinstance(getattr(self, name), Mapping):
                raise PlanError(f"Plan.{name} must be a mapping, got "
                                f"{type(getattr(self, name)).__name__}")
        bad = [k for k, v in self.param_placements.items() if not isinstance(v, ParamPlacement)]
        if bad:
            raise PlanError(f"Plan.param_placements[{bad[0]!r}] must be a ParamPlacement")
        alts = tuple(self.alternatives)
        if not all(isinstance(a, Alternative) for a in alts):
            raise PlanError("Plan.alternatives must hold Alternative values")
        set_ = object.__setattr__
        set_(self, "alternatives", alts)
        for name in ("param_placements", "op_strategies", "module_styles", "recompute", "offload",
                     "op_keys"):
            set_(self, name, types.MappingProxyType(dict(getattr(self, name))))
        set_(self, "predicted", _freeze(self.predicted, "predicted"))
        set_(self, "stages", tuple(_freeze(s, f"stages[{i}]") for i, s in enumerate(self.stages)))
        for name in ("objectives", "hetero"):
            if getattr(self, name) is not None:
                set_(self, name, _freeze(getattr(self, name), name))
        try:
            d = self.to_dict()
        except (TypeError, AttributeError, ValueError) as e:
            raise PlanError(f"Plan holds a value of the wrong type: {e}") from None
        check_plan(d)

    def pool_of_rank(self, rank: int) -> Mapping[str, Any] | None:
        """The pool ``rank`` runs on (its ``hetero.pools`` entry, with ``index``), None where
        the plan is for one node type."""
        if self.hetero is None:
            return None
        for i, p in enumerate(self.hetero["pools"]):
            if p["first_rank"] <= rank < p["first_rank"] + p["num_ranks"]:
                return {"index": i, **p}
        raise PlanError(f"rank {rank} is past the plan's {self.cluster.world_size} ranks")

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.deepcopy (and multiprocessing) go through the canonical JSON text: the frozen
        # mappings inside are not copyable themselves, and the text is the contract anyway
        return (_plan_from_text, (self.to_json(), self.solver.time_s))

    # ---- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "autoplan_version": self.autoplan_version,
            "model": _fields_dict(self.model),
            "cluster": self.cluster.to_dict(),
            "training": {k: ([list(b) for b in v] if k == "seq_lengths" else v)
                         for k, v in _fields_dict(self.training).items()
                         if (k != "expert_capacity_factor" or v != 1.0)
                         and (k != "seq_lengths" or v)},
            "mesh": {"axes": list(self.mesh.axes), "shape": list(self.mesh.shape),
                     "rank_to_device": list(self.mesh.rank_to_device),
                     "tp_domain": self.mesh.tp_domain},
            "config": self.config.to_dict(),
            "param_placements": {k: {"tp": p.tp, "dp": p.dp, "shape": list(p.shape),
                                     **({"ep": p.ep} if p.ep != "R" else {})}
                                 for k, p in self.param_placements.items()},
            "op_strategies": dict(self.op_strategies),
            "module_styles": dict(self.module_styles),
            "recompute": dict(self.recompute),
            "offload": dict(self.offload),
            "predicted": _thaw(self.predicted),
            "alternatives": [{**_fields_dict(a), "config": a.config.to_dict()}
                             for a in self.alternatives],
            "solver": {k: v for k, v in _fields_dict(self.solver).items()
                       if k != "time_s" and (k != "worst_gap" or self.solver.ilps_solved)},
            "stages": [_thaw(s) for s in self.stages],
            **({"op_keys": dict(self.op_keys)} if self.op_keys else {}),
            **({"objectives": _thaw(self.objectives)} if self.objectives is not None else {}),
            **({"hetero": _thaw(self.hetero)} if self.hetero is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1, ensure_ascii=True,
                          allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the plan (atomically: a temporary file renamed over ``path``); returns the path."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="ascii", newline="\n") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except OSError as e:
            raise PlanError(f"cannot write plan file {path!r}: {e}; check the folder exists "
                            "and is writable") from None
        return path

    @staticmethod
    def from_dict(d: Any) -> Plan:
        """Validate a parsed plan (PlanError naming the JSON path of any problem) and build it."""
        try:
            check_plan(d)
        except PlanError as e:
            raise PlanError(f"{e} (plan files are written by autoplan: re-plan, or see the format "
                            "in autoplan/planner/plan.schema.json)") from None
        return Plan(
            schema_version=d["schema_version"], autoplan_version=d["autoplan_version"],
            model=ModelInfo(**d["model"]), cluster=ClusterInfo(**d["cluster"]),
            training=TrainingInfo(**{**d["training"], "seq_lengths": tuple(
                (int(n), int(c)) for n, c in d["training"].get("seq_lengths", ()))}),
            mesh=MeshInfo(axes=tuple(d["mesh"]["axes"]), shape=tuple(d["mesh"]["shape"]),
                          rank_to_device=tuple(d["mesh"]["rank_to_device"]),
                          tp_domain=d["mesh"]["tp_domain"]),
            config=ParallelConfig.from_dict(d["config"]),
            param_placements={k: ParamPlacement(tp=v["tp"], dp=v["dp"], shape=tuple(v["shape"]),
                                                 ep=v.get("ep", "R"))
                              for k, v in d["param_placements"].items()},
            op_strategies=d["op_strategies"], module_styles=d["module_styles"],
            recompute=d["recompute"], offload=d["offload"], predicted=d["predicted"],
            alternatives=tuple(Alternative(**{**a, "config": ParallelConfig.from_dict(a["config"])})
                               for a in d["alternatives"]),
            solver=SolverReport(**d["solver"]), stages=tuple(d["stages"]),
            op_keys=d.get("op_keys", {}), objectives=d.get("objectives"),
            hetero=d.get("hetero"))

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        return Plan.from_dict(parse_json(text))


def _plan_from_text(text: str, time_s: float) -> Plan:
    plan = Plan.from_json(text)
    object.__setattr__(plan.solver, "time_s", time_s)
    return plan


def predicted_from_estimate(estimate: Any) -> dict[str, Any]:
    """``Estimate.to_dict()`` minus the per-device memory list (derivable, 1,024+ entries)."""
    d = estimate.to_dict()
    d.pop("per_device_memory_bytes", None)
    for st in d["stages"]:
        st.pop("chunks", None)             # Plan.stages lists them
    return d


def plan_from_file(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file; PlanError (naming the file) on any problem."""
    path = os.fspath(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise PlanError(f"file is {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for "
                            "plan files; this is not a plan autoplan wrote")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        return Plan.from_json(data)
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path!r}; write one with autoplan.plan(...).save(path) "
                        "or `autoplan plan ... -o plan.json`") from None
    except PlanError as e:
        raise PlanError(f"plan file {path!r}: {e}") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {path!r}: {e}") from None


def plan_mismatch(plan: Plan, *, graph: Any = None, cluster: Any = None,
                  allow_cluster_mismatch: bool = False) -> str:
    """What differs between the plan and the given graph / cluster ("" when nothing that
    refuses it). The cluster is compared by its hardware (:func:`cluster_differences`); with
    ``allow_cluster_mismatch`` only a different world size refuses."""
    problems = []
    if graph is not None and model_fingerprint(plan, graph) != plan.model.fingerprint:
        problems.append(_model_mismatch(plan.model, ModelInfo.of(graph)))
    if cluster is not None:
        diffs = cluster_differences(plan, cluster)
        if any(d.refuses and (not allow_cluster_mismatch or d.what == "ranks")
               for d in diffs):
            problems.append(_cluster_mismatch(plan.cluster, cluster, diffs))
    return "; ".join(problems)


def model_fingerprint(plan: Plan, graph: Any) -> str:
    """``graph``'s fingerprint as ``plan`` records one: the canonical form from schema 6 on
    (without the views' aliasing, which follows the device's kernel layouts, or with it as
    autoplan 0.1 wrote it: ``OpGraph.aliasing_fingerprint``), the positional hash of the trace
    (``OpGraph.positional_fingerprint``) in older plans."""
    if plan.schema_version < 6:
        return graph.positional_fingerprint()
    if _aliasing_form(plan, graph):
        return graph.aliasing_fingerprint()
    return graph.fingerprint()


def plan_op_keys(plan: Plan, graph: Any) -> Any:
    """``graph``'s canonical op keys in the form ``plan`` recorded its own in."""
    return graph.op_keys(aliasing=_aliasing_form(plan, graph))


def _aliasing_form(plan: Plan, graph: Any) -> bool:
    return (plan.schema_version >= 6 and graph.fingerprint() != plan.model.fingerprint
            and graph.aliasing_fingerprint() == plan.model.fingerprint)


def cluster_differences(plan: Plan, cluster: Any) -> tuple[Difference, ...]:
    """How the hardware of ``cluster`` differs from what ``plan`` was made for (each says
    whether it refuses the plan or only makes its prediction stale; ``cluster/hardware.py``)."""
    return compare(plan.cluster.planned_hardware(), cluster.hardware())


def stale_prediction(plan: Plan, cluster: Any) -> str:
    """"" when ``plan``'s predicted step time and memory are for ``cluster``'s hardware, else
    one line saying for what hardware they are, and what differs here."""
    diffs = cluster_differences(plan, cluster)
    if not diffs:
        return ""
    return (f"the plan's prediction is for {plan.cluster.planned_hardware().summary()} "
            f"({plan.cluster.name!r}), not this {cluster.hardware().summary()} "
            f"({'; '.join(map(str, diffs))}): stale here")


def _describe_model(m: ModelInfo) -> str:
    return (f"{m.name!r} (fingerprint {m.fingerprint[:12]}\u2026, {m.num_params:,} "
            f"parameters, {m.num_ops:,} ops)")


def _model_mismatch(planned: ModelInfo, given: ModelInfo) -> str:
    msg = (f"plan is for model {_describe_model(planned)} but the given model is "
           f"{_describe_model(given)}")
    if (planned.num_params, planned.num_ops) == (given.num_params, given.num_ops):
        msg += (" (same sizes: the traced graphs differ, e.g. in batch size, sequence length, "
                "dtypes or loss_fn/targets: trace as when planning)")
    return msg


def _cluster_mismatch(planned: ClusterInfo, cluster: Any, diffs: tuple[Difference, ...]) -> str:
    """The refusal: both clusters' hardware, every difference, and the way on."""
    here = cluster.hardware()
    msg = (f"plan is for cluster {planned.name!r} ({planned.planned_hardware().summary()}) but "
           f"the given cluster {cluster.name!r} is {here.summary()}; what differs: "
           f"{'; '.join(map(str, diffs))}")
    if any(d.what == "ranks" for d in diffs):
        return (msg + f". The plan's mesh needs {planned.world_size} ranks: no flag runs it "
                f"on {here.world_size}")
    a = planned.hardware.device_memory_bytes if planned.hardware is not None else None
    b = here.device_memory_bytes
    fit = ", and with less device memory here it may not fit" if a and b and b < 0.98 * a else ""
    return (msg + ". To run it here anyway, pass --allow-cluster-mismatch to `autoplan run` "
            "(allow_cluster_mismatch=True to compile() or load_plan()): its predicted step "
            f"time and memory are then stale{fit}; if discovery got this machine wrong, give "
            "the cluster with --cluster PRESET:NODES or a cluster file")


# ---- freezing and rounding --------------------------------------------------------------------
def _round(x: float) -> float:
    return float(f"{x:.{SIG_DIGITS}g}") if math.isfinite(x) else x


def _round_fields(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, float):
            object.__setattr__(obj, name, _round(v))


def _freeze(v: Any, path: str) -> Any:
    """Deep-immutable copy with floats rounded: mappings -> MappingProxyType, lists -> tuples."""
    if isinstance(v, Mapping):
        return types.MappingProxyType({str(k): _freeze(x, sub(path, str(k)))
                                       for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x, f"{path}[{i}]") for i, x in enumerate(v))
    if isinstance(v, float):
        return _round(v)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    fail(path, f"{type(v).__name__} is not JSON data (use dicts, lists, str, int, float, bool)")


def _thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def _fields_dict(obj: Any) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v)
            for f in fields(obj)}
