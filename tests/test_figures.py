"""The pictures of `autoplan inspect --timeline/--memory` say what the text report says: the
timeline names every part of the step's time breakdown (exposed p2p included) and ends at the
step time, long pipelines are grouped with a window drawn block by block, and the memory chart
covers the whole step, stacked, its peak the predicted peak memory. Checked on the values the
drawing functions are given (``timeline_figure``, ``memory_figure``), and once drawn."""

import subprocess
import sys

import pytest

from autoplan import Cluster, plan
from autoplan.planner import figures
from autoplan.planner.explain import explain_plan
from autoplan.planner.explain_memory import stage_total as _stage_total


@pytest.fixture(scope="module")
def gpt3_eight_layers():
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt3-175b", device="meta", num_layers=8)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def _plan(graph, nodes, batch, **force):
    return plan(graph, Cluster.preset("eth-a100-80gb", nodes=nodes), global_batch_size=batch,
                profile=None, max_pp=force.get("pp", 1), force=force)


@pytest.fixture(scope="module")
def long_pipeline(gpt3_eight_layers):
    """The issue's case in small: slow Ethernet, pp 8, 128 micro-batches, where waiting on the
    pipeline's sends is the largest cost after compute."""
    return _plan(gpt3_eight_layers, 8, 128, pp=8, tp=8, schedule="1f1b")


PLANS = {"1f1b": dict(pp=4, schedule="1f1b"),
         "interleaved": dict(pp=4, schedule="interleaved_1f1b", virtual_stages=2),
         "zero_bubble": dict(pp=4, schedule="zero_bubble"),
         "dualpipev": dict(pp=4, schedule="dualpipev"),
         "no pipeline": dict(pp=1)}


@pytest.fixture(scope="module", params=list(PLANS))
def any_plan(request, gpt3_eight_layers):
    return _plan(gpt3_eight_layers, 4, 16, **PLANS[request.param])


def _report_times(p) -> dict[str, str]:
    """The text report's "time per step" items: name -> the time as printed."""
    lines = explain_plan(p).split("time per step", 1)[1].splitlines()[1:]
    out = {}
    for line in lines:
        if line.strip().startswith("= step time"):
            return out
        out[line[2:24].strip()] = line[24:36].strip()
    raise AssertionError("no '= step time' line in the report")


def _check_timeline(p):
    fig = figures.timeline_figure(p)
    step = p.predicted["step_time_s"]
    report = _report_times(p)
    named = {k for k, v in report.items() if v not in ("0 s", "0 ns")}
    # every part of the report's breakdown with a time is a named part of the picture, and
    # nothing else is; together they are the step
    assert {x.key for x in fig.parts} == named
    for x in fig.parts:
        assert x.label and x.seconds > 0
    # (a plan keeps 6 significant digits of each figure)
    assert sum(x.seconds for x in fig.parts) == pytest.approx(step, rel=1e-5)
    # the schedule, then the parts after it, end at the step time
    assert fig.end_s == pytest.approx(step, rel=1e-5)
    after = sum(x.seconds for x in fig.parts if x.where == "after")
    assert fig.schedule_end_s + after == pytest.approx(step, rel=1e-5)
    return fig


def test_the_timeline_names_every_part_of_the_step(any_plan):
    fig = _check_timeline(any_plan)
    p = any_plan.config.pp
    assert fig.ranks == p
    # the parts after the schedule are drawn on every rank, one after another
    keys = [x.key for x in fig.parts if x.where == "after"]
    assert len(fig.after) == p * len(keys)
    assert {b.kind for b in fig.after} == set(keys)


def test_the_long_pipeline_draws_exposed_p2p_and_a_window(long_pipeline):
    fig = _check_timeline(long_pipeline)
    t = long_pipeline.predicted["time"]
    p2p = next(x for x in fig.parts if x.key == "comm pp_p2p")
    assert p2p.where == "idle" and "p2p" in p2p.label
    assert p2p.seconds == pytest.approx(t["comm_exposed_s"]["pp_p2p"])
    assert p2p.seconds > 0.2 * fig.step_s            # a large part: the grey block
    assert fig.send_s > 0 and any("send" in n for n in fig.notes)
    # too many blocks to label: the whole step grouped, and a window at its start
    assert fig.window is not None and fig.columns
    lo, hi = fig.window
    assert lo == 0 and 0 < hi < fig.schedule_end_s / 4
    assert any("grouped" in n and "128 micro-batches" in n for n in fig.notes)
    for r in range(fig.ranks):
        drawn = [b for b in fig.blocks if b.rank == r and b.kind != "idle"]
        assert 2 <= len(drawn) <= figures.MAX_BLOCKS
        assert all(lo <= b.start_s < b.end_s <= hi + 1e-12 for b in drawn)
    # the grouped columns cover the whole schedule, each rank's shares adding up to 1
    for r in range(fig.ranks):
        cols = [c for c in fig.columns if c.rank == r]
        assert len(cols) == figures.COLUMNS
        assert cols[0].start_s == 0 and cols[-1].end_s == pytest.approx(fig.schedule_end_s)
        for c in cols:
            assert sum(s for _, s in c.shares) == pytest.approx(1.0)
    # the bottleneck rank idles for the bubble and the exposed p2p together, and computes for
    # the parts inside its blocks
    sim = figures.simulate_plan(long_pipeline)
    r = max(range(fig.ranks), key=lambda i: sim.busy_s[i])
    idle = sim.makespan_s - sim.busy_s[r]
    assert idle == pytest.approx(t["bubble_s"] + t["comm_exposed_s"]["pp_p2p"], rel=1e-4)
    inside = sum(x.seconds for x in fig.parts if x.where == "blocks")
    assert sim.busy_s[r] == pytest.approx(inside, rel=1e-5)


def test_a_short_schedule_is_drawn_block_by_block(gpt3_eight_layers):
    p = _plan(gpt3_eight_layers, 4, 16, pp=4, schedule="1f1b")
    fig = figures.timeline_figure(p)
    assert fig.window is None and not fig.columns
    for r in range(4):
        kinds = [b.kind for b in fig.blocks if b.rank == r and b.kind != "idle"]
        assert kinds.count("F") == kinds.count("B") == 16


def _check_memory(p):
    fig = figures.memory_figure(p)
    step = p.predicted["step_time_s"]
    stages = p.predicted["stages"]
    assert len(fig.series) == len(stages)
    for s, st in zip(fig.series, stages):
        # the whole step, stacked by kind
        assert s.times_s[0] == 0 and s.times_s[-1] == pytest.approx(step)
        assert list(s.times_s) == sorted(s.times_s)
        labels = [label for label, _ in s.bands]
        assert labels[:3] == ["weights", "gradients", "optimizer state"]
        assert labels[-1] == "activations"
        for _, vals in s.bands:
            assert len(vals) == len(s.times_s)
        # each stage's peak is its predicted memory, the fullest's the plan's peak
        assert max(s.totals) == pytest.approx(_stage_total(st), rel=1e-9)
    full = fig.series[fig.fullest]
    assert max(full.totals) == pytest.approx(p.predicted["peak_memory_bytes"], rel=1e-5)
    return fig


def test_the_memory_chart_covers_the_step_and_peaks_at_the_prediction(any_plan):
    _check_memory(any_plan)


def test_activations_grow_through_forwards_and_drain_through_backwards(long_pipeline):
    import numpy as np
    fig = _check_memory(long_pipeline)
    sim = figures.simulate_plan(long_pipeline)
    r = fig.fullest
    acts = dict(fig.series[r].bands)["activations"]
    times = fig.series[r].times_s
    events = [e for e in sim.events if e.rank == r]
    for kind, sign in (("F", 1), ("B", -1)):
        e = next(e for e in events[len(events) // 2:] if e.kind == kind)  # steady state
        a, mid, b = np.interp([e.start_s, (e.start_s + e.end_s) / 2, e.end_s], times, acts)
        assert sign * (b - a) > 0                      # a forward adds, a backward frees
        assert mid == pytest.approx((a + b) / 2)       # layer by layer, not at once
    # and the activations are gone once the schedule has drained
    assert acts[-1] == pytest.approx(0.0, abs=1.0)


def test_the_pictures_are_drawn(long_pipeline, tmp_path):
    pytest.importorskip("matplotlib")
    from autoplan.cli.main import main
    path = tmp_path / "p.json"
    long_pipeline.save(path)
    t, m = tmp_path / "t.png", tmp_path / "m.png"
    assert main(["inspect", str(path), "--timeline", str(t), "--memory", str(m)]) == 0
    for f in (t, m):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 20000


def test_figures_do_not_load_matplotlib():
    """The figures' values are computed without matplotlib: only drawing loads it."""
    code = ("import sys\n"
            "from autoplan import Cluster, plan\n"
            "from autoplan.models import build_example\n"
            "from autoplan.planner import figures\n"
            "ex = build_example('gpt-tiny', device='meta')\n"
            "p = plan(ex.model, Cluster.local(2), global_batch_size=8, profile=None,\n"
            "         example_inputs=ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,\n"
            "         force={'pp': 2})\n"
            "figures.timeline_figure(p); figures.memory_figure(p)\n"
            "print(sorted(m for m in sys.modules if m.startswith('matplotlib')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
