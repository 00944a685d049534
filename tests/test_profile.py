"""Measured op profiles: op keys, the ProfileDB file format, replaying ops, calibration, the CLI."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn

import autoplan
from autoplan.cluster.profile_db import (Calibration, OpTiming, ProfileDB, list_packaged_devices,
                                      op_key)
from autoplan.machine.calibration import calibrate
from autoplan.machine.profiler import build_db, local_device_name, profile_graph
from autoplan.errors import ProfileError


def _trace(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None, loss=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoplan.trace(model, (x,), loss_fn=loss, targets=y)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.fixture(scope="module")
def mlp_graph():
    return _trace(_mlp(), torch.randn(8, 16), torch.randint(0, 4, (8,)),
                  nn.functional.cross_entropy)


def _cal(**kw) -> Calibration:
    base = dict(matmul_flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10, launch_s=3e-6,
                optimizer_s_per_param=5e-9, optimizer_s_per_tensor=2e-5,
                step_overhead_s=4e-4)
    base.update(kw)
    return Calibration(**base)


def _db(entries=None, threads=2, device="cpu-test-device") -> ProfileDB:
    entries = entries if entries is not None else {
        "aten.relu.default|a": OpTiming(fwd_s=1.5e-6, bwd_s=2.25e-6, fwd_cv=0.1, bwd_cv=0.2,
                                        repeats=15),
        "aten.linear.default|b": OpTiming(fwd_s=0.001234, bwd_s=0.0, fwd_cv=0.0, bwd_cv=0.0,
                                          repeats=3),
    }
    return ProfileDB(device=device, device_kind="cpu", threads=threads, torch_version="2.x",
                     calibration=_cal(), entries=entries, sources=("mlp-tiny@32",))


# ---- op keys --------------------------------------------------------------------------------

def test_op_key_same_for_identical_ops_in_two_layers(mlp_graph):
    linears = [op for op in mlp_graph.ops if op.target == "aten.linear.default"]
    keys = [op_key(mlp_graph, op) for op in linears]
    # layers 2 and 3 are Linear(32, 32) on a (8, 32) input that requires grad: one key
    assert keys[1] == keys[2]
    assert linears[1].inputs != linears[2].inputs          # different value names
    assert keys[0] != keys[1]                              # other shapes, input without grad
    assert keys[2] != keys[3]
    assert keys[1].startswith("aten.linear.default|")
    # a second trace of the same model gives the same keys (value names are not part of them)
    again = _trace(_mlp(), torch.randn(8, 16), torch.randint(0, 4, (8,)),
                   nn.functional.cross_entropy)
    assert [op_key(again, op) for op in again.ops] == [op_key(mlp_graph, op)
                                                       for op in mlp_graph.ops]


def test_op_key_ignores_the_trace_device(mlp_graph):
    class Pos(nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[-1], device=x.device)

    real = _trace(Pos(), torch.randn(2, 5))
    meta = _trace(Pos(), torch.randn(2, 5, device="meta"))
    assert [op_key(real, op) for op in real.ops] == [op_key(meta, op) for op in meta.ops]


# ---- the database file ----------------------------------------------------------------------

def test_save_load_round_trip_is_stable(tmp_path):
    db = _db()
    path = tmp_path / "sub" / "cpu-test-device.json"
    db.save(path)
    loaded = ProfileDB.load(path)
    assert loaded == db
    assert dict(loaded.entries) == dict(db.entries)
    first = path.read_bytes()
    loaded.save(path)
    assert path.read_bytes() == first                       # byte-stable re-save
    assert json.loads(first)["schema_version"] == 1


@pytest.mark.parametrize("text, expect", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level"),
    ('{"schema_version": 99}', "schema_version 99"),
    ('{"schema_version": 1, "device": "d"}', "missing field"),
])
def test_malformed_file_raises_profile_error(tmp_path, text, expect):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=expect) as info:
        ProfileDB.load(path)
    assert str(path) in str(info.value)


def test_bad_entry_and_calibration_raise_profile_error(tmp_path):
    d = _db().to_dict()
    d["entries"]["x"] = {"fwd_s": -1.0, "bwd_s": 0.0, "fwd_cv": 0.0, "bwd_cv": 0.0, "repeats": 1}
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="fwd_s") as info:
        ProfileDB.load(path)
    assert str(path) in str(info.value)
    d = _db().to_dict()
    del d["calibration"]["launch_s"]
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="launch_s"):
        ProfileDB.load(path)


def test_the_size_curve_round_trips_and_bad_curves_are_refused(tmp_path):
    curve = ((32.0, 0.38), (128.0, 0.97), (1024.0, 1.0))
    db = dataclasses.replace(_db(), calibration=_cal(matmul_size_efficiency=curve))
    path = tmp_path / "cpu-test-device.json"
    db.save(path)
    assert ProfileDB.load(path).calibration.matmul_size_efficiency == curve
    assert "matmul_size_efficiency" not in json.dumps(_db().to_dict())   # none: not written
    for bad, expect in [([[64, 0.5], [32, 0.9]], "must increase"), ([[32, -1]], "fraction"),
                        ([[32]], "pairs"), ("fast", "pairs"), ([[0, 1.0]], "size")]:
        d = _db().to_dict()
        d["calibration"]["matmul_size_efficiency"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(ProfileError, match=expect):
            ProfileDB.load(path)


def test_element_rates_round_trip_and_bad_ones_are_refused(tmp_path):
    rates = (("gelu_tanh", 1.2e-9, 1.5e-9), ("softmax", 4e-10, 5e-10))
    db = dataclasses.replace(_db(), calibration=_cal(elementwise_s_per_element=rates))
    path = tmp_path / "cpu-test-device.json"
    db.save(path)
    assert ProfileDB.load(path).calibration.elementwise_s_per_element == rates
    assert json.loads(path.read_text())["calibration"]["elementwise_s_per_element"] == {
        "gelu_tanh": [1.2e-9, 1.5e-9], "softmax": [4e-10, 5e-10]}
    for bad, expect in [({"tanh": [-1.0, 0.0]}, "tanh.forward"), ({"tanh": [1e-9]}, "forward"),
                        ([1, 2], "name")]:
        d = _db().to_dict()
        d["calibration"]["elementwise_s_per_element"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(ProfileError, match=expect):
            ProfileDB.load(path)


def test_a_measured_element_rate_is_a_third_ceiling():
    """GELU's tanh form, softmax and a cross entropy's log-softmax take at least the measured
    time per element (a CPU core's tanh outlasts the bytes); other ops keep the roofline."""
    from autoplan.cost.compute import compute_model, elementwise_key

    class M(nn.Module):
        def forward(self, x):
            h = nn.functional.gelu(x, approximate="tanh").softmax(-1)
            return nn.functional.gelu(h) * 2.0
    g = _trace(M(), torch.randn(64, 128), torch.randint(0, 128, (64,)),
               nn.functional.cross_entropy)
    keys = [elementwise_key(g, op) for op in g.ops]
    assert ("gelu_tanh", 64 * 128) in keys and ("softmax", 64 * 128) in keys
    assert ("gelu", 64 * 128) in keys and ("log_softmax", 64 * 128) in keys
    slow = (("gelu_tanh", 1e-6, 2e-6), ("log_softmax", 3e-6, 4e-6), ("softmax", 0.0, 0.0))
    cal = _cal(elementwise_s_per_element=slow)
    cluster = autoplan.Cluster.local(1, calibration={
        "matmul_flops_per_s": cal.matmul_flops_per_s,
        "memory_bandwidth_bytes_per_s": cal.memory_bandwidth_bytes_per_s,
        "launch_s": cal.launch_s})
    plain = compute_model(g, cluster.device, "fp32", _db(entries={}))
    rated = compute_model(g, cluster.device, "fp32",
                          dataclasses.replace(_db(entries={}), calibration=cal))
    for i, (op, key) in enumerate(zip(g.ops, keys)):
        got, was = rated.base_cost(i), plain.base_cost(i)
        rate = dict((k, (f, b)) for k, f, b in slow).get(key[0]) if key else None
        if rate is None or rate == (0.0, 0.0):
            assert got == was, op.target            # not measured, or never the ceiling
            continue
        share = rated.slowdown
        assert got.fwd_s == pytest.approx((key[1] * rate[0] + cal.launch_s) * share)
        assert got.bwd_s == pytest.approx((key[1] * rate[1] + cal.launch_s) * share
                                          if op.differentiable else 0.0)


def test_merged_updates_entries_and_refuses_other_thread_counts():
    old = _db()
    newer = _db(entries={"aten.relu.default|a": OpTiming(fwd_s=1e-6, bwd_s=1e-6, fwd_cv=0.0,
                                                          bwd_cv=0.0, repeats=15),
                         "aten.gelu.default|c": OpTiming(fwd_s=2e-6, bwd_s=3e-6, fwd_cv=0.0,
                                                         bwd_cv=0.0, repeats=15)})
    merged = old.merged(newer)
    assert set(merged.entries) == {"aten.relu.default|a", "aten.linear.default|b",
                                   "aten.gelu.default|c"}
    assert merged.entries["aten.relu.default|a"].fwd_s == 1e-6
    with pytest.raises(ProfileError, match="threads"):
        old.merged(_db(threads=4))


def test_find_searches_env_dir_then_cache_then_packaged(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(tmp_path / "env"))
    shipped = list_packaged_devices()
    assert shipped, "the package ships at least one measured profile (profiles/*.json)"
    found = ProfileDB.find(shipped[0])
    assert found is not None and found.device == shipped[0] and found.entries
    assert ProfileDB.find("no-such-device") is None
    # a file in $AUTOPLAN_PROFILE_DIR wins over the packaged one
    _db(device=shipped[0], entries={}).save(tmp_path / "env" / f"{shipped[0]}.json")
    assert not ProfileDB.find(shipped[0]).entries
    with pytest.raises(ProfileError, match="file name"):
        ProfileDB.find("../etc/passwd")


def test_packaged_profiles_cover_the_examples():
    from autoplan.cluster.profile_db import packaged_profiles
    for device in list_packaged_devices():
        shipped = ProfileDB.from_text((packaged_profiles() / f"{device}.json").read_bytes())
        assert shipped.device == device
        assert shipped.threads >= 1 and shipped.calibration.matmul_flops_per_s > 0
        assert any(s.startswith("gpt-tiny@") for s in shipped.sources)


def test_the_cpu_name_can_be_set(monkeypatch):
    """$AUTOPLAN_CPU_NAME names this machine's CPU (the suite sets it: its plans must not
    depend on the machine's profile); unset, /proc/cpuinfo does."""
    from autoplan.cluster import local
    monkeypatch.setenv(local.CPU_NAME_ENV, "AMD EPYC")
    assert local_device_name() == "cpu-amd-epyc"
    assert autoplan.Cluster.local(2).device.name == "cpu-amd-epyc"
    monkeypatch.delenv(local.CPU_NAME_ENV)
    assert local.cpu_model_name()              # this machine's own


# ---- measuring --------------------------------------------------------------------------------

def test_profiling_a_tiny_mlp_times_its_matmuls(mlp_graph):
    prof = profile_graph(mlp_graph, warmup=1, repeats=3)
    assert not prof.failures
    assert prof.num_ops == len(mlp_graph.ops) and prof.num_keys < prof.num_ops  # shared keys
    db = build_db(prof.timings, _cal(), device_name="cpu-test-device")
    assert db.threads == torch.get_num_threads()
    assert db.coverage(mlp_graph) == 1.0
    for op in mlp_graph.ops:
        t = db.lookup(mlp_graph, op)
        assert t is not None and t.fwd_s > 0 and t.repeats >= 1
        if op.kind == "matmul":
            assert t.bwd_s > 0
            assert t.fwd_s < 0.5
    skipped = profile_graph(mlp_graph, warmup=0, repeats=1, skip=prof.timings.keys())
    assert skipped.skipped == prof.num_keys and not skipped.timings


def test_integer_inputs_are_valid_indices():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.out = nn.Linear(8, 7)

        def forward(self, tokens):
            h = self.emb(tokens)
            pos = torch.arange(tokens.shape[1])
            return self.out(h[:, pos].mean(1))

    g = _trace(Tagger(), torch.randint(0, 50, (4, 6)), torch.randint(0, 7, (4,)),
               nn.functional.cross_entropy)
    prof = profile_graph(g, warmup=0, repeats=2)
    assert not prof.failures, prof.failures
    targets = {k.split("|")[0] for k in prof.timings}
    assert {"aten.embedding.default", "aten.cross_entropy_loss.default"} <= targets


def test_unreplayable_op_is_counted_not_raised(mlp_graph):
    import dataclasses
    bad = dataclasses.replace(mlp_graph.ops[1], target="aten.no_such_op.default")
    g = dataclasses.replace(mlp_graph, ops=(mlp_graph.ops[0], bad))
    prof = profile_graph(g, warmup=0, repeats=1)
    assert len(prof.timings) == 1 and len(prof.failures) == 1
    assert "no_such_op" in next(iter(prof.failures.values()))


def test_calibration_is_positive_and_plausible():
    cal = calibrate("cpu")
    assert 1e8 < cal.matmul_flops_per_s < 1e14
    assert 1e8 < cal.memory_bandwidth_bytes_per_s < 1e13
    assert 1e-8 < cal.launch_s < 1e-2
    assert 1e-12 < cal.optimizer_s_per_param < 1e-5
    assert 1e-6 < cal.step_overhead_s < 0.5
    assert cal.matmul_dtype == "float32"
    # the size curve: relative to the reference network's size, small products slower
    sizes = [n for n, _ in cal.matmul_size_efficiency]
    assert sizes == sorted(sizes) and sizes[0] <= 64 and sizes[-1] >= 512
    fractions = dict(cal.matmul_size_efficiency)
    assert 0.0 < fractions[sizes[0]] < fractions[sizes[-1]]
    assert all(0.2 < f < 3.0 for f in fractions.values() if f is not fractions[sizes[0]])
    rates = {k: (f, b) for k, f, b in cal.elementwise_s_per_element}
    assert set(rates) == {"gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "softmax",
                          "log_softmax"}
    assert all(0 < f < 1e-6 and 0 <= b < 1e-6 for f, b in rates.values())


def test_cli_profiles_an_example_and_merges(tmp_path, capsys):
    from autoplan.cli.profile_cmd import main

    out = tmp_path / "p.json"
    _db(device=local_device_name(), threads=torch.get_num_threads()).save(out)
    assert main(["mlp-tiny@8", "--repeats", "2", "--warmup", "1",
                 "-o", str(out)]) == 0
    db = ProfileDB.load(out)
    assert "aten.relu.default|a" in db.entries                # kept from the existing file
    assert any(k.startswith("aten.linear.default|") for k in db.entries)
    assert "mlp-tiny@8" in db.sources
    text = capsys.readouterr().out
    assert "failed" in text and "calibration" in text
    assert main(["no-such-model", "-o", str(out)]) == 2
    assert main(["mlp-tiny@0", "-o", str(out)]) == 2


def test_host_allocator_tuning_is_applied_once_and_can_be_opted_out(monkeypatch):
    import platform
    import sys

    from autoplan.cost import host_allocator as ha
    monkeypatch.setattr(ha, "_applied", None)
    monkeypatch.setenv("AUTOPLAN_HOST_MALLOC", "default")
    assert ha.keep_freed_host_memory() is False
    monkeypatch.setattr(ha, "_applied", None)
    monkeypatch.delenv("AUTOPLAN_HOST_MALLOC")
    applied = ha.keep_freed_host_memory()
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert applied is glibc
    assert ha.keep_freed_host_memory() is applied                      # cached


# ---- the prediction benchmark still runs (its ratio is printed, never asserted) -------------

def test_cpu_prediction_benchmark_runs(capsys):
    """benchmarks/cpu_prediction.py profiles, estimates and times a step end to end; the ratio
    depends on the CPU and the load, so only its being a positive finite number is checked."""
    import importlib.util
    import math
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_prediction.py"
    spec = importlib.util.spec_from_file_location("cpu_prediction", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ratios = bench.run_case("mlp", 16, attempts=1, repeats=2, steps=2)
    assert len(ratios) == 1 and math.isfinite(ratios[0]) and ratios[0] > 0
    assert "predicted/measured" in capsys.readouterr().out


class _Products(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 128)

    def forward(self, x):                       # x: (4, 8, 16, 64)
        h = self.proj(x)                        # one product: M = 4 * 8 * 16, K = 64, N = 128
        q, k = h[..., :64], h[..., 64:]
        scores = q @ k.transpose(-1, -2)        # 32 products of 16 x 64 x 16
        att = nn.functional.scaled_dot_product_attention(q, k, q)
        return scores.sum() + att.sum()


def test_products_run_at_the_rate_of_their_size():
    from autoplan.cost.compute import compute_model, product_size, size_efficiency
    g = _trace(_Products(), torch.randn(4, 8, 16, 64))
    sizes = {op.kind + ":" + op.target.split(".")[1]: product_size(g, op) for op in g.ops
             if op.kind in ("matmul", "attention")}
    assert sizes["matmul:linear"] == pytest.approx((4 * 8 * 16 * 64 * 128) ** (1 / 3))
    assert sizes["matmul:matmul"] == pytest.approx((16 * 64 * 16) ** (1 / 3))
    assert sizes["attention:scaled_dot_product_attention"] == pytest.approx(
        (16 * 64 * 16) ** (1 / 3))
    assert all(product_size(g, op) is None for op in g.ops
               if op.kind not in ("matmul", "attention"))

    curve = ((16.0, 0.2), (64.0, 0.5), (256.0, 1.0))
    assert size_efficiency(curve, 8.0) == 0.2 and size_efficiency(curve, 1e6) == 1.0
    assert size_efficiency(curve, 32.0) == pytest.approx(0.35)        # halfway in log size
    assert size_efficiency((), 8.0) == 1.0
    cal = _cal(matmul_size_efficiency=curve)
    db = dataclasses.replace(_db(entries={}), calibration=cal)
    cluster = autoplan.Cluster.local(1, calibration={
        "matmul_flops_per_s": cal.matmul_flops_per_s,
        "memory_bandwidth_bytes_per_s": cal.memory_bandwidth_bytes_per_s,
        "launch_s": cal.launch_s})
    flat = compute_model(g, cluster.device, "fp32", _db(entries={}))
    curved = compute_model(g, cluster.device, "fp32", db)
    i = next(i for i, op in enumerate(g.ops) if opname_of(op) == "matmul")
    op = g.ops[i]
    eff = size_efficiency(curve, product_size(g, op))
    assert 0.2 < eff < 0.5
    assert curved.base_cost(i).fwd_s - cal.launch_s == pytest.approx(
        op.fwd_flops / (cal.matmul_flops_per_s * eff) * curved.slowdown)
    assert flat.base_cost(i).fwd_s < curved.base_cost(i).fwd_s
    # an eighth of the work (a shard): sides halved, the rate of half the size
    half = size_efficiency(curve, product_size(g, op) / 2)
    assert curved.op_cost(i, 1 / 8).fwd_s - cal.launch_s == pytest.approx(
        (curved.base_cost(i).fwd_s - cal.launch_s) / 8 * eff / half)
    assert flat.op_cost(i, 1 / 8).fwd_s - cal.launch_s == pytest.approx(
        (flat.base_cost(i).fwd_s - cal.launch_s) / 8)


def opname_of(op):
    return op.target.split(".")[1]
