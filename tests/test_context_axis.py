"""Context parallelism on a mesh axis of its own (``ParallelConfig.cp``, issue 12 item 2): the
sequence split over cp ranks under whatever the tensor-parallel axis does (pp x dp x cp x tp,
as torchtitan and Megatron-Core lay it out). The config and its rank layout, the tp strategies that
compose with it, its price (the ILP's objective equals the estimate's), the planner's use of it
for long sequences, and training equal to one device on 2 and 4 gloo ranks with the ILP's own
tensor-parallel sharding beside it."""

import random

import pytest
import torch

from autoplan import Cluster, ParallelConfig, estimate
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.cost.compute import compute_model
from autoplan.errors import ConfigError
from autoplan.estimate.chunk_cost import chunk_cost
from autoplan.estimate.cost_inputs import CostInputs
from autoplan.estimate.layout import chunks_for
from autoplan.graph import trace
from autoplan.graph.analysis import analyze
from autoplan.models import build_example
from autoplan.planner.ilp import solve
from autoplan.planner.planfile import Plan
from autoplan.planner.problem import reduce_graph, sharding_from_choice
from autoplan.sharding.context_axis import context_axis
from autoplan.sharding.strategies import strategies_by_name
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_ilp_objective import config_context, shared_objective, walks
from tests.test_runtime import _plan, _rank, assert_equals_one_device


def _graph(name, batch_size=2, **kw):
    ex = build_example(name, batch_size=batch_size, **kw)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


# ---- the config ------------------------------------------------------------------------------

def test_ranks_are_laid_out_tp_cp_dp_and_gradients_average_over_dp_x_cp():
    c = ParallelConfig(dp=2, cp=2, tp=2, zero_stage=3)
    assert c.world_size == 8 and c.mesh_axes() == ("dp", "cp", "tp")
    assert c.mesh_shape() == (2, 2, 2)
    assert c.tp_group() == (0, 1) and c.cp_group() == (0, 2) and c.cp_group(dp_index=1) == (4, 6)
    assert c.dp_group() == (0, 2, 4, 6)                  # dp x cp: who averages gradients
    assert c.shard_degree == 4 and c.grad_degree == 4 and c.uses_fsdp
    for r in range(8):                               # tp fastest, then cp, dp, pp
        i = c.dims.coords(r)
        assert ((i[MeshAxis.PP] * 2 + i[MeshAxis.DP]) * 2 + i[MeshAxis.CP]) * 2 \
            + i[MeshAxis.TP] == r
    assert ParallelConfig.from_dict(c.to_dict()) == c
    assert "cp" not in ParallelConfig(dp=2).to_dict()       # old plans read back byte for byte
    hsdp = ParallelConfig(dp=4, cp=2, zero_stage=3, dp_shard=2)
    assert hsdp.mesh_axes() == ("dp_replicate", "dp_shard", "cp", "tp")
    assert hsdp.dp_shard_group() == (0, 1, 2, 3)             # (dp_shard x cp) consecutive
    for bad in (dict(ep=2, dp=2), dict(cp=0)):
        with pytest.raises(ConfigError):
            ParallelConfig(cp=2 if "cp" not in bad else bad["cp"],
                           **{k: v for k, v in bad.items() if k != "cp"})


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_tp_strategies_that_cannot_run_under_the_cp_axis_are_not_offered():
    """Attention is ring attention over cp: its ring over tp (two kernels) is not offered; the
    loss is split over the sequence on cp around a vocabulary-parallel cross entropy on tp."""
    g = _graph("hf-llama-gqa-tiny")
    ax = context_axis(g, 2)
    attn = next(i for i, o in enumerate(g.ops) if o.target.startswith("aten.scaled_dot"))
    loss = next(i for i, o in enumerate(g.ops) if o.target.startswith("aten.cross_entropy"))
    by = strategies_by_name(g, g.ops[attn], 2)
    assert ax.tp_conflict(attn, by["seq"], 2) and not ax.tp_conflict(attn, by["heads"], 2)
    losses = strategies_by_name(g, g.ops[loss], 2)
    assert ax.strategy(loss).kernel == "split_loss"
    assert not ax.tp_conflict(loss, losses["vocab"], 2)      # composed kernels
    # the sequence split of a batch of 2 reaches the loss as one block per sample
    assert str(ax.strategy(loss).inputs[0]) == "S(0)[2]"
    with pytest.raises(ConfigError, match="ring attention"):
        context_axis(_graph("mlp-tiny"), 2)


# ---- its price -------------------------------------------------------------------------------

CP_MODELS = ["llama-tiny", "nanogpt-tiny"] + (
    ["hf-llama-gqa-tiny", "hf-gpt2-lm-tiny"] if has_transformers() else [])


@pytest.mark.parametrize("seed", range(4))
def test_the_ilp_objective_is_the_estimates_price_under_a_cp_axis(seed):
    """With a cp axis beside tp, the ILP's objective for any choice equals the estimate's
    compute, recomputation, exposed tp and cp traffic (ring attention's passes over the cp
    group, at the tp piece each strategy leaves them) and tp gradient all-reduces; and its
    memory the estimate's state and activations (1 / cp of the sequence kept; as in
    ``test_ilp_objective``, not full recomputation's kept layer inputs)."""
    rng = random.Random(seed)
    name = CP_MODELS[seed % len(CP_MODELS)]
    ex = build_example(name, device="meta", batch_size=rng.choice([1, 2]))
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset(rng.choice(["dgx-h100", "dgx-a100-80gb"]), nodes=2)
    cp = rng.choice([2, 4])
    config = ParallelConfig(dp=16 // (2 * cp), cp=cp, tp=2,
                            micro_batch_size=rng.choice([1, 2]), precision="bf16",
                            recompute=rng.choice(["none", "selective", "full"]))
    m = rng.choice([1, 4])
    compute = compute_model(g, cluster.device, config.precision, None)
    ax = context_axis(g, cp)
    ctx = config_context(g, cluster, config, m, compute, context=ax,
                         cp_collective_s=lambda kind, nbytes: cluster.collective_time_s(
                             kind, nbytes, config.cp_group()))
    red = reduce_graph(ctx)
    problem = red.problem
    objective = shared_objective(problem)
    choices = walks(solve(problem, time_limit_s=30).choice, problem, objective, rng, 8, 2)
    rings = 0
    for choice in choices:
        sh = sharding_from_choice(g, 2, red, choice)
        assert not any(ax.tp_conflict(i, s, 2) for i, s in enumerate(sh.op_strategy))
        ci = CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                        cluster=cluster, config=config, context=ax)
        (chunk,) = chunks_for(ci)
        c = chunk_cost(ci, chunk, config.recompute)
        rings += c.cp_s > 0
        priced = m * (c.fwd_s + c.bwd_s + c.recompute_s + c.tp_fwd_s + c.tp_bwd_s) + c.tp_step_s
        assert objective(choice) == pytest.approx(priced, rel=1e-9), (name, cp, choice)
        if config.recompute != "full":   # (full recomputation's kept layer inputs: outside)
            held = sum(problem.node_memory[v][j] for v, j in enumerate(choice))
            assert held == pytest.approx(c.params * 16.0 + c.activation_bytes, rel=1e-9)
    assert rings == len(choices)                      # the ring's passes are priced


@pytest.mark.parametrize("zero", [1, 3])
def test_with_its_dp_terms_the_ilp_objective_is_the_step_time_under_a_cp_axis(zero):
    """A configuration's own ILP (``dp_problem``: gradient sync and ZeRO's traffic over dp x
    cp, hidden behind the compute the choice makes) prices a choice at the estimate's step
    time of the plan it makes, with the cp axis beside tp (within 0.1 %, as without it)."""
    from autoplan.cost.memory import model_state_bytes
    from autoplan.planner.dp_problem import DpPricing, with_dp_terms
    ex = build_example("llama-tiny", device="meta", batch_size=2)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset("dgx-h100", nodes=2)
    config = ParallelConfig(dp=2, cp=4, tp=2, micro_batch_size=1, zero_stage=zero,
                            precision="bf16")
    m = 4
    compute = compute_model(g, cluster.device, config.precision, None)
    sharded = model_state_bytes(1.0, dp=config.shard_degree, zero_stage=zero,
                                precision="bf16", optimizer="adamw",
                                mixed_precision=config.mixed_precision).total_bytes
    ctx = config_context(g, cluster, config, m, compute, state_bytes_per_param=sharded,
                         step_shard=config.shard_degree if zero >= 2 else 1,
                         context=context_axis(g, 4),
                         cp_collective_s=lambda kind, nbytes: cluster.collective_time_s(
                             kind, nbytes, config.cp_group()))
    red = reduce_graph(ctx)
    reference = solve(red.problem, time_limit_s=30).choice
    pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=compute, interference=ctx.interference)
    dp = with_dp_terms(red, g, pricing, reference=reference)
    for choice in (dp.lift(reference), solve(dp.problem, time_limit_s=30).choice):
        sh = sharding_from_choice(g, 2, red, dp.strategies(choice))
        est = estimate(g, cluster, config=config, global_batch_size=2 * m, profile=None,
                       sharding=sh)
        assert dp.problem.objective(choice) == pytest.approx(est.step_time_s, rel=1e-3)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_a_cp_axis_keeps_a_piece_of_the_sequence_and_pays_its_ring():
    """Llama-3-8B at 32K tokens on 2 x 8 H100: cp 2 beside tp 8 keeps half the activations of
    dp 2 x tp 8 per rank (the same micro-batch), splits the attention's work, pays ring
    attention's passes over the two nodes, and ZeRO shards the weights over dp x cp."""
    g = _graph("hf-llama3-8b", batch_size=1, device="meta", seq_len=32768,
               max_positions=32768)
    cluster = Cluster.preset("dgx-h100", nodes=2)
    kw = dict(tp=8, zero_stage=3, recompute="full", micro_batch_size=1)
    flat = estimate(g, cluster, config=ParallelConfig(dp=2, **kw), global_batch_size=2,
                    profile=None)
    ring = estimate(g, cluster, config=ParallelConfig(dp=1, cp=2, cp_layout="zigzag", **kw),
                    global_batch_size=2, profile=None)
    acts = [e.stages[0].memory.activations_bytes for e in (flat, ring)]
    # half, but for what every rank holds whole: HF's causal mask (s x s booleans, 1 GiB at
    # 32K tokens), made whole on every rank and sliced by its rows for the ring
    mask = 32768 ** 2
    assert acts[1] - mask == pytest.approx((acts[0] - mask) / 2, rel=0.02)
    assert ring.time.comm_exposed_s["cp_ring"] >= 0 and "cp_ring" not in flat.time.comm_exposed_s
    # two sequences over 16 ranks each, or one over each 8: the same work per rank, where the
    # ring is balanced (zigzag); in contiguous pieces its last rank does 3/4 of the attention
    assert ring.time.compute_s == pytest.approx(flat.time.compute_s, rel=0.05)
    uneven = estimate(g, cluster, config=ParallelConfig(dp=1, cp=2, **kw), global_batch_size=2,
                      profile=None)
    assert uneven.time.compute_s > ring.time.compute_s * 1.05
    states = [e.stages[0].memory.params_bytes for e in (flat, ring)]
    assert states[1] == pytest.approx(states[0])      # sharded over dp x cp = 2 either way


# ---- training on gloo ranks ------------------------------------------------------------------

RUN_CASES = [
    # (model, world, forced fields, family[, tp sharding rule])
    ("llama-tiny", 2, dict(cp=2, zero_stage=0), "causal attention over a 2-way ring"),
    ("llama-tiny", 4, dict(cp=4, micro_batch_size=1, cp_layout="contiguous"),
     "a 4-way ring, contiguous pieces"),
    ("llama-tiny", 4, dict(cp=2, tp=2, sequence_parallel=True),
     "Megatron TP + SP x cp2", "megatron"),
    ("nanogpt-tiny", 4, dict(cp=2, tp=2), "fused qkv: cp2 x the ILP's tp2"),
] + ([
    ("hf-llama-gqa-tiny", 4, dict(cp=2, tp=2), "HF Llama (GQA): cp2 x the ILP's tp2"),
    ("hf-gpt2-lm-tiny", 4, dict(cp=2, dp=2, zero_stage=3), "HF GPT-2: FSDP over dp2 x cp2"),
] if has_transformers() else [])


@pytest.mark.parametrize("case", RUN_CASES, ids=[c[3] for c in RUN_CASES])
def test_a_cp_axis_trains_like_one_device(case):
    name, world, force, family = case[:4]
    p = _plan(name, world, force, *case[4:])
    for k, v in force.items():
        assert getattr(p.config, k) == v, (k, p.config)
    # every model here is causal: its ring balanced in the zigzag layout unless forced
    assert p.config.cp_layout == force.get("cp_layout", "zigzag"), p.config
    assert_equals_one_device(run_ranks(_rank, world, name, p.to_json()), name, family)


def test_dropout_draws_a_mask_per_piece_over_both_axes():
    """A random op on a tensor split over cp and tp: each (cp, tp) piece gets its own mask, and
    the same piece the same mask again from the same generator state (recomputation)."""
    from autoplan.runtime.program_calls import kernel_split_random_axes
    from autoplan.runtime.tp_comm import ShapeComm

    class Slot:
        def __init__(self, rank, size):
            self.comm = type("C", (), {"rank": rank, "size": size})()
    drop = torch.ops.aten.native_dropout.default
    x = torch.ones(64)
    masks = {}
    for c in range(2):
        for t in range(2):
            torch.manual_seed(0)
            out, _ = kernel_split_random_axes(drop, [x, 0.5, True], {}, Slot(c, 2), Slot(t, 2))
            masks[c, t] = out
    assert len({tuple(m.tolist()) for m in masks.values()}) == 4
    torch.manual_seed(0)
    again, _ = kernel_split_random_axes(drop, [x, 0.5, True], {}, Slot(1, 2), Slot(0, 2))
    assert torch.equal(again, masks[1, 0])
    shape = Slot(0, 2)
    shape.comm = ShapeComm(size=2)
    assert kernel_split_random_axes(drop, [x, 0.5, True], {}, shape, None)[0].shape == x.shape


LAYERS4 = dict(num_layers=4)


def _pp_rank(rank, world, plan_json):
    from autoplan.runtime.trainer import compile
    from tests.test_runtime import GLOBAL_BATCH, STEPS, _optimizer
    ex = build_example("llama-tiny", batch_size=GLOBAL_BATCH, seed=0, **LAYERS4)
    small = build_example("llama-tiny", batch_size=1, seed=0, **LAYERS4)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    return losses, {k: v.tolist() for k, v in trainer.full_state_dict().items()}


@pytest.mark.parametrize("schedule", [dict(schedule="1f1b"),
                                      dict(schedule="interleaved_1f1b", virtual_stages=2)],
                         ids=["1f1b", "interleaved"])
def test_a_cp_axis_under_pipeline_stages_trains_like_one_device(schedule):
    """pp2 x cp2 on 4 ranks: each stage's sequence pieces sent on to the next stage's pieces,
    a stage's ring over its own cp ranks; every rank reports the global loss and the
    parameters gathered from their stages equal one device's."""
    from autoplan import plan as make_plan
    from tests.test_runtime import GLOBAL_BATCH, _reference
    small = build_example("llama-tiny", batch_size=1, seed=0, **LAYERS4)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = make_plan(g, Cluster.local(4), global_batch_size=GLOBAL_BATCH, precision="fp32",
                  profile=None, force=dict(pp=2, cp=2, **schedule), max_pp=2)
    assert (p.config.pp, p.config.cp, p.config.schedule) == (2, 2, schedule["schedule"])
    assert sorted(r for st in p.stages for r in st["ranks"]) == [0, 1, 2, 3]
    results = run_ranks(_pp_rank, 4, p.to_json(), timeout_s=240.0)
    ref_losses, ref_params = _reference("llama-tiny", **LAYERS4)
    seen = {}
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5), p.config.short()
        seen.update({k: torch.tensor(v, dtype=ref_params[k].dtype) for k, v in params.items()})
    assert set(seen) == set(ref_params)
    for k, ref in ref_params.items():
        err = ((seen[k].reshape(ref.shape) - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e} ({p.config.short()})"
