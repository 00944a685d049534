"""Objectives beyond step time (planner/objectives.py): the energy model, the prices and power
of cost_models/economics.yaml and their overrides, the device counts searched, the cheapest
plan meeting a deadline checked by brute force over every count and every plan the search
kept, the plan file's objectives section, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

import autoplan
from autoplan import Cluster
from autoplan.cluster import specs
from autoplan.cluster.economics import Economics, economics
from autoplan.errors import ClusterError, ConfigError, PlanError
from autoplan.estimate.energy import step_energy
from autoplan.planner import objectives
from autoplan.planner.planfile import Plan

ECON = Economics(device="X", usd_per_gpu_hour=2.0, tdp_watt=700.0, compute_fraction=1.0,
                 communication_fraction=0.5, idle_fraction=0.3)


def _predicted(step_s, compute_s, optimizer_s, comm_s, stages):
    return {"step_time_s": step_s,
            "time": {"compute_s": compute_s, "recompute_s": 0.0, "optimizer_s": optimizer_s,
                     "comm_exposed_s": {"dp_grad_sync": comm_s}, "bubble_s": 0.0,
                     "overhead_s": 0.0},
            "stages": [{"fwd_s": f, "bwd_s": b} for f, b in stages]}


# ---- the energy model -------------------------------------------------------------------------
def test_energy_weights_power_by_what_devices_do():
    # 0.7 s busy at 700 W, 0.1 s communicating at 350 W, 0.2 s idle at 210 W, on 8 devices
    e = step_energy(_predicted(1.0, 0.6, 0.1, 0.1, [(0.1, 0.2)]), 8, ECON)
    assert e.compute_joules == pytest.approx(8 * 0.7 * 700)
    assert e.communication_joules == pytest.approx(8 * 0.1 * 350)
    assert e.idle_joules == pytest.approx(8 * 0.2 * 210)
    assert e.total_joules == pytest.approx(8 * 567)
    assert e.compute_device_s + e.communication_device_s + e.idle_device_s == pytest.approx(8.0)
    assert e.average_watt(1.0, 8) == pytest.approx(567)


def test_a_faster_pipeline_stage_waits_for_the_slowest():
    # stage 1 does half of stage 0's forward/backward: 0.3 s of its 0.6 s compute becomes idle
    e = step_energy(_predicted(1.0, 0.6, 0.1, 0.1, [(0.2, 0.4), (0.1, 0.2)]), 8, ECON)
    slow = 4 * (0.7 * 700 + 0.1 * 350 + 0.2 * 210)
    fast = 4 * (0.4 * 700 + 0.1 * 350 + 0.5 * 210)
    assert e.total_joules == pytest.approx(slow + fast)
    assert e.idle_device_s == pytest.approx(4 * 0.2 + 4 * 0.5)


def test_a_breakdown_longer_than_the_step_is_scaled_to_it():
    e = step_energy(_predicted(1.0, 1.0, 0.1, 0.1, [(1.0, 1.0)]), 1, ECON)
    assert e.compute_device_s + e.communication_device_s == pytest.approx(1.0)
    assert e.idle_device_s == pytest.approx(0.0, abs=1e-12)
    no_power = Economics(**{**ECON.to_dict(), "tdp_watt": None})
    with pytest.raises(ConfigError, match="--tdp-watt"):
        step_energy(_predicted(1.0, 0.5, 0.0, 0.0, [(1, 1)]), 1, no_power)


# ---- prices and power -------------------------------------------------------------------------
def test_every_device_has_a_sourced_tdp_and_a_dated_price_or_none():
    table = specs.raw_data("economics.yaml")
    assert set(table["devices"]) == set(specs.raw_data("devices.yaml")["devices"])
    for name, e in table["devices"].items():
        assert e["tdp_watt"] > 0 and "datasheet" in e["source"].lower(), name
        if e["usd_per_gpu_hour"] is None:
            assert e["price_kind"] == "none", name
        else:
            assert e["price_kind"] in ("on-demand", "capacity-block") and e["price_date"], name
            assert "https://" in e["source"] and "/ 8" in _comment(name), name
    assert all(0 <= table["power_model"][k] <= 1 for k in
               ("compute_fraction", "communication_fraction", "idle_fraction"))


def _comment(name):
    """The YAML comment on a device's price line (the instance price divided by 8)."""
    text = (specs._data_dir() / "economics.yaml").read_text()
    block = text[text.index(f"  {name}:"):]
    return block.splitlines()[1]


def test_a_cluster_file_and_the_options_override_the_list_price():
    base = Cluster.preset("dgx-h100")
    assert economics(base).usd_per_gpu_hour == pytest.approx(12.29)
    d = {**base.to_dict(), "economics": {"usd_per_gpu_hour": 2.5, "idle_fraction": 0.2}}
    mine = Cluster.from_dict(d)
    assert mine.fingerprint() == base.fingerprint()       # prices change no step time
    assert Cluster.from_dict(mine.to_dict()).economics == mine.economics
    e = economics(mine)
    assert (e.usd_per_gpu_hour, e.idle_fraction, e.price_kind) == (2.5, 0.2, "given")
    assert economics(mine, {"usd_per_gpu_hour": 1.0}).usd_per_gpu_hour == 1.0
    for bad in ({"usd_per_gpu_hour": -1}, {"idle_fraction": 2}, {"bogus": 1}, "cheap",
                {"tdp_watt": float("nan")}, {"tdp_watt": True}):
        with pytest.raises(ClusterError):
            Cluster.from_dict({**base.to_dict(), "economics": bad})


def test_device_counts_are_whole_nodes_and_powers_of_two_in_a_node():
    assert objectives.device_counts(Cluster.preset("dgx-h100", 4), None) == [1, 2, 4, 8, 16, 32]
    assert objectives.device_counts(Cluster.preset("dgx-h100", 4), 24) == [1, 2, 4, 8, 16, 24]
    assert objectives.device_counts(Cluster.preset("dgx-h100", 3), None) == [1, 2, 4, 8, 16, 24]
    assert objectives.device_counts(Cluster.preset("dgx-h100", 1), 6) == [1, 2, 4]
    big = objectives.device_counts(Cluster.preset("dgx-h100", 1000), None)
    assert len(big) == 14 and big[-1] == 8000           # bounded: about log2 of the devices
    sub = objectives.sub_cluster(Cluster.preset("dgx-h100", 2), 2)
    assert sub.fingerprint() == Cluster.from_spec("dgx-h100/2").fingerprint()
    assert objectives.sub_cluster(Cluster.preset("dgx-h100", 4), 16).num_nodes == 2


# ---- the search, checked by brute force --------------------------------------------------------
TOKENS = 10 ** 9


@pytest.fixture(scope="module")
def graph():
    from autoplan.models import build_example
    ex = build_example("gpt-tiny")
    return autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


@pytest.fixture(scope="module")
def every_plan(graph):
    """Brute force: every device count the search considers, each planned for step time, with
    every plan it kept there (the chosen one and its fitting alternatives): (gpus, run time,
    cost) of each, computed here from the plan's own step time and tokens per step."""
    cluster = Cluster.preset("dgx-h100", 2)
    price = economics(cluster).usd_per_gpu_hour
    out = []
    for n in objectives.device_counts(cluster, None):
        p = autoplan.plan(graph, objectives.sub_cluster(cluster, n), global_batch_size=16)
        tokens_per_step = p.predicted["tokens_per_s"] * p.predicted["step_time_s"]
        for step_s in [p.predicted["step_time_s"]] + [a.step_time_s for a in p.alternatives
                                                      if a.fits]:
            run_s = TOKENS / tokens_per_step * step_s
            out.append((n, run_s, n * price * run_s / 3600))
    return cluster, out


def test_the_cheapest_plan_meeting_a_deadline_is_found(graph, every_plan):
    cluster, brute = every_plan
    counts = sorted({n for n, _, _ in brute})
    assert counts == [1, 2, 4, 8, 16]
    # a deadline between the fastest plans on 2 and on 4 devices: the cheap small counts miss it
    fastest = {n: min(r for m, r, _ in brute if m == n) for n in counts}
    deadline_days = (fastest[2] + fastest[4]) / 2 / 86_400
    meets = [(c, n) for n, r, c in brute if r <= deadline_days * 86_400]
    want_cost, want_n = min(meets)
    got = autoplan.plan(graph, cluster, global_batch_size=16, objective="cost", tokens=TOKENS,
                        deadline_days=deadline_days)
    sec = got.objectives
    assert got.cluster.world_size == want_n == sec["chosen_gpus"] != 1
    chosen = next(p for p in sec["points"] if p["gpus"] == want_n)
    assert chosen["cost_usd"] == pytest.approx(want_cost, rel=1e-5)
    assert [p["gpus"] for p in sec["points"] if p["excluded"]] == [1, 2]
    assert "misses the deadline" in sec["points"][0]["excluded"]
    assert sec["winners"] == {"time": 16, "cost": want_n, "energy": want_n}
    # the front: every point not beaten on all three figures (here each count trades time
    # for cost, so all are on it)
    assert all(p["pareto"] for p in sec["points"])
    # written and read back, byte for byte; schema 8; the table and the picture from the file
    again = Plan.from_json(got.to_json())
    assert again.to_json() == got.to_json() and again.schema_version == 8
    from autoplan.planner.explain import explain_plan
    text = explain_plan(again)
    assert "objectives: cost" in text and f"cost -> {want_n} GPUs" in text
    with pytest.raises(PlanError, match="schema 8"):
        Plan.from_dict({**json.loads(got.to_json()), "schema_version": 7})
    bad = json.loads(got.to_json())
    bad["objectives"]["chosen_gpus"] = 16
    with pytest.raises(PlanError, match="objectives.chosen_gpus"):
        Plan.from_dict(bad)
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources
    schema = json.loads((resources.files("autoplan.planner") / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(got.to_json()))


def test_no_plan_meeting_the_bounds_says_what_to_change(graph, every_plan):
    cluster, brute = every_plan
    fastest_days = min(r for _, r, _ in brute) / 86_400
    with pytest.raises(ConfigError, match=r"--deadline [0-9.]+ or more") as e:
        autoplan.plan(graph, cluster, global_batch_size=16, objective="cost", tokens=TOKENS,
                      deadline_days=fastest_days / 2, max_gpus=16)
    assert "16 devices" in str(e.value)
    cheapest = min(c for _, _, c in brute)
    with pytest.raises(ConfigError, match="--budget-usd"):
        autoplan.plan(graph, cluster, global_batch_size=16, objective="time", tokens=TOKENS,
                      budget_usd=cheapest / 2, max_gpus=2)


def test_bad_objective_options_are_refused_before_the_search(graph):
    for kw, words in ((dict(objective="speed"), "objective"),
                      (dict(deadline_days=3), "tokens"), (dict(budget_usd=9), "tokens"),
                      (dict(max_gpus=0), "max_gpus"), (dict(tokens=1.5), "tokens"),
                      (dict(tokens=10, deadline_days=math.inf), "deadline_days"),
                      (dict(economics={"tdp_watt": 0}), "tdp_watt")):
        with pytest.raises(ConfigError, match=words):
            autoplan.plan(graph, "dgx-h100", global_batch_size=16, **kw)
    with pytest.raises(ConfigError, match="no price for device"):   # CPUs have no list price
        autoplan.plan(graph, "local:1", global_batch_size=16, precision="fp32",
                      objective="cost", profile=None)


# ---- the command line --------------------------------------------------------------------------
def test_plan_command_prints_the_front_and_draws_it(tmp_path, capsys):
    from autoplan.cli.main import main
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--cluster", "dgx-h100/4", "--global-batch", "16",
                 "--objective", "energy", "--tokens", "2e9", "--usd-per-gpu-hour", "3",
                 "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "objectives: energy" in text and "$3/GPU-hour (given)" in text
    assert "wins: time -> 4 GPUs" in text and "the plan's energy: compute" in text
    sec = Plan.from_json(out.read_text()).objectives
    assert sec["tokens"] == 2 * 10 ** 9 and [p["gpus"] for p in sec["points"]] == [1, 2, 4]
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"          # inspect draws the same front from the plan file
    assert main(["inspect", str(out), "--pareto", str(again)]) == 0
    assert f"wrote {again}" in capsys.readouterr().out
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = tmp_path / "plain.json"
    assert main(["plan", "gpt-tiny", "--cluster", "dgx-h100/1", "--global-batch", "16",
                 "-q", "-o", str(plain)]) == 0
    assert main(["inspect", str(plain), "--pareto", str(again)]) == 1
    assert "holds no objectives search to draw" in capsys.readouterr().err
    assert main(["plan", "gpt-tiny", "--cluster", "dgx-h100/1", "--global-batch", "16",
                 "--deadline", "3", "-q", "-o", str(out)]) == 1
    assert "--deadline bounds a whole run" in capsys.readouterr().err
