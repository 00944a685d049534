"""The pipeline simulator reproduces the schedules' published bubble and memory figures."""

import pytest

from autoplan.errors import ConfigError
from autoplan.estimate.pipeline_sim import simulate


def _uniform(schedule, p, v, m, f=1.0, b=2.0, send=0.0):
    n = p * v
    return simulate(schedule=schedule, p=p, v=v, m=m, fwd_s=[f / v] * n, bwd_s=[b / v] * n,
                    send_s=[send] * (n - 1), activation_bytes=[1.0 / v] * n)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 3), (8, 32)])
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    r = _uniform(schedule, p, 1, m)
    assert r.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.makespan_s == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 3, 16)])
def test_interleaving_divides_the_bubble_by_v(p, v, m):
    plain = _uniform("1f1b", p, 1, m)
    inter = _uniform("interleaved_1f1b", p, v, m)
    bubble = lambda r: r.makespan_s - m * 3.0          # noqa: E731
    assert bubble(inter) == pytest.approx(bubble(plain) / v, abs=1e-9)


def test_activations_in_flight_per_schedule():
    p, m = 4, 8
    assert _uniform("gpipe", p, 1, m).peak_activation_bytes == (8.0,) * 4
    # 1F1B: rank r holds p - r micro-batches
    assert _uniform("1f1b", p, 1, m).peak_activation_bytes == (4.0, 3.0, 2.0, 1.0)
    # interleaved (Megatron-LM): (2(p-r-1) + (v-1)p + 1) chunks of 1/v of the stage
    inter = _uniform("interleaved_1f1b", p, 2, m).peak_activation_bytes
    assert inter == tuple((2 * (p - r - 1) + (2 - 1) * p + 1) / 2 for r in range(p))


def test_sends_and_slow_stages_stretch_the_step():
    fast = _uniform("1f1b", 4, 1, 8)
    slow_link = _uniform("1f1b", 4, 1, 8, send=0.5)
    assert slow_link.makespan_s > fast.makespan_s
    # one stage twice as slow sets the pace: about m times its extra time
    r = simulate(schedule="1f1b", p=4, v=1, m=8, fwd_s=[1, 1, 2, 1], bwd_s=[2, 2, 4, 2])
    assert r.makespan_s >= 8 * 6.0
    assert max(range(4), key=lambda k: r.busy_s[k]) == 2


def test_every_action_runs_once_in_dependency_order():
    r = _uniform("interleaved_1f1b", 4, 2, 8, send=0.1)
    seen = {(e.kind, e.microbatch, e.chunk): e for e in r.events}
    assert len(seen) == len(r.events) == 2 * 8 * 8
    for (kind, mb, c), e in seen.items():
        if kind == "F" and c > 0:
            assert e.start_s >= seen[("F", mb, c - 1)].end_s + 0.1 - 1e-12
        if kind == "B" and c < 7:
            assert e.start_s >= seen[("B", mb, c + 1)].end_s + 0.1 - 1e-12


@pytest.mark.parametrize("p,v,m", [(2, 1, 4), (4, 1, 8), (8, 1, 16), (4, 2, 8), (2, 2, 4)])
def test_zero_bubble_fills_the_bubble_with_weight_gradients(p, v, m):
    """ZB-H1 (Qi et al. 2024) with T_F = T_B = T_W: the 1F1B bubble (p-1)(F+B+W) shrinks to
    (p-1)(F+B-W); interleaving shrinks it further; every W runs after its own B."""
    n = p * v
    f, b = 1.0 / v, 2.0 / v                     # b = B + W, W = b / 2 = F
    zb = simulate(schedule="zero_bubble", p=p, v=v, m=m, fwd_s=[f] * n, bwd_s=[b] * n)
    base = "1f1b" if v == 1 else "interleaved_1f1b"
    one = simulate(schedule=base, p=p, v=v, m=m, fwd_s=[f] * n, bwd_s=[b] * n)
    work = m * v * (f + b)
    if v == 1:
        assert zb.makespan_s == pytest.approx(work + (p - 1) * (f + b / 2 - b / 2))
        assert one.makespan_s == pytest.approx(work + (p - 1) * (f + b))
    assert zb.makespan_s < one.makespan_s
    end = {(e.kind, e.microbatch, e.chunk): e.end_s for e in zb.events}
    start = {(e.kind, e.microbatch, e.chunk): e.start_s for e in zb.events}
    assert sum(1 for e in zb.events if e.kind == "W") == m * n
    for (kind, mb, c), t in start.items():
        if kind == "W":
            assert t >= end[("B", mb, c)] - 1e-12


def test_bad_inputs_raise():
    with pytest.raises(ConfigError, match="multiple"):
        _uniform("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ConfigError, match="unknown"):
        _uniform("zigzag", 2, 1, 2)
    with pytest.raises(ConfigError, match="chunks"):
        simulate(schedule="1f1b", p=2, v=1, m=2, fwd_s=[1.0], bwd_s=[1.0, 1.0])


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_inspect_draws_timeline_and_memory(tmp_path, schedule):
    pytest.importorskip("matplotlib")
    from autoplan import Cluster, plan
    from autoplan.cli.main import main
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt3-175b", device="meta", num_layers=8)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    p = plan(g, Cluster.preset("eth-a100-80gb", nodes=4), global_batch_size=64, profile=None,
             max_pp=4, force={"pp": 4, "schedule": schedule})
    path = tmp_path / "p.json"
    p.save(path)
    t, m = tmp_path / "t.png", tmp_path / "m.png"
    assert main(["inspect", str(path), "--timeline", str(t), "--memory", str(m)]) == 0
    for f in (t, m):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


def test_stage_partition_balances_embedding_and_head():
    from autoplan.estimate.partition import balanced_counts
    # no extras: an even split
    assert balanced_counts(12, 4, 1.0, 0.0, 0.0) == [3, 3, 3, 3]
    # a head worth two layers: the last stage takes fewer layers
    counts = balanced_counts(16, 4, 1.0, 0.0, 2.0)
    assert sum(counts) == 16 and counts[-1] < counts[0]
    loads = [c * 1.0 for c in counts]
    loads[-1] += 2.0
    assert max(loads) == 5.0
    assert balanced_counts(5, 1, 1.0, 3.0, 3.0) == [5]
