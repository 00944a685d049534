"""Uneven data parallelism (``ParallelConfig.dp_shares``): each dp replica runs its own number
of micro-batches per step (a faster GPU takes more of the batch). The field's rules and its
plan-file form here; its runtime, trained against one device on gloo, in
``test_dp_shares_runtime.py``."""

import json
from dataclasses import replace
from importlib import resources

import pytest
import torch

from autoplan import Cluster, ParallelConfig
from autoplan import plan as make_plan
from autoplan.errors import ConfigError, PlanError
from autoplan.graph import trace
from autoplan.graph.loss import TokenMeanLoss, step_weights
from autoplan.models import build_example
from autoplan.planner.planfile import Plan


def test_shares_name_each_replicas_rows_of_the_global_batch():
    c = ParallelConfig(dp=3, micro_batch_size=2, dp_shares=[1, 3, 2])
    assert c.dp_shares == (1, 3, 2)                       # a list reads as a tuple
    assert c.replica_microbatches(12) == (1, 3, 2)
    # contiguous, in dp-index order: the replicas together hold the batch in its order
    assert [c.replica_rows(12, d) for d in range(3)] == [(0, 2), (2, 6), (8, 4)]
    assert c.microbatches(12) == 3                        # the most any replica runs
    assert "shares1:3:2" in c.short()
    even = ParallelConfig(dp=3, micro_batch_size=2)
    assert even.replica_microbatches(12) == (2, 2, 2)
    assert [even.replica_rows(12, d) for d in range(3)] == [(0, 4), (4, 4), (8, 4)]
    with pytest.raises(ConfigError, match="global batch of 12 .* got 10"):
        c.replica_microbatches(10)


@pytest.mark.parametrize("kw,match", [
    (dict(dp=2, dp_shares=(1,)), "1 counts for dp=2"),
    (dict(dp=2, dp_shares=(0, 2)), "positive micro-batch count"),
    (dict(dp=2, dp_shares=(1, True)), "positive micro-batch count"),
    (dict(dp=2, dp_shares="13"), "positive micro-batch count"),
    (dict(dp=2, dp_shares=(1, 3), num_microbatches=3), "leave num_microbatches None"),
    (dict(dp=2, ep=2, dp_shares=(1, 3)), "all-to-all"),
    (dict(dp=2, pp=2, zero_stage=3, dp_shares=(1, 3)), "pp > 1 with ZeRO-3"),
    (dict(dp=2, pp=2, dp_shares=(1, 3)), r"'1f1b' needs at least pp=2 .* \[1\]"),
    (dict(dp=2, pp=2, schedule="dualpipev", virtual_stages=2, dp_shares=(4, 3)),
     r"at least 2 x pp=4 .* \[3\]"),
    (dict(dp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, dp_shares=(4, 3)),
     "a multiple of pp=2"),
])
def test_shares_are_refused_where_they_cannot_run(kw, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kw)


def test_zero_ddp_hsdp_and_pipelines_take_shares():
    for kw in (dict(zero_stage=0), dict(zero_stage=1), dict(zero_stage=3),
               dict(zero_stage=3, dp_shard=2), dict(pp=2, schedule="gpipe"),
               dict(pp=2, zero_stage=1, schedule="gpipe"),
               dict(tp=2, sequence_parallel=True), dict(cp=2)):
        dp = 4 if "dp_shard" in kw else 2
        ParallelConfig(dp=dp, dp_shares=tuple(range(1, dp + 1)), **kw)


def test_token_weights_follow_the_shares():
    loss = TokenMeanLoss(target_input=1, ignore_index=-100)
    y = torch.zeros(8, 4, dtype=torch.long)
    y[0, :2] = -100                                         # 30 targets counted
    w0 = step_weights(loss, y, 0, 2, 2, shares=(1, 3))      # rows 0-1: 6 counted
    w1 = step_weights(loss, y, 1, 2, 2, shares=(1, 3))      # rows 2-7: 8 each
    assert w0 == pytest.approx([6 * 2 * 1 / 30]) and w1 == pytest.approx([8 * 2 * 3 / 30] * 3)
    # what the runtime computes, each rank's weighted mean averaged over dp, is the global mean
    assert (sum(w0) / 1 + sum(w1) / 3) / 2 == pytest.approx(1.0)


@pytest.fixture(scope="module")
def small_plan():
    ex = build_example("gpt-tiny", batch_size=1, seed=0)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    return make_plan(g, Cluster.local(2), global_batch_size=4, precision="fp32", profile=None,
                     force=dict(dp=2, tp=1, micro_batch_size=1), max_pp=1)


def with_shares(plan: Plan, shares: tuple[int, ...]) -> Plan:
    """``plan`` with uneven dp shares (its prediction left the even one's: the runtime's
    tests need the plan, not the planner's price of it)."""
    config = replace(plan.config, dp_shares=shares)
    predicted = json.loads(json.dumps(plan.to_dict()["predicted"]))
    predicted["config"] = config.to_dict()
    return replace(plan, config=config, predicted=predicted)


def test_plan_files_write_shares_only_when_set(small_plan):
    text = small_plan.to_json()
    assert "dp_shares" not in text                    # older plans read back byte for byte
    assert Plan.from_json(text).to_json() == text
    uneven = with_shares(small_plan, (1, 3))
    out = uneven.to_json()
    assert '"dp_shares": [\n' in out or '"dp_shares": [1, 3]' in out
    back = Plan.from_json(out)
    assert back.config.dp_shares == (1, 3) and back.to_json() == out
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((resources.files("autoplan.planner") / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(out))
    d = json.loads(out)
    for bad in ([1], [1, 0], [1, "3"], [1, True], "1,3", 2, [2, 3]):   # [2, 3]: batch 5
        d["config"]["dp_shares"] = bad
        with pytest.raises(PlanError, match="dp_shares"):
            Plan.from_json(json.dumps(d))


def test_force_parses_a_list_of_shares():
    from autoplan.cli.plan_cmd import parse_force
    assert parse_force(["dp_shares=1,3"]) == {"dp_shares": (1, 3)} or \
        parse_force(["dp_shares=1,3"]) == {"dp_shares": [1, 3]}


# --- what a rank holds under shares (the estimate) ---------------------------------------

@pytest.fixture(scope="module")
def gpt():
    """Six layers of GPT-3 1.3B's shape on the meta device: model states dominate."""
    ex = build_example("gpt3-1.3b", device="meta", batch_size=1, num_layers=6)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name="gpt3-1.3b-6")


def _pair(graph, shares, **kw):
    """(even, shares) estimates of one config on 4 H100s at the batch the shares make."""
    from autoplan import estimate
    cluster = Cluster.preset("dgx-h100/2", 2)
    even = ParallelConfig(dp=4, tp=1, micro_batch_size=1, **kw)
    gbs = sum(shares)
    return (estimate(graph, cluster, config=even, global_batch_size=gbs, profile=None),
            estimate(graph, cluster, config=replace(even, dp_shares=shares),
                     global_batch_size=gbs, profile=None))


@pytest.mark.parametrize("kw, weights_bytes, grads_bytes", [
    (dict(zero_stage=0), 0, 0),
    (dict(zero_stage=1, precision="fp32"), 0, 0),
    # whole fp32 gradients in place of a quarter of them; ZeRO-2's weights are whole anyway
    (dict(zero_stage=2), 0, 4 * 3 / 4),
    (dict(zero_stage=3), 2, 4 * 3 / 4),            # + the bf16 weights gathered
    (dict(zero_stage=3, precision="fp32"), 4, 4 * 3 / 4),
    (dict(zero_stage=3, dp_shard=2), 2, 4 * 1 / 2),    # HSDP: half the gradients each
    (dict(zero_stage=3, offload_params=True), 2, 4),   # on the device, out of the host's
])
def test_shares_hold_fsdp_gradients_and_weights_whole_for_the_step(gpt, kw, weights_bytes,
                                                                   grads_bytes):
    """A rank of 3 micro-batches under FSDP holds, per parameter, the gathered weights
    (ZeRO-3) and fp32 gradients unsharded for the step (runtime/steps.fsdp_once_a_step):
    the peak over the even config's grows by exactly that (less ZeRO-3's two-layer gather
    buffer it no longer needs); DDP and ZeRO-1 hold what they did."""
    even, shares = _pair(gpt, (3, 3, 3, 3), **kw)
    params = even.stages[0].params_per_device
    a, b = even.stages[0].memory, shares.stages[0].memory
    assert b.params_bytes - a.params_bytes == pytest.approx(params * weights_bytes)
    assert b.grads_bytes - a.grads_bytes == pytest.approx(params * grads_bytes)
    assert b.activations_bytes == a.activations_bytes
    assert b.optimizer_bytes == a.optimizer_bytes and b.offloaded_bytes == a.offloaded_bytes
    gathered = a.transient_bytes - b.transient_bytes
    # ZeRO-3's root unit (the weights outside the layers), gathered through the root's forward
    # and backward (fp32 under autocast), is counted whole with the rest under the shares
    outside = sum(v.meta.numel for v in gpt.params if "layers." not in v.fqn)
    root = outside * (4 - weights_bytes) if weights_bytes == 2 else outside * weights_bytes
    assert gathered == pytest.approx(0 if kw.get("zero_stage") != 3 else
                                     2 * params / 6 * weights_bytes * 2 + root)
    assert shares.peak_memory_bytes - even.peak_memory_bytes == pytest.approx(
        params * (weights_bytes + grads_bytes) - gathered)


def test_shares_of_one_micro_batch_hold_what_the_even_config_does(gpt):
    for z in (2, 3):
        even, shares = _pair(gpt, (1, 1, 1, 1), zero_stage=z)
        assert shares.peak_memory_bytes == even.peak_memory_bytes
        assert shares.step_time_s == pytest.approx(even.step_time_s, rel=1e-12)


def test_zero3_under_shares_gathers_once_a_step(gpt):
    """ZeRO-3's gathers and reduce-scatter run once a step under shares, not per micro-batch:
    the exposed gather time is the one-micro-batch config's, the step shorter than the even
    config's; so does ZeRO-2's reduce-scatter, which an even config runs in every micro-batch's
    backward (``dp_terms.reduce_scatters_per_step``)."""
    one, _ = _pair(gpt, (1, 1, 1, 1), zero_stage=3)
    even, shares = _pair(gpt, (3, 3, 3, 3), zero_stage=3)
    gather = "zero_param_gather"
    assert shares.time.comm_exposed_s[gather] == pytest.approx(one.time.comm_exposed_s[gather])
    assert shares.time.comm_exposed_s[gather] < even.time.comm_exposed_s[gather]
    assert shares.step_time_s < even.step_time_s
    even2, shares2 = _pair(gpt, (3, 3, 3, 3), zero_stage=2)
    assert shares2.step_time_s < even2.step_time_s
    sync = "dp_grad_sync"
    assert shares2.time.comm_exposed_s[sync] < even2.time.comm_exposed_s[sync]


def test_context_parallel_ranks_share_their_replicas_count():
    c = ParallelConfig(dp=2, cp=2, zero_stage=3, dp_shares=(3, 1))
    assert c.grad_view().dp_shares == (3, 3, 1, 1) and c.grad_view().dp == 4
