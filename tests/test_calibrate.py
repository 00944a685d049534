"""`autoplan calibrate`'s mechanics, deterministically: the refits recover known coefficients
from synthetic measurements, the phases of a recorded trace add up to the step, and a written
profile is what the next plan on this machine uses. (Its accuracy is a benchmark's business.)"""

import random

import pytest

from autoplan.cost.compute import size_efficiency
from autoplan.cost.refit import fit_line, refit_compute, refit_link
from autoplan.estimate.attribution import PHASES, attribute, collective_kind
from tests.distributed import run_ranks
from tests.test_checkpoint import GLOBAL_BATCH, _example, _plan


def _kernel(name, shapes, dur, start=0.0):
    return {"name": name, "thread": 1, "start_s": start, "dur_s": dur, "top": False,
            "leaf": True, "shapes": shapes}


def test_refit_recovers_known_coefficients():
    rng = random.Random(0)
    rate, bw, launch = 80e9, 12e9, 3e-6
    events = []
    for _ in range(200):
        m, k, n = (rng.choice([16, 64, 256, 512]) for _ in range(3))
        events.append(_kernel("aten::mm", [[m, k], [k, n]], launch + 2 * m * k * n / rate))
        size = rng.choice([1, 8, 4096, 65536, 1 << 20])
        nbytes = 4 * (size + size)
        events.append(_kernel("aten::gelu", [[size]], launch + nbytes / bw))
    fit = refit_compute(events, 1)
    assert fit.matmul_flops_per_s == pytest.approx(rate, rel=1e-6)
    assert fit.memory_bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert fit.launch_s == pytest.approx(launch, rel=1e-2)
    # on a size curve (small products slower), the rate of its fraction 1
    curve = ((16.0, 0.25), (64.0, 0.75), (512.0, 1.0))
    events = []
    for _ in range(200):
        m, k, n = (rng.choice([16, 64, 256, 512]) for _ in range(3))
        size = (m * k * n) ** (1 / 3)
        events.append(_kernel("aten::mm", [[m, k], [k, n]],
                              launch + 2 * m * k * n / (rate * size_efficiency(curve, size))))
    fit = refit_compute(events, 1, curve)
    assert fit.matmul_flops_per_s == pytest.approx(rate, rel=1e-6)
    # a link: A * latency + B / bandwidth
    lat, link_bw = 40e-6, 2.5e9
    sizes = [(2, 1e3), (2, 1e5), (4, 1e6), (2, 4e6)]
    samples = [(a, b, a * lat + b / link_bw) for _ in range(50) for a, b in sizes]
    link = refit_link(samples)
    assert link.latency_s == pytest.approx(lat, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(link_bw, rel=1e-6)
    # waits for a late peer (mean 10 us per message step) are added to the latency; the
    # bandwidth is the link's (the lower envelope of each size)
    jittered = [(a, b, t + a * (20e-6 if i // 4 % 2 else 0.0))
                for i, (a, b, t) in enumerate(samples)]
    link = refit_link(jittered)
    assert link.wait_s == pytest.approx(10e-6, rel=1e-6)
    assert link.latency_s == pytest.approx(lat + 10e-6, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(link_bw, rel=1e-6)
    assert fit_line([1.0, 1.0], [2.0, 3.0]) is None            # no spread, no fit


def _record(rank, world, plan_json):
    import torch

    from autoplan.planner.planfile import Plan
    from autoplan.runtime.step_trace import record_steps
    from autoplan.runtime.trainer import compile
    ex = _example(GLOBAL_BATCH)
    small = _example(1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (ex.targets,)
    trainer.step(batch)
    return record_steps(trainer, batch, 2)


def test_phases_of_a_recorded_trace_add_up_to_the_step():
    plan = _plan(2, dict(tp=2, sequence_parallel=True))
    for rec in run_ranks(_record, 2, plan.to_json()):
        ph = attribute(rec["events"], rec["step_s"])
        assert set(ph.seconds) == set(PHASES)
        assert ph.total_s() == pytest.approx(ph.step_s, rel=1e-9)
        assert ph.step_s == pytest.approx(sum(rec["step_s"]) / 2, rel=0.05)
        s = ph.seconds
        assert s["compute.matmul"] > 0 and s["compute.other"] > 0 and s["optimizer"] > 0
        assert s["comm.all_gather"] + s["comm.reduce_scatter"] + s["comm.all_reduce"] > 0
        assert all(v >= 0 for v in s.values())
    assert collective_kind("gloo:all_reduce") == "all_reduce"
    assert collective_kind("nccl:send") == "p2p" and collective_kind("aten::mm") is None


def test_a_written_profile_is_what_the_next_plan_uses(tmp_path, monkeypatch):
    from autoplan import Cluster
    from autoplan.cli.calibrate_cmd import write_profile
    from autoplan.cluster import local
    from autoplan.cost.refit import ComputeFit, LinkFit
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(local, "local_cpu_device_name", lambda: "cpu-calibrate-test")
    before = Cluster.local(2)
    fits = {"compute": ComputeFit(matmul_flops_per_s=77e9, memory_bandwidth_bytes_per_s=9e9,
                                  launch_s=2e-6, points={"matmul": 9, "memory": 9}),
            "link": LinkFit(latency_s=55e-6, bandwidth_bytes_per_s=1.7e9, points=9),
            "optimizer_s_per_param": 1e-8, "threads": 1, "framework_s_per_op": 40e-6}
    path = write_profile(fits, None)
    assert path == str(tmp_path / "cpu-calibrate-test.json")
    after = Cluster.local(2)
    assert after.fingerprint() != before.fingerprint()
    assert after.links["loopback"].bandwidth_bytes_per_s == pytest.approx(1.7e9)
    assert after.links["loopback"].latency_s == pytest.approx(55e-6)
    assert after.device.peak_flops["fp32"] == pytest.approx(77e9)
    from autoplan.cluster.profile_db import ProfileDB
    db = ProfileDB.find("cpu-calibrate-test")
    assert db.calibration.optimizer_s_per_param == pytest.approx(1e-8)
    assert db.calibration.launch_s == pytest.approx(2e-6)
    assert db.calibration.framework_s_per_op == pytest.approx(40e-6)
    assert db.threads == 1
    # four ranks on two cores: each has half a core for its compute and its transfers, and no
    # core is left for gloo's threads to hide transfers behind compute
    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    shared = Cluster.local(4)
    assert shared.device.compute_share == pytest.approx(0.5)
    assert shared.device.overlap_interference == 1.0
    assert shared.links["loopback"].bandwidth_bytes_per_s == pytest.approx(0.85e9)
    assert shared.links["loopback"].latency_s == pytest.approx(110e-6)
    assert Cluster.local(1).device.overlap_interference is None


def test_first_use_probe_times_the_loopback_link():
    """Two real rank processes all-reduce over gloo; the fit gives the link physical figures."""
    from autoplan.machine.first_use import probe_loopback, unit_terms
    link = probe_loopback()
    assert link is not None
    assert 1e6 < link["bandwidth_bytes_per_s"] < 1e12
    assert 0.0 <= link["latency_s"] < 0.1
    # the cost model's terms: 2 ring steps of two loopback hops each; 2 (n-1)/n of the bytes
    a, b = unit_terms("all_reduce", 1 << 20, 2)
    assert a == pytest.approx(4.0, rel=1e-3) and b == pytest.approx(1 << 20, rel=1e-3)


def test_calibrate_command_measures_two_plans_and_writes_the_profile(tmp_path, monkeypatch):
    """`autoplan calibrate dp2.json tp2.json` end to end under torchrun: phases per plan, the
    joint fit, a profile with the framework time and the link, re-estimates of both plans."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "AUTOPLAN_PROFILE_DIR": str(tmp_path / "profiles"),
           "AUTOPLAN_AUTO_CALIBRATE": "0", "PYTHONWARNINGS": "ignore"}

    def autoplan(*args):
        out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", *args], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    from autoplan.cli.main import main
    for k in ("AUTOPLAN_PROFILE_DIR", "AUTOPLAN_AUTO_CALIBRATE"):
        monkeypatch.setenv(k, env[k])
    plans = []
    for name, force in (("dp2", ["tp=1", "zero_stage=0"]), ("tp2", ["tp=2"])):
        plans.append(str(tmp_path / f"{name}.json"))       # planned in this process
        assert main(["plan", "gpt-tiny", "--cluster", "local:2", "--global-batch", "4",
                     "--precision", "fp32", "--max-pp", "1", "-q",
                     *[x for f in force for x in ("--force", f)], "-o", plans[-1]]) == 0
    # 4 profiled steps: enough transfers of each size for the link's envelope fit (with 2, the
    # noise of a busy machine left no bandwidth term in about one run of twenty)
    text = autoplan("calibrate", *plans, "--model", "gpt-tiny", "--steps", "4",
                    "--warmup", "1")
    assert text.count("phase (rank") == 2 and "dp2 tp1" in text and "dp1 tp2" in text
    assert "refit (least squares" in text and text.count("re-estimated with the refit") == 2
    (profile,) = (tmp_path / "profiles").glob("*.json")
    data = json.loads(profile.read_text())
    assert "loopback" in data["links"] and data["threads"] == 1
    # written only when the fit leaves some (a busy machine's noise can leave none)
    assert data["calibration"].get("framework_s_per_op", 0.0) >= 0.0


def test_link_refit_keeps_the_known_bandwidth_when_sizes_do_not_determine_it():
    """Noise on a busy machine can make larger transfers no slower than smaller ones: the
    latency is still fitted, with the bandwidth planning already uses, and says so."""
    from autoplan.cost.refit import refit_link
    noisy = [(4.0, 1e3, 2.0e-3), (4.0, 1e3, 2.1e-3), (4.0, 1e6, 1.9e-3), (4.0, 1e6, 2.0e-3)]
    assert refit_link(noisy) is None
    fit = refit_link(noisy, known_bandwidth_bytes_per_s=1e9)
    assert fit.bandwidth_kept and fit.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert 0 < fit.latency_s < 1e-3
    clean = [(4.0, b, 4 * 1e-4 + b / 2e9) for b in (1e3, 1e6, 4e6) for _ in range(3)]
    fit = refit_link(clean, known_bandwidth_bytes_per_s=1e9)
    assert not fit.bandwidth_kept and fit.bandwidth_bytes_per_s == pytest.approx(2e9)


def test_the_waits_are_fitted_over_the_plans_with_the_measured_framework_time():
    """With the framework's time per op measured directly, the steps' residuals give the wait
    per transfer step alone (one unknown: least squares, at least 0)."""
    from autoplan.cli.calibrate_cmd import _waits
    slope = [20.0, 300.0]                # seconds of step per second of latency: dp2, tp2
    wait = 4e-4
    assert _waits(slope, [x * wait for x in slope], 0.0) == pytest.approx(wait)
    noisy = [slope[0] * wait + 2e-3, slope[1] * wait - 1e-3]
    assert _waits(slope, noisy, 0.0) == pytest.approx(wait, rel=0.05)
    assert _waits(slope, [-1e-2, -5e-2], 0.0) == 0.0
    assert _waits([0.0, 0.0], [1e-2, 1e-2], 3e-4) == 3e-4     # no transfers: the profiled one


def test_a_profile_without_the_framework_time_has_it_measured(tmp_path, monkeypatch):
    """A profile made before first use measured the eager framework's time per op (the one
    shipped for this CPU) gets it measured as first use does: fitted jointly with the waits
    from two plans it absorbed what else the steps spent (204 us per op, 6 us measured)."""
    from autoplan.cli.calibrate_cmd import _current_framework_s_per_op
    from autoplan.cluster.profile_db import ProfileDB
    monkeypatch.setenv("AUTOPLAN_PROFILE_CACHE", str(tmp_path))
    monkeypatch.setattr(ProfileDB, "find", staticmethod(lambda device: None))
    assert _current_framework_s_per_op() > 0
