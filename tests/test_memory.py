"""Memory model against published formulas (ZeRO; Korthikanti et al. 2022)."""

import pytest

from autoplan.cost.memory import activation_bytes, model_state_bytes


@pytest.mark.parametrize("stage,per_param", [
    (0, lambda n: 16.0),
    (1, lambda n: 4.0 + 12.0 / n),
    (2, lambda n: 2.0 + 14.0 / n),
    (3, lambda n: 16.0 / n),
])
def test_zero_model_states_match_paper(stage, per_param):
    # ZeRO paper, Fig. 1: 7.5B parameters, N = 64 data-parallel GPUs, mixed-precision Adam
    psi, n = 7.5e9, 64
    got = model_state_bytes(psi, dp=n, zero_stage=stage, precision="bf16", optimizer="adam")
    want = per_param(n) * psi
    assert abs(got.total_bytes - want) / want < 0.01


def test_optimizer_offload_leaves_no_state_on_device():
    s = model_state_bytes(1e9, dp=8, zero_stage=1, precision="bf16", offload_optimizer=True)
    assert s.optimizer_bytes == 0 and s.offloaded_bytes == pytest.approx(12e9 / 8)


S, B, H, A = 2048, 1, 12288, 96   # GPT-3 175B shapes


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, "none", S * B * H * (34 + 5 * A * S / H)),
    (8, False, "none", S * B * H * (10 + 24 / 8 + 5 * A * S / (H * 8))),
    (8, True, "none", S * B * H / 8 * (34 + 5 * A * S / H)),
    (8, True, "selective", S * B * H / 8 * 34),
    (1, False, "full", 2 * S * B * H),
])
def test_layer_activations_match_korthikanti(gpt3_two_layers, tp, sp, recompute, formula):
    g = gpt3_two_layers
    layer = g.blocks[0].instances[0]
    got = activation_bytes(g, layer.start, layer.stop, micro_batch_size=1, tp=tp, sp=sp,
                           recompute=recompute, precision="bf16")
    assert abs(got - formula) / formula < 0.02


def test_activations_scale_with_micro_batch(gpt3_two_layers):
    g = gpt3_two_layers
    layer = g.blocks[0].instances[0]
    one = activation_bytes(g, layer.start, layer.stop, micro_batch_size=1)
    four = activation_bytes(g, layer.start, layer.stop, micro_batch_size=4)
    assert four == pytest.approx(4 * one, rel=0.01)


def test_parameter_offload_keeps_weights_and_gradients_on_the_host():
    s = model_state_bytes(1e9, dp=8, zero_stage=3, precision="bf16", offload_params=True)
    assert s.total_bytes == 0 and s.offloaded_bytes == pytest.approx(16e9 / 8)


def test_the_host_runs_torchs_adam_fused_as_priced():
    """Optimizer offload's host step is priced at a vectorised CPU Adam's rate: torch's Adam
    and AdamW run fused on the host copies where the user chose no implementation (the same
    hyper-parameters and, to fp32 rounding, the same step); a chosen implementation or another
    optimizer stays as made."""
    import torch

    from autoplan.runtime.optim import vectorised_on_host

    def made(cls, **kw):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 64, generator=gen))
        p.grad = torch.randn(64, 64, generator=gen)
        return p, cls([p], lr=1e-2, eps=1e-6, weight_decay=0.1, **kw)
    p, fused = made(torch.optim.AdamW)
    fused = vectorised_on_host(fused)
    q, loop = made(torch.optim.AdamW, foreach=False)
    assert vectorised_on_host(loop) is loop                  # chosen: kept
    g = fused.param_groups[0]
    assert (g["fused"], g["lr"], g["eps"], g["weight_decay"]) == (True, 1e-2, 1e-6, 0.1)
    for _ in range(3):
        fused.step()
        loop.step()
    assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    sgd = torch.optim.SGD([p], lr=0.1)
    assert vectorised_on_host(sgd) is sgd
