"""The plan file: round trip, canonical text, schema, refusal of malformed files, load_plan's
model/cluster checks, and the inspect/diff text and commands."""

import copy
import dataclasses
import json
import re
from importlib import resources

import pytest

import autoplan
from autoplan import ParallelConfig, estimate
from autoplan.cli.main import main
from autoplan.cluster import Cluster
from autoplan.errors import PlanError
from autoplan.estimate.result import (
    Estimate,
    MemoryBreakdown,
    StageEstimate,
    TimeBreakdown,
)
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner import planfile_check as check
from autoplan.planner.explain import explain_plan
from autoplan.planner.text_format import fmt_ranges
from autoplan.planner.plan_diff import diff_plans
from autoplan.planner import loading
from autoplan.planner.loading import load_plan
from autoplan.planner.planfile import (
    PLAN_SCHEMA_VERSION,
    Alternative,
    ClusterInfo,
    MeshInfo,
    ModelInfo,
    ParamPlacement,
    Plan,
    SolverReport,
    TrainingInfo,
    plan_from_file,
    predicted_from_estimate,
)

GBS = 32


@pytest.fixture(scope="module")
def tiny():
    ex = build_example("gpt-tiny", device="meta", batch_size=1)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    return ex, graph


@pytest.fixture(scope="module")
def a100_x2():
    return Cluster.preset("dgx-a100-80gb", nodes=2)


def make_plan(graph, cluster, config, *, alternatives=(), recompute="none", styles=True):
    """A small, consistent plan as the search would fill it (16 ranks, mesh dp x tp)."""
    est = estimate(graph, cluster, config=config, global_batch_size=GBS, profile=None)
    layers = [inst.path for b in graph.blocks for inst in b.instances]
    module_styles = {}
    if styles and config.tp > 1:
        for layer in layers:
            module_styles.update({f"{layer}.attn.qkv": "colwise", f"{layer}.attn.proj": "rowwise",
                                  f"{layer}.mlp.fc": "colwise", f"{layer}.mlp.proj": "rowwise"})
        module_styles["tok_embeddings"] = "vocab_parallel"
    tp = "S(0)" if config.tp > 1 else "R"
    dp = "S(0)" if config.zero_stage == 3 else "R"
    alts = tuple(Alternative.of(estimate(graph, cluster, config=c, global_batch_size=GBS,
                                         profile=None), why) for c, why in alternatives)
    return Plan(
        autoplan_version=autoplan.__version__,
        model=ModelInfo.of(graph, name="gpt-tiny"), cluster=ClusterInfo.of(cluster),
        training=TrainingInfo(global_batch_size=GBS, precision=config.precision,
                              optimizer=config.optimizer),
        mesh=MeshInfo(axes=("pp", "dp", "tp")[config.pp == 1:],
                      shape=(config.pp, config.dp, config.tp)[config.pp == 1:],
                      rank_to_device=cluster.device_names,
                      tp_domain="nvswitch" if config.tp > 1 else "none"),
        config=config,
        param_placements={"layers.0.attn.qkv.weight": ParamPlacement(tp=tp, dp=dp, shape=(192, 64)),
                          "tok_embeddings.weight": ParamPlacement(tp=tp, dp=dp, shape=(256, 64))},
        op_strategies={"linear": "colwise", "linear_1": "rowwise", "embedding": "vocab"},
        module_styles=module_styles, recompute={layer: recompute for layer in layers},
        offload={"optimizer": config.offload_optimizer, "params": False},
        predicted=predicted_from_estimate(est), alternatives=alts,
        solver=SolverReport(solver="CBC", status="optimal", objective_s=0.000123456789,
                            bound_s=0.000123456789, gap=0.0, num_variables=120,
                            num_constraints=300, ilps_solved=6, candidates_evaluated=14,
                            time_s=1.25),
        stages=tuple({"index": st.index, "layers": list(st.layers),
                      "chunks": [list(c) for c in st.chunks],
                      "ranks": list(range(st.index * config.dp * config.tp,
                                          (st.index + 1) * config.dp * config.tp))}
                     for st in est.stages) if config.pp > 1 else ())


@pytest.fixture(scope="module")
def plan(tiny, a100_x2):
    return make_plan(tiny[1], a100_x2, ParallelConfig(dp=4, tp=4),
                     alternatives=[(ParallelConfig(dp=16), "3% slower: DP all-reduce across nodes"),
                                   (ParallelConfig(dp=8, tp=2), "9% slower: smaller TP, more DP sync")])


@pytest.fixture(scope="module")
def searched(tiny, a100_x2):
    """A plan the search made: one that fits its model (load_plan checks that too)."""
    return autoplan.plan(tiny[1], a100_x2, global_batch_size=GBS, precision="bf16", profile=None,
                         force={"tp": 4}, max_pp=1)


@pytest.fixture()
def plan_dict(plan):
    return json.loads(plan.to_json())


# ================================================================ round trip, canonical text
def test_a_version_1_plan_still_loads_and_reads_back_byte_for_byte(plan_dict):
    """Schema 2 added HSDP and the V schedules; a plan written before has neither and loads."""
    plan_dict["schema_version"] = 1
    text = json.dumps(plan_dict, sort_keys=True, indent=1)
    old = Plan.from_json(text)
    assert old.schema_version == 1 and old.config == Plan.from_json(
        json.dumps({**plan_dict, "schema_version": 2})).config
    assert json.loads(old.to_json()) == plan_dict


def test_round_trip_and_identical_text(plan, tmp_path):
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan and again.to_json() == text
    path = plan.save(tmp_path / "plan.json")
    loaded = plan_from_file(path)
    assert loaded == plan
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    assert text.endswith("\n") and text.isascii()
    assert loaded.solver.time_s == 0.0 and plan.solver.time_s == 1.25   # never written
    assert "time_s" not in json.loads(text)["solver"]
    assert "per_device_memory_bytes" not in json.loads(text)["predicted"]


def test_deepcopy_goes_through_the_json(plan):
    twin = copy.deepcopy(plan)
    assert twin == plan and twin is not plan and twin.solver.time_s == plan.solver.time_s


def test_same_inputs_give_byte_identical_files(tiny, a100_x2, plan):
    twin = make_plan(tiny[1], a100_x2, ParallelConfig(dp=4, tp=4),
                     alternatives=[(ParallelConfig(dp=16), "3% slower: DP all-reduce across nodes"),
                                   (ParallelConfig(dp=8, tp=2), "9% slower: smaller TP, more DP sync")])
    assert twin.to_json() == plan.to_json()


def test_floats_are_rounded_to_six_significant_digits(plan):
    assert plan.solver.objective_s == 0.000123457
    d = json.loads(plan.to_json())
    for value in (d["predicted"]["step_time_s"], d["predicted"]["mfu"],
                  d["alternatives"][0]["step_time_s"]):
        assert float(f"{value:.6g}") == value
    assert isinstance(plan.predicted["stages"], tuple)       # frozen
    with pytest.raises(TypeError):
        plan.predicted["mfu"] = 1.0


def test_placement_text_is_normalized():
    assert ParamPlacement(tp=" S(1) ", dp="R", shape=[4, 4]) == ParamPlacement(tp="S(1)", dp="R",
                                                                              shape=(4, 4))
    assert ParamPlacement(tp="S(1)", dp="R", shape=(4, 4)).tp_placement.dim == 1


def test_mesh_coordinates():
    mesh = MeshInfo(axes=("pp", "dp", "tp"), shape=(2, 3, 4), rank_to_device=(), tp_domain="node")
    assert mesh.coordinates(0) == (0, 0, 0)
    assert mesh.coordinates(5) == (0, 1, 1)
    assert mesh.coordinates(23) == (1, 2, 3)


# ================================================================ the schema
def _schema():
    return json.loads((resources.files("autoplan.planner") / "plan.schema.json").read_text())


def test_written_plans_validate_against_the_shipped_schema(plan, plan_dict, searched):
    jsonschema = pytest.importorskip("jsonschema")
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(plan_dict)
    found = json.loads(searched.to_json())          # the search's plan: with its op keys
    assert set(found["op_keys"]) == set(found["op_strategies"])
    jsonschema.Draft202012Validator(schema).validate(found)
    plan_dict["mesh"]["colour"] = "red"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(plan_dict)


def names(cls):
    return tuple(f.name for f in dataclasses.fields(cls))


def test_format_keys_match_the_dataclasses_and_the_schema():
    schema = _schema()
    assert names(Plan) == check.PLAN_KEYS + check.PLAN_OPTIONAL_KEYS
    assert set(schema["properties"]) == set(check.PLAN_KEYS + check.PLAN_OPTIONAL_KEYS)
    assert set(schema["required"]) == set(check.PLAN_KEYS)
    for cls, keys, prop in ((ModelInfo, check.MODEL_KEYS, "model"),
                            (ClusterInfo, check.CLUSTER_KEYS + check.CLUSTER_OPTIONAL_KEYS,
                             "cluster"),
                            (TrainingInfo, check.TRAINING_KEYS + check.TRAINING_OPTIONAL_KEYS,
                             "training"),
                            (MeshInfo, check.MESH_KEYS, "mesh"),
                            (SolverReport, check.SOLVER_KEYS + check.SOLVER_OPTIONAL_KEYS
                             + ("time_s",), "solver")):
        assert names(cls) == keys
        assert set(schema["properties"][prop]["properties"]) == set(keys) - {"time_s"}
    assert names(Alternative) == check.ALTERNATIVE_KEYS
    assert names(ParamPlacement) == check.PLACEMENT_KEYS + check.PLACEMENT_OPTIONAL_KEYS
    assert set(schema["$defs"]["parallel_config"]["properties"]) == set(names(ParallelConfig))
    # predicted = Estimate.to_dict() without the per-device list: keep the spec in step
    assert set(check._PREDICTED) == (set(names(Estimate)) | {"fits"}) - {"per_device_memory_bytes"}
    assert set(check._TIME) == set(names(TimeBreakdown))
    assert set(check._STAGE) == set(names(StageEstimate)) - {"chunks"}   # in Plan.stages
    assert set(check._MEMORY) == set(names(MemoryBreakdown))
    assert set(schema["properties"]["predicted"]["properties"]) == set(check._PREDICTED)


# ================================================================ malformed files
def _set(path, value):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value
    return mutate


def _delete(path):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        del d[last]
    return mutate


QKV = "layers.0.attn.qkv.weight"
_KEY = "ab" * 9 + "0"          # 19 of an op key's 20 hex characters


def _op_keys(**changed):
    """op_keys for the test plan's three ops, some ``changed``."""
    return {"linear": _KEY + "0", "linear_1": _KEY + "1", "embedding": _KEY + "2", **changed}


MALFORMED = [
    ("newer version", _set(["schema_version"], 10), "written by a newer autoplan"),
    ("unknown version", _set(["schema_version"], 0), "reads plan schemas 1, 2, 3, 4, 5, 6, 7"),
    ("no version", _delete(["schema_version"]), "reads plan schemas 1, 2, 3, 4, 5, 6, 7"),
    ("op keys in a schema-6 plan",
     lambda d: (d.__setitem__("schema_version", 6), d.__setitem__("op_keys", _op_keys())),
     "schema 7 added (op_keys)"),
    ("op key text", _set(["op_keys"], _op_keys(linear="to_8")),
     "op_keys.linear: 'to_8' does not match"),
    ("op key twice", _set(["op_keys"], _op_keys(linear_1=_KEY + "0")),
     "is also the key of op 'linear'"),
    ("op key of no op", _set(["op_keys"], _op_keys(conv=_KEY + "3")),
     "names op 'conv', which op_strategies does not"),
    ("op without key", _set(["op_keys"], {"linear": _KEY + "0"}),
     "has no key for op 'embedding'"),
    ("no hardware", _delete(["cluster", "hardware"]), "missing key(s) cluster.hardware"),
    ("hardware key", _set(["cluster", "hardware", "colour"], 1), "cluster.hardware.colour"),
    ("device kind", _set(["cluster", "hardware", "device_kind"], "tpu"),
     "cluster.hardware.device_kind: 'tpu' is not one of gpu, cpu"),
    ("memory", _set(["cluster", "hardware", "device_memory_bytes"], -1),
     "cluster.hardware.device_memory_bytes: must be >= 1"),
    ("links", _set(["cluster", "hardware", "node_links"], "nvlink4"),
     "cluster.hardware.node_links: expected a JSON array"),
    ("a version-1 plan with schema 2's schedules",
     lambda d: (d.__setitem__("schema_version", 1), d["config"].__setitem__("schedule", "zbv")),
     "schema 2 added"),
    ("unknown top key", _set(["colour"], 1), "unknown key(s) colour"),
    ("unknown nested key", _set(["mesh", "colour"], 1), "mesh.colour"),
    ("unknown deep key", _set(["predicted", "time", "nap_s"], 0.0), "predicted.time.nap_s"),
    ("missing key", _delete(["mesh", "shape"]), "missing key(s) mesh.shape"),
    ("wrong type", _set(["mesh", "shape"], "4x4"), "mesh.shape: expected a JSON array"),
    ("negative", _set(["predicted", "step_time_s"], -1.0), "predicted.step_time_s: must be"),
    ("bool for int", _set(["model", "num_ops"], True), "model.num_ops: expected an integer"),
    ("bad placement", _set(["param_placements", QKV, "tp"], "Shard(0)"),
     f'param_placements["{QKV}"].tp: cannot parse placement'),
    ("placement dim", _set(["param_placements", QKV, "tp"], "S(2)"), "shards dim 2"),
    ("partial param", _set(["param_placements", QKV, "dp"], "P"), "cannot be partial"),
    ("mesh vs world", _set(["mesh", "shape"], [4, 2]), "must all be equal"),
    ("devices vs world", _set(["mesh", "rank_to_device"], [f"n0.gpu{i}" for i in range(8)]),
     "must all be equal"),
    ("device twice", _set(["mesh", "rank_to_device"], ["n0.gpu0"] * 16), "more than one rank"),
    ("device off cluster", _set(["mesh", "rank_to_device", 15], "n9.gpu7"), "rank_to_device[15]"),
    ("axis vs config", _set(["mesh", "axes"], ["pp", "tp"]), "axis 'pp' has size 4"),
    ("tp domain", _set(["mesh", "tp_domain"], "none"), "mesh.tp_domain"),
    ("bad config", _set(["config", "zero_stage"], 5), "config: not a valid ParallelConfig"),
    ("config type", _set(["config", "sequence_parallel"], "yes"),
     "config.sequence_parallel: expected true or false, got a string 'yes'"),
    ("config key", _set(["config", "colour"], 2), "unknown ParallelConfig keys"),
    ("alternative config", _set(["alternatives", 1, "config", "tp"], 0), "alternatives[1].config"),
    ("batch", _set(["training", "global_batch_size"], 30), "does not divide"),
    ("precision", _set(["training", "precision"], "fp16"), "training.precision"),
    ("predicted config", _set(["predicted", "config", "dp"], 8), "predicted.config"),
    ("status", _set(["solver", "status"], "great"), "solver.status"),
    ("why_lost lines", _set(["alternatives", 0, "why_lost"], "a\nb"), "one line"),
    ("style name", _set(["module_styles", "layers.0.attn.qkv"], "col wise"),
     'module_styles["layers.0.attn.qkv"]'),
    ("recompute", _set(["recompute", "layers.0"], "some"), 'recompute["layers.0"]'),
    ("offload", _set(["offload", "optimizer"], True), "offload.optimizer"),
    ("stage ranks", _set(["stages"], [{"index": 0, "layers": [], "chunks": [[]],
                                       "ranks": [99]}]),
     "stages[0].ranks"),
    ("fingerprint", _set(["model", "fingerprint"], "not hex"), "model.fingerprint"),
    ("huge string", _set(["autoplan_version"], "x" * ((1 << 20) + 1)), "characters"),
]


@pytest.mark.parametrize("mutate,expected", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_plan_is_refused_with_its_path(plan_dict, mutate, expected):
    mutate(plan_dict)
    with pytest.raises(PlanError) as info:
        Plan.from_json(json.dumps(plan_dict))
    assert expected in str(info.value)


@pytest.mark.parametrize("make_text,expected", [
    (lambda t: t[: len(t) // 2], "truncated"),
    (lambda t: "", "truncated"),
    (lambda t: t.replace('"autoplan_version"', '"autoplan_version": "0", "autoplan_version"', 1),
     "duplicate key 'autoplan_version'"),
    (lambda t: t.replace('"mfu": ', '"mfu": NaN, "x": ', 1), "NaN is not allowed"),
    (lambda t: t.replace('"mfu": ', '"mfu": -Infinity, "x": ', 1), "-Infinity is not allowed"),
    (lambda t: t.replace('"mfu": ', '"mfu": 1e999, "x": ', 1), "infinity"),
    (lambda t: t.replace('"num_ops": ', '"num_ops": ' + "9" * 50 + ', "x": ', 1), "digits"),
    (lambda t: "[1, 2]", "one JSON object"),
    (lambda t: '{"a": ' + "[" * 80 + "]" * 80 + "}", "deeper than 64"),
    (lambda t: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (lambda t: "__import__('os').system('echo hi')", "not valid JSON"),
], ids=["truncated", "empty", "duplicate", "nan", "-inf", "overflow", "long int", "array",
        "deep", "very deep", "code"])
def test_malformed_text_is_refused(plan, make_text, expected):
    with pytest.raises(PlanError) as info:
        Plan.from_json(make_text(plan.to_json()))
    assert expected in str(info.value)


def test_non_utf8_bytes_and_bad_files_are_refused(tmp_path):
    with pytest.raises(PlanError, match="UTF-8"):
        Plan.from_json(b"\xff\xfe{}")
    with pytest.raises(PlanError, match="no plan file"):
        plan_from_file(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(check.MAX_FILE_BYTES + 1)          # sparse: nothing is written or read
    with pytest.raises(PlanError, match="limit for plan files") as info:
        plan_from_file(big)
    assert "big.json" in str(info.value)


def test_plan_built_in_python_is_validated(plan):
    with pytest.raises(PlanError, match="must all be equal"):
        dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, shape=(2, 4)))
    with pytest.raises(PlanError, match="ParamPlacement"):
        dataclasses.replace(plan, param_placements={"w": {"tp": "R", "dp": "R", "shape": [1]}})
    with pytest.raises(PlanError, match="not JSON data"):
        dataclasses.replace(plan, predicted={**plan.predicted, "mfu": object()})
    with pytest.raises(PlanError, match="predicted.config"):
        dataclasses.replace(plan, predicted={**plan.predicted, "config": {"dp": 16}})


# ================================================================ load_plan
def test_load_plan_accepts_the_right_model_and_cluster(searched, tiny, a100_x2, tmp_path):
    plan = searched
    path = plan.save(tmp_path / "plan.json")
    ex, graph = tiny
    assert load_plan(path, graph=graph, cluster=a100_x2) == plan
    assert load_plan(path, model=graph) == plan
    assert load_plan(path, model=ex.model, example_inputs=ex.example_inputs, loss_fn=ex.loss_fn,
                     targets=ex.targets, cluster=Cluster.preset("dgx-a100-80gb", nodes=2)) == plan
    assert load_plan(path) == plan


def test_load_plan_refuses_another_model(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    ex = build_example("gpt-tiny", device="meta", batch_size=1, num_layers=3)
    other = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    with pytest.raises(PlanError) as info:
        load_plan(path, graph=other)
    msg = str(info.value)
    assert "plan is for model 'gpt-tiny'" in msg and "118,528 parameters, 66 ops" in msg
    assert f"given model is 'GPT' (fingerprint {other.fingerprint()[:12]}" in msg
    assert f"{other.num_params:,} parameters" in msg and "replan=True" in msg
    with pytest.raises(PlanError, match="example_inputs"):
        load_plan(path, model=ex.model)


def test_load_plan_refuses_another_cluster(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError) as info:
        load_plan(path, cluster=Cluster.preset("dgx-a100-80gb", nodes=4))
    msg = str(info.value)
    assert "ranks: 16 planned, 32 here" in msg and "nodes: 2 planned, 4 here" in msg
    assert "no flag runs it on 32" in msg and "autoplan.plan(" in msg
    with pytest.raises(PlanError, match="no flag runs it"):      # a mesh of another size
        load_plan(path, cluster="dgx-a100-80gb:4", allow_cluster_mismatch=True)
    with pytest.raises(PlanError) as info:
        load_plan(path, cluster=Cluster.preset("dgx-h100", nodes=2))
    msg = str(info.value)
    assert "device: A100-SXM4-80GB planned, H100-SXM5-80GB here" in msg
    assert "links in a node: nvlink3 x12 + pcie4-x16 planned, nvlink4 x18 + pcie5-x16" in msg
    assert "network: ib-hdr planned, ib-ndr here" in msg
    assert "ranks" not in msg and "--allow-cluster-mismatch" in msg and "--cluster" in msg
    # other hardware of the plan's world size runs when the mismatch is allowed
    assert load_plan(path, cluster="dgx-h100:2", allow_cluster_mismatch=True) == plan


def test_load_plan_replans_on_request(searched, tiny, monkeypatch, tmp_path):
    plan = searched
    path = plan.save(tmp_path / "plan.json")
    calls = []
    monkeypatch.setattr(loading.search, "plan",
                        lambda graph, cluster, **kw: calls.append((graph, cluster, kw)) or "new plan")
    h100 = Cluster.preset("dgx-h100", nodes=2)
    with pytest.raises(PlanError, match="without replan=True"):
        load_plan(path, graph=tiny[1], cluster=h100, time_limit_s=5)
    with pytest.raises(PlanError, match="needs both the model"):
        load_plan(path, cluster=h100, replan=True)
    assert load_plan(path, graph=tiny[1], cluster=a100_cluster(), replan=True) == plan
    assert calls == []                                  # nothing stale: no re-planning
    assert load_plan(path, graph=tiny[1], cluster=h100, replan=True, precision="fp16") == "new plan"
    graph, cluster, kw = calls[0]
    assert graph is tiny[1] and cluster is h100
    assert kw == {"global_batch_size": GBS, "precision": "fp16", "optimizer": "adamw",
                  "expert_capacity_factor": 1.0}


def test_load_plan_refuses_a_plan_that_does_not_fit_the_model(plan, tiny, a100_x2, tmp_path):
    """The hand-made fixture plan has the model's fingerprint but places only two of its
    parameters: loading it for that model says what is missing."""
    path = plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="has no placement"):
        load_plan(path, graph=tiny[1], cluster=a100_x2)


def a100_cluster():
    return Cluster.preset("dgx-a100-80gb", nodes=2)


# ================================================================ inspect, diff
def test_explain_plan_mentions_the_key_facts(plan):
    text = explain_plan(plan)
    for fact in ("'gpt-tiny'", "118,528 parameters", "'dgx-a100-80gb'", "global batch 32",
                 "bf16", "dp x tp = 4 x 4", "NVSwitch", "d3.t3", "dp4 tp4", "MFU",
                 "samples/s", "layers.0-1", "attn+mlp colwise/rowwise", "recompute none",
                 "tok_embeddings vocab_parallel", "optimizer", "margin", "of 80.00 GiB",
                 "comm tp", "3% slower: DP all-reduce across nodes", "dp16 tp1",
                 "CBC optimal", "gap 0.00%", "120 variables", "6 ILPs solved",
                 "14 candidates"):
        assert fact in text, fact
    rows = [line for line in text.splitlines() if re.match(r"  n\d+ ", line)]
    assert len(rows) == 2 and rows[0].split()[1:3] == ["d0.t0", "d0.t1"]
    # every parameter's placement on each mesh axis, layers folded
    assert re.search(r"layers\.\*\.attn\.qkv\.weight +\d+ x \d+ +R +S\(0\)", text), text


def test_explain_plan_elides_large_meshes_and_collapses_blocks(tiny):
    cluster = Cluster.preset("dgx-a100-80gb", nodes=8)
    big = make_plan(tiny[1], cluster, ParallelConfig(dp=16, tp=4, recompute="full"),
                    recompute="full")
    text = explain_plan(big)
    assert "(3 more nodes)" in text and "  n7 " in text and "  n4 " not in text
    assert "recompute full" in text and "d15.t3" in text
    mixed = dataclasses.replace(big, recompute={"layers.0": "full", "layers.1": "none"})
    assert "layers.0 " in explain_plan(mixed) and "layers.1 " in explain_plan(mixed)
    assert fmt_ranges([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"


def test_explain_pipeline_plan(tiny, a100_x2):
    piped = make_plan(tiny[1], a100_x2, ParallelConfig(dp=4, tp=2, pp=2, micro_batch_size=2))
    text = explain_plan(piped)
    for fact in ("pp x dp x tp = 2 x 4 x 2", "p1.d3.t1", "pipeline stages   1f1b",
                 "micro-batches; bubble", "fwd/mb", "per stage: 0:", "stage 0, the fullest of 2",
                 ", stage 1"):
        assert fact in text, fact
    row = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    assert "8-15" in row and row.endswith("layers.1") and "n" in row   # ranks, devices, layers
    assert Plan.from_json(piped.to_json()) == piped


def test_diff_plans_names_changes_and_effect(plan, tiny, a100_x2):
    other = make_plan(tiny[1], a100_x2, ParallelConfig(dp=16), recompute="full")
    text = diff_plans(plan, other)
    for fact in ("model    same", "cluster  same", "dp x tp = 4 x 4 -> dp x tp = 16 x 1",
                 "nvswitch -> none", "dp 4 -> 16", "tp 4 -> 1", "module styles: 0 changed",
                 "9 removed", "placements: 2 changed", "S(0)", "recompute: 2 blocks changed",
                 "none -> full: layers.0-1", "step time", "peak memory", "MFU"):
        assert fact in text, fact
    pa, pb = plan.predicted["step_time_s"], other.predicted["step_time_s"]
    assert f"({(pb - pa) / pa * 100:+.1f}%)" in text
    assert diff_plans(plan, plan).startswith("no differences")


def test_diff_covers_stage_changes(plan, tiny, a100_x2):
    piped = make_plan(tiny[1], a100_x2, ParallelConfig(dp=4, tp=2, pp=2, micro_batch_size=2))
    text = diff_plans(plan, piped)
    for fact in ("stages   1 -> 2; 1 of 2 layers on another stage", "stage 0 -> 1: layers.1",
                 "bubble"):
        assert fact in text, fact
    assert "stages" not in diff_plans(plan, make_plan(tiny[1], a100_x2, ParallelConfig(dp=16)))


def test_cli_inspect_and_diff(plan, tiny, a100_x2, tmp_path, capsys):
    a = plan.save(tmp_path / "a.json")
    b = make_plan(tiny[1], a100_x2, ParallelConfig(dp=16)).save(tmp_path / "b.json")
    assert main(["inspect", a]) == 0
    assert "dp x tp = 4 x 4" in capsys.readouterr().out
    assert main(["inspect", "--json", a]) == 0
    assert capsys.readouterr().out == plan.to_json()
    assert main(["diff", a, b]) == 0
    assert "dp 4 -> 16" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"schema_version": 1')
    assert main(["inspect", str(tmp_path / "bad.json")]) == 1
    err = capsys.readouterr().err
    assert "autoplan inspect: error" in err and "truncated" in err and "bad.json" in err
    assert PLAN_SCHEMA_VERSION == 7


def test_schema_enums_match_the_code():
    """The schema's closed lists are the code's: a new schedule or policy must reach both."""
    from autoplan.sharding.parallel_config import OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES
    props = _schema()["$defs"]["parallel_config"]["properties"]
    assert props["schedule"]["enum"] == list(SCHEDULES)
    assert props["recompute"]["enum"] == list(RECOMPUTE)
    assert props["stage_recompute"]["items"]["enum"] == list(RECOMPUTE)
    assert props["precision"]["enum"] == list(PRECISIONS)
    assert props["optimizer"]["enum"] == list(OPTIMIZERS)
    hardware = _schema()["properties"]["cluster"]["properties"]["hardware"]["properties"]
    assert hardware["device_kind"]["enum"] == [*check.DEVICE_KINDS, None]
    assert hardware["backend"]["enum"] == [*check.BACKENDS, None]
    assert set(hardware) == set(check.HARDWARE_KEYS + check.HARDWARE_OPTIONAL_KEYS)


# ================================================================ a plan against its model
def _wrong_plans():
    """(label, edit of a tp=2 plan or of a pp=2 plan, what the error says)."""
    def place(fqn, **kw):
        return lambda p: dataclasses.replace(p, param_placements={
            **p.param_placements, fqn: dataclasses.replace(p.param_placements.get(
                fqn, ParamPlacement(tp="R", dp="R", shape=(4,))), **kw)})

    def drop(fqn):
        return lambda p: dataclasses.replace(p, param_placements={
            k: v for k, v in p.param_placements.items() if k != fqn})
    qkv = "layers.0.attn.qkv.weight"
    return [
        ("no such parameter", "tp", place("layers.9.attn.qkv.weight", tp="R"),
         "no parameter of the model"),
        ("wrong shape", "tp", place(qkv, shape=(3, 3)), "has shape"),
        ("missing placement", "tp", drop(qkv), "has no placement"),
        ("uneven split", "tp", place(qkv, tp="S(1)[5]"), "does not split"),
        ("placement the ops disagree with", "tp",
         place("layers.0.mlp.proj.weight", tp="R"), "ops read it as"),
        ("unknown strategy", "tp", lambda p: dataclasses.replace(
            p, op_strategies={**p.op_strategies, next(iter(p.op_strategies)): "sideways"}),
         "has no strategy 'sideways'"),
        ("style of no module", "tp", lambda p: dataclasses.replace(
            p, module_styles={**p.module_styles, "layers.7.attn": "colwise"}), "no module"),
        ("recompute of no layer", "tp", lambda p: dataclasses.replace(
            p, recompute={**p.recompute, "layers.99": "full"}), "no layer of the model"),
        ("stage ranks twice", "pp", lambda p: dataclasses.replace(
            p, stages=tuple({**st, "ranks": [0]} for st in p.stages)), "exactly once"),
        ("stage layers out of range", "pp", lambda p: dataclasses.replace(
            p, stages=tuple({**st, "layers": ["layers.5"], "chunks": [["layers.5"]]}
                            for st in p.stages)), "which the model does not have"),
    ]


@pytest.mark.parametrize("label,family,edit,match", _wrong_plans(),
                         ids=[w[0] for w in _wrong_plans()])
def test_a_plan_that_does_not_fit_its_model_is_refused(label, family, edit, match):
    from autoplan.planner.plan_vs_model import check_plan_against
    ex = build_example("gpt-tiny", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    force, max_pp = ({"tp": 2}, 1) if family == "tp" else ({"pp": 2}, 2)
    # Megatron's sharding: which weights the ILP splits depends on this machine's costs
    good = autoplan.plan(g, Cluster.local(2), global_batch_size=4, precision="fp32",
                         profile=None, force=force, max_pp=max_pp, sharding="megatron")
    check_plan_against(good, g)
    with pytest.raises(PlanError, match=match):
        check_plan_against(edit(good), g)
