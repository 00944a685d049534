"""ZeRO-2 (FSDP2, weights kept after forward) with several micro-batches per replica: what the
runtime issues in a step is what the estimate prices, counted on gloo
(``runtime/comm_counter``): the weights gathered once (in the first forward, kept whole until
the last backward), the gradients reduce-scattered in every micro-batch's backward (ZeRO-2's
sharded gradients; ``dp_terms.reduce_scatters_per_step``), and the loss once."""

from autoplan import Cluster
from autoplan.estimate.dp_terms import StageParams, reduce_scatters_per_step, stage_terms
from autoplan.cost.compute import compute_model
from tests.distributed import run_ranks
from tests.test_checkpoint import GLOBAL_BATCH, _graph, _plan, NAME, OVERRIDES
from tests.test_training_options import _compiled

DP = 2


def _count_rank(rank, world, plan_json):
    from autoplan.runtime.comm_counter import CommCounter
    trainer, batch = _compiled(plan_json)
    trainer.step(batch)
    with CommCounter() as counter:
        trainer.step(batch)
    params = sum(p.numel() for p in trainer.runner.model.parameters())
    units = sum(1 for m in trainer.runner.model.modules() if type(m).__name__.startswith("FSDP"))
    return {k: list(v) for k, v in counter.counts.items()}, params, units


def test_zero2_gathers_once_and_reduce_scatters_each_micro_batch_as_priced():
    plan = _plan(DP, dict(dp=DP, zero_stage=2, micro_batch_size=1))
    m = GLOBAL_BATCH // DP
    config = plan.config
    assert m >= 2 and config.uses_fsdp
    times = reduce_scatters_per_step(config, m)
    assert times == m
    # the estimate: one gather of the updated shards, ``m`` reduce-scatters of the gradients
    graph = _graph(NAME, tuple(sorted(OVERRIDES.items())))
    cluster = Cluster.local(DP)
    terms = stage_terms(config, cluster, StageParams(params=1e6, layers=4), m, 0,
                        compute_model(graph, cluster.device, "fp32", None), None)
    by_key = {t.shares[0][0]: t for t in terms}
    assert by_key["zero_param_gather"].times == 1
    assert by_key["dp_grad_sync"].times == m
    for counts, params, units in run_ranks(_count_rank, DP, plan.to_json()):
        assert units >= 2
        # fp32 weights and gradients: the whole model gathered once, reduced m times
        assert counts["all_gather"] == [units, 4 * params]
        assert counts["reduce_scatter"] == [m * units, m * 4 * params]
        assert counts["all_reduce"] == [1, 8]               # the step's loss


def test_zero2_accumulation_with_weights_kept_gathered_equals_one_device():
    """The weights kept whole between micro-batches, the gradients reduced in each: one
    device's losses and parameters."""
    import pytest

    from tests.test_runtime import _reference
    from tests.test_training_options import _close, _opt, _rank
    plan = _plan(DP, dict(dp=DP, tp=1, zero_stage=2, micro_batch_size=1), "ilp")
    ref_losses, ref_params = _reference("gpt-tiny", optimizer=_opt, **OVERRIDES)
    results = run_ranks(_rank, DP, plan.to_json(), {})
    for losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    _close(results, ref_params)


def test_pipelined_fsdp_holds_whole_gradients_for_the_step():
    """Under a pipeline torch's schedule runs FSDP2's backwards without gradient sync and
    reduces after the last one: a stage's rank holds its gradients whole (fp32) for the step,
    not their shard; with one micro-batch a rank holds them as without a pipeline."""
    from autoplan import ParallelConfig
    from autoplan.estimate.estimator import estimate
    graph = _graph(NAME, tuple(sorted(OVERRIDES.items())))
    for zero in (2, 3):
        cfg = ParallelConfig(dp=2, pp=2, zero_stage=zero, micro_batch_size=1,
                             schedule="1f1b", precision="fp32")
        est = estimate(graph, Cluster.local(4), config=cfg, global_batch_size=GLOBAL_BATCH,
                       profile=None)
        assert est.num_microbatches >= 2
        for s in est.stages:
            assert s.memory.grads_bytes == 4 * s.params_per_device


def _pp_count_rank(rank, world, plan_json):
    from autoplan.runtime.comm_counter import CommCounter
    trainer, batch = _compiled(plan_json)
    trainer.step(batch)
    with CommCounter() as counter:
        trainer.step(batch)
    chunks = trainer.runner.chunks.values()
    params = sum(p.numel() for ch in chunks for p in ch.parameters())
    units = sum(1 for ch in chunks for m in ch.modules() if type(m).__name__.startswith("FSDP"))
    return {k: list(v) for k, v in counter.counts.items()}, params, units


def test_pipelined_zero3_gathers_and_reduces_as_priced():
    """pp2 x dp2 ZeRO-3, 4 micro-batches: torch's schedule gathers a unit's weights for every
    forward and for the first backward only, and reduce-scatters once after the last: what
    the simulator and the closed form price (``pipeline_timing.fsdp_step_counts``)."""
    from autoplan.estimate.pipeline_timing import fsdp_step_counts
    plan = _plan(4, dict(pp=2, dp=2, zero_stage=3, schedule="1f1b", micro_batch_size=1),
                 max_pp=2)
    m = GLOBAL_BATCH // 2
    gathers = sum(fsdp_step_counts(m))
    assert gathers == m + 1
    for counts, params, units in run_ranks(_pp_count_rank, 4, plan.to_json()):
        assert counts["all_gather"] == [gathers * units, gathers * 4 * params]
        assert counts["reduce_scatter"] == [units, 4 * params]


def test_the_root_units_gathers_are_priced_in_the_dtype_the_runtime_gathers_them():
    """Under 16-bit autocast FSDP gathers the weights outside the layers (the embedding
    table's unit) in fp32 (runtime/autocast_weights.py): ZeRO-3 holds them gathered through
    the root's forward and backward, at 4 bytes; under 16-bit weights ("params") at 2; ZeRO-2
    and weights held whole for the step count 2 already and add the other 2; ZeRO-1 (DDP)
    gathers nothing. The gathers' time follows: more bytes under autocast."""
    import dataclasses

    from autoplan.estimate.dp_terms import dp_collectives, fp32_gathered
    from autoplan.estimate.estimator import root_unit_bytes
    from autoplan.sharding.parallel_config import ParallelConfig
    c = ParallelConfig(dp=2, zero_stage=3, precision="bf16")
    held = StageParams(params=100.0, layer_params=60.0, layers=2)
    assert c.mixed_precision == "autocast" and fp32_gathered(c, 100.0, 60.0) == 40.0
    assert root_unit_bytes(c, held, step_whole=False) == 40 * 4
    params = dataclasses.replace(c, mixed_precision="params")
    assert fp32_gathered(params, 100.0, 60.0) == 0.0
    assert root_unit_bytes(params, held, step_whole=False) == 40 * 2
    assert root_unit_bytes(dataclasses.replace(c, zero_stage=2), held, False) == 40 * 2
    assert root_unit_bytes(c, held, step_whole=True) == 40 * 2
    assert root_unit_bytes(dataclasses.replace(c, zero_stage=1), held, False) == 0.0
    cluster = Cluster.from_spec("dgx-h100/2")
    _, ag32, _ = dp_collectives(c, cluster, 4e9, 2, 0, fp32_params=2e9)
    _, ag16, _ = dp_collectives(c, cluster, 4e9, 2, 0)
    assert ag32 > ag16 > 0
