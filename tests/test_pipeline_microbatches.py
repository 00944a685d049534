"""A pipeline with fewer micro-batches than stages: 1F1B cannot run it (torch's Schedule1F1B
raises mid-build), so it is refused when planned or compiled, saying what to change; the
search says why it leaves such a mesh out."""

import json

import pytest

from autoplan import Cluster, ParallelConfig
from autoplan.errors import ConfigError, PlanError
from autoplan.estimate.estimator import estimate
from autoplan.planner.planfile import Plan
from tests.test_checkpoint import GLOBAL_BATCH, _example, _graph, _plan, NAME, OVERRIDES


def _graph_of():
    return _graph(NAME, tuple(sorted(OVERRIDES.items())))


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_when_planned():
    config = ParallelConfig(pp=2, schedule="1f1b", micro_batch_size=GLOBAL_BATCH)
    with pytest.raises(ConfigError, match=r"1f1b needs at least as many micro-batches as "
                                          r"pipeline stages \(pp = 2\), got 1 .*global batch "
                                          r"to at least 16.*gpipe"):
        estimate(_graph_of(), Cluster.local(2), config=config,
                 global_batch_size=GLOBAL_BATCH, profile=None)
    # GPipe runs them (all forwards, then all backwards)
    est = estimate(_graph_of(), Cluster.local(2), config=ParallelConfig(
        pp=2, schedule="gpipe", micro_batch_size=GLOBAL_BATCH),
        global_batch_size=GLOBAL_BATCH, profile=None)
    assert est.num_microbatches == 1


def test_the_search_says_why_it_leaves_out_a_mesh_of_too_few_micro_batches():
    from autoplan.planner.search import plan
    for force, expected in (
            ({}, "pp2 x dp1 x tp1 mbs 1: 1 micro-batch per step for 2 pipeline stages (mostly "
                 "bubble; 1F1B needs one per stage): a global batch of at least pp x dp x "
                 "micro_batch_size = 2 would let it in, skipped"),
            ({"micro_batch_size": 1}, "pp2 x dp1 x tp1 mbs 1: 1f1b needs at least as many "
                                      "micro-batches as pipeline stages (pp = 2), got 1")):
        said = []
        plan(_graph_of(), Cluster.local(2), global_batch_size=1, precision="fp32",
             profile=None, max_pp=2, force=force, progress=said.append)
        assert any(expected in s for s in said), (force, said)


def test_a_hand_edited_1f1b_plan_with_too_few_micro_batches_is_refused_at_compile(
        monkeypatch):
    from autoplan.runtime.trainer import compile
    good = _plan(2, dict(pp=2, schedule="1f1b", micro_batch_size=1), max_pp=2)
    edited = json.loads(good.to_json())
    for config in (edited["config"], edited["predicted"]["config"]):
        config["micro_batch_size"] = GLOBAL_BATCH               # one micro-batch a step
    monkeypatch.setenv("WORLD_SIZE", "2")
    ex, small = _example(GLOBAL_BATCH), _example(1)
    with pytest.raises(PlanError, match="1f1b needs at least as many micro-batches"):
        compile(ex.model, "local", example_inputs=small.example_inputs,
                example_targets=small.targets, loss_fn=ex.loss_fn,
                optimizer=lambda ps: __import__("torch").optim.SGD(ps, lr=0.1),
                global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(json.dumps(edited)))
