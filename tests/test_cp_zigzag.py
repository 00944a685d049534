"""Load-balanced context parallelism (issue 40 item 4): the zigzag (head-tail) sequence layout
of a cp axis (``ParallelConfig.cp_layout``). Rank r of c holds chunks r and 2c-1-r of 2c, so a
causal ring gives every rank the same attention work where the contiguous layout gives rank r
2r+1 halves of a block. The ring's per-step parts add up to the work the planner prices,
ring attention in the layout equals attention with its gradients, the planner prices and
picks it, and plans train equal to one device on gloo ranks (own model and HF, fp32 and bf16
autocast)."""

import pytest
import torch

from autoplan import Cluster, ParallelConfig, estimate
from autoplan.errors import ConfigError
from autoplan.planner.explain import explain_plan
from autoplan.planner.planfile import Plan
from autoplan.runtime.ring_attention import block_parts
from autoplan.runtime.tp_comm import from_rank_major, rank_major
from autoplan.sharding import ring_work
from autoplan.sharding.context_axis import context_axis
from autoplan.sharding.placement import Placement
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_context_parallel import _graph, _weight
from tests.test_runtime import GLOBAL_BATCH, _plan, _rank, _reference, assert_equals_one_device


# ---- the layout and the work each rank does -----------------------------------------------------

def test_zigzag_pieces_are_head_and_tail_chunks_and_gather_back_in_order():
    x = torch.arange(2 * 16).reshape(2, 16)
    p = Placement.parse("S(1)")
    pieces = rank_major(x, p, 4, zigzag=True)
    assert pieces[1, 0].tolist() == [2, 3, 12, 13]        # chunks 1 and 6 of 8
    assert torch.equal(from_rank_major(pieces, p, 4, zigzag=True), x)
    # a (batch x sequence) dim split per sample (two blocks): each sample's head and tail
    flat = torch.arange(32)
    blocks = rank_major(flat, Placement.parse("S(0)[2]"), 2, zigzag=True)
    assert blocks[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31]
    assert torch.equal(from_rank_major(blocks, Placement.parse("S(0)[2]"), 2, True), flat)


def _runtime_units(c, zigzag, causal):
    """Each rank's work in chunk units (``ring_work``) as the ring's per-step parts do it."""
    rows = 4                                   # two chunks of 2 rows per rank
    chunk = rows // 2
    out = []
    for r in range(c):
        units = 0.0
        for i in range(c):
            for qs, ks, diag in block_parts(zigzag, causal, False, c, r, (r - i) % c, rows):
                n_q = len(range(rows)[qs]) / chunk
                n_k = len(range(rows)[ks]) / chunk
                units += n_q * n_k * (0.5 if diag else 1.0)
        out.append(units)
    return tuple(out)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_the_ring_does_the_work_the_planner_prices_and_zigzag_balances_it(c):
    for layout in ring_work.CP_LAYOUTS:
        for causal in (True, False):
            assert _runtime_units(c, layout == "zigzag", causal) == \
                ring_work.rank_units(c, layout, causal), (c, layout, causal)
    # one device's causal attention is 2c^2 units: the ranks share exactly that
    assert sum(ring_work.rank_units(c, "zigzag", True)) == 2 * c * c
    assert set(ring_work.rank_units(c, "zigzag", True)) == {2 * c}
    contiguous = ring_work.rank_units(c, "contiguous", True)
    assert contiguous[0] == 2 and contiguous[-1] == 4 * c - 2      # 2r + 1 diagonal halves
    assert ring_work.critical_share(c, "contiguous", True) == pytest.approx((2 * c - 1) / c**2)
    assert ring_work.critical_share(c, "zigzag", True) == pytest.approx(1 / c)
    assert ring_work.critical_share(c, "contiguous", False) == pytest.approx(1 / c)


# ---- ring attention in the zigzag layout --------------------------------------------------------

def _zigzag_ring(rank, world, q, k, v, mask, causal, autocast):
    """One rank's ring attention on its head-tail rows, and the gradients of a fixed loss."""
    import contextlib

    import torch.distributed as dist

    from autoplan.runtime.ring_attention import ring_attention
    from autoplan.runtime.tp_comm import AxisComm, local_piece
    dist.init_process_group("gloo")
    comm = AxisComm(dist.group.WORLD, world, rank, zigzag=True)
    rows = Placement.parse("S(2)")
    mine = [local_piece(x, rows, world, rank, True).requires_grad_() for x in (q, k, v)]
    m = local_piece(mask, Placement.parse("S(2)"), world, rank, True) if mask is not None \
        else None
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast
           else contextlib.nullcontext())
    with amp:
        out = ring_attention(torch.ops.aten.scaled_dot_product_attention.default,
                             [*mine, m, 0.0, causal], {}, comm)
    weight = local_piece(_weight(q.shape[:3] + v.shape[-1:]), rows, world, rank, True)
    (out.float() * weight).sum().backward()
    return out.detach().float().tolist(), [x.grad.tolist() for x in mine]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["causal", "bool mask", "full", "causal bf16"])
def test_zigzag_ring_attention_equals_attention_and_its_gradients(world, how):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 8 * world, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    causal = how.startswith("causal")
    autocast = how.endswith("bf16")
    mask = None
    if how == "bool mask":       # causal with a padded key, as HF builds it
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
        mask[0, :, :, 0] = False
        mask[0, :, 0, 0] = True
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    if autocast:                 # one device's attention on the same bf16 inputs
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.bfloat16() for x in full), is_causal=True).float()
    else:
        ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask,
                                                               is_causal=causal)
    (ref * _weight(ref.shape)).sum().backward()
    results = run_ranks(_zigzag_ring, world, q, k, v, mask, causal, autocast)
    rows = Placement.parse("S(2)")
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    gtol = dict(rtol=5e-2, atol=5e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    outs = torch.stack([torch.tensor(o) for o, _ in results])
    torch.testing.assert_close(from_rank_major(outs, rows, world, True), ref.detach(), **tol)
    for n, x in enumerate(full):
        grads = torch.stack([torch.tensor(g[n]) for _, g in results])
        torch.testing.assert_close(from_rank_major(grads, rows, world, True), x.grad, **gtol)


# ---- the planner ---------------------------------------------------------------------------------

def test_causal_rings_are_priced_at_their_slowest_rank_and_planned_zigzag():
    """Llama-3-8B at 32K tokens, cp 4 x tp 8 on 4 x 8 H100: the contiguous layout's attention
    is priced at its last rank's (2c-1)/c^2 = 7/16 where the zigzag one is 1/4; the planner
    lays a causal ring out zigzag and says so; a plan file without the field reads back
    contiguous."""
    if not has_transformers():
        pytest.skip("transformers not installed")
    g = _graph("hf-llama3-8b", device="meta", seq_len=32768, max_positions=32768)
    zz = context_axis(g, 4, "zigzag")
    rings = zz.rings()
    assert rings and all(zz.causal(i) for i in rings)     # HF's mask: built from shapes
    contiguous = context_axis(g, 4)
    assert contiguous.op_scale(rings[0]) == pytest.approx(7 / 16)
    assert zz.op_scale(rings[0]) == pytest.approx(1 / 4)
    cluster = Cluster.preset("dgx-h100", nodes=4)
    kw = dict(dp=1, cp=4, tp=8, zero_stage=3, recompute="full", micro_batch_size=1)
    est = {layout: estimate(g, cluster, config=ParallelConfig(cp_layout=layout, **kw),
                            global_batch_size=1, profile=None)
           for layout in ring_work.CP_LAYOUTS}
    assert est["zigzag"].step_time_s < est["contiguous"].step_time_s
    # only the attention's work (and what its ring passes hide behind) differs
    assert est["zigzag"].peak_memory_bytes == est["contiguous"].peak_memory_bytes
    assert est["zigzag"].time.compute_s < est["contiguous"].time.compute_s

    from autoplan import plan
    p = plan(g, cluster, global_batch_size=4, profile=None, force={"cp": 4, "tp": 8})
    assert p.config.cp_layout == "zigzag"
    assert "sequence layout zigzag" in explain_plan(p)
    assert Plan.from_json(p.to_json()).config.cp_layout == "zigzag"
    old = p.to_json().replace('"cp_layout": "zigzag",', "")
    assert '"cp_layout"' not in old and Plan.from_json(old).config.cp_layout == "contiguous"
    forced = plan(g, cluster, global_batch_size=4, profile=None,
                  force={"cp": 4, "tp": 8, "cp_layout": "contiguous"})
    assert forced.config.cp_layout == "contiguous"
    assert forced.predicted["step_time_s"] > p.predicted["step_time_s"]


def test_a_non_causal_ring_stays_contiguous_and_zigzag_needs_2c_chunks():
    g = _graph("llama-tiny", seq_len=12)          # is_causal=True
    ax = context_axis(g, 4)
    assert ax.rings() and all(ax.causal(i) for i in ax.rings())
    with pytest.raises(ConfigError, match="cp_layout='contiguous'"):
        context_axis(g, 4, "zigzag")             # 12 tokens do not cut into 8 chunks
    # a ring on the tp axis runs contiguous pieces: priced at its last rank's share too
    ring = ax.rings()[0]
    assert ring_work.tp_work_share(g, ring, "ring_attention", 4) == pytest.approx(7 / 16)
    assert ring_work.tp_work_share(g, ring, "", 4) == pytest.approx(1 / 4)
    with pytest.raises(ConfigError, match="cp_layout"):
        ParallelConfig(cp=2, cp_layout="roundrobin")
    if has_transformers():                       # BERT: a padding mask read from the input
        bert = _graph("hf-bert-tiny")
        found = context_axis(bert, 2)
        assert found.rings() and not any(found.causal(i) for i in found.rings())


# ---- training equal to one device ------------------------------------------------------------------

# fp32 plans of own and HF models on a 2-way zigzag ring (cp2 alone, x tp2, x FSDP over dp2)
# train equal to one device in tests/test_context_axis.py (the planner lays them out zigzag);
# here the 4-way ring, whose zigzag steps take both the j < r and j > r halves on every rank

def test_a_4_way_zigzag_ring_trains_like_one_device():
    p = _plan("llama-tiny", 4, dict(cp=4, micro_batch_size=1))
    assert p.config.cp_layout == "zigzag", p.config
    assert_equals_one_device(run_ranks(_rank, 4, "llama-tiny", p.to_json()), "llama-tiny",
                             "own Llama, zigzag cp4")


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_zigzag_trains_in_bf16_autocast():
    """HF Llama, cp 2 in bf16 autocast: one loss on every rank, within bf16's precision of one
    fp32 device, and the zigzag and contiguous layouts (the same bf16 products, other blocks)
    agree closer still."""
    from autoplan import plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    from tests.test_zoo import _rank as zoo_rank
    name = "hf-llama-gqa-tiny"
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    losses = {}
    for layout in ring_work.CP_LAYOUTS:
        p = plan(g, Cluster.local(2), global_batch_size=GLOBAL_BATCH, precision="bf16",
                 profile=None, force=dict(cp=2, zero_stage=0, cp_layout=layout), max_pp=1)
        assert (p.config.cp, p.config.cp_layout, p.config.precision) == (2, layout, "bf16")
        (mine, _), (other, _) = run_ranks(zoo_rank, 2, name, p.to_json())
        assert mine == other
        losses[layout] = mine
    ref, _ = _reference(name)
    assert losses["zigzag"] == pytest.approx(ref, rel=2e-2)
    assert losses["zigzag"][0] == pytest.approx(ref[0], rel=5e-4)
    assert losses["zigzag"] == pytest.approx(losses["contiguous"], rel=5e-3)
