"""Context parallelism: attention over a sequence split across ranks as ring attention (the
key/value blocks passed around the ring), its strategy and price, the planner's use of it for
long sequences, and training equal to one device on 2 and 4 gloo ranks."""

import pytest
import torch

from autoplan import Cluster, ParallelConfig, estimate, plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.sharding.sharding import context_sharding, megatron_sharding
from autoplan.sharding.strategies import strategies_by_name
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_experts import _timeline_draws_the_exchanges
from tests.test_runtime import _rank, assert_equals_one_device


def _graph(name, **kw):
    ex = build_example(name, batch_size=1, **kw)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def _ring(rank, world, q, k, v, mask, causal):
    """One rank's ring attention on its rows, and the gradients of a fixed loss."""
    from autoplan.runtime.ring_attention import ring_attention
    from autoplan.runtime.tp_comm import AxisComm
    import torch.distributed as dist
    dist.init_process_group("gloo")
    comm = AxisComm(dist.group.WORLD, world, rank)
    rows = q.shape[2] // world
    mine = [x[:, :, rank * rows:(rank + 1) * rows].clone().requires_grad_() for x in (q, k, v)]
    m = mask[..., rank * rows:(rank + 1) * rows, :] if mask is not None else None
    out = ring_attention(torch.ops.aten.scaled_dot_product_attention.default,
                         [*mine, m, 0.0, causal], {}, comm)
    weight = _weight(q.shape[:3] + v.shape[-1:])[:, :, rank * rows:(rank + 1) * rows]
    (out * weight).sum().backward()
    return out.detach().tolist(), [x.grad.tolist() for x in mine]


def _weight(shape):
    """A fixed upstream gradient, different per element."""
    return torch.arange(torch.Size(shape).numel()).reshape(shape).sin()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["causal", "bool mask", "float mask", "full"])
def test_ring_attention_equals_attention_and_its_gradients(world, how):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 8 * world, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64).float() for _ in range(3))
    causal = how == "causal"
    mask = None
    if how == "bool mask":       # causal with a padded key, as HF builds it
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
        mask[0, :, :, 0] = False
        mask[0, :, 0, 0] = True
    elif how == "float mask":
        mask = torch.randn(1, h, s, s)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask,
                                                           is_causal=causal)
    (ref * _weight(ref.shape)).sum().backward()
    results = run_ranks(_ring, world, q, k, v, mask, causal)
    rows = s // world
    for r, (out, grads) in enumerate(results):
        sl = slice(r * rows, (r + 1) * rows)
        torch.testing.assert_close(torch.tensor(out), ref.detach()[:, :, sl], rtol=1e-5,
                                   atol=1e-5)
        for g, x in zip(grads, full):
            torch.testing.assert_close(torch.tensor(g), x.grad[:, :, sl], rtol=1e-4, atol=1e-5)


def test_the_seq_strategy_is_ring_attention_with_its_traffic():
    g = _graph("llama-tiny")
    op = next(o for o in g.ops if o.target.startswith("aten.scaled_dot_product_attention"))
    seq = strategies_by_name(g, op, 2)["seq"]
    assert seq.kernel == "ring_attention" and seq.inputs[:3] == seq.outputs * 3
    kinds = sorted((c.kind, c.phase) for c in seq.comms)
    assert kinds == sorted([("all_gather", "fwd"), ("all_gather", "bwd"),
                            ("reduce_scatter", "bwd")] * 2)
    sh = context_sharding(g, 2)
    assert sum(s.kernel == "ring_attention" for s in sh.op_strategy) == 2     # both layers
    assert context_sharding(_graph("mlp-tiny"), 2) is None                    # no attention


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_a_learned_attention_mask_is_not_split_over_the_ring():
    """T5 adds a learned relative position bias to its scores (the mask input requires grad).
    The ring's kernels give no mask gradient, so its attention is not offered the sequence
    split: drawn at random it had trained the bias wrong (1e-2 off one device)."""
    g = _graph("hf-t5-tiny")
    ops = [o for o in g.ops if o.target.startswith("aten.scaled_dot_product_attention")]
    learned = [o for o in ops if len(o.inputs) == 4 and g.value(o.inputs[3]).requires_grad]
    assert learned
    assert all("seq" not in strategies_by_name(g, o, 2) for o in learned)


def test_long_sequences_plan_context_parallel(tmp_path):
    """Llama-3-8B at 131,072 tokens on 8 x 8 H100: the search splits the sequence (ring
    attention), on the tensor-parallel axis or on a cp axis of its own, with FSDP over the
    rest, and beats every Megatron-LM tensor + sequence parallel configuration that fits (tp 2,
    4, 8; ZeRO-1 or 3) and the best plan that has only the tp axis to split it on. A ring on
    the tp axis runs contiguous pieces, priced at its last rank's (2t-1)/t^2 of the causal
    attention (``sharding/ring_work.py``): there heads beside sequence parallelism win."""
    if not has_transformers():
        pytest.skip("transformers not installed")
    g = _graph("hf-llama3-8b", device="meta", seq_len=131072, max_positions=131072)
    cluster = Cluster.preset("dgx-h100", nodes=8)
    p = plan(g, cluster, global_batch_size=64, profile=None)
    rings = {v for k, v in p.op_strategies.items() if k.startswith("scaled_dot_product")}
    assert rings == {"seq"} and p.config.tp > 1 or p.config.cp > 1, (rings, p.config.short())
    assert p.predicted["fits"]
    from autoplan.planner.explain import explain_plan
    assert "run as ring attention" in explain_plan(p)
    if p.config.cp > 1:                      # its own axis: in the plan file (schema 5)
        assert "cp" in p.mesh.axes and p.schema_version >= 5
        assert f"over cp ({p.config.cp} ranks)" in explain_plan(p)
        assert Plan.from_json(p.to_json()).to_json() == p.to_json()
    on_tp = plan(g, cluster, global_batch_size=64, profile=None, force={"cp": 1})
    assert on_tp.config.cp == 1 and on_tp.predicted["fits"]
    assert p.predicted["step_time_s"] <= on_tp.predicted["step_time_s"]
    # ring attention's exposed passes have their own key, and the timeline draws them
    assert p.predicted["time"]["comm_exposed_s"]["cp_ring"] > 0
    _timeline_draws_the_exchanges(p, "cp_ring", tmp_path)
    fitting = []
    for tp in (2, 4, 8):
        for z in (1, 3):
            e = estimate(g, cluster, config=ParallelConfig(
                dp=64 // tp, tp=tp, zero_stage=z, recompute="full", sequence_parallel=True),
                global_batch_size=64, profile=None, sharding=megatron_sharding(g, tp, True))
            if e.fits:
                fitting.append(e.step_time_s)
    assert fitting and p.predicted["step_time_s"] < min(fitting)


def test_a_plan_whose_tensor_traffic_is_all_ring_passes_is_valid():
    """Llama-3-70B, pp16 x dp4 x tp4 with the sequence split everywhere (the plan `autoplan
    plan llama3-70b --cluster dgx-h100:32 --global-batch 1024` picks): the tp axis carries
    only ring passes, and its exposed time, the tp traffic less the ring's, came out
    -1.1e-16 s, which the plan file refused (the search failed)."""
    g = _graph("llama3-70b", device="meta")
    e = estimate(g, Cluster.preset("dgx-h100", nodes=32), config=ParallelConfig(
        dp=4, tp=4, pp=16, sequence_parallel=True, zero_stage=1,
        chunk_layers=(1, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 5)),
        global_batch_size=1024, profile=None, sharding=context_sharding(g, 4))
    assert e.time.comm_exposed_s["cp_ring"] > 0
    assert all(v >= 0 for v in e.time.comm_exposed_s.values()), e.time.comm_exposed_s


CASES = [
    ("llama-tiny", 2, dict(tp=2, zero_stage=0), "context parallel (RoPE, GQA)"),
    ("hf-llama-gqa-tiny", 2, dict(tp=2, zero_stage=0), "HF Llama, context parallel"),
    ("nanogpt-tiny", 4, dict(tp=2, dp=2, zero_stage=3), "nanoGPT, context parallel x FSDP"),
    ("hf-mistral-tiny", 4, dict(tp=4, zero_stage=0), "HF Mistral, 4-way ring"),
]


@pytest.mark.parametrize("name,world,force,family", CASES, ids=[c[3] for c in CASES])
def test_context_parallel_run_equals_single_device(name, world, force, family):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = plan(g, Cluster.local(world), global_batch_size=8, precision="fp32", profile=None,
             force=force, fixed_sharding=context_sharding(g, force["tp"]), max_pp=1)
    rings = [v for k, v in p.op_strategies.items() if k.startswith("scaled_dot_product")]
    assert rings and set(rings) == {"seq"}, rings
    assert_equals_one_device(run_ranks(_rank, world, name, p.to_json()), name, family)
