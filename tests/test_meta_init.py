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
    with pytest.raises(PlanError, match=r"buffer body\.scale of _Scaled .*empty_weights"):
        _compile_meta(model, small, 2)


def test_a_model_built_under_empty_weights_keeps_its_buffers_and_trains_as_on_the_cpu():
    """The same model built under autoplan.empty_weights(): weights on meta, the buffer its
    __init__ computed kept; the rank holds it, and trains as the CPU build does (the same seed
    gives torch's layers the same reset_parameters draws)."""
    import autoplan
    from types import SimpleNamespace
    with autoplan.empty_weights():
        model = _Net()
    assert all(p.is_meta for p in model.parameters())
    assert not model.body.scale.is_meta
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    small = SimpleNamespace(example_inputs=(x[:2].to("meta"),), targets=y[:2].to("meta"),
                            loss_fn=nn.functional.cross_entropy)
    trainer = _compile_meta(model, small, 4)
    assert torch.equal(dict(trainer.model.named_buffers())["body.scale"],
                       torch.linspace(0.5, 1.5, 8))
    losses = [trainer.step((x, y)) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_torchtitan_llama_built_for_meta_keeps_its_rotary_table():
    """torchtitan's Llama computes its complex rotary table (freqs_cis) in __init__ and has no
    reset_parameters: `build_example(..., device="meta")` builds it under empty_weights(), so
    `autoplan run --meta` trains it with the table a CPU build computes."""
    cpu = build_example("titan-llama-tiny", batch_size=4, seed=0)
    meta = build_example("titan-llama-tiny", batch_size=1, seed=0, device="meta")
    assert all(p.is_meta for p in meta.model.parameters())
    assert torch.equal(meta.model.freqs_cis, cpu.model.freqs_cis)
    trainer = _compile_meta(build_example("titan-llama-tiny", device="meta").model, meta, 4)
    held = dict(trainer.model.named_buffers())
    assert torch.equal(held["freqs_cis"], cpu.model.freqs_cis)
    rows = tuple(cpu.example_inputs) + (cpu.targets,)
    losses = [trainer.step(rows) for _ in range(4)]
    assert losses[0] - losses[-1] > 0.5, losses


class _Huge(nn.Module):
    """Weights written from values, too big for any machine, beside a small computed table."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2**20, 2**20) * 0.02)     # 4 TiB in fp32
        self.proj = nn.Linear(2**16, 2**16)
        self.register_buffer("table", torch.arange(8).float() / 8)


def test_empty_weights_never_computes_a_big_weight_and_keeps_small_buffers():
    import autoplan
    register = nn.Module.register_parameter
    with autoplan.empty_weights():
        with autoplan.empty_weights():          # nested blocks are fine
            model = _Huge()
    assert nn.Module.register_parameter is register          # put back
    assert model.experts.is_meta and model.proj.weight.is_meta and model.proj.bias.is_meta
    assert torch.equal(model.table, torch.arange(8).float() / 8)
    assert torch.randn(2, 2).device.type == "cpu"             # only inside the block
    with autoplan.empty_weights(meta_above_numel=4):          # a table over the bound: meta
        assert _Huge().table.is_meta
    for bad in (-1, 2.5, "1"):
        with pytest.raises(ValueError, match="meta_above_numel"):
            with autoplan.empty_weights(meta_above_numel=bad):
                pass
