"""Adam's moments in less memory (``ParallelConfig.optimizer_state``): 8-bit (torchao's
AdamW8bit) and bf16 states, planned, priced, run on gloo ranks, checkpointed and resharded.

Being lossy, a plan's training is compared with the library applied by hand on one device
(torchao's optimizer over the same model, seed and batch), not with exact AdamW. The model has
one parameter shape, (128, 128), so torchao compiles its step for few shapes; its blocks of 256
elements are the same on one device, on ZeRO-1's whole tensors and on FSDP2's dim-0 shards
(64 rows of 128: a contiguous half of the flat tensor, 32 whole blocks), so the plans quantise
exactly what one device quantises. What differs is the order in which dp sums the gradients
(about 1e-7 relative), hence the 1e-5 tolerance of the other equality tests.
"""

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.errors import ConfigError, PlanError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.sharding.parallel_config import ParallelConfig
from tests.distributed import run_ranks
from tests.test_runtime import train_one_device

torchao = pytest.importorskip("torchao.optim")


@pytest.fixture(autouse=True)
def _inductor_in_process():
    """torchao compiles its step with Inductor, whose compile workers are processes this one
    starts: a rank forked after them and compiling a graph of its own waits on them forever
    (seen with a cold Inductor cache). One compile thread compiles in the process, here and
    in the ranks forked from it."""
    from torch._inductor import config
    with config.patch(compile_threads=1):
        yield


NAME = "mlp-tiny"
SHAPE = dict(in_features=128, hidden_size=128, num_layers=2, num_classes=128, bias=False)
GLOBAL_BATCH = 8
STEPS = 4
LR = 1e-2


def _example(batch):
    return build_example(NAME, batch_size=batch, seed=0, **SHAPE)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def _by_hand(cls):
    """Losses and weights of ``cls`` (torchao's optimizer) on one device, STEPS steps."""
    ex = _example(GLOBAL_BATCH)
    return train_one_device(ex, cls(ex.model.parameters(), lr=LR, eps=1e-6), steps=STEPS)


def _plan(world, force, **kw):
    small = _example(1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, max_pp=1, **kw)


def _train(rank, world, plan_json, ckpt, steps, save_at, resume):
    from autoplan.runtime.checkpoint_held import optimizer_slots
    from autoplan.runtime.trainer import compile
    ex, small = _example(GLOBAL_BATCH), _example(1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_adamw,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json),
                      resume=resume)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = []
    for _ in range(steps):
        losses.append(trainer.step(batch))
        if trainer.steps_done == save_at:
            trainer.save(ckpt)
    kinds = sorted({f"{type(o).__name__}:{type(_local(s['exp_avg'])).__name__}:"
                    f"{_local(s['exp_avg']).dtype}"
                    for o, _ in optimizer_slots(trainer.optimizer) for s in o.state.values()})
    sd = trainer.full_state_dict()
    return trainer.steps_done, losses, {k: v.tolist() for k, v in sd.items()}, kinds


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_same(results, ref_losses, ref_params, first=0):
    """Losses within 1e-5; weights within 1e-5 but for at most 0.1 % of their elements, and
    those within two learning rates: an element whose moment sits on the border of two codes
    may round to the other code where dp summed its gradient in another order, and Adam's
    step moves a weight by about the learning rate."""
    for _, losses, params, _ in results:
        assert losses == pytest.approx(ref_losses[first:], rel=1e-5)
        for k, ref in ref_params.items():
            d = (torch.tensor(params[k]).reshape(ref.shape) - ref).abs()
            off = d > 1e-5 * (1 + ref.abs())
            assert off.float().mean().item() <= 1e-3, (k, off.sum().item())
            assert d.max().item() <= 2 * LR, k


def test_8bit_states_train_as_torchao_by_hand_and_reshard(tmp_path):
    """ZeRO-1 (whole tensors per rank) saves after step 2; ZeRO-3 (FSDP2's DTensor shards)
    resumes from it: both train as torchao's AdamW8bit on one device, and the resumed run's
    moments are 8-bit again."""
    ref_losses, ref_params = _by_hand(torchao.AdamW8bit)
    ckpt = str(tmp_path / "ckpt")
    zero1 = _plan(2, dict(tp=1, zero_stage=1, optimizer_state="8bit"))
    assert zero1.config.optimizer_state == "8bit" and "adam-8bit" in zero1.config.short()
    first = run_ranks(_train, 2, zero1.to_json(), ckpt, STEPS, 2, None)
    _assert_same(first, ref_losses, ref_params)
    assert first[0][3] == ["AdamW8bit:OptimState8bit:torch.float32"]
    zero3 = _plan(2, dict(tp=1, zero_stage=3, optimizer_state="8bit"))
    resumed = run_ranks(_train, 2, zero3.to_json(), ckpt, STEPS - 2, None, ckpt)
    assert [r[0] for r in resumed] == [STEPS, STEPS]
    _assert_same(resumed, ref_losses, ref_params, first=2)
    assert resumed[0][3] == ["AdamW8bit:OptimState8bit:torch.float32"]


def test_bf16_states_train_as_the_library_by_hand():
    """ZeRO-0 over 2 ranks with bf16 moments trains as torchao's step with bf16 moment buffers
    (``BF16StateAdamW``) on one device."""
    from autoplan.runtime.bf16_adam import BF16StateAdamW
    ref_losses, ref_params = _by_hand(BF16StateAdamW)
    plan = _plan(2, dict(tp=1, zero_stage=0, optimizer_state="bf16"))
    got = run_ranks(_train, 2, plan.to_json(), None, STEPS, None, None)
    _assert_same(got, ref_losses, ref_params)
    assert got[0][3] == ["BF16StateAdamW:Tensor:torch.bfloat16"]


def test_bf16_moments_are_megatrons():
    """One step from zero moments: the weight moves as fp32 AdamW moves it (the update is
    computed before the moments are rounded), and the moments hold the fp32 ones in bf16."""
    from autoplan.runtime.bf16_adam import BF16StateAdamW
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    w_ref = torch.nn.Parameter(w.detach().clone())
    g = torch.randn(64, 64)
    w.grad, w_ref.grad = g.clone(), g.clone()
    opt = BF16StateAdamW([w], lr=LR)
    opt.step()
    torch.optim.AdamW([w_ref], lr=LR).step()
    assert torch.allclose(w, w_ref, rtol=0, atol=1e-6)     # an ulp of weights near 2
    state = opt.state[w]
    assert state["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], (0.1 * g).bfloat16())
    assert torch.equal(state["exp_avg_sq"], (0.001 * g * g).bfloat16())


def test_the_user_factory_gives_the_hyper_parameters():
    from autoplan.runtime.lowbit_optim import state_factory
    params = [torch.nn.Parameter(torch.zeros(64, 64))]
    opt = state_factory(lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.8, 0.9), eps=1e-5,
                                                     weight_decay=0.1), "8bit")(params)
    assert type(opt) is torchao.AdamW8bit
    g = opt.param_groups[0]
    assert (float(g["lr"]), g["betas"], g["eps"], g["weight_decay"]) == (
        pytest.approx(3e-4), (0.8, 0.9), 1e-5, 0.1)
    adam = state_factory(lambda ps: torch.optim.Adam(ps), "8bit")(params)
    assert type(adam) is torchao.Adam8bit
    with pytest.raises(PlanError, match="Adam's and AdamW's"):
        state_factory(lambda ps: torch.optim.SGD(ps, lr=0.1), "8bit")(params)


def test_without_torchao_the_plan_is_refused(monkeypatch):
    from autoplan.runtime.lowbit_optim import require_library
    monkeypatch.setitem(__import__("sys").modules, "torchao.optim", None)
    with pytest.raises(PlanError, match=r"autoplan\[lowbit\]"):
        require_library("8bit")
    require_library("fp32")                     # fp32 moments need nothing


def test_the_config_field():
    c = ParallelConfig(dp=2, zero_stage=1, optimizer_state="8bit")
    assert c.to_dict()["optimizer_state"] == "8bit"
    assert ParallelConfig.from_dict(c.to_dict()) == c
    assert "optimizer_state" not in ParallelConfig().to_dict()       # old plans byte for byte
    assert c.short().endswith("adam-8bit bf16")
    with pytest.raises(ConfigError, match="Adam"):
        ParallelConfig(optimizer="sgd", optimizer_state="bf16")
    with pytest.raises(ConfigError, match="optimizer_state"):
        ParallelConfig(optimizer_state="4bit")


def test_memory_and_step_priced():
    from autoplan.cost.memory import bytes_per_param, model_state_bytes
    from autoplan.estimate.dp_terms import step_bytes_per_param
    # 2 moments x (1 byte + a 4-byte scale per 256 elements); bf16: 2 x 2; fp32 master kept
    assert bytes_per_param("bf16", "adamw", "autocast", "8bit") == (4, 4, 2 + 8 / 256)
    assert bytes_per_param("bf16", "adamw", "params", "bf16") == (2, 2, 4 + 4)
    assert bytes_per_param("bf16", "adamw", "params", "fp32") == (2, 2, 12)
    s = model_state_bytes(1e9, dp=4, zero_stage=1, precision="bf16", optimizer_state="8bit")
    assert s.optimizer_bytes == pytest.approx(1e9 * (4 + 2 + 8 / 256) / 4)
    steps = [step_bytes_per_param(ParallelConfig(optimizer_state=k))
             for k in ("fp32", "bf16", "8bit")]
    assert steps == [28, 20, 28 - 16 + 4 + 16 / 256]


def test_lossy_states_are_searched_only_when_allowed():
    from autoplan.planner.search import plan
    small = _example(1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    kw = dict(global_batch_size=GLOBAL_BATCH, profile=None, max_pp=1, force=dict(tp=1, zero_stage=0))
    exact = plan(g, Cluster.from_spec("dgx-h100:1"), **kw)
    lossy = plan(g, Cluster.from_spec("dgx-h100:1"), allow_lossy=True, **kw)
    assert exact.config.optimizer_state == "fp32"
    assert lossy.config.optimizer_state == "8bit"          # fewest bytes: memory and step
    assert lossy.predicted["time"]["optimizer_s"] < exact.predicted["time"]["optimizer_s"]
    sgd = plan(g, Cluster.from_spec("dgx-h100:1"), optimizer="sgd", allow_lossy=True, **kw)
    assert sgd.config.optimizer_state == "fp32"
    from autoplan.planner.explain import explain_plan
    assert "Lossy: numerics differ from exact AdamW" in explain_plan(lossy)
    assert "Lossy" not in explain_plan(exact)


def test_torchao_imports_without_torch_pytree_notices():
    """torchao's first import logs a pytree deprecation notice per Enum under torch 2.12+; the
    runtime's import drops them (every rank of a run printed them), and still raises what
    a broken install raises."""
    import subprocess
    import sys
    code = ("from autoplan.runtime.lowbit_optim import require_library, lowbit_class; "
            "require_library('8bit'); lowbit_class('bf16', True)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "register_constant" not in r.stderr


def test_the_host_step_is_priced_as_torchaos_on_cpu_tensors():
    """Under optimizer offload the step runs torchao's low-bit Adam on the host's CPU tensors,
    slower than the host's fp32 CPU Adam (``benchmarks/host_adam_states.py``), not faster as on
    a GPU; the estimate prices it so and the explanation says so."""
    from autoplan import estimate
    from autoplan.estimate.dp_terms import HOST_STEP_SLOWDOWN
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.search import plan
    small = _example(1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    cluster = Cluster.from_spec("dgx-h100/1")
    host, device = {}, {}
    for state in ("fp32", "bf16", "8bit"):
        for where, off in ((host, True), (device, False)):
            c = ParallelConfig(micro_batch_size=GLOBAL_BATCH, offload_optimizer=off,
                               optimizer_state=state)
            where[state] = estimate(g, cluster, config=c, global_batch_size=GLOBAL_BATCH,
                                    profile=None).time.optimizer_s
    assert device["8bit"] < device["bf16"] < device["fp32"]   # on the device: fewer bytes
    assert host["8bit"] / host["fp32"] == pytest.approx(HOST_STEP_SLOWDOWN["8bit"], rel=0.05)
    assert host["fp32"] < host["bf16"] < host["8bit"]
    p = plan(g, cluster, global_batch_size=GLOBAL_BATCH, profile=None, max_pp=1,
             force=dict(tp=1, offload_optimizer=True, optimizer_state="8bit"))
    assert "slower than the host's fp32 Adam" in explain_plan(p)
