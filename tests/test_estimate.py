"""estimate(): any ParallelConfig on any cluster, validated, with breakdowns that add up."""

import pytest

import autoplan
from autoplan import ConfigError, ParallelConfig, estimate
from autoplan.cluster import Cluster
from autoplan.graph import trace
from autoplan.models import build_example


@pytest.fixture(scope="module")
def gpt3_12_layers():
    """GPT-3 175B layer shapes with 12 layers (pp up to 12), on the meta device."""
    ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=12)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


@pytest.fixture(scope="module")
def a100_x24():
    return Cluster.preset("dgx-a100-80gb", nodes=24)   # 192 GPUs = dp 2 x tp 8 x pp 12


def _est(graph, cluster, **kw):
    batch = kw.pop("global_batch_size", 192)
    return estimate(graph, cluster, config=ParallelConfig(**kw), global_batch_size=batch,
                    profile=None)


def test_issue_example_runs_on_meta_model():
    """The README/issue example: a meta-device GPT, a preset, estimate() from the module."""
    ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=12)
    cluster = autoplan.Cluster.preset("dgx-a100-80gb", nodes=24)
    est = autoplan.estimate(ex.model, cluster, example_inputs=ex.example_inputs,
                            global_batch_size=192,
                            config=autoplan.ParallelConfig(dp=2, tp=8, pp=12, micro_batch_size=1,
                                                           schedule="1f1b", zero_stage=1,
                                                           recompute="full", precision="bf16"))
    assert est.step_time_s > 0 and 0 < est.mfu < 1
    assert est.peak_memory_bytes == max(est.per_device_memory_bytes)
    assert len(est.per_device_memory_bytes) == 192
    assert est.time.total_s == pytest.approx(est.step_time_s)
    assert est.tokens_per_s == pytest.approx(est.samples_per_s * 2048)


def test_breakdowns_add_up(gpt3_12_layers, a100_x24):
    est = _est(gpt3_12_layers, a100_x24, dp=2, tp=8, pp=12, schedule="1f1b", zero_stage=1,
               recompute="full")
    t = est.time
    assert t.compute_s > 0 and t.recompute_s > 0 and t.bubble_s > 0
    assert t.comm_exposed_s["tp"] > 0 and t.comm_exposed_s["pp_p2p"] > 0
    for s in est.stages:
        m = s.memory
        assert m.total_bytes == pytest.approx(m.params_bytes + m.grads_bytes + m.optimizer_bytes
                                              + m.activations_bytes + m.transient_bytes
                                              + m.margin_bytes)
    # 1F1B: stage i holds p - i micro-batches
    assert [s.microbatches_in_flight for s in est.stages] == list(range(12, 0, -1))


def test_policies_move_time_and_memory_the_right_way(gpt3_12_layers, a100_x24):
    base = dict(dp=2, tp=8, pp=12, sequence_parallel=True)
    none = _est(gpt3_12_layers, a100_x24, **base, recompute="none")
    sel = _est(gpt3_12_layers, a100_x24, **base, recompute="selective")
    full = _est(gpt3_12_layers, a100_x24, **base, recompute="full")
    assert none.peak_memory_bytes > sel.peak_memory_bytes > full.peak_memory_bytes
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    z0 = _est(gpt3_12_layers, a100_x24, **base, zero_stage=0)
    z3 = _est(gpt3_12_layers, a100_x24, **base, zero_stage=3)
    assert z3.stages[1].memory.optimizer_bytes == pytest.approx(
        z0.stages[1].memory.optimizer_bytes / 2)
    gp = _est(gpt3_12_layers, a100_x24, **base, schedule="gpipe")
    assert gp.stages[0].microbatches_in_flight == gp.num_microbatches
    inter = _est(gpt3_12_layers, a100_x24, dp=4, tp=8, pp=6, sequence_parallel=True,
                 schedule="interleaved_1f1b", virtual_stages=2, global_batch_size=192 * 2)
    plain = _est(gpt3_12_layers, a100_x24, dp=4, tp=8, pp=6, sequence_parallel=True,
                 schedule="1f1b", global_batch_size=192 * 2)
    # (v divides the bubble of uniform stages exactly, tests/test_pipeline_sim.py; here the last
    # stage holds the LM head: 5.8 % off)
    assert inter.time.bubble_s == pytest.approx(plain.time.bubble_s / 2, rel=0.08)


def test_tensor_parallel_splits_layer_weights(gpt3_12_layers):
    one = Cluster.preset("dgx-a100-80gb", nodes=3)   # 24 GPUs
    tp1 = _est(gpt3_12_layers, one, dp=2, tp=1, pp=12, global_batch_size=24)
    tp8 = _est(gpt3_12_layers, Cluster.preset("dgx-a100-80gb", nodes=24), dp=2, tp=8, pp=12,
               global_batch_size=24)
    # a middle stage holds one layer: 12h^2 weights split 8 ways, only norms/biases replicated
    assert tp8.stages[5].params_per_device == pytest.approx(tp1.stages[5].params_per_device / 8,
                                                             rel=0.01)


@pytest.mark.parametrize("kw,match", [
    (dict(dp=3, tp=8, pp=12), "devices"),                         # 288 != 192
    (dict(dp=2, tp=8, pp=12, micro_batch_size=5), "multiple of micro_batch_size"),
    (dict(dp=16, tp=1, pp=12, num_microbatches=7), "num_microbatches"),
    (dict(dp=2, tp=1, pp=96), "only 12 layers"),
])
def test_invalid_configs_say_why(gpt3_12_layers, a100_x24, kw, match):
    with pytest.raises(ConfigError, match=match):
        _est(gpt3_12_layers, a100_x24, **kw)


@pytest.mark.parametrize("kw", [
    dict(dp=0), dict(schedule="zigzag"), dict(zero_stage=4), dict(recompute="some"),
    dict(precision="fp8"), dict(tp=1, sequence_parallel=True),
    dict(virtual_stages=2, schedule="1f1b"),
])
def test_config_fields_are_validated(kw):
    with pytest.raises(ConfigError):
        ParallelConfig(**kw)


def test_config_round_trips():
    c = ParallelConfig(dp=4, tp=2, pp=2, zero_stage=2, recompute="selective")
    assert ParallelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown"):
        ParallelConfig.from_dict({"dp": 1, "bogus": 2})


def test_memory_bound_model_does_not_fit_without_sharding(gpt3_12_layers):
    node = Cluster.preset("dgx-a100-80gb", nodes=1)
    dp = _est(gpt3_12_layers, node, dp=8, global_batch_size=8)
    assert not dp.fits and any("exceeds" in w for w in dp.warnings)
    sharded = _est(gpt3_12_layers, node, dp=1, tp=8, global_batch_size=8, zero_stage=0,
                   sequence_parallel=True, recompute="full")
    assert sharded.peak_memory_bytes < dp.peak_memory_bytes / 4


def test_parameter_offload_trades_host_traffic_for_device_memory(gpt3_12_layers, a100_x24):
    on = _est(gpt3_12_layers, a100_x24, dp=2, tp=8, pp=12, zero_stage=3)
    off = _est(gpt3_12_layers, a100_x24, dp=2, tp=8, pp=12, zero_stage=3, offload_params=True)
    assert off.peak_memory_bytes < on.peak_memory_bytes
    # under a pipeline torch's schedule keeps the gathered weights on the device from the
    # first micro-batch to its reduce after the last (``cost.memory.holds_step_whole``): the
    # shards and the optimizer state are what leave it
    held, gathered = off.stages[1].memory, off.stages[1].params_per_device * 2
    assert held.params_bytes == gathered < on.stages[1].memory.params_bytes
    assert held.optimizer_bytes == 0 and held.offloaded_bytes > 0
    assert off.time.comm_exposed_s["offload"] > 0 and off.step_time_s > on.step_time_s
    with pytest.raises(ConfigError, match="zero_stage=3"):
        ParallelConfig(dp=2, zero_stage=1, offload_params=True)


def test_pipelined_collectives_come_from_the_simulated_streams(gpt3_12_layers, a100_x24):
    """With pipeline stages the data-parallel collectives run in the simulator on each rank's
    own stream: gradient syncs hide behind the last backwards, so only part is exposed (also
    when the rank's chunks are interleaved); FSDP's gathers show up as their own item."""
    base = dict(dp=24, pp=2, tp=4, micro_batch_size=1, zero_stage=1)
    one = estimate(gpt3_12_layers, a100_x24, config=ParallelConfig(**base), global_batch_size=96, profile=None)
    two = estimate(gpt3_12_layers, a100_x24, config=ParallelConfig(
        **base, schedule="interleaved_1f1b", virtual_stages=2), global_batch_size=96, profile=None)
    cfg = one.config
    from autoplan.cost.memory import GRAD_BYTES             # fp32 gradients
    whole = max(a100_x24.collective_time_s("reduce_scatter", st.params_per_device * GRAD_BYTES,
                                           cfg.dp_group(pp_index=st.index)) for st in one.stages)
    for est in (one, two):
        assert 0 < est.time.comm_exposed_s["dp_grad_sync"] < 0.75 * whole
    fsdp = estimate(gpt3_12_layers, a100_x24,
                    config=ParallelConfig(**{**base, "zero_stage": 3}), global_batch_size=96, profile=None)
    assert fsdp.time.comm_exposed_s["zero_param_gather"] > 0
    screened = estimate(gpt3_12_layers, a100_x24, config=ParallelConfig(**base),
                        global_batch_size=96, simulate_pipeline=False, profile=None)
    assert screened.step_time_s == pytest.approx(one.step_time_s, rel=0.15)


def test_api_arguments_are_checked_with_errors_that_say_the_fix():
    """A wrong argument to estimate/plan/trace raises autoplan's typed error, never an
    AttributeError or TypeError from deep inside."""
    import torch
    from torch import nn

    import autoplan
    from autoplan import Cluster, ConfigError, TraceError
    g = autoplan.trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x.nonzero()[:, 0]])
    bad = [
        (TraceError, "tensor values", lambda: autoplan.trace(DataDependent(), (torch.randn(3, 4),))),
        (TraceError, "computes nothing", lambda: autoplan.trace(nn.Sequential(),
                                                                (torch.randn(2, 4),))),
        (TraceError, "no samples", lambda: autoplan.trace(nn.Linear(4, 4), (torch.randn(0, 4),))),
        (TraceError, "needs example inputs", lambda: autoplan.trace(nn.Linear(4, 4), None)),
        (ConfigError, "cluster must be", lambda: autoplan.estimate(
            g, None, config=ParallelConfig(), global_batch_size=2)),
        (ConfigError, "profile must be", lambda: autoplan.estimate(
            g, Cluster.local(1), config=ParallelConfig(), global_batch_size=2, profile="bogus")),
        (ConfigError, "global_batch_size", lambda: autoplan.estimate(
            g, Cluster.local(1), config=ParallelConfig(), global_batch_size=None)),
        (ConfigError, "global_batch_size", lambda: autoplan.plan(g, Cluster.local(1),
                                                                 global_batch_size="8")),
        (ConfigError, "the options are", lambda: autoplan.plan(g, Cluster.local(1),
                                                               global_batch_size=2, bogus=1)),
        (autoplan.ClusterError, "at most", lambda: Cluster.preset("dgx-h100", nodes=10**9)),
        (autoplan.ClusterError, "at most", lambda: Cluster.from_spec("dgx-h100:99999999999")),
        (autoplan.ClusterError, "at most", lambda: Cluster.from_spec("local:100000")),
        (autoplan.ClusterError, "at most", lambda: Cluster.local(10**7)),
    ]
    for error, match, call in bad:
        with pytest.raises(error, match=match):
            call()
    # a spec string is a cluster too
    assert autoplan.plan(g, "local:1", global_batch_size=2, profile=None).config.dp == 1


def test_zero1_gather_hides_behind_the_next_forward_as_the_runtime_runs_it(gpt3_12_layers,
                                                                            a100_x24):
    """ZeRO-1's updated weights are broadcast after the step and waited for layer by layer in
    the next forward (runtime/optim.py): the estimate charges the first modules' share and the
    interference, not the whole gather; ZeRO-2 (FSDP2 without reshard) still pays it."""
    from autoplan.estimate.overlap import OVERLAP_INTERFERENCE
    from autoplan.cost.memory import PRECISION_BYTES        # the fp32 weights
    cfg = dict(dp=24, tp=8, pp=1, micro_batch_size=8)      # a forward longer than the gather
    zero1 = _est(gpt3_12_layers, a100_x24, zero_stage=1, **cfg)
    zero2 = _est(gpt3_12_layers, a100_x24, zero_stage=2, **cfg)
    stage = zero1.stages[0]
    whole = a100_x24.collective_time_s("all_gather",
                                       stage.params_per_device * PRECISION_BYTES["fp32"],
                                       zero1.config.dp_group())
    hidden = zero1.time.comm_exposed_s["zero_param_gather"]
    assert 0 < hidden < 0.5 * whole
    assert zero2.time.comm_exposed_s["zero_param_gather"] > hidden
    # the forward is far longer than the gather: what is left is the first modules' part
    # (embedding, head, one layer) plus the interference of the rest
    assert hidden >= OVERLAP_INTERFERENCE * whole


def test_zero1_gathers_the_weights_in_the_dtype_they_are_held_in(gpt3_12_layers, a100_x24):
    """Under autocast (this runtime) ZeRO-1 broadcasts fp32 weights; where the weights are held
    in 16 bits (``mixed_precision="params"``, Megatron-LM's distributed optimizer) it gathers
    bf16: half the bytes, over the same group."""
    from autoplan.cost.memory import PRECISION_BYTES
    from autoplan.cost.compute import compute_model
    from autoplan.estimate.dp_terms import StageParams, stage_terms
    compute = compute_model(gpt3_12_layers, a100_x24.device, "bf16")
    cfg = dict(dp=24, tp=8, pp=1, micro_batch_size=1, zero_stage=1, precision="bf16")
    gathers = {}
    for mp in ("autocast", "params"):
        config = ParallelConfig(mixed_precision=mp, **cfg)
        terms = stage_terms(config, a100_x24, StageParams(params=1e9, layer_params=9e8,
                                                          layers=12), 1, 0, compute, None)
        (t,) = [t for t in terms if dict(t.shares).get("zero_param_gather")]
        gathers[mp] = t.seconds
    group = ParallelConfig(**cfg).dp_shard_group(pp_index=0)
    for mp, dtype in (("autocast", "fp32"), ("params", "bf16")):
        assert gathers[mp] == pytest.approx(a100_x24.collective_time_s(
            "all_gather", 1e9 * PRECISION_BYTES[dtype], group))
    assert gathers["params"] < 0.6 * gathers["autocast"]


def test_tp_comm_overlap_is_priced_only_when_asked_and_needs_sequence_parallelism(
        gpt3_12_layers, a100_x24):
    base = dict(dp=24, tp=8, pp=1, micro_batch_size=1, zero_stage=1, sequence_parallel=True)
    plain = _est(gpt3_12_layers, a100_x24, **base)
    overlapped = _est(gpt3_12_layers, a100_x24, tp_comm_overlap=True, **base)
    tp_plain, tp_hidden = (e.time.comm_exposed_s["tp"] for e in (plain, overlapped))
    assert 0 < tp_hidden < 0.5 * tp_plain
    assert overlapped.time.compute_s == pytest.approx(plain.time.compute_s)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        ParallelConfig(tp=8, tp_comm_overlap=True)
    # plans without it serialize as before (golden plans stay byte-identical)
    assert "tp_comm_overlap" not in ParallelConfig(tp=8).to_dict()
    again = ParallelConfig.from_dict(overlapped.config.to_dict())
    assert again.tp_comm_overlap and again == overlapped.config


def test_tp_comm_overlap_runs_its_gemms_in_row_chunks_at_their_rate(gpt3_12_layers):
    """Under Megatron-LM's --tp-comm-overlap (Transformer Engine's defaults) an all-gather's
    GEMM runs in t row chunks and a reduce-scatter's in 4: on a device whose GEMM rate by shape
    is known (the H100, OpenXLA's sm_90 table) the chunks' lower rate is priced; the fewer the
    rows, the more it costs; a device without a table prices whole GEMMs."""
    from autoplan.cost.compute import compute_model
    from autoplan.estimate.chunk_cost import overlap_chunks
    assert overlap_chunks("colwise_sp", 8) == (8, 1)          # forward in ring steps
    assert overlap_chunks("rowwise_sp", 8) == (4, 8)          # TE's pipeline; dgrad in steps
    assert overlap_chunks("colwise", 8) == (1, 1)
    g = gpt3_12_layers                      # one 2,048-token sequence, hidden 12,288
    h100 = Cluster.preset("dgx-h100", nodes=3)
    table = h100.device.matmul_shape_efficiency
    model = compute_model(g, h100.device, "bf16", mixed_precision="params")
    qkv = next(i for i, op in enumerate(g.ops) if op.kind == "matmul" and op.params)
    assert model.product_sides(qkv) == (2048.0, 36864.0, 12288.0)
    # two sequences (4,096 rows), columns over t = 8: ring chunks of 512 rows
    fwd, bwd = model.chunked_slowdown(qkv, 2 / 8, ("n", 8), 8, 1)
    assert fwd == pytest.approx(table.fraction(4096, 4608, 12288) / table.fraction(512, 4608, 12288))
    assert fwd == pytest.approx(780.2 / 661.6, rel=2e-3) and bwd == 1.0
    # the input gradient (half the backward's FLOPs; (rows, K, N)) in 8 chunks, the weight
    # gradient whole (both at the full rate whole: every side at least 4,096)
    fwd, bwd = model.chunked_slowdown(qkv, 2 / 8, ("n", 8), 4, 8)
    dgrad = table.fraction(4096, 12288, 4608) / table.fraction(512, 12288, 4608)
    assert bwd == pytest.approx(0.5 + 0.5 * dgrad)
    assert model.chunked_slowdown(qkv, 2 / 8, ("n", 8), 1, 1) == (1.0, 1.0)
    more = model.chunked_slowdown(qkv, 8 / 8, ("n", 8), 8, 1)[0]       # 2,048-row chunks
    assert 1.0 < more < fwd
    # whole estimates: the H100's curve slows the overlapped configuration's compute only
    h100 = Cluster.preset("dgx-h100", nodes=3)
    base = dict(dp=3, tp=8, pp=1, micro_batch_size=1, zero_stage=1, sequence_parallel=True,
                precision="bf16", mixed_precision="params")
    plain = _est(g, h100, **base)
    overlapped = _est(g, h100, tp_comm_overlap=True, **base)
    assert overlapped.time.compute_s > 1.03 * plain.time.compute_s
    flat = Cluster.from_dict({**h100.to_dict(), "name": "flat-h100", "device": {
        k: v for k, v in h100.device.to_dict().items() if k != "matmul_shape_efficiency"}})
    assert _est(g, flat, tp_comm_overlap=True, **base).time.compute_s == \
        pytest.approx(_est(g, flat, **base).time.compute_s)


def test_layer_products_run_at_the_rate_of_their_shape():
    """On a device with a measured GEMM table (the H100) a layer's product runs at the rate of
    its (M, N, K): a 2,048-wide layer's below the large-product rate, and a tensor-parallel
    split slows it by the side it cuts (columns, the contraction, rows), the same in the
    sharding ILP (which passes ``divided_split``) as in the estimate. A device without a table
    prices every split alike."""
    from autoplan.cost.compute import compute_model
    from autoplan.sharding.strategies import strategies
    from autoplan.sharding.strategy import divided_split
    ex = build_example("gpt3-1.3b", device="meta", batch_size=1, num_layers=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    device = Cluster.preset("dgx-h100", nodes=1).device
    table = device.matmul_shape_efficiency
    model = compute_model(g, device, "bf16", mixed_precision="params")
    qkv = next(i for i, op in enumerate(g.ops) if op.kind == "matmul" and op.params)
    op = g.ops[qkv]
    assert model.product_sides(qkv) == (2048.0, 6144.0, 2048.0)
    rate = model.tput.matmul_flops_per_s
    frac = table.fraction(2048, 6144, 2048)
    assert 0.9 < frac < 0.96
    # the table's times hold each kernel's launch: none added
    assert model.op_cost(qkv).fwd_s == pytest.approx(op.fwd_flops / (rate * frac))
    # backward: the input gradient (M, K, N) and the weight gradient (N, K, M)
    per_flop = 0.5 / table.fraction(2048, 2048, 6144) + 0.5 / table.fraction(6144, 2048, 2048)
    assert model.op_cost(qkv).bwd_s == pytest.approx(op.bwd_flops * per_flop / rate)
    # four sequences, split 8 ways by each side
    by_side = {side: model.op_cost(qkv, 4 / 8, (side, 8)) for side in "mnk"}
    for side, sides in (("m", (1024, 6144, 2048)), ("n", (8192, 768, 2048)),
                        ("k", (8192, 6144, 256))):
        assert model.product_sides(qkv, 4 / 8, (side, 8)) == sides
        assert by_side[side].fwd_s == pytest.approx(
            4 / 8 * op.fwd_flops / (rate * table.fraction(*sides)))
    assert by_side["k"].fwd_s > 1.3 * by_side["n"].fwd_s        # a 256-long contraction
    names = {s.name: divided_split(g, op, s) for s in strategies(g, op, 8)}
    assert names["colwise"] == ("n", 8) and names["rowwise"] == ("k", 8)
    assert names["seq"] == ("m", 8)
    flat = compute_model(g, Cluster.preset("dgx-a100-80gb", nodes=1).device, "bf16")
    costs = {flat.op_cost(qkv, 4 / 8, (side, 8)) for side in "mnk"}
    assert len(costs) == 1
    # the table is of 16-bit tensor-core products: fp32 ones (vector units) are priced flat
    fp32 = compute_model(g, device, "fp32")
    assert fp32.tput.matmul_shape is None
    assert len({fp32.op_cost(qkv, 4 / 8, (side, 8)) for side in "mnk"}) == 1


def test_the_compute_model_is_kept_per_device_not_per_name():
    """A graph keeps one ComputeModel per device: a device edited under the same name (a
    cluster file's H100 without the GEMM table) gets its own, not the preset's."""
    from autoplan.cluster.specs import DeviceSpec
    from autoplan.cost.compute import compute_model
    ex = build_example("gpt-tiny", device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    h100 = Cluster.preset("dgx-h100", nodes=1).device
    flat = DeviceSpec.from_dict({k: v for k, v in h100.to_dict().items()
                                 if k != "matmul_shape_efficiency"})
    assert flat.name == h100.name
    assert compute_model(g, h100, "bf16") is compute_model(g, h100, "bf16")
    assert compute_model(g, flat, "bf16").tput.matmul_shape is None
    assert compute_model(g, h100, "bf16").tput.matmul_shape is not None


def test_an_estimate_does_not_depend_on_what_was_estimated_before():
    """Range and chunk costs are cached on the graph; the cache key must hold every config
    field they read (ZeRO-2 shards the tp step's gradient all-reduce over dp, ZeRO-0 does
    not), so the same config costs the same after another was estimated on that graph."""
    def fresh():
        ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=4)
        return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2)
    kw = dict(dp=4, tp=4, pp=1, micro_batch_size=1, sequence_parallel=True)
    shared = fresh()
    for z in (0, 2):
        alone = _est(fresh(), cluster, zero_stage=z, global_batch_size=16, **kw)
        after = _est(shared, cluster, zero_stage=z, global_batch_size=16, **kw)
        assert after.step_time_s == alone.step_time_s
        assert after.time == alone.time


def test_dropout_with_p_zero_costs_nothing():
    """torch returns the input from dropout(p=0): no kernel, so no time (the activation memory
    rule already kept no mask for it); p > 0 moves the tensor and its mask."""
    from autoplan.cost.compute import compute_model
    cluster = Cluster.preset("dgx-h100", nodes=1)
    costs = {}
    for p in (0.0, 0.1):
        ex = build_example("gpt-tiny", device="meta", batch_size=1, dropout=p)
        g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
        cm = compute_model(g, cluster.device, "bf16", None)
        drops = [i for i, op in enumerate(g.ops) if op.kind == "dropout"]
        assert drops
        costs[p] = [cm.base_cost(i) for i in drops]
    assert all(c.fwd_s == 0.0 and c.bwd_s == 0.0 for c in costs[0.0])
    assert all(c.fwd_s > 0.0 and c.bwd_s > 0.0 for c in costs[0.1])


def test_cross_entropy_is_priced_in_fp32_passes_over_its_logits():
    """The loss over N logits runs in fp32 whatever the precision (autocast's fp32 list):
    in bf16 the cast and log-softmax's passes move 22 N bytes forward and 26 N backward, in
    fp32 16 N and 20 N; as one op's bf16 bytes it was priced at 2 N and 4 N."""
    from autoplan.cost.compute import compute_model
    from autoplan.graph.opgraph import opname
    cluster = Cluster.preset("dgx-h100", nodes=1)
    dev = cluster.device
    ex = build_example("gpt-tiny", device="meta", batch_size=4)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    k = next(i for i, op in enumerate(g.ops) if opname(op) == "cross_entropy_loss")
    n = g.value(g.ops[k].inputs[0]).meta.numel
    bw = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency
    for precision, fwd_bytes, bwd_bytes in (("bf16", 22, 26), ("fp32", 16, 20)):
        c = compute_model(g, dev, precision, None).base_cost(k)
        assert c.fwd_s == pytest.approx(fwd_bytes * n / bw + dev.kernel_launch_s)
        assert c.bwd_s == pytest.approx(bwd_bytes * n / bw + dev.kernel_launch_s)


def test_a_weight_gathered_for_its_product_is_held_whole_while_it_runs():
    """A product whose weight is stored split on the tp axis and gathered (``*_gathered``)
    holds the whole weight while it runs, and in backward its whole gradient before the
    reduce-scatter: the largest such pair is in the transient memory."""
    from autoplan.cost.memory import GRAD_BYTES, PRECISION_BYTES
    from autoplan.sharding.sharding import Sharding
    from autoplan.sharding.strategies import strategies
    # untied: a tied weight's backward buffer (``chunk_cost.tied_grad_buffer_bytes``) is held
    # as that weight is split, which differs between the two shardings
    ex = build_example("gpt-tiny", batch_size=2, tie_embeddings=False)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    plain, gathered = [], []
    for op in g.ops:
        options = strategies(g, op, 2)
        plain.append(options[0])
        gathered.append(next((s for s in options if s.kernel == "gathered_weight"), options[0]))
    whole = [max(g.value(n).meta.numel for k, n in enumerate(op.inputs)
                 if s.inputs[k] != s.local_input(k))
             for op, s in zip(g.ops, gathered) if s.kernel == "gathered_weight"]
    assert len(whole) >= 4
    config = ParallelConfig(dp=4, tp=2, micro_batch_size=2, precision="fp32")
    cluster = Cluster.preset("dgx-h100", nodes=1)
    got = []
    for picked in (plain, gathered):
        est = estimate(g, cluster, config=config, global_batch_size=8, profile=None,
                       sharding=Sharding.build(g, 2, picked))
        got.append(est.stages[0].memory.transient_bytes)
    assert got[1] - got[0] == pytest.approx(max(whole) * (PRECISION_BYTES["fp32"] + GRAD_BYTES))


# ---- a compiled program -------------------------------------------------------------------

def test_a_compiled_program_runs_element_wise_chains_as_one_pass():
    """``compiled=True`` prices what inductor runs: a chain of element-wise ops (GELU's tanh
    form: pow, mul, add, tanh, ...) is one kernel, so its inner ops move no bytes and open no
    kernel; what the chain takes from a product and hands to the next is read and written
    once. Products are priced as before, and the whole step gets cheaper."""
    from autoplan.cost.compute import ComputeModel, compute_model, fused_traffic
    ex = build_example("gpt3-1.3b", device="meta", batch_size=1, num_layers=2)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    traffic = fused_traffic(g)
    kinds = {g.ops[i].kind for i in traffic}
    assert kinds <= {"pointwise", "norm", "dropout", "reduction", "copy", "creation"}
    assert any(t.moved == 0.0 and not t.launches for t in traffic.values())   # chain interiors
    assert any(t.moved > 0.0 and t.launches for t in traffic.values())        # chain heads
    device = Cluster.preset("dgx-h100", nodes=1).device
    eager, fused = (compute_model(g, device, "bf16", fused=f) for f in (False, True))
    # the eager program's casts at the full achieved rate (``EAGER_ELEMENTWISE_SHARE`` = 1)
    at_full_rate = ComputeModel(g, device, "bf16")
    at_full_rate.eager_share = 1.0
    for i, op in enumerate(g.ops):
        a, b = eager.base_cost(i), fused.base_cost(i)
        if i in traffic:
            assert b.fwd_s <= a.fwd_s and b.bwd_s <= a.bwd_s, op.name
        else:             # as before, but autocast's casts before a product: eager kernels
            c = at_full_rate.base_cost(i)
            assert (c.fwd_s, c.bwd_s) == (b.fwd_s, b.bwd_s), op.name
            assert b.fwd_s <= a.fwd_s and b.bwd_s <= a.bwd_s, op.name
    inner = next(i for i, t in traffic.items() if t.moved == 0.0 and not t.launches)
    assert fused.base_cost(inner).fwd_s < eager.base_cost(inner).fwd_s / 10
    cl = Cluster.preset("dgx-h100", nodes=1)
    times = [estimate(g, cl, global_batch_size=8, config=ParallelConfig(
        dp=8, micro_batch_size=1, zero_stage=3, precision="bf16", compiled=c)).step_time_s
        for c in (False, True)]
    assert times[1] < times[0]
    cfg = ParallelConfig(dp=8, precision="bf16", compiled=True)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg and "compiled" in cfg.short()
    assert "compiled" not in ParallelConfig(dp=8).to_dict()      # old plans read back as written


def test_a_compiled_programs_chains_end_at_every_layers_edge():
    """The runtime compiles each layer, and each run of ops between layers, as a region of its
    own (``runtime/program_modules.split_outside``): a region reads its inputs and writes its
    outputs, so no chain runs from one layer into the next. Every layer then prices alike
    (Llama's first cast once read the embedding's output for free, the others' not), a layer's
    last residual add writes its output and its first op reads its input."""
    from autoplan.cost.compute import compute_model
    from autoplan.cost.fused import compiled_regions, fused_traffic
    from autoplan.estimate.partition import pipeline_units
    ex = build_example("llama-tiny", device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    units, regions, traffic = pipeline_units(g), compiled_regions(g), fused_traffic(g)
    assert len(units) >= 2
    for u in units:
        assert len(set(regions[u.start:u.stop])) == 1
        assert regions[u.start - 1] != regions[u.start] != regions[u.stop]
        ends = [i for i in range(u.start, u.stop) if i in traffic]
        assert traffic[ends[0]].launches and traffic[ends[-1]].moved > 0.0
    cm = compute_model(g, Cluster.preset("dgx-h100", nodes=1).device, "bf16", fused=True)
    first = [cm.base_cost(i) for i in range(units[0].start, units[0].stop)]
    for u in units[1:]:
        assert [cm.base_cost(i) for i in range(u.start, u.stop)] == first, u.path
