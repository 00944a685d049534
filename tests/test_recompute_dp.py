"""The per-layer recomputation DP (planner/recompute_dp.py) against brute force, and Chen's
sqrt(n) schedule coming out of it on a uniform chain."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from autoplan.planner.recompute_dp import (ChainLayer, LayerOption, solve_chain,
                                           uniform_best)


def _random_chain(rng: random.Random, n: int) -> list[ChainLayer]:
    """Unlike layers with none / ops / full: ops keeps its input and its products' outputs
    and replays the cheap ops; full keeps its input and replays its forward; both rebuild the
    layer's activations in backward."""
    layers = []
    for _ in range(n):
        acts = rng.uniform(1.0, 10.0)
        inp = rng.uniform(0.05, 0.3) * acts
        fwd = rng.uniform(0.5, 2.0)
        layers.append(ChainLayer(options=(
            LayerOption(policy="none", kept_bytes=acts, recompute_s=0.0),
            LayerOption(policy="ops", kept_bytes=inp + rng.uniform(0.2, 0.6) * acts,
                        recompute_s=rng.uniform(0.05, 0.3) * fwd, working_bytes=acts),
            LayerOption(policy="full", kept_bytes=inp, recompute_s=fwd, working_bytes=acts),
        ), input_bytes=inp, fwd_s=fwd))
    return layers


def _brute(layers, budget, flight):
    best = None
    for combo in itertools.product(*(layer.options for layer in layers)):
        mem = flight * sum(o.kept_bytes for o in combo) + max(o.working_bytes for o in combo)
        if mem <= budget:
            t = sum(o.recompute_s for o in combo)
            best = t if best is None else min(best, t)
    return best


def test_dp_matches_brute_force_on_random_chains():
    rng = random.Random(7)
    checked = infeasible = 0
    for trial in range(60):
        n = rng.randint(2, 7)
        layers = _random_chain(rng, n)
        flight = rng.choice([1.0, 2.0, 3.5])
        most = flight * sum(l.none_bytes for l in layers)
        least = flight * sum(min(o.kept_bytes for o in l.options) for l in layers) \
            + max(l.none_bytes for l in layers)
        budget = rng.uniform(0.8 * least, most)
        exact = _brute(layers, budget, flight)
        got = solve_chain(layers, budget_bytes=budget, in_flight=flight)
        if exact is None:
            assert got is None
            infeasible += 1
            continue
        assert got is not None, f"trial {trial}: infeasible where the optimum is {exact}"
        assert got.memory_bytes <= budget * (1 + 1e-9)
        assert got.recompute_s <= exact * 1.05 + 1e-12, (trial, got.recompute_s, exact)
        assert got.recompute_s >= exact - 1e-9        # and never better than the optimum
        checked += 1
    assert checked >= 40 and infeasible >= 1


def test_thinned_fronts_stay_feasible_and_close():
    """With small fronts (thinned from the fifth layer on) the answer still fits and stays near."""
    rng = random.Random(3)
    for _ in range(10):
        layers = _random_chain(rng, 7)
        budget = 0.6 * sum(l.none_bytes for l in layers)
        exact = _brute(layers, budget, 1.0)
        got = solve_chain(layers, budget_bytes=budget, max_states=32)
        if exact is None:
            continue
        assert got is not None and got.memory_bytes <= budget * (1 + 1e-9)
        assert got.recompute_s <= exact * 1.10 + 1e-12


def test_mix_beats_the_best_uniform_policy():
    """Where a uniform policy must recompute every layer, the DP recomputes only some."""
    layers = [ChainLayer(options=(
        LayerOption(policy="none", kept_bytes=10.0, recompute_s=0.0),
        LayerOption(policy="full", kept_bytes=1.0, recompute_s=1.0, working_bytes=10.0)))
        for _ in range(8)]
    budget = 50.0
    uni = uniform_best(layers, budget_bytes=budget)
    got = solve_chain(layers, budget_bytes=budget)
    assert uni.policies == ("full",) * 8 and uni.recompute_s == 8.0
    # k layers kept whole: 10k + (8 - k) + 10 <= 50 -> k = 3
    assert got.policies.count("none") == 3 and got.recompute_s == 5.0
    assert got.memory_bytes <= budget


@pytest.mark.parametrize("n", [16, 64])
def test_chen_sqrt_n_on_a_uniform_chain(n):
    """Chen et al. 2016: a chain of n like layers whose inputs are as large as their
    activations (1 unit each), checkpointed in segments: the least memory at one extra forward
    is about 2 sqrt(n) units, with segments of about sqrt(n) layers."""
    layers = [ChainLayer(options=(LayerOption(policy="none", kept_bytes=1.0, recompute_s=0.0),),
                         input_bytes=1.0, fwd_s=1.0) for _ in range(n)]
    root = math.sqrt(n)
    # smallest budget the DP fits: search it
    lo, hi = 1.0, float(n)
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        if solve_chain(layers, budget_bytes=mid, max_segment=n) is None:
            lo = mid
        else:
            hi = mid
    sol = solve_chain(layers, budget_bytes=hi, max_segment=n)
    assert sol is not None
    assert hi <= 2 * root + 2                       # Chen's 2 sqrt(n) memory
    lengths = [j - i for i, j in sol.segments]
    assert lengths and all(abs(k - root) <= root / 2 + 1 for k in lengths)
    assert sol.recompute_s <= n                     # at most one extra forward
    # without segments nothing below n units fits (each layer keeps one unit)
    assert solve_chain(layers, budget_bytes=n - 1, max_segment=1) is None


def test_the_search_chooses_per_layer_recomputation_with_weights_kept_whole():
    """Llama-3-8B on one 8 x H100 node, ZeRO-3 with the attention weights kept whole
    (``dp_whole``), micro-batches of 2: recomputation is needed to fit, and the plan's per-layer
    choice recomputes less than any uniform policy that fits the same configuration; the plan
    file carries it layer by layer."""
    from dataclasses import replace

    from autoplan import Cluster, estimate, plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.planner.compare import plan_sharding
    ex = build_example("llama3-8b", device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    p = plan(g, cluster, global_batch_size=64, profile=None, max_pp=1,
             force=dict(zero_stage=3, tp=1, micro_batch_size=2,
                        dp_whole=["layers.*.attention.*"]))
    cfg = p.config
    assert cfg.dp_whole and cfg.layer_recompute is not None and p.predicted["fits"]
    assert len(set(cfg.layer_recompute)) > 1
    assert list(p.recompute.values()) == list(cfg.layer_recompute)
    mine = p.predicted["time"]["recompute_s"]
    sh = plan_sharding(p, g)
    uniform = [estimate(g, cluster, config=replace(cfg, layer_recompute=None, recompute=r,
                                                   layer_offload=None),
                        global_batch_size=64, profile=None, sharding=sh)
               for r in ("none", "selective", "ops", "full")]
    fitting = [e.time.recompute_s for e in uniform if e.fits]
    assert not uniform[0].fits and fitting and mine < min(fitting)


@pytest.fixture(scope="module")
def gpt3_pp2():
    """GPT-3 175B shapes with 24 layers (traced on meta), two DGX A100 nodes, and a pp 2 x tp 8
    config at micro-batch 16 that fits only with full recomputation."""
    from autoplan import Cluster, ParallelConfig
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=24)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cfg = ParallelConfig(dp=1, tp=8, pp=2, micro_batch_size=16, sequence_parallel=True,
                         recompute="full", chunk_layers=(12, 12))
    return g, Cluster.preset("dgx-a100-80gb", nodes=2), cfg


def test_per_layer_choice_composes_with_the_stage_partition(gpt3_pp2):
    """GPT-3 175B shapes, 24 layers over pp 2 x tp 8, micro-batches of 16 (1F1B: the first
    stage holds two in flight, the last one); no uniform policy but full fits. The chain DP
    gives each stage its own policies within its own budget, keeps the split, and the result
    fits and recomputes less; the first stage recomputes more than the last."""
    from dataclasses import replace

    from autoplan import estimate
    from autoplan.estimate.estimator import cost_inputs
    from autoplan.planner.recompute_choice import per_layer_config
    from autoplan.sharding.parallel_config import RECOMPUTE
    g, cluster, cfg = gpt3_pp2

    def est(c):
        return estimate(g, cluster, config=c, global_batch_size=64, profile=None)
    assert [est(replace(cfg, recompute=r)).fits for r in RECOMPUTE] == [False] * 3 + [True]
    full = est(cfg)
    new = per_layer_config(cost_inputs(g, cluster, cfg, None, None, 1.0), full)
    assert new is not None and new.chunk_layers == (12, 12) and len(set(new.layer_recompute)) > 1
    mixed = est(new)
    assert mixed.fits and mixed.time.recompute_s < full.time.recompute_s
    first, last = new.layer_recompute[:12], new.layer_recompute[12:]
    assert sum(map(RECOMPUTE.index, first)) > sum(map(RECOMPUTE.index, last))


# ---- activation offload in the same choice ---------------------------------------------------

def _offload_chain(rng: random.Random, n: int, link: float) -> list[ChainLayer]:
    """Unlike layers with the options the runtime runs: none / ops / full, each also offloaded
    (what it keeps goes to the host: kept on the device drops by the bytes moved; its exposed
    copy seconds grow with the bytes over ``link``, less what the next layer's compute hides),
    and selective never offloaded."""
    layers = []
    for _ in range(n):
        acts = rng.uniform(1.0, 10.0)
        inp = rng.uniform(0.05, 0.3) * acts
        fwd = rng.uniform(0.5, 2.0)
        ops_keep = inp + rng.uniform(0.2, 0.6) * acts
        plain = [("none", acts, 0.0, 0.0, acts), ("ops", ops_keep, 0.2 * fwd, acts, inp),
                 ("full", inp, fwd, acts, inp)]
        opts = [LayerOption(policy="selective", kept_bytes=0.7 * acts, recompute_s=0.1 * fwd,
                            working_bytes=0.3 * acts)]
        for policy, kept, rs, work, moved in plain:
            opts.append(LayerOption(policy=policy, kept_bytes=kept, recompute_s=rs,
                                    working_bytes=work))
            hidden = rng.uniform(0.0, 1.0) * fwd
            opts.append(LayerOption(policy=policy, kept_bytes=kept - moved, recompute_s=rs,
                                    working_bytes=work, offload=True, moved_bytes=moved,
                                    offload_s=max(0.0, 2 * moved / link - hidden)))
        layers.append(ChainLayer(options=tuple(opts)))
    return layers


def _brute_joint(layers, budget, flight, host):
    best = None
    for combo in itertools.product(*(layer.options for layer in layers)):
        moved = [o.moved_bytes for o in combo if o.offload]
        mem = (flight * sum(o.kept_bytes for o in combo) + max(o.working_bytes for o in combo)
               + max(moved, default=0.0))
        if mem <= budget and flight * sum(moved) <= host:
            t = sum(o.time_s for o in combo)
            best = t if best is None else min(best, t)
    return best


def test_joint_recompute_and_offload_dp_matches_brute_force():
    """Recomputation and offload chosen together under a device and a host budget: the DP's
    time is the exact optimum's (within 5 %), its answer fits both budgets (the copy in flight
    counted), and it never offloads a selective layer."""
    rng = random.Random(11)
    checked = infeasible = mixed = 0
    for trial in range(40):
        n = rng.randint(2, 5)
        layers = _offload_chain(rng, n, link=rng.choice([2.0, 20.0, 200.0]))
        flight = rng.choice([1.0, 2.0])
        most = flight * sum(l.none_bytes for l in layers)
        budget = rng.uniform(0.3, 1.0) * most
        host = rng.choice([float("inf"), rng.uniform(0.0, 0.6) * most])
        exact = _brute_joint(layers, budget, flight, host)
        got = solve_chain(layers, budget_bytes=budget, in_flight=flight,
                          host_budget_bytes=None if host == float("inf") else host)
        if exact is None:
            assert got is None, trial
            infeasible += 1
            continue
        assert got is not None, f"trial {trial}: infeasible where the optimum is {exact}"
        assert got.memory_bytes <= budget * (1 + 1e-9) and got.host_bytes <= host * (1 + 1e-9)
        assert got.time_s <= exact * 1.05 + 1e-12, (trial, got.time_s, exact)
        assert got.time_s >= exact - 1e-9
        assert not any(o and p == "selective" for o, p in zip(got.offloads, got.policies))
        mixed += any(got.offloads) and any(p != "none" for p in got.policies)
        checked += 1
    assert checked >= 25 and infeasible >= 1 and mixed >= 5


def test_a_fast_host_link_offloads_some_layers_and_recomputes_the_rest():
    """Eight like layers that must shed memory: recomputing one costs 1 s, offloading it
    0.1 s of exposed copies (a fast host link), but the host holds only three layers' worth.
    The optimum (brute force) offloads some layers and recomputes others; recomputation alone
    costs more."""
    def layer(offload_ok: bool) -> ChainLayer:
        opts = [LayerOption(policy="none", kept_bytes=10.0, recompute_s=0.0),
                LayerOption(policy="full", kept_bytes=1.0, recompute_s=1.0, working_bytes=10.0)]
        if offload_ok:
            opts += [LayerOption(policy="none", kept_bytes=0.0, recompute_s=0.0, offload=True,
                                 moved_bytes=10.0, offload_s=0.1),
                     LayerOption(policy="full", kept_bytes=0.0, recompute_s=1.0,
                                 working_bytes=10.0, offload=True, moved_bytes=1.0,
                                 offload_s=0.01)]
        return ChainLayer(options=tuple(opts))
    budget, host = 50.0, 30.0
    joint = solve_chain([layer(True)] * 8, budget_bytes=budget, host_budget_bytes=host)
    alone = solve_chain([layer(False)] * 8, budget_bytes=budget)
    assert joint is not None and alone is not None
    assert _brute_joint([layer(True)] * 8, budget, 1.0, host) == pytest.approx(joint.time_s)
    # some layers offloaded whole, the rest kept or recomputed (their inputs offloaded too,
    # where the host has room): a mix, faster than recomputation alone
    whole = [o and p == "none" for o, p in zip(joint.offloads, joint.policies)]
    assert 0 < sum(whole) < 8 and "full" in joint.policies
    assert joint.time_s < 4.0 and alone.time_s == 5.0
    assert joint.host_bytes <= host and joint.memory_bytes <= budget
    # with room on the host, nothing is recomputed: four layers offloaded (4 x 10 kept and
    # one copy of 10 in flight fill the 50)
    free = solve_chain([layer(True)] * 8, budget_bytes=budget)
    assert set(free.policies) == {"none"} and free.offloads.count(True) == 4
    assert free.time_s == pytest.approx(0.4)


def test_joint_choice_per_pipeline_stage_and_not_on_cpus(gpt3_pp2):
    """GPT-3 175B shapes, 24 layers over pp 2 x tp 8 on DGX A100s (the stage-partition test
    above): with offload allowed, each stage chooses its own offloaded layers within its own
    device and host budgets, the split kept; the result fits, recomputes less than the
    recompute-only choice and is no slower. CPU clusters are not offered it."""
    from dataclasses import replace

    from autoplan import Cluster, estimate
    from autoplan.estimate.estimator import cost_inputs
    from autoplan.planner.options import SearchOptions
    from autoplan.planner.recompute_choice import per_layer_config
    from autoplan.planner.search_space import layer_offload_offered
    g, cluster, cfg = gpt3_pp2

    def est(c):
        return estimate(g, cluster, config=c, global_batch_size=64, profile=None)
    full = est(cfg)
    ci = cost_inputs(g, cluster, cfg, None, None, 1.0)
    alone = est(per_layer_config(ci, full))
    joint_cfg = per_layer_config(ci, full, offload=True)
    assert joint_cfg.chunk_layers == (12, 12) and joint_cfg.layer_offload is not None
    joint = est(joint_cfg)
    assert joint.fits and joint.time.recompute_s < alone.time.recompute_s
    assert joint.step_time_s <= alone.step_time_s
    # the first stage (two micro-batches in flight) offloads; the last one's first layer
    # never does under full recomputation: its input, all it keeps, is held by the schedule
    first, last = joint_cfg.layer_offload[:12], joint_cfg.layer_offload[12:]
    assert any(first) and not (last[0] and joint_cfg.layer_recompute[12] == "full")
    host_share = cluster.host.memory_bytes / cluster.devices_per_node
    assert all(s.memory.offloaded_bytes <= host_share for s in joint.stages)
    # what the estimate moves per stage is what its layers' rows say
    rows = joint.layer_recompute
    assert sum(r["offloaded_bytes"] for r in rows[:12]) == pytest.approx(
        joint.stages[0].offloaded_activation_bytes_per_microbatch)
    opts = SearchOptions()
    assert layer_offload_offered(cfg, opts, cluster)
    assert not layer_offload_offered(cfg, opts, Cluster.local(2))
    assert not layer_offload_offered(replace(cfg, compiled=True), opts, cluster)
