"""Attention whose traced mask is proven causal runs as ``is_causal=True`` with no mask
(``runtime/causal_mask.py``), as plain eager HF Llama calls it; masks that read an input, or
are not the causal triangle, stay. Multi-rank numerics of the rewritten HF programs are the
zoo's (``tests/test_zoo.py``: HF Llama, Mistral, Qwen2 under tp=2 match one device)."""

import pytest
import torch
from torch import nn

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.graph.trace import export_program
from autoplan.runtime.causal_mask import causal_attention_nodes
from tests.conftest import has_transformers

CPU = torch.device("cpu")
SDPA = torch.ops.aten.scaled_dot_product_attention.default
needs_hf = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")


def _sdpa_calls(gm):
    from autoplan.runtime.kernels import get_arg
    return [(get_arg(SDPA, list(n.args), dict(n.kwargs), "attn_mask"),
             get_arg(SDPA, list(n.args), dict(n.kwargs), "is_causal", False))
            for n in gm.graph.nodes if n.target is SDPA]


@needs_hf
def test_hf_llama_program_calls_causal_attention_and_trains_like_eager():
    from autoplan.models import build_example
    from autoplan.runtime.emit import emit
    ex = build_example("hf-llama-gqa-tiny", batch_size=2, seed=0)
    ref = build_example("hf-llama-gqa-tiny", batch_size=2, seed=0)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    p = make_plan(g, Cluster.local(1), global_batch_size=2, precision="fp32", profile=None)
    rp = emit(ex.model, p, g, example_inputs=ex.example_inputs, example_targets=ex.targets,
              loss_fn=ex.loss_fn, t=1, tp_rank=0, device=CPU, seed=0)
    calls = _sdpa_calls(rp.program.graph_module)
    assert len(calls) == 2 and all(m is None and c for m, c in calls), calls
    # the mask's ops went with it (HF builds it with cumsum / le / and)
    kept = {n.target for n in rp.program.graph_module.graph.nodes}
    assert torch.ops.aten.cumsum.default not in kept and torch.ops.aten.le.Tensor not in kept

    loss = rp.module(*ex.example_inputs, ex.targets)
    loss.backward()
    ref_loss = ref.loss_fn(ref.model(*ref.example_inputs), ref.targets)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    grads = dict(ref.model.named_parameters())
    for name, w in ex.model.named_parameters():
        torch.testing.assert_close(w.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


@needs_hf
def test_a_padding_mask_input_or_a_sliding_window_is_kept():
    from autoplan.models import build_example
    from autoplan.models.zoo import HFCall
    ex = build_example("hf-llama-gqa-tiny", batch_size=2, seed=0)
    padded = HFCall(ex.model.model, inputs=("input_ids", "attention_mask"), output="logits")
    ids = ex.example_inputs[0]
    am = torch.ones_like(ids)
    am[0, :3] = 0
    ep, _, _ = export_program(padded, (ids, am))
    assert [m is not None for m, _ in _sdpa_calls(ep.graph_module)] == [True, True]
    assert causal_attention_nodes(ep.graph, CPU) == frozenset()
    # the same model without the input: its mask is the causal one
    ep, _, _ = export_program(ex.model, ex.example_inputs)
    assert len(causal_attention_nodes(ep.graph, CPU)) == 2
    # a sliding window shorter than the sequence: made from shapes alone, but not causal
    sw = build_example("hf-mistral-tiny", batch_size=2, seed=0, extra=(("sliding_window", 4),))
    ep, _, _ = export_program(sw.model, sw.example_inputs)
    assert causal_attention_nodes(ep.graph, CPU) == frozenset()


class _MaskedAttention(nn.Module):
    """One attention with a mask made in ``forward`` the way ``form`` says."""

    def __init__(self, form: str, s: int = 8):
        super().__init__()
        self.form = form
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("tril", torch.ones(s, s, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        allowed = i[:, None] >= i[None, :]
        if self.form == "bool":
            mask = allowed
        elif self.form == "-inf":
            mask = torch.zeros(s, s, device=x.device).masked_fill(~allowed, float("-inf"))
        elif self.form == "lowest":
            mask = torch.zeros(s, s, device=x.device).masked_fill(
                ~allowed, torch.finfo(torch.float32).min)
        elif self.form == "below-diagonal":
            mask = i[:, None] > i[None, :] - 1 - s      # every key: not causal
        else:                                            # "buffer": causal, but read
            mask = self.tril                             # from the module's state
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("form,proven", [("bool", True), ("-inf", True), ("lowest", True),
                                         ("below-diagonal", False), ("buffer", False)])
def test_only_a_mask_made_from_shapes_and_equal_to_the_triangle_is_proven(form, proven):
    ep, _, _ = export_program(_MaskedAttention(form), (torch.randn(2, 8, 16),))
    assert bool(causal_attention_nodes(ep.graph, CPU)) is proven
