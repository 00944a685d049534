"""Reading a plan file safely and checking every rule of its format (see ``planfile.py``).

The format is defined here once, as the key lists below and the checks of ``check_plan``; the
dataclasses of ``planfile.py`` and ``plan.schema.json`` mirror it (a test keeps them in step).
Every problem raises :class:`~autoplan.errors.PlanError` naming its JSON path (``mesh.shape``,
``param_placements["layers.0.attn.qkv.weight"].tp``), the value seen, and what to do.

Hostile input is refused without executing anything: the text is size-checked before parsing,
parsed by ``json.loads`` with hooks that reject duplicate keys, NaN/Infinity, overflowing and
over-long numbers, then depth- and string-length-checked iteratively.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from autoplan import safe_io
from autoplan.cluster.cluster import BACKENDS
from autoplan.cluster.hardware import EXTRA_KEYS as HARDWARE_KEYS
from autoplan.cluster.hardware import OPTIONAL_EXTRA_KEYS as HARDWARE_OPTIONAL_KEYS
from autoplan.cluster.specs import DEVICE_KINDS
from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.sharding.mesh_axes import BASE_AXES, DP_SPLITS, MeshAxis
from autoplan.sharding.parallel_config import RECOMPUTE, V_SCHEDULES, ParallelConfig
from autoplan.sharding.placement import Placement
from autoplan.sharding.seq_lengths import MAX_BINS, MAX_COUNT, MAX_LENGTH
from autoplan.planner.hetero_check import HETERO_SCHEMA, check_hetero
from autoplan.planner.objectives_check import check_objectives
from autoplan.planner.planfile_values import MAX_STRING_CHARS, fail, kind, sub
from autoplan.planner.planfile_values import a_bool as _bool, a_list as _list, a_map as _map
from autoplan.planner.planfile_values import a_num as _num, a_str as _str, an_int as _int
from autoplan.planner.planfile_values import clip as _clip, closed_keys as _keys

# 2: HSDP (config.dp_shard, mesh axes dp_replicate x dp_shard) and the V-shaped schedules
# (zbv, dualpipev). A version-1 plan has none of them and reads as it did.
# 3: expert parallelism (config.ep, mesh axes edp x ep); older plans read as they did.
# 4: ZeRO-3 with some weights kept whole (config.dp_whole); older plans read as they did.
# 5: context parallelism on an axis of its own (config.cp, mesh axis cp); older plans read as
# they did.
# 6: cluster.hardware, what a plan is matched to the cluster it runs on by (device kind and
# memory, backend, links, network: cluster/hardware.py); an older plan is matched by its
# device name, nodes and devices per node.
# 7: op_keys, each op's canonical key (OpGraph.op_keys): a process whose trace named the ops
# otherwise (another PYTHONHASHSEED) finds the plan's ops by it. An older plan, or one without
# the table, is matched by op name as before.
# 8: objectives, the device-count search's figures (time, cost, energy per count, the Pareto
# front, the winners: planner/objectives.py). Written only by plans that carry it; every other
# plan is still written as schema 7, byte for byte as before.
# 9: hetero, a plan for a heterogeneous cluster's pools (planner/hetero_check.py: which pool each
# stage or dp replica runs on, its work and memory, the cluster as its slowest GPU), with
# cluster.hardware.pools (each pool's nodes, device, links and NIC) it is matched by. Written
# only by such plans; every other plan reads and writes as before.
PLAN_SCHEMA_VERSION = 7           # what a plan is written as (without objectives)
OBJECTIVES_SCHEMA = 8
READABLE_PLAN_SCHEMAS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
MAX_FILE_BYTES = 256 << 20        # refuse larger files before reading them
MAX_DEPTH = 64                    # JSON nesting (a valid plan needs about 6)
MAX_NUMBER_CHARS = 40             # characters of one JSON number

SOLVER_STATUSES = ("optimal", "feasible", "infeasible", "not_solved")
TP_DOMAINS = ("nvswitch", "nvlink", "pcie", "node", "network", "none")

# The keys of each closed object, in the order the dataclasses declare them.
PLAN_KEYS = ("autoplan_version", "model", "cluster", "training", "mesh", "config",
             "param_placements", "op_strategies", "module_styles", "recompute", "offload",
             "predicted", "alternatives", "solver", "stages", "schema_version")
PLAN_OPTIONAL_KEYS = ("op_keys",          # schema 7: op name -> canonical key (the search's)
                      "objectives",       # schema 8: the objectives search (objectives_check)
                      "hetero")           # schema 9: a plan on pools (hetero_check)
MODEL_KEYS = ("name", "fingerprint", "num_params", "num_ops")
CLUSTER_KEYS = ("name", "fingerprint", "world_size", "device", "num_nodes", "devices_per_node")
CLUSTER_OPTIONAL_KEYS = ("hardware",)      # schema 6 writes it (HARDWARE_KEYS)
TRAINING_KEYS = ("global_batch_size", "precision", "optimizer")
TRAINING_OPTIONAL_KEYS = ("expert_capacity_factor",   # MoE plans priced with imbalance
                          "seq_lengths")              # plans priced for packed documents
MESH_KEYS = ("axes", "shape", "rank_to_device", "tp_domain")
PLACEMENT_KEYS = ("tp", "dp", "shape")
PLACEMENT_OPTIONAL_KEYS = ("ep",)         # schema 3: expert weights of expert-parallel plans
OFFLOAD_KEYS = ("optimizer", "params")
ALTERNATIVE_KEYS = ("config", "step_time_s", "peak_memory_bytes", "fits", "why_lost")
SOLVER_KEYS = ("solver", "status", "objective_s", "bound_s", "gap", "num_variables",
               "num_constraints", "ilps_solved", "candidates_evaluated")   # time_s: not written
SOLVER_OPTIONAL_KEYS = ("worst_gap",)     # where the search solved an ILP
STAGE_KEYS = ("index", "layers", "chunks", "ranks")

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")        # axis, strategy and style names
_HEX = re.compile(r"^[0-9a-f]{8,128}$")               # fingerprints
_OP_KEY = re.compile(r"^[0-9a-f]{20}(\.[1-9][0-9]{0,8})?$")   # canonical.canonical_op_keys
_DEVICE = re.compile(r"^n([0-9]{1,9})\.([A-Za-z0-9_\-]{1,128})$")   # "n3.gpu5"


PLAN_LIMITS = safe_io.Limits(max_bytes=MAX_FILE_BYTES, max_depth=MAX_DEPTH,
                             max_string_chars=MAX_STRING_CHARS,
                             max_number_chars=MAX_NUMBER_CHARS)


def parse_json(text: str | bytes) -> Any:
    """The plan's JSON through the hardened reader (``autoplan.safe_io``)."""
    text = safe_io.decode(text, what="plan file", error=PlanError, limits=PLAN_LIMITS)
    return safe_io.parse_json(text, what="plan file", error=PlanError, limits=PLAN_LIMITS)


# ================================================================ validation
def check_plan(d: Any) -> None:
    """Every rule of the format, on the JSON form; PlanError names the path of the first problem."""
    if not isinstance(d, Mapping):
        raise PlanError(f"a plan file holds one JSON object, got {kind(d)}")
    version = _check_schema_version(d.get("schema_version"))
    _keys({k: x for k, x in d.items() if k not in PLAN_OPTIONAL_KEYS}, "", PLAN_KEYS)
    _str(d["autoplan_version"], "autoplan_version", limit=64)
    _check_model(d["model"])
    c = d["cluster"]
    _check_cluster(c, version)
    t = d["training"]
    _check_training(t)
    config = _config(d["config"], "config")
    _check_schema_covers(version, config)
    _check_training_matches(t, config)
    _check_mesh(d["mesh"], config, c)
    _check_placements(d["param_placements"])
    _check_op_tables(d, version)
    _check_offload(d["offload"], config)
    _check_predicted(d, t)
    _check_alternatives(d["alternatives"])
    _check_solver(d["solver"])
    _check_stages(d["stages"], c["world_size"])
    if "objectives" in d:
        if version < OBJECTIVES_SCHEMA:
            fail("schema_version", f"{version}, but the plan uses what schema 8 added "
                 "(objectives): set schema_version 8")
        check_objectives(d["objectives"], c["world_size"])
    if "hetero" in d or "pools" in (c.get("hardware") or {}):
        if version < HETERO_SCHEMA:
            fail("schema_version", f"{version}, but the plan uses what schema 9 added (hetero, "
                 "cluster.hardware.pools): set schema_version 9")
        if ("hetero" in d) != ("pools" in (c.get("hardware") or {})):
            fail("hetero", "a plan for pools has both the hetero section and "
                 "cluster.hardware.pools, any other plan neither")
        check_hetero(d["hetero"], c["world_size"], config, _config)


def _check_schema_version(version: Any) -> int:
    """A schema this autoplan reads (a newer one: upgrade)."""
    if isinstance(version, int) and not isinstance(version, bool) \
            and version > max(READABLE_PLAN_SCHEMAS):
        raise PlanError(f"schema_version {version}: this plan was written by a newer autoplan "
                        f"than this one, which reads plan schemas "
                        f"{', '.join(map(str, READABLE_PLAN_SCHEMAS))}; upgrade autoplan or "
                        "re-plan with this version")
    if version not in READABLE_PLAN_SCHEMAS or isinstance(version, bool):
        raise PlanError(f"schema_version {_clip(version)!r}: this autoplan reads plan schemas "
                        f"{', '.join(map(str, READABLE_PLAN_SCHEMAS))}"
                        + ("" if isinstance(version, int) else
                           " (missing or not an integer: is this a plan file?)") +
                        "; re-plan with this autoplan version")
    return version


def _check_model(m: Any) -> None:
    m = _keys(m, "model", MODEL_KEYS)
    _str(m["name"], "model.name", limit=1000)
    _str(m["fingerprint"], "model.fingerprint", pattern=_HEX)
    _int(m["num_params"], "model.num_params")
    _int(m["num_ops"], "model.num_ops")


def _check_cluster(c: Any, version: int) -> None:
    _keys({k: x for k, x in c.items() if k not in CLUSTER_OPTIONAL_KEYS}
          if isinstance(c, Mapping) else c, "cluster", CLUSTER_KEYS)
    if "hardware" in c or version >= 6:
        _check_hardware(c.get("hardware", _MISSING))
    _str(c["name"], "cluster.name", limit=1000)
    _str(c["fingerprint"], "cluster.fingerprint", pattern=_HEX)
    _str(c["device"], "cluster.device", limit=1000)
    for k in ("world_size", "num_nodes", "devices_per_node"):
        _int(c[k], f"cluster.{k}", lo=1)
    if c["world_size"] != c["num_nodes"] * c["devices_per_node"]:
        fail("cluster.world_size", f"{c['world_size']} != num_nodes {c['num_nodes']} x "
              f"devices_per_node {c['devices_per_node']}")


def _check_seq_lengths(bins: Any) -> None:
    """``training.seq_lengths``: 1 to MAX_BINS [length, count] pairs, lengths distinct and
    increasing, some document counted."""
    path = "training.seq_lengths"
    rows = _list(bins, path)
    if not 1 <= len(rows) <= MAX_BINS:
        fail(path, f"{len(rows)} bins; a plan records 1 to {MAX_BINS}")
    last = 0
    for k, row in enumerate(rows):
        pair = _list(row, f"{path}[{k}]")
        if len(pair) != 2:
            fail(f"{path}[{k}]", f"expected [length, count], got {len(pair)} values")
        n = _int(pair[0], f"{path}[{k}][0]", lo=last + 1)
        if n > MAX_LENGTH:
            fail(f"{path}[{k}][0]", f"{n} tokens is over {MAX_LENGTH}")
        if _int(pair[1], f"{path}[{k}][1]") > MAX_COUNT:
            fail(f"{path}[{k}][1]", f"over {MAX_COUNT} documents")
        last = n
    if not any(row[1] for row in rows):
        fail(path, "every count is 0")


def _check_training(t: Any) -> None:
    _keys({k: x for k, x in t.items() if k not in TRAINING_OPTIONAL_KEYS}
          if isinstance(t, Mapping) else t, "training", TRAINING_KEYS)
    if "expert_capacity_factor" in t and not (
            _num(t["expert_capacity_factor"], "training.expert_capacity_factor") >= 1.0):
        fail("training.expert_capacity_factor", f"{t['expert_capacity_factor']!r}: a capacity "
             "factor is >= 1 (1: balanced routing)")
    if "seq_lengths" in t:
        _check_seq_lengths(t["seq_lengths"])
    _int(t["global_batch_size"], "training.global_batch_size", lo=1)
    _str(t["precision"], "training.precision", limit=64)
    _str(t["optimizer"], "training.optimizer", limit=64)


def _check_schema_covers(version: int, config: ParallelConfig) -> None:
    """The plan's schema version is at least the one that added each feature it uses."""
    if version == 1 and (config.dp_shard is not None or config.schedule in V_SCHEDULES):
        fail("schema_version", "1, but the plan uses what schema 2 added (config.dp_shard or "
             f"schedule {config.schedule!r}): set schema_version 2")
    if version < 3 and config.ep > 1:
        fail("schema_version", f"{version}, but the plan uses what schema 3 added (config.ep): "
             "set schema_version 3")
    if version < 4 and config.dp_whole:
        fail("schema_version", f"{version}, but the plan uses what schema 4 added "
             "(config.dp_whole): set schema_version 4")
    if version < 5 and config.cp > 1:
        fail("schema_version", f"{version}, but the plan uses what schema 5 added "
             "(config.cp): set schema_version 5")


def _check_training_matches(t: Mapping, config: ParallelConfig) -> None:
    """``training`` agrees with ``config``, whose micro-batches split its global batch."""
    for k in ("precision", "optimizer"):
        if t[k] != getattr(config, k):
            fail(f"training.{k}", f"{t[k]!r} but config.{k} is {getattr(config, k)!r}")
    try:
        config.microbatches(t["global_batch_size"])
    except ConfigError as e:
        fail("config", f"{e} (training.global_batch_size {t['global_batch_size']})")


def _check_op_tables(d: Mapping, version: int) -> None:
    """Per-op strategies, module styles, op keys and recompute policies: names only."""
    for section in ("op_strategies", "module_styles"):
        for k, v in _map(d[section], section).items():
            _str(v, sub(section, k), pattern=_NAME)
    if "op_keys" in d:
        _check_op_keys(d["op_keys"], d["op_strategies"], version)
    for k, v in _map(d["recompute"], "recompute").items():
        _str(v, sub("recompute", k), choices=RECOMPUTE)


def _check_offload(off: Any, config: ParallelConfig) -> None:
    acts = isinstance(off, Mapping) and "activations" in off
    off = _keys(off, "offload", OFFLOAD_KEYS + (("activations",) if acts else ()))
    for k in OFFLOAD_KEYS:
        _bool(off[k], f"offload.{k}")
    if acts != config.offloads_activations:
        fail("offload.activations", f"{'present' if acts else 'absent'} but "
             f"config.offload_activations is {config.offload_activations} and "
             f"config.layer_offload {config.layer_offload}")
    for j, x in enumerate(_list(off["activations"], "offload.activations") if acts else ()):
        _str(x, f"offload.activations[{j}]", limit=1000)
    if off["optimizer"] != config.offload_optimizer:
        fail("offload.optimizer", f"{off['optimizer']} but config.offload_optimizer is "
              f"{config.offload_optimizer}")
    if off["params"] != config.offload_params:
        fail("offload.params", f"{off['params']} but config.offload_params is "
              f"{config.offload_params}")


def _check_predicted(d: Mapping, t: Mapping) -> None:
    """The prediction is of the chosen configuration and global batch."""
    p = d["predicted"]
    _check_spec(p, _PREDICTED, "predicted")
    for i, row in enumerate(p.get("layer_recompute", ())):
        _str(row["policy"], f"predicted.layer_recompute[{i}].policy", choices=RECOMPUTE)
    if p["config"] != d["config"]:
        fail("predicted.config", "differs from config: the prediction must be of the chosen "
              "configuration")
    if p["global_batch_size"] != t["global_batch_size"]:
        fail("predicted.global_batch_size", f"{p['global_batch_size']} but "
              f"training.global_batch_size is {t['global_batch_size']}")


def _check_alternatives(alternatives: Any) -> None:
    for i, a in enumerate(_list(alternatives, "alternatives")):
        path = f"alternatives[{i}]"
        _keys(a, path, ALTERNATIVE_KEYS)
        _config(a["config"], f"{path}.config")
        _num(a["step_time_s"], f"{path}.step_time_s")
        _num(a["peak_memory_bytes"], f"{path}.peak_memory_bytes")
        _bool(a["fits"], f"{path}.fits")
        _str(a["why_lost"], f"{path}.why_lost", limit=1000, one_line=True)


def _check_solver(s: Any) -> None:
    optional = tuple(k for k in SOLVER_OPTIONAL_KEYS if isinstance(s, dict) and k in s)
    s = _keys(s, "solver", SOLVER_KEYS + optional)
    if optional:
        _num(s["worst_gap"], "solver.worst_gap", none_ok=True)
    _str(s["solver"], "solver.solver", limit=64)
    _str(s["status"], "solver.status", choices=SOLVER_STATUSES)
    _num(s["objective_s"], "solver.objective_s")
    _num(s["bound_s"], "solver.bound_s", none_ok=True)
    _num(s["gap"], "solver.gap", none_ok=True)
    for k in ("num_variables", "num_constraints", "ilps_solved", "candidates_evaluated"):
        _int(s[k], f"solver.{k}")


_MISSING = object()


def _check_hardware(h: Any) -> None:
    """``cluster.hardware``: each field may be null (not known where the plan was made)."""
    if h is _MISSING:
        fail("cluster", "missing key(s) cluster.hardware (schema 6 plans record the hardware "
             "they were made for)")
    _keys(h, "cluster.hardware", HARDWARE_KEYS
          + tuple(k for k in HARDWARE_OPTIONAL_KEYS if isinstance(h, Mapping) and k in h))
    if isinstance(h, Mapping) and "pools" in h:
        for i, x in enumerate(_list(h["pools"], "cluster.hardware.pools")):
            _str(x, f"cluster.hardware.pools[{i}]", limit=1000, one_line=True)
    for k, choices in (("device_kind", DEVICE_KINDS), ("backend", BACKENDS)):
        if h[k] is not None:
            _str(h[k], f"cluster.hardware.{k}", choices=choices)
    if h["device_memory_bytes"] is not None:
        _int(h["device_memory_bytes"], "cluster.hardware.device_memory_bytes", lo=1)
    if h["node_links"] is not None:
        for i, x in enumerate(_list(h["node_links"], "cluster.hardware.node_links")):
            _str(x, f"cluster.hardware.node_links[{i}]", limit=200, one_line=True)
    if h["fabric"] is not None:
        _str(h["fabric"], "cluster.hardware.fabric", limit=200, one_line=True)


def _check_op_keys(keys: Any, strategies: Mapping[str, Any], version: int) -> None:
    """``op_keys``: one distinct canonical key for each op of ``op_strategies``."""
    if version < 7:
        fail("schema_version", f"{version}, but the plan uses what schema 7 added (op_keys): "
             "set schema_version 7")
    owner: dict[str, str] = {}
    for name, key in _map(keys, "op_keys").items():
        _str(key, sub("op_keys", name), pattern=_OP_KEY)
        if key in owner:
            fail(sub("op_keys", name), f"{key!r} is also the key of op {_clip(owner[key])!r}: "
                 "each op has its own key")
        owner[key] = name
    if set(keys) != set(strategies):
        odd = sorted(set(keys) ^ set(strategies))[0]
        fail("op_keys", (f"names op {_clip(odd)!r}, which op_strategies does not" if odd in keys
                         else f"has no key for op {_clip(odd)!r} of op_strategies") +
             ": the two name the same ops (re-plan rather than edit them)")


def _check_mesh(mesh: Any, config: ParallelConfig, cluster: Mapping[str, Any]) -> None:
    m = _keys(mesh, "mesh", MESH_KEYS)
    axes = [_str(a, f"mesh.axes[{i}]", pattern=_NAME) for i, a in enumerate(_list(m["axes"],
                                                                                   "mesh.axes"))]
    shape = [_int(n, f"mesh.shape[{i}]", lo=1) for i, n in enumerate(_list(m["shape"],
                                                                            "mesh.shape"))]
    if len(axes) != len(shape) or not axes or len(set(axes)) != len(axes):
        fail("mesh.axes", f"{axes} must be distinct, non-empty and match mesh.shape {shape}")
    devices = _list(m["rank_to_device"], "mesh.rank_to_device")
    world = math.prod(shape)
    if not world == len(devices) == cluster["world_size"] == config.world_size:
        fail("mesh.shape", f"{shape} holds {world} ranks, but mesh.rank_to_device lists "
              f"{len(devices)}, cluster.world_size is {cluster['world_size']} and config "
              f"dp x cp x tp x pp is {config.world_size}; they must all be equal")
    hsdp = set(DP_SPLITS[MeshAxis.DP_SHARD])
    if (config.dp_shard is not None) != hsdp.issubset(axes) or (
            config.dp_shard is None and hsdp & set(axes)):
        fail("mesh.axes", f"{axes}: an HSDP plan (config.dp_shard) has axes dp_replicate and "
              f"dp_shard in place of dp, any other plan neither; expected "
              f"{list(config.mesh_axes())}")
    experts = set(DP_SPLITS[MeshAxis.EP])
    if (config.ep > 1) != experts.issubset(axes) or (config.ep == 1 and experts & set(axes)):
        fail("mesh.axes", f"{axes}: an expert-parallel plan (config.ep > 1) has axes edp and "
              f"ep in place of dp, any other plan neither; expected {list(config.mesh_axes())}")
    if (config.cp > 1) != (MeshAxis.CP in axes):
        fail("mesh.axes", f"{axes}: a context-parallel plan (config.cp > 1) has an axis cp "
              f"between the dp axes and tp, any other plan none; expected "
              f"{list(config.mesh_axes())}")
    want_sizes = {**{a.value: config.dims.degree(a) for a in BASE_AXES},
                  **dict(zip(config.mesh_axes(), config.mesh_shape()))}
    for axis, size in zip(axes, shape):
        want = want_sizes.get(axis)
        if want is not None and size != want:
            fail("mesh.shape", f"axis {axis!r} has size {size} but the config makes it {want}")
    for i, dev in enumerate(devices):
        match = _DEVICE.match(_str(dev, f"mesh.rank_to_device[{i}]", limit=160))
        if match is None or int(match.group(1)) >= cluster["num_nodes"]:
            fail(f"mesh.rank_to_device[{i}]", f"{dev!r} is not a device of the cluster; write "
                  f"'n<node>.<device>' with node < {cluster['num_nodes']}, e.g. 'n0.gpu0'")
    if len(set(devices)) != len(devices):
        dup = next(x for x in devices if devices.count(x) > 1)
        fail("mesh.rank_to_device", f"device {dup!r} is given to more than one rank")
    _str(m["tp_domain"], "mesh.tp_domain", choices=TP_DOMAINS)
    if (m["tp_domain"] == "none") != (config.tp == 1):
        fail("mesh.tp_domain", f"{m['tp_domain']!r} with config.tp {config.tp}: 'none' is for "
              "tp == 1 exactly")


def _check_placements(placements: Any) -> None:
    for fqn, v in _map(placements, "param_placements").items():
        path = sub("param_placements", fqn)
        _keys({k: x for k, x in v.items() if k not in PLACEMENT_OPTIONAL_KEYS}
              if isinstance(v, Mapping) else v, path, PLACEMENT_KEYS)
        shape = [_int(n, f"{path}.shape[{i}]") for i, n in enumerate(_list(v["shape"],
                                                                            f"{path}.shape"))]
        for axis in ("tp", "dp") + tuple(k for k in PLACEMENT_OPTIONAL_KEYS if k in v):
            try:
                pl = Placement.parse(v[axis])
            except AutoplanError as e:
                fail(f"{path}.{axis}", str(e))
            if pl.kind == "P":
                fail(f"{path}.{axis}", "a parameter cannot be partial (P); use R or S(d)")
            if pl.is_shard and pl.dim >= len(shape):
                fail(f"{path}.{axis}", f"{pl} shards dim {pl.dim} but the parameter has shape "
                      f"{shape} ({len(shape)} dims)")


def _check_stages(stages: Any, world: int) -> None:
    for i, st in enumerate(_list(stages, "stages")):
        path = f"stages[{i}]"
        _keys(st, path, STAGE_KEYS)
        if _int(st["index"], f"{path}.index") != i:
            fail(f"{path}.index", f"{st['index']} but stages must be listed in order from 0")
        for j, x in enumerate(_list(st["layers"], f"{path}.layers")):
            _str(x, f"{path}.layers[{j}]", limit=1000)
        flat = []
        for j, chunk in enumerate(_list(st["chunks"], f"{path}.chunks")):
            for k, x in enumerate(_list(chunk, f"{path}.chunks[{j}]")):
                flat.append(_str(x, f"{path}.chunks[{j}][{k}]", limit=1000))
        if flat != list(st["layers"]):
            fail(f"{path}.chunks", "the chunks' layers, in order, must be the stage's layers")
        ranks = [_int(r, f"{path}.ranks[{j}]") for j, r in enumerate(_list(st["ranks"],
                                                                            f"{path}.ranks"))]
        if any(r >= world for r in ranks) or len(set(ranks)) != len(ranks):
            fail(f"{path}.ranks", f"ranks must be distinct and below the world size {world}")


# The chosen configuration's Estimate.to_dict() (result.py) without per_device_memory_bytes.
# "f": finite float >= 0, "f?": or null, "i": int >= 0, "s": string, "b": bool, "c": config.
_MEMORY = {k: "f" for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                            "transient_bytes", "margin_bytes", "offloaded_bytes")}
_MEMORY["nvme_bytes"] = "f"          # only where the plan offloads to NVMe (_OPTIONAL)
_STAGE = {"index": "i", "layers": ["s"], "num_ops": "i", "params_per_device": "f", "fwd_s": "f",
          "bwd_s": "f", "activation_bytes_per_microbatch": "f", "microbatches_in_flight": "f",
          "memory": _MEMORY, "offloaded_activation_bytes_per_microbatch": "f"}
_TIME = {"compute_s": "f", "recompute_s": "f", "comm_exposed_s": ("map", "f"), "bubble_s": "f",
         "optimizer_s": "f", "overhead_s": "f"}
_LAYER_COST = {"layer": "s", "policy": "s", "kept_bytes": "f", "saved_bytes": "n",
               "recompute_s": "f", "offloaded_bytes": "f", "offload_s": "f"}
_PREDICTED = {"config": "c", "global_batch_size": "i", "num_microbatches": "i",
              "step_time_s": "f", "time": _TIME, "peak_memory_bytes": "f",
              "device_memory_bytes": "f", "stages": [_STAGE], "model_flops_per_step": "f",
              "mfu": "f", "samples_per_s": "f", "tokens_per_s": "f?",
              "activation_bytes_per_layer": "f", "warnings": ["s"], "fits": "b",
              "host_memory_per_device_bytes": "f", "nvme_per_device_bytes": "f",
              "fp8_linears": [{"linear": "s", "m": "f", "n": "f", "k": "f", "bf16_s": "f",
                               "fp8_s": "f", "pays": "b"}],
              "layer_recompute": [_LAYER_COST]}
# keys an Estimate writes only when not zero or empty (older plans have none; fp8_linears:
# fp8 plans only; layer_recompute: per-layer recomputation or offload only; offloaded_bytes,
# offload_s: per-layer offload only)
_OPTIONAL = frozenset({"nvme_bytes", "nvme_per_device_bytes", "fp8_linears",
                       "offloaded_activation_bytes_per_microbatch", "layer_recompute",
                       "offloaded_bytes", "offload_s"})


def _check_spec(v: Any, spec: Any, path: str) -> None:
    if isinstance(spec, dict):
        _keys(v, path, [k for k in spec if k not in _OPTIONAL or k in _map(v, path)])
        for k, item in spec.items():
            if k in v:
                _check_spec(v[k], item, sub(path, k))
    elif isinstance(spec, list):
        for i, x in enumerate(_list(v, path)):
            _check_spec(x, spec[0], f"{path}[{i}]")
    elif isinstance(spec, tuple):                  # ("map", value spec): free keys
        for k, x in _map(v, path).items():
            _check_spec(x, spec[1], sub(path, k))
    elif spec in ("f", "f?"):
        _num(v, path, none_ok=spec == "f?")
    elif spec == "n":                              # a finite float of either sign
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v \
                or v in (float("inf"), float("-inf")):
            fail(path, f"expected a finite number, got {kind(v)}")
    elif spec == "i":
        _int(v, path)
    elif spec == "s":
        _str(v, path)
    elif spec == "b":
        _bool(v, path)
    else:
        _config(v, path)


_NULLABLE = ("num_microbatches", "chunk_layers", "stage_recompute", "layer_recompute",
             "layer_offload", "dp_shares")
_LISTS = {"chunk_layers": int, "stage_recompute": str, "dp_whole": str, "fp8_skip": str,
          "layer_recompute": str, "layer_offload": bool, "dp_shares": int}
_ITEM_NAMES = {int: "integers", str: "strings", bool: "true/false values"}


def _config(v: Any, path: str) -> ParallelConfig:
    d = dict(_map(v, path))
    for f in fields(ParallelConfig):          # JSON types first: true is not a ZeRO stage
        if f.name not in d:
            continue
        if f.name in _NULLABLE and d[f.name] is None:
            continue
        if f.name in _LISTS:
            item = _LISTS[f.name]
            if not isinstance(d[f.name], (list, tuple)) or any(
                    isinstance(x, bool) != (item is bool) or not isinstance(x, item)
                    for x in d[f.name]):
                fail(sub(path, f.name), f"expected null or an array of "
                     f"{_ITEM_NAMES[item]}, got {kind(d[f.name])}")
            continue
        typ = type(f.default) if f.default is not None else int
        if isinstance(d[f.name], bool) != (typ is bool) or not isinstance(d[f.name], typ):
            want = {bool: "true or false", int: "an integer", str: "a string"}[typ]
            fail(sub(path, f.name), f"expected {want}, got {kind(d[f.name])}")
    try:
        return ParallelConfig.from_dict(d)
    except (ConfigError, TypeError) as e:
        fail(path, f"not a valid ParallelConfig: {e}")
    raise AssertionError("unreachable")
