"""Document-masked attention as flex attention on CUDA (``runtime/document_attention.py``):
the traced mask of packed documents is proven the document mask of the position-ids input
(own Llama and HF Llama; a padding mask is not), the block mask built from the position ids
gives the dense mask's attention, and on CUDA the rank program runs flex attention without the
dense mask, its loss and gradients those of the dense program (``-m gpu``)."""

import pytest
import torch

from autoplan.graph.trace import export_program
from autoplan.models import build_example
from autoplan.models.packing import document_mask, packed_example
from autoplan.runtime.document_attention import (block_mask, document_attention_nodes,
                                                 proven_document_masks)
from tests.conftest import has_transformers

ROWS = [[5, 11, 16], [1, 31]]
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _packed(name, device="cpu"):
    return packed_example(build_example(name, batch_size=2, seed=0, seq_len=32, device=device),
                          ROWS)


@pytest.mark.parametrize("name", ["llama-tiny", "hf-llama-tiny"])
def test_a_packed_models_mask_is_proven_the_document_mask_of_its_position_ids(name):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    ex = _packed(name)
    ep, _, _ = export_program(ex.model, ex.example_inputs)
    found = proven_document_masks(ep.graph)
    sdpa = [n.name for n in ep.graph.nodes if n.target is SDPA]
    assert sorted(found) == sorted(sdpa) and len(sdpa) == 2
    placeholders = [n.name for n in ep.graph.nodes if n.op == "placeholder"]
    assert set(found.values()) == {placeholders[-1]}          # the position ids, last input
    assert document_attention_nodes(ep.graph, torch.device("cpu")) == {}   # CPU: dense mask
    plain = build_example(name, batch_size=2, seed=0, seq_len=32)
    ep, _, _ = export_program(plain.model, plain.example_inputs)
    assert proven_document_masks(ep.graph) == {}


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_a_padding_mask_is_not_a_document_mask():
    from autoplan.models.zoo import HFCall
    ex = build_example("hf-llama-gqa-tiny", batch_size=2, seed=0)
    padded = HFCall(ex.model.model, inputs=("input_ids", "attention_mask"), output="logits")
    ids = ex.example_inputs[0]
    am = torch.ones_like(ids)
    am[0, :3] = 0
    ep, _, _ = export_program(padded, (ids, am))
    assert proven_document_masks(ep.graph) == {}


@pytest.mark.filterwarnings("ignore:flex_attention called without")
def test_the_block_mask_attends_as_the_dense_document_mask():
    from torch.nn.attention.flex_attention import flex_attention
    from autoplan.models.packing import document_position_ids
    torch.manual_seed(0)
    pos = document_position_ids(ROWS, 32)
    q, k, v = (torch.randn(2, 2, 32, 8) for _ in range(3))
    bm = block_mask(pos)
    assert block_mask(pos) is bm                       # one per position ids, every layer
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=bm)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                            attn_mask=document_mask(pos))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_program_runs_flex_attention_equal_to_the_dense_mask():
    """On CUDA the rank program calls flex attention with no dense mask (its ops dropped);
    the loss and gradients are those of the model run with SDPA's dense mask."""
    from autoplan import Cluster
    from autoplan import plan as make_plan
    from autoplan.graph import trace
    from autoplan.runtime.document_attention import kernel_document_attention
    from autoplan.runtime.emit import emit
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    ex, ref = _packed("llama-tiny"), _packed("llama-tiny")
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    p = make_plan(g, Cluster.from_spec("dgx-h100/1"), global_batch_size=2, precision="fp32",
                  profile=None, force={"compiled": False})
    ex.model.to(cuda)
    ref.model.to(cuda)
    inputs = tuple(t.to(cuda) for t in ex.example_inputs)
    targets = ex.targets.to(cuda)
    rp = emit(ex.model, p, g, example_inputs=inputs, example_targets=targets,
              loss_fn=ex.loss_fn, t=1, tp_rank=0, device=cuda, seed=0)
    nodes = list(rp.program.graph_module.graph.nodes)
    assert sum(n.target is kernel_document_attention for n in nodes) == 2
    assert not any(n.target is SDPA for n in nodes)
    assert torch.ops.aten.cumsum.default not in {n.target for n in nodes}
    loss = rp.module(*inputs, targets)
    loss.backward()
    ref_loss = ref.loss_fn(ref.model(*inputs), targets)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    grads = dict(ref.model.named_parameters())
    for name, w in ex.model.named_parameters():
        torch.testing.assert_close(w.grad, grads[name].grad, rtol=1e-3, atol=1e-5)
