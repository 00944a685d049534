"""The search skips a configuration that only recomputes more than one that fits
(``costing.evaluate(prune_dominated=True)``): it would be no faster, so the plan is the one the
full enumeration finds. These tests hold the premise (``estimate`` never prices a stronger
recomputation policy faster) and the conclusion (same plan, same alternatives, fewer configs
costed)."""

from __future__ import annotations

import random

import pytest

from autoplan import Cluster, ParallelConfig, estimate
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner import costing, search
from autoplan.sharding.sharding import megatron_sharding, replicated


def _graph(name, **kw):
    ex = build_example(name, device="meta", batch_size=1, **kw)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny", "gpt3-6.7b"])
def test_a_stronger_recomputation_policy_is_never_faster(name):
    graph = _graph(name)
    cluster = Cluster.preset("dgx-a100-40gb", nodes=2)
    rng = random.Random(name)
    for _ in range(12):
        tp = rng.choice([1, 2, 4])
        dp = cluster.world_size // tp
        mbs = rng.choice([1, 2, 4])
        zero = rng.choice([0, 1, 2, 3])
        offload = rng.random() < 0.3
        sh = megatron_sharding(graph, tp, True) if tp > 1 else replicated(graph)
        times = []
        for recompute in ("none", "selective", "full"):
            cfg = ParallelConfig(dp=dp, tp=tp, micro_batch_size=mbs, zero_stage=zero,
                                 recompute=recompute, sequence_parallel=tp > 1,
                                 offload_optimizer=offload)
            est = estimate(graph, cluster, config=cfg, global_batch_size=dp * mbs * 4,
                           profile=None, sharding=sh)
            times.append(est.step_time_s)
        assert times == sorted(times), (name, tp, mbs, zero, times)


def _summary(p):
    return (p.config.to_dict(), p.predicted["step_time_s"],
            [(a.config.short(), a.why_lost) for a in p.alternatives])


@pytest.mark.parametrize("name,preset,nodes,gbs,kw", [
    ("llama-tiny", "dgx-a100-80gb", 1, 64, {}),
    ("gpt3-6.7b", "dgx-a100-40gb", 1, 64, {}),           # memory-tight: recomputation wins
    ("gpt3-13b", "dgx-a100-40gb", 2, 32, {"force": {"pp": 1}}),
])
def test_pruning_finds_the_plan_the_full_enumeration_finds(monkeypatch, name, preset, nodes,
                                                           gbs, kw):
    graph = _graph(name)
    cluster = Cluster.preset(preset, nodes=nodes)
    pruned = search.plan(graph, cluster, global_batch_size=gbs, profile=None, **kw)
    full_evaluate = costing.evaluate

    def every_config(*args, **kwargs):
        return full_evaluate(*args, **{**kwargs, "prune_dominated": False})
    monkeypatch.setattr(search, "evaluate", every_config)
    full = search.plan(graph, cluster, global_batch_size=gbs, profile=None, **kw)
    assert _summary(pruned) == _summary(full)
    assert pruned.solver.candidates_evaluated < full.solver.candidates_evaluated
