"""Packed documents behind a document mask, run (issue 40 item 4): position ids that restart
per document make HF Llama and autoplan's own Llama attend within documents only, and plans
for them train equal to one device on gloo (data and tensor parallel); the planner prices such
a plan's attention at its masked work (``--seq-lengths``)."""

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.models.packing import document_mask, packed_example
from autoplan.planner.planfile import Plan
from autoplan.sharding.seq_lengths import histogram_of
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_runtime import GLOBAL_BATCH, STEPS, _optimizer, train_one_device

# one row per sample of the global batch: documents crossing no row, of uneven lengths
ROWS = [[5, 11, 16], [32], [1, 31], [20, 12], [8, 8, 8, 8], [3, 29], [31, 1], [16, 16]]


def _packed(name, batch):
    ex = build_example(name, batch_size=batch, seed=0, seq_len=32)
    return packed_example(ex, ROWS[:batch])


def _reference(name):
    ex = _packed(name, GLOBAL_BATCH)
    opt = _optimizer(ex.model.parameters())
    return train_one_device(ex, opt)


def _rank(rank, world, name, plan_json):
    from autoplan.runtime.trainer import compile
    ex, small = _packed(name, GLOBAL_BATCH), _packed(name, 1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    sd = trainer.full_state_dict()
    return losses, ({k: v.tolist() for k, v in sd.items()} if rank == 0 else None)


def _plan(name, world, force, seq_lengths=None):
    small = _packed(name, 1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, max_pp=1, seq_lengths=seq_lengths)


def _needs(name):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")


@pytest.mark.parametrize("name", ["llama-tiny", "hf-llama-tiny"])
def test_documents_do_not_see_each_other(name):
    """A document's logits do not change when the other documents of its row do, and equal
    the document run alone (positions restart with it)."""
    _needs(name)
    ex = _packed(name, 1)
    tokens, pos = ex.example_inputs
    with torch.no_grad():
        packed = ex.model(tokens, pos)
        other = tokens.clone()
        other[:, :5] = (other[:, :5] + 1) % 64
        changed = ex.model(other, pos)
        alone = ex.model(tokens[:, 5:16])
    assert torch.allclose(packed[:, 5:], changed[:, 5:], atol=1e-6)
    assert not torch.allclose(packed[:, :5], changed[:, :5])
    assert torch.allclose(packed[:, 5:16], alone, atol=1e-5)
    mask = document_mask(pos)
    assert mask.shape == (1, 1, 32, 32) and int(mask.sum()) == 15 + 66 + 136


@pytest.mark.parametrize("name,world,force", [
    ("llama-tiny", 2, dict(tp=2, sequence_parallel=True)),
    ("llama-tiny", 2, dict(cp=2, zero_stage=0, cp_layout="zigzag")),
    ("hf-llama-tiny", 2, dict(tp=1, zero_stage=3)),
    ("hf-llama-tiny", 2, dict(tp=2)),
    ("hf-llama-tiny", 2, dict(cp=2, zero_stage=0)),
], ids=["own-tp2-sp", "own-cp2-zigzag", "hf-zero3", "hf-tp2", "hf-cp2"])
def test_packed_plans_train_equal_to_one_device(name, world, force):
    """The document mask is built from the position ids inside the traced graph; on a cp ring
    the runtime computes every block whole with the mask's columns (ring_attention), so the
    ring runs packed documents too, in either layout."""
    _needs(name)
    p = _plan(name, world, force, seq_lengths=histogram_of([(5, 3), (16, 2), (32, 1)]))
    for k, v in force.items():
        assert getattr(p.config, k) == v, (k, p.config)
    ref_losses, ref_params = _reference(name)
    results = run_ranks(_rank, world, name, p.to_json())
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    params = results[0][1]
    assert set(params) == set(ref_params)
    for k, ref in ref_params.items():
        got = torch.tensor(params[k], dtype=ref.dtype).reshape(ref.shape)
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e}"
