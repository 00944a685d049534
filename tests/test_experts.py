"""Expert parallelism (MoE): the experts found in a graph, the config, its price, the planner's
choice and plan file, and the runtime equal to one device on 2 and 4 gloo ranks (HF Mixtral and
a top-k MoE written in plain PyTorch)."""

import json

import pytest
import torch

from autoplan import Cluster, ConfigError, ParallelConfig, estimate, plan
from autoplan.errors import PlanError
from autoplan.graph import trace
from autoplan.graph.experts import find_experts
from autoplan.models import build_example
from autoplan.planner.compare import plan_sharding
from autoplan.planner.explain import explain_plan
from autoplan.planner.planfile import Plan
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_runtime import _plan, _rank, assert_equals_one_device

needs_hf = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")


def _graph(name, **kw):
    ex = build_example(name, batch_size=1, **kw)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


@pytest.fixture(scope="module")
def mixtral8x7b():
    if not has_transformers():
        pytest.skip("transformers not installed")
    return _graph("hf-mixtral-8x7b", device="meta")


def _timeline_draws_the_exchanges(p, kind, tmp_path):
    """The timeline picture draws the plan's exposed exchanges inside its blocks: ``kind``'s
    share of the bottleneck stage's per-micro-batch time."""
    pytest.importorskip("matplotlib")
    from autoplan.planner import figures, figures_draw
    shares = figures.in_block_comm_shares(p)
    stage = max(p.predicted["stages"], key=lambda s: s["fwd_s"] + s["bwd_s"])
    m = p.predicted["num_microbatches"]
    assert 0 < shares[kind] < 1
    assert shares[kind] * m * (stage["fwd_s"] + stage["bwd_s"]) == pytest.approx(
        p.predicted["time"]["comm_exposed_s"][kind])
    path = tmp_path / "timeline.png"
    # the plan holds its figures to 6 significant digits, and the timeline adds them up
    assert figures_draw.draw_timeline(p, str(path)) == pytest.approx(
        p.predicted["step_time_s"], rel=1e-5)
    assert path.read_bytes()[:4] == b"\x89PNG"


@needs_hf
def test_experts_are_found_through_casts_and_transposes():
    hf = find_experts(_graph("hf-mixtral-tiny"))
    assert hf.num_experts == 4 and len(hf.ops) == 4          # gate_up and down, 2 layers
    assert all(p.endswith(("experts.gate_up_proj", "experts.down_proj")) for p in hf.params)
    assert hf.ep_degrees(8) == (1, 2, 4)
    plain = find_experts(_graph("titan-moe-tiny"))
    assert plain.num_experts == 4 and len(plain.ops) == 6    # w1, w3, w2 (cast to bf16 first)
    assert not hf.stacked and not plain.stacked
    assert sorted(p.rsplit(".", 1)[1] for p in plain.params) == ["w1", "w1", "w2", "w2",
                                                                 "w3", "w3"]
    assert find_experts(_graph("titan-llama-tiny")) is None


def test_stacked_experts_applied_with_bmm_or_einsum_are_experts():
    """Expert-choice routing's stacked experts (``torch.bmm`` over (experts, tokens, hidden))
    are found like a grouped product's, and so are the same weights applied with
    ``torch.einsum``; a bmm of two activations (attention scores) is none."""
    ec = find_experts(_graph("titan-ecmoe-tiny"))
    assert ec.num_experts == 4 and len(ec.ops) == 6 and ec.stacked == frozenset(ec.ops)
    assert all(p.endswith(("moe.w1", "moe.w3", "moe.w2")) for p in ec.params)

    class EinsumExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 6))

        def forward(self, x, y):
            scores = torch.bmm(x, x.transpose(1, 2))            # two activations
            return torch.einsum("ecd,edf->ecf", scores @ x, self.w).sum() + y.sum()
    x = torch.randn(4, 5, 8)
    g = trace(EinsumExperts(), (x, torch.zeros(4)), loss_fn=lambda out, t: out,
              targets=torch.zeros(4))
    found = find_experts(g)
    assert found is not None and found.num_experts == 4 and found.params == ("w",)
    assert [g.ops[i].target.split(".")[1] for i in found.ops] in (["einsum"], ["bmm"])


def test_config_rules_groups_and_mesh():
    c = ParallelConfig(dp=8, tp=2, ep=4, zero_stage=1)
    assert c.mesh_axes() == ("edp", "ep", "tp") and c.mesh_shape() == (2, 4, 2)
    assert c.ep_group() == (0, 2, 4, 6) and c.ep_group(replica=1, tp_index=1) == (9, 11, 13, 15)
    assert c.expert_dp_group(ep_index=3) == (6, 14)
    assert " ep4" in c.short() and ParallelConfig.from_dict(c.to_dict()) == c
    assert "ep" not in ParallelConfig(dp=8).to_dict()      # older plans read back byte for byte
    assert ParallelConfig(dp=4, ep=2, pp=2).mesh_axes() == ("pp", "edp", "ep", "tp")
    for bad, why in ((dict(dp=4, ep=3), "divide"), (dict(dp=4, ep=2, zero_stage=3, dp_shard=2), "HSDP")):
        with pytest.raises(ConfigError, match=why):
            ParallelConfig(**bad)


def test_the_estimate_shards_expert_state_and_prices_the_exchanges(mixtral8x7b):
    """Mixtral-8x7B on 2 x 8 H100: ep=8 holds an eighth of the experts per rank; the routed
    rows cross the ep group twice per grouped product each way; the experts' gradients are
    all-reduced over the 2 ranks holding the same experts, not over all 16."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    kw = dict(dp=16, zero_stage=1, recompute="full")
    one = estimate(mixtral8x7b, cluster, config=ParallelConfig(**kw), global_batch_size=32,
                   profile=None)
    ep8 = estimate(mixtral8x7b, cluster, config=ParallelConfig(**kw, ep=8),
                   global_batch_size=32, profile=None)
    experts = sum(v.meta.numel for v in mixtral8x7b.param_values
                  if v.name in find_experts(mixtral8x7b).param_values)
    assert experts > 0.9 * mixtral8x7b.num_params
    held = one.stages[0].params_per_device - ep8.stages[0].params_per_device
    assert held == pytest.approx(experts * 7 / 8, rel=1e-9)
    m1, m8 = one.stages[0].memory, ep8.stages[0].memory
    ratio = ep8.stages[0].params_per_device / one.stages[0].params_per_device
    assert m8.params_bytes == pytest.approx(m1.params_bytes * ratio)
    # ZeRO-1: the experts' optimizer state is sharded over the 2 ranks holding them only
    rest = one.stages[0].params_per_device - experts
    per_param = m1.optimizer_bytes * 16 / one.stages[0].params_per_device
    assert m8.optimizer_bytes == pytest.approx(per_param * (rest / 16 + experts / 8 / 2))
    assert ep8.time.comm_exposed_s["ep_all_to_all"] > 0
    assert "ep_all_to_all" not in one.time.comm_exposed_s
    assert ep8.time.compute_s == pytest.approx(one.time.compute_s)
    # FSDP (ZeRO-3) shards the rest over all 16 ranks and each expert slab over its 2 holders
    z3 = estimate(mixtral8x7b, cluster, config=ParallelConfig(**{**kw, "zero_stage": 3}, ep=8),
                  global_batch_size=32, profile=None)
    per_param = z3.stages[0].memory.params_bytes
    # the runtime's fp32 weights and gradients (autocast), AdamW's 8 bytes, all sharded
    assert per_param == pytest.approx(4 * (rest / 16 + experts / 8 / 2))
    assert z3.stages[0].memory.optimizer_bytes == pytest.approx(
        8 * (rest / 16 + experts / 8 / 2))
    assert z3.stages[0].memory.grads_bytes == pytest.approx(4 * (rest / 16 + experts / 8 / 2))


def test_full_recompute_keeps_no_expert_weight_as_an_activation(mixtral8x7b):
    """HF Mixtral transposes its expert weights inside each layer. Under full recomputation a
    layer keeps only the activations it reads from before it; the transposed weights are
    views of parameters, not activations (they had been counted: 85 GiB for 8x7B)."""
    from autoplan.cost.memory import activation_parts
    from autoplan.estimate.partition import main_block
    inst = main_block(mixtral8x7b).instances[0]
    kept = activation_parts(mixtral8x7b, inst.start, inst.stop, micro_batch_size=1,
                            recompute="full")
    params = {v.name for v in mixtral8x7b.param_values}
    assert kept and not params & set(kept)
    none = activation_parts(mixtral8x7b, inst.start, inst.stop, micro_batch_size=1)
    assert sum(kept.values()) < 0.1 * sum(none.values())


def test_a_capacity_factor_prices_the_busiest_expert_rank(mixtral8x7b, tmp_path):
    """With routing allowed ``c`` times the balanced share per expert, the busiest ep rank
    computes, keeps and exchanges ``c`` times the rows of the experts' span; without expert
    parallelism every rank still computes its own tokens' rows, so nothing changes. The plan
    records the factor and is priced with it again when re-estimated."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    kw = dict(dp=16, zero_stage=1, recompute="none")
    est = {(ep, c): estimate(mixtral8x7b, cluster, config=ParallelConfig(**kw, ep=ep),
                             global_batch_size=32, profile=None, expert_capacity_factor=c)
           for ep in (1, 8) for c in (1.0, 1.5)}
    assert est[1, 1.5].step_time_s == est[1, 1.0].step_time_s
    flat, skewed = est[8, 1.0], est[8, 1.5]
    # the expert span's work (its grouped products and the SwiGLU between them) grows by half
    grown = skewed.time.compute_s - flat.time.compute_s
    assert 0.3 * flat.time.compute_s < grown < 0.5 * flat.time.compute_s
    a2a = skewed.time.comm_exposed_s["ep_all_to_all"] / flat.time.comm_exposed_s["ep_all_to_all"]
    assert 1.3 < a2a <= 1.5
    acts = (skewed.stages[0].memory.activations_bytes, flat.stages[0].memory.activations_bytes)
    assert acts[1] < acts[0] < 1.5 * acts[1]
    fits = dict(kw, recompute="full", ep=8)
    p = plan(mixtral8x7b, cluster, global_batch_size=32, profile=None,
             expert_capacity_factor=1.5, force=dict(fits, tp=1, pp=1, micro_batch_size=1))
    assert p.training.expert_capacity_factor == 1.5
    again = estimate(mixtral8x7b, cluster, config=p.config, global_batch_size=32,
                     profile=None, expert_capacity_factor=1.5,
                     sharding=plan_sharding(p, mixtral8x7b))
    # the plan file keeps 6 significant digits (planfile.SIG_DIGITS)
    assert p.predicted["step_time_s"] == pytest.approx(again.step_time_s, rel=1e-5)
    assert '"expert_capacity_factor": 1.5' in p.to_json()
    assert Plan.from_json(p.to_json()).to_json() == p.to_json()
    assert "expert capacity factor 1.5" in explain_plan(p)
    for bad in (0.5, "many", float("nan")):
        with pytest.raises(ConfigError, match="expert_capacity_factor must be a number >= 1"):
            estimate(mixtral8x7b, cluster, config=ParallelConfig(**kw, ep=8),
                     global_batch_size=32, profile=None, expert_capacity_factor=bad)
    doc = json.loads(p.to_json())
    doc["training"]["expert_capacity_factor"] = 0.9
    with pytest.raises(PlanError, match="expert_capacity_factor"):
        Plan.from_json(json.dumps(doc))


def test_the_planner_chooses_ep_for_mixtral_and_writes_its_axes(mixtral8x7b, tmp_path):
    """On 2 x 8 H100, among eager programs, the free search picks expert parallelism (over
    pipelines only) and the plan file records its axes. (HF's experts multiply in fp32 under
    autocast, as one device runs them: autocast does not reach their grouped product, and HF
    casts the rows to the fp32 weight's dtype; so the step is 117 s, nearly all of it the
    experts at the fp32 rate.)"""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    eager = {"compiled": False}
    p = plan(mixtral8x7b, cluster, global_batch_size=256, profile=None, force=eager)
    no_ep = plan(mixtral8x7b, cluster, global_batch_size=256, profile=None,
                 force={**eager, "ep": 1})
    assert p.config.ep > 1, p.config.short()
    assert p.predicted["step_time_s"] < no_ep.predicted["step_time_s"]
    from autoplan.planner.explain import explain_plan
    text = explain_plan(p)
    assert "experts  " in text and "all-to-all" in text
    assert p.mesh.axes == (("pp",) if p.config.pp > 1 else ()) + ("edp", "ep", "tp")
    assert p.predicted["time"]["comm_exposed_s"]["ep_all_to_all"] > 0
    _timeline_draws_the_exchanges(p, "ep_all_to_all", tmp_path)
    back = Plan.from_json(p.to_json())
    assert back.config == p.config and back.to_json() == p.to_json()
    old = json.loads(p.to_json())
    old["schema_version"] = 2
    with pytest.raises(PlanError, match="schema 3 added"):
        Plan.from_json(json.dumps(old))
    with pytest.raises(ConfigError, match="has no experts"):
        plan(_graph("titan-llama-tiny"), Cluster.local(2), global_batch_size=8,
             profile=None, force={"ep": 2})
    with pytest.raises(ConfigError, match="4 experts do not split"):
        plan(_graph("titan-moe-tiny"), Cluster.local(3), global_batch_size=9,
             profile=None, force={"ep": 3})


@needs_hf
def test_rows_stay_with_their_experts_between_grouped_products():
    """One dispatch and one combine per MoE layer, not a pair per grouped product (Mixtral's
    gate_up and down; the top-k MoE's w1, w3 and w2 read one dispatch)."""
    from autoplan.runtime import program_calls as P
    from autoplan.runtime.emit import emit
    for name in ("hf-mixtral-tiny", "titan-moe-tiny"):
        p = _plan(name, 2, dict(tp=1, zero_stage=0, ep=2))
        ex, small = build_example(name, batch_size=8, seed=0), build_example(name, batch_size=1)
        rp = emit(ex.model, p, _graph(name), example_inputs=small.example_inputs,
                  example_targets=small.targets, loss_fn=ex.loss_fn, t=1, tp_rank=0,
                  device=torch.device("cpu"), seed=0, ep=(2, 0))
        targets = [n.target for n in rp.program.graph_module.graph.nodes]
        layers = 2
        assert targets.count(P.kernel_dispatch) == layers and targets.count(P.kernel_combine) == layers
        assert targets.count(P.kernel_local_experts) == len(find_experts(_graph(name)).ops)


def test_stacked_rows_are_exchanged_once_per_moe_layer():
    """Expert-choice routing's w1, w3 and w2 products read one even exchange per layer and
    bring their rows home once; each rank holds half of every stacked weight."""
    from autoplan.runtime import program_calls as P
    from autoplan.runtime.emit import emit
    name = "titan-ecmoe-tiny"
    p = _plan(name, 2, dict(tp=1, zero_stage=0, ep=2))
    assert {v.ep for k, v in p.param_placements.items() if ".moe.w" in k} == {"S(0)"}
    ex, small = build_example(name, batch_size=8, seed=0), build_example(name, batch_size=1)
    rp = emit(ex.model, p, _graph(name), example_inputs=small.example_inputs,
              example_targets=small.targets, loss_fn=ex.loss_fn, t=1, tp_rank=0,
              device=torch.device("cpu"), seed=0, ep=(2, 0))
    targets = [n.target for n in rp.program.graph_module.graph.nodes]
    assert targets.count(P.kernel_dispatch_stacked) == 2 and targets.count(P.kernel_combine) == 2
    assert targets.count(P.kernel_dispatch) == 0 and targets.count(P.kernel_local_experts) == 6


def test_a_mixtral_sized_expert_choice_moe_on_bmm_plans_with_expert_parallelism():
    """Mixtral-8x7B's sizes with stacked experts applied by bmm, on 2 x 8 H100 (meta device):
    ``force ep=8`` plans (before: "the model has no experts to split") and prices the
    exchanges, its expert weights an eighth per rank."""
    g = _graph("titan-ecmoe-8x7b", device="meta")
    cluster = Cluster.preset("dgx-h100", nodes=2)
    p = plan(g, cluster, global_batch_size=256, profile=None, force={"ep": 8})
    assert p.config.ep == 8
    assert p.predicted["time"]["comm_exposed_s"]["ep_all_to_all"] > 0
    experts = {k: v for k, v in p.param_placements.items() if ".moe.w" in k}
    assert len(experts) == 3 * 32 and {v.ep for v in experts.values()} == {"S(0)"}


CASES = [
    ("hf-mixtral-tiny", 2, dict(tp=1, zero_stage=0, ep=2), "ilp", "HF Mixtral, EP2"),
    # stacked experts applied with torch.bmm (expert-choice routing): even exchanges
    ("titan-ecmoe-tiny", 2, dict(tp=1, zero_stage=0, ep=2), "ilp",
     "expert-choice MoE on bmm, EP2"),
    ("titan-ecmoe-tiny", 4, dict(tp=2, zero_stage=0, ep=2), "megatron",
     "expert-choice MoE on bmm, EP2 x TP2 inside the experts"),
    ("titan-ecmoe-tiny", 4, dict(tp=1, zero_stage=3, ep=2), "ilp",
     "expert-choice MoE on bmm, EP2 x FSDP (ZeRO-3) over 4"),
    # its experts multiply in bf16 (torch._grouped_mm's dtype): ep = dp keeps each expert's
    # rows on one rank, as on one device (a weight gradient summed from two ranks' bf16
    # products differs by bf16 rounding, as under plain data parallelism)
    ("titan-moe-tiny", 4, dict(tp=1, zero_stage=1, ep=4), "ilp", "plain top-k MoE, EP4 ZeRO-1"),
    ("hf-mixtral-tiny", 4, dict(tp=1, zero_stage=1, ep=2), "ilp",
     "HF Mixtral, EP2 x expert-DP2, ZeRO-1"),
    ("hf-mixtral-tiny", 4, dict(tp=2, zero_stage=0, ep=2), "megatron",
     "HF Mixtral, EP2 x TP2 inside the experts"),
    # the optimizer steps on host copies, expert slabs' state sharded over their 2 holders
    ("hf-mixtral-tiny", 4, dict(tp=1, zero_stage=1, ep=2, offload_optimizer=True), "ilp",
     "HF Mixtral, EP2 x ZeRO-1, optimizer offloaded"),
    # FSDP shards the rest over all 4 ranks, each expert slab over its 2 holders
    ("hf-mixtral-tiny", 4, dict(tp=1, zero_stage=3, ep=2), "ilp",
     "HF Mixtral, EP2 x FSDP (ZeRO-3) over 4"),
    # FSDP2's CPU offload of every shard, the expert slabs' over their 2 holders
    ("hf-mixtral-tiny", 4, dict(tp=1, zero_stage=3, ep=2, offload_params=True), "ilp",
     "HF Mixtral, EP2 x FSDP, parameters offloaded"),
]


def _rank_and_expert_shards(rank, world, name, plan_json):
    """``_rank``'s losses and weights, and per expert weight this rank's (numel of its slab,
    numel it holds, numel of its optimizer state)."""
    from torch.distributed.tensor import DTensor

    from tests.test_runtime import STEPS, _compiled
    trainer, batch = _compiled(name, plan_json)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    held = {}
    for k, p in trainer.model.named_parameters():
        if k.replace("_checkpoint_wrapped_module.", "") in trainer.experts:
            local = p.to_local() if isinstance(p, DTensor) else p
            state = trainer.optimizer.state[p]["exp_avg"]
            state = state.to_local() if isinstance(state, DTensor) else state
            held[k] = (p.numel(), local.numel(), state.numel())
    sd = trainer.full_state_dict()
    return losses, ({k: v.tolist() for k, v in sd.items()} if rank == 0 else None), held


@pytest.mark.parametrize("name,world,force,sharding,family", CASES,
                         ids=[f"{c[0]}-{c[1]}ranks-{c[4]}" for c in CASES])
def test_expert_parallel_run_equals_single_device(name, world, force, sharding, family):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    p = _plan(name, world, force, sharding)
    assert (p.config.ep, p.config.tp, p.config.zero_stage) == (force["ep"], force["tp"],
                                                               force["zero_stage"])
    if force["zero_stage"] < 2:
        assert_equals_one_device(run_ranks(_rank, world, name, p.to_json()), name, family)
        return
    results = run_ranks(_rank_and_expert_shards, world, name, p.to_json())
    assert_equals_one_device([r[:2] for r in results], name, family)
    edp = world // force["ep"]                   # FSDP shards each slab over its holders
    for _, _, held in results:
        assert held and all(local * edp == slab and state == local
                            for slab, local, state in held.values()), held


@needs_hf
def test_expert_parallel_checkpoint_resumes_and_reshards(tmp_path):
    """Save under EP2 (ZeRO-1) on 2 ranks: resuming is the same run bit for bit. Save under
    EP2 x FSDP on 4 ranks: resuming under tp2 on 2 ranks (experts whole again) gives the
    same next losses and weights."""
    from tests.test_checkpoint import _bitwise_same, _plan as ck_plan, _run, _whole
    kw = dict(name="hf-mixtral-tiny", overrides={"layers": 2})
    ep2 = ck_plan(2, dict(tp=1, zero_stage=1, ep=2), "ilp", **kw)
    ckpt = str(tmp_path / "ckpt")
    full = _run(2, ep2.to_json(), ckpt, steps=4, save_at=2, **kw)
    same = _run(2, ep2.to_json(), ckpt, steps=2, resume=ckpt, **kw)
    assert [r[1] for r in same] == [f[1][2:] for f in full]       # bitwise
    _bitwise_same(_whole(same), _whole(full))

    a = ck_plan(4, dict(tp=1, zero_stage=3, ep=2), "ilp", **kw)
    b = ck_plan(2, dict(tp=2), "megatron", **kw)
    assert a.config.ep == 2 and b.config.ep == 1
    ckpt = str(tmp_path / "ckpt4")
    full = _run(4, a.to_json(), ckpt, steps=4, save_at=2, **kw)
    other = _run(2, b.to_json(), ckpt, steps=2, resume=ckpt, **kw)
    for start, losses, _ in other:
        assert start == 2 and losses == pytest.approx(full[0][1][2:], rel=1e-6)
    got, ref = _whole(other), _whole(full)
    for k in ref:
        g, r = torch.tensor(got[k]), torch.tensor(ref[k])
        assert (g - r).norm() <= 1e-5 * max(r.norm(), 1e-12), k


@needs_hf
@pytest.mark.parametrize("force", [dict(schedule="1f1b", zero_stage=3),
                                   dict(schedule="zero_bubble", zero_stage=0)],
                         ids=["1F1B FSDP", "zero bubble (split backward)"])
def test_pipelined_expert_parallel_run_equals_single_device(force):
    """pp2 x EP2 on 4 ranks: each stage's experts split over its 2 dp ranks."""
    from tests.test_checkpoint import _plan as ck_plan, _run, _whole
    from tests.test_runtime import STEPS, _reference
    kw = dict(name="hf-mixtral-tiny", overrides={"layers": 2})
    p = ck_plan(4, dict(pp=2, dp=2, ep=2, **force), "ilp", max_pp=2, **kw)
    assert (p.config.pp, p.config.ep, p.config.schedule) == (2, 2, force["schedule"])
    assert p.mesh.axes == ("pp", "edp", "ep", "tp")
    results = _run(4, p.to_json(), None, steps=STEPS, **kw)
    ref_losses, ref_params = _reference("hf-mixtral-tiny")
    for _, losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    got = _whole(results)
    assert set(got) == set(ref_params)
    for k, ref in ref_params.items():
        g = torch.tensor(got[k], dtype=ref.dtype).reshape(ref.shape)
        assert ((g - ref).norm() / ref.norm().clamp_min(1e-12)).item() <= 1e-5, k


def test_verify_shrinks_an_expert_parallel_plan_to_ep2():
    from autoplan.planner.shrink import shrunk_force
    assert shrunk_force(ParallelConfig(dp=16, tp=2, ep=8, zero_stage=1), 4)["ep"] == 2
    assert shrunk_force(ParallelConfig(dp=16, tp=2, zero_stage=1), 4)["ep"] == 1
    assert shrunk_force(ParallelConfig(dp=16, tp=2, ep=8), 2)["ep"] == 1     # no dp left
