"""Plans in bf16, the precision GPU users plan in, run: the weights in fp32, products in bf16.

Every other runtime test trains in fp32 to compare with one device to round-off; these check
the mixed-precision paths themselves, which fp32 never takes: FSDP's mixed-precision gathers
meeting the fp32 casts a traced HF model keeps (its RMSNorm upcasts and casts back to the dtype
it was traced in), ZeRO-1's fp32 weights meeting bf16 activations, and grouped expert products
(a custom op autocast does not reach) under both. Each runs 3 AdamW steps on 2 gloo ranks; the
losses agree between the ranks and follow single-device fp32 training within bf16's precision.
"""

import pytest
import torch

from autoplan import Cluster
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.search import plan as make_plan
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_runtime import GLOBAL_BATCH, _reference
from tests.test_zoo import _rank

CASES = [
    # (ZeRO-3's 16-bit gathers alone: tests/test_zoo_16bit.py, against eager autocast)
    # the sequence split everywhere: ring attention, and the loss over vocabulary shards
    ("hf-llama-gqa-tiny", dict(tp=2, zero_stage=0), dict(sharding="context")),
    # every product on sequence shards with its weight stored split and gathered (and so ring
    # attention, its q and k from an fp32 rotary embedding beside a bf16 v)
    ("hf-llama-gqa-tiny", dict(tp=2, zero_stage=3), dict(pin={"*:linear": "seq_gathered"})),
    ("hf-mixtral-tiny", dict(tp=1, zero_stage=3, ep=2), {}),
]


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
@pytest.mark.parametrize("name,force,kw", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_bf16_plans_train(name, force, kw):
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = make_plan(g, Cluster.local(2), global_batch_size=GLOBAL_BATCH, precision="bf16",
                  profile=None, force=force, max_pp=1, **kw)
    assert p.config.precision == "bf16"
    results = run_ranks(_rank, 2, name, p.to_json())
    ref, _ = _reference(name)
    (losses, _), (other, _) = results
    assert losses == other                              # one loss, on every rank
    assert losses == pytest.approx(ref, rel=2e-2)       # bf16 products: a few ulps of 2^-8
    # before any step the weights are the same: the loss itself is fp32, as autocast makes
    # it (rounded to bf16 it would be off by up to 2^-9 of itself)
    assert losses[0] == pytest.approx(ref[0], rel=5e-4)
    assert losses[-1] < losses[0]


class _CastsBeforeItsNorm(torch.nn.Module):
    """The pattern of HF BART's embeddings: a tensor cast to the dtype the model was traced in
    (fp32) meets a layer norm outside every layer, whose weights FSDP's mixed precision hands
    over in bf16."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.pos = torch.nn.Embedding(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids):
        positions = self.pos(torch.arange(ids.shape[1])).to(torch.float32)
        return self.head(self.norm(self.embed(ids) + positions))


def test_a_norm_whose_input_stays_fp32_takes_bf16_weights():
    """On CPU, autocast leaves ``layer_norm`` alone and its kernel refuses an fp32 input with
    bf16 weights (HF BART under ZeRO-3 in bf16 failed so): the rank program runs such a norm
    with its weights in the input's dtype, as one device does."""
    import copy

    from autoplan.runtime.emit import emit
    model = _CastsBeforeItsNorm()
    one_device = copy.deepcopy(model)     # fp32 weights rounded as the bf16 gathers round them
    for w in one_device.parameters():
        w.data = w.data.bfloat16().float()
    ids = torch.randint(0, 32, (2, 8))
    g = trace(model, (ids,))
    p = make_plan(g, Cluster.local(1), global_batch_size=2, precision="bf16", profile=None)
    rp = emit(model, p, g, example_inputs=(ids,), example_targets=None, loss_fn=None, t=1,
              tp_rank=0, device=torch.device("cpu"), seed=0)
    rp.module.to(torch.bfloat16)                      # as FSDP's mixed precision gathers them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rp.module(ids)
        with pytest.raises(RuntimeError, match="mixed dtype"):     # what the kernel refuses
            torch.nn.functional.layer_norm(torch.randn(2, 16), (16,), rp.module.get_parameter(
                "norm.weight"), rp.module.get_parameter("norm.bias"))
        ref = one_device(ids)
    assert out.shape == ref.shape
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
