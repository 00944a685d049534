"""A model built on the meta device is materialized with the values its authors give it
(``runtime/meta_init.py``): Hugging Face's own initialization (norms one, rotary frequencies
from the config), torch's ``reset_parameters``, and a refusal, never noise, for a buffer that
cannot be recovered."""

import pytest
import torch
from torch import nn

from autoplan.errors import PlanError
from autoplan.models import build_example

pytestmark = pytest.mark.hf


def _compile_meta(model, small, gbs):
    from autoplan.runtime.trainer import compile
    return compile(model, "local", example_inputs=small.example_inputs,
                   example_targets=small.targets, loss_fn=small.loss_fn,
                   optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), global_batch_size=gbs,
                   precision="fp32", profile=None)


def test_hugging_face_llama_built_on_meta_trains_from_its_own_initialization():
    pytest.importorskip("transformers")
    cpu = build_example("hf-llama-tiny", batch_size=4, seed=0)
    small = build_example("hf-llama-tiny", batch_size=1, seed=0, device="meta")
    trainer = _compile_meta(build_example("hf-llama-tiny", device="meta").model, small, 4)
    trained = dict(trainer.model.named_parameters())
    norms = [n for n in trained if "norm" in n]
    assert norms and all(torch.equal(trained[n].detach(), torch.ones_like(trained[n]))
                         for n in norms)
    freq = {n: b for n, b in trainer.model.named_buffers() if n.endswith("rotary_emb.inv_freq")}
    want = {n: b for n, b in cpu.model.named_buffers() if n.endswith("rotary_emb.inv_freq")}
    assert freq and freq.keys() == want.keys()
    assert all(torch.equal(freq[n], want[n]) for n in freq)
    # as a CPU build trains: the loss starts near log(vocab) and falls by a similar amount
    rows = tuple(cpu.example_inputs) + (cpu.targets,)
    losses = [trainer.step(rows) for _ in range(4)]
    assert losses[0] - losses[-1] > 0.5, losses


class _Scaled(nn.Module):
    """A layer written without reset_parameters, holding a buffer computed in __init__."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.proj(x) * self.scale


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Scaled()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_buffer_no_initializer_fills_is_refused_by_name():
    from types import SimpleNamespace
    with torch.device("meta"):
        model = _Net()
    small = SimpleNamespace(example_inputs=(torch.randn(2, 8, device="meta"),),
                            targets=torch.randint(0, 4, (2,), device="meta"),
                            loss_fn=nn.functional.cross_entropy)
    with pytest.raises(PlanError, match=r"buffer body\.scale of _Scaled .*reset_parameters"):
        _compile_meta(model, small, 2)
