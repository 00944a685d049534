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


@pytest.mark.parametrize("schedule", ["zero_bubble", "dualpipev"])     # W blocks; a V
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
    # the pictures say what the text report says: the step time, each stage's peak memory
    from autoplan.planner import figures_draw
    from autoplan.planner.explain_memory import stage_total as _stage_total
    assert figures_draw.draw_timeline(p, str(t)) == pytest.approx(p.predicted["step_time_s"])
    peaks = figures_draw.draw_memory(p, str(m))
    assert peaks == pytest.approx([_stage_total(st) for st in p.predicted["stages"]])


# ------------------------------------------------------------ collectives on their own stream
def test_gradient_sync_streams_behind_the_last_backward():
    """A chunk's gradient sync goes layer by layer behind its last backward: with 4 layers only
    the last layer's share (sync / 4) is left after the rank's compute ends."""
    kw = dict(schedule="1f1b", p=2, v=1, m=4, fwd_s=[1.0, 1.0], bwd_s=[1.0, 1.0])
    base = simulate(**kw)
    r = simulate(sync_s=[0.5, 0.5], layers=[4, 4], **kw)
    assert r.makespan_s == pytest.approx(base.makespan_s + 0.5 / 4)
    assert [e.kind for e in r.comm_events] == ["sync", "sync"]
    assert r.comm_busy_s == pytest.approx((0.5, 0.5))
    # a sync longer than the backward it hides behind is exposed beyond it
    slow = simulate(sync_s=[3.0, 3.0], layers=[4, 4], **kw)
    assert slow.makespan_s == pytest.approx(base.makespan_s - 1.0 + 0.25 + 3.0)


def test_interleaving_hides_the_earlier_chunks_syncs():
    """With 2 chunks per rank the first chunk finishes its backwards earlier: its sync overlaps
    the other chunk's, so less is exposed than when the same sync waits for the end."""
    kw = dict(schedule="interleaved_1f1b", p=2, v=2, m=4, fwd_s=[0.5] * 4, bwd_s=[0.5] * 4)
    base = simulate(**kw).makespan_s
    split = simulate(sync_s=[1.0] * 4, layers=[2] * 4, **kw).makespan_s - base
    whole = simulate(**{**kw, "schedule": "1f1b", "v": 1, "fwd_s": [1.0] * 2,
                        "bwd_s": [1.0] * 2})
    one = simulate(sync_s=[2.0] * 2, layers=[4] * 2, **{**kw, "schedule": "1f1b", "v": 1,
                                                          "fwd_s": [1.0] * 2,
                                                          "bwd_s": [1.0] * 2})
    assert split < one.makespan_s - whole.makespan_s


def test_fsdp_gathers_are_prefetched_and_queue_behind_reductions():
    kw = dict(schedule="1f1b", p=2, v=1, m=4, fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0])
    base = simulate(**kw).makespan_s
    # small collectives: hidden but for the first gather's first layer and the last reduce's
    cheap = simulate(fsdp_s=[(0.4, 0.4, 0.4)] * 2, layers=[4, 4], **kw)
    assert base < cheap.makespan_s <= base + 0.4 / 4 + 0.4 / 4 + 1e-9
    kinds = {e.kind for e in cheap.comm_events}
    assert kinds == {"gather", "reduce"}
    # gathers and reductions of 8 micro-batch actions at 3 s each: the stream is the bottleneck
    slow = simulate(fsdp_s=[(3.0, 3.0, 3.0)] * 2, layers=[4, 4], **kw)
    assert slow.makespan_s >= max(slow.comm_busy_s) >= 4 * 9.0 - 1e-9
    for r in range(2):              # one stream per rank: its collectives never overlap
        ev = [e for e in slow.comm_events if e.rank == r]
        ev.sort(key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(ev, ev[1:]))



@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                        ("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2),
                                        ("dualpipev", 2)])
def test_totals_are_the_full_simulations_totals(schedule, v):
    """The planner reads ``pipeline_totals`` (no events kept); it must be the same numbers as
    the full simulation's, with uneven stages, sends, syncs and FSDP traffic."""
    import random

    from autoplan.estimate.pipeline_sim import PipelineTotals, pipeline_totals
    rng = random.Random(7)
    p, m = 4, 8
    n = p * v
    kw = dict(schedule=schedule, p=p, v=v, m=m,
              fwd_s=[rng.uniform(0.5, 1.5) for _ in range(n)],
              bwd_s=[rng.uniform(1.0, 3.0) for _ in range(n)],
              send_s=[rng.uniform(0.0, 0.2) for _ in range(n - 1)],
              activation_bytes=[rng.uniform(1.0, 2.0) for _ in range(n)])
    for extra in ({}, {"sync_s": [rng.uniform(0.1, 4.0) for _ in range(n)],
                       "layers": [rng.randint(1, 4) for _ in range(n)]},
                  {"fsdp_s": [tuple(rng.uniform(0.0, 1.0) for _ in range(3)) for _ in range(n)],
                   "sync_s": [0.3] * n, "layers": [2] * n}):
        full = simulate(**kw, **extra)
        assert pipeline_totals(**kw, **extra) == PipelineTotals.of(full)
        # the peaks (read off the actions as they end) are the memory timelines' highest
        assert full.peak_activation_bytes == pytest.approx(
            [max(level for _, level in line) for line in full.memory_timeline], rel=1e-12)
    # equal stages: many actions end at one instant, where frees come before allocations
    even = dict(kw, fwd_s=[1.0] * n, bwd_s=[2.0] * n, send_s=[], activation_bytes=[1.0] * n)
    full = simulate(**even)
    assert full.peak_activation_bytes == pytest.approx(
        [max(level for _, level in line) for line in full.memory_timeline], rel=1e-12)


# ------------------------------------------------------------ V-shaped schedules
def _torch_order(schedule, p, m, r):
    """torch's own action list for rank ``r`` (what its runtime executes), as (kind, mb,
    chunk): overlapped forward-backward pairs run one after the other."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts
    cls = {"zbv": ts.ScheduleZBVZeroBubble, "dualpipev": ts.ScheduleDualPipeV}[schedule]
    kinds = {ts.FORWARD: "F", ts.BACKWARD_INPUT: "B", ts.BACKWARD_WEIGHT: "W",
             ts.FULL_BACKWARD: "BW"}
    me = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    out = []
    for a in cls._calculate_single_rank_operations(me, r):
        for x in (a.sub_actions or (a,)) if a is not None else ():
            out.append((kinds[x.computation_type], x.microbatch_index, x.stage_index))
    return out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_run_torchs_own_action_order(schedule):
    """The simulator's order for every rank is the list torch's ScheduleZBVZeroBubble /
    ScheduleDualPipeV hands its runtime, micro-batch for micro-batch."""
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from autoplan.estimate.schedule_orders import orders
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 2):
            if schedule == "dualpipev" and m < 2 * p:
                continue
            mine = orders(schedule, p, 2, m)
            for r in range(p):
                assert mine[r] == _torch_order(schedule, p, m, r), (p, m, r)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_v_schedules_keep_zero_bubbles_time_with_1f1bs_memory(schedule, p, m):
    """With T_F = T_B = T_W (Qi et al. 2024 Sec. 6) the V schedules take interleaved zero
    bubble's time: a bubble of one chunk forward per extra rank, a sixth of 1F1B's; ZB-V keeps 1F1B's p micro-batches in flight on every rank (the V
    balances memory), DualPipeV one chunk more; interleaved zero bubble keeps more. Every
    action runs once, the turn of the V sends nothing, every W follows its B."""
    n = 2 * p
    f, b = 0.5, 1.0
    kw = dict(p=p, m=m, fwd_s=[f] * n, bwd_s=[b] * n, activation_bytes=[0.5] * n,
              send_s=[0.1] * (n - 1))
    r = simulate(schedule=schedule, v=2, **kw)
    one = simulate(schedule="1f1b", v=1, p=p, m=m, fwd_s=[1.0] * p, bwd_s=[2.0] * p,
                   activation_bytes=[1.0] * p)
    zb = simulate(schedule="zero_bubble", v=2, **kw)
    work = m * 3.0
    assert r.makespan_s < one.makespan_s
    free = simulate(schedule=schedule, v=2, **{**kw, "send_s": ()})
    assert free.makespan_s - work == pytest.approx((p - 1) * f)
    assert free.makespan_s - work == pytest.approx((one.makespan_s - work) / 6)
    assert free.makespan_s == pytest.approx(
        simulate(schedule="zero_bubble", v=2, **{**kw, "send_s": ()}).makespan_s)
    assert max(r.peak_activation_bytes) == pytest.approx(p + (0.5 if schedule == "dualpipev"
                                                             else 0.0))
    assert max(r.peak_activation_bytes) < max(zb.peak_activation_bytes)
    seen = {(e.kind, e.microbatch, e.chunk, e.end_s - e.start_s): e for e in r.events}
    assert sum(1 for e in r.events if e.kind == "F") == m * n
    assert sum(1 for e in r.events if e.kind == "B") == m * n
    assert len(seen) == len(r.events)
    from autoplan.sharding.parallel_config import chunk_ranks
    ranks = chunk_ranks(schedule, p, 2)
    assert ranks == tuple(range(p)) + tuple(reversed(range(p)))
    start = {(e.kind, e.microbatch, e.chunk): e for e in r.events if e.kind == "F"}
    for (kind, mb, c), e in start.items():
        if c > 0:
            gap = 0.0 if ranks[c] == ranks[c - 1] else 0.1
            assert e.start_s >= start[("F", mb, c - 1)].end_s + gap - 1e-12


def test_v_schedules_need_two_chunks_per_rank_and_enough_microbatches():
    from autoplan.sharding.parallel_config import ParallelConfig
    with pytest.raises(ConfigError, match="virtual_stages=2"):
        ParallelConfig(pp=2, schedule="zbv", virtual_stages=4)
    with pytest.raises(ConfigError, match="2 x pp"):
        _uniform("dualpipev", 4, 2, 6)
    cfg = ParallelConfig(pp=4, schedule="dualpipev", virtual_stages=2)
    assert [cfg.rank_chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert ParallelConfig(pp=4, schedule="zero_bubble", virtual_stages=2).rank_chunks(1) == (1, 5)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_peaks_settle_by_the_steady_state(schedule):
    """``order_peak_chunks`` reads a V schedule's peaks off an order of at most
    STEADY_MICROBATCHES_PER_RANK x p micro-batches: every longer order keeps the same peaks."""
    from autoplan.estimate.schedule_orders import (STEADY_MICROBATCHES_PER_RANK,
                                                   _order_peak_chunks, order_peak_chunks)
    for p in (2, 3, 4, 5, 8, 16):
        cap = STEADY_MICROBATCHES_PER_RANK * p
        for m in range(2 * p, 12 * p + 1, 1 if p < 8 else 5):
            assert _order_peak_chunks(schedule, p, 2, m) == order_peak_chunks(schedule, p, 2, m)
        assert order_peak_chunks(schedule, p, 2, 1000) == _order_peak_chunks(schedule, p, 2, cap)


# ---- the critical path ----------------------------------------------------------------------

_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
              ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule,v", _SCHEDULES)
@pytest.mark.parametrize("seed", range(6))
def test_the_critical_path_is_the_makespan_and_a_chain_at_other_times(schedule, v, seed):
    """The chain walked back from the last action adds up to the simulated step at the times
    it was found with; at other times it is still a chain of the schedule, so no longer than
    the step there (zero bubble's greedy weight gradients aside: they go where they fit, so the
    chains themselves move with the times)."""
    import random
    from autoplan.estimate.critical_path import critical_path
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    m = 2 * p if schedule == "dualpipev" or v > 1 else rng.choice([1, 3, 4, 8])
    n = p * v
    f = [rng.uniform(0.5, 1.5) for _ in range(n)]
    b = [rng.uniform(1.0, 3.0) for _ in range(n)]
    s = [rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in range(n - 1)]
    kw = dict(schedule=schedule, p=p, v=v, m=m)
    path = critical_path(fwd_s=f, bwd_s=b, send_s=s, **kw)
    assert path.length_s(f, b, s) == pytest.approx(simulate(fwd_s=f, bwd_s=b, send_s=s,
                                                            **kw).makespan_s, rel=1e-12)
    assert path.makespan_s == pytest.approx(path.length_s(f, b, s), rel=1e-12)
    assert sum(path.fwd) >= 1 and sum(path.bwd) > 0
    if schedule != "zero_bubble":
        for _ in range(5):
            f2 = [x * rng.uniform(0.8, 1.2) for x in f]
            b2 = [x * rng.uniform(0.8, 1.2) for x in b]
            s2 = [x * rng.uniform(0.5, 2.0) for x in s]
            step = simulate(fwd_s=f2, bwd_s=b2, send_s=s2, **kw).makespan_s
            assert path.length_s(f2, b2, s2) <= step * (1 + 1e-12)


def test_a_first_rank_that_paces_1f1b_idles_where_the_others_are_slower_than_it():
    """Two ranks, the first the slower: its step is its own m micro-batches plus the idle time
    before its first backward (the second rank's forward and backward beyond its second
    forward) and before its last (beyond its backward), max(0, f1 + b1 - f0) +
    max(0, f1 + b1 - b0), not the whole round trip f1 + b1 a closed form charges. The path
    counts it so."""
    from autoplan.estimate.critical_path import critical_path
    for f0, b0, f1, b1, m in [(1.0, 2.0, 0.9, 1.8, 6), (1.0, 2.0, 0.5, 1.0, 6),
                              (2.0, 1.0, 0.4, 2.5, 5)]:
        want = m * (f0 + b0) + max(0.0, f1 + b1 - f0) + max(0.0, f1 + b1 - b0)
        kw = dict(schedule="1f1b", p=2, v=1, m=m, fwd_s=[f0, f1], bwd_s=[b0, b1])
        assert simulate(**kw).makespan_s == pytest.approx(want, rel=1e-12)
        path = critical_path(**kw)
        assert path.length_s([f0, f1], [b0, b1]) == pytest.approx(want, rel=1e-12)
