"""Models autoplan did not write train exactly as on one device, under every plan family.

The zoo (``autoplan/models/zoo.py``): Hugging Face GPT-2, Llama (GQA), Mistral, Qwen2, Mixtral,
BERT-MLM, T5 (encoder-decoder) and ViT built from configs, and hand-written models the way
people write them (``nn.TransformerEncoder``, nanoGPT's fused qkv with a literal head count,
weights on the root module, a CNN with batch norm, a Llama written the torchtitan way). Each runs tensor parallelism (Megatron's
rule, with sequence parallelism where there is a sequence) and the ILP's own plan; data
parallel, ZeRO-3, pipeline and 2-D plans are spread over them, on 2 and 4 gloo ranks.

After 3 AdamW steps the loss every rank reports equals single-device training within 1e-5
relative, and so does every parameter: ||got - ref|| <= 1e-5 ||ref|| + 1e-7 sqrt(n). The
absolute floor is for weights whose exact gradient is zero (a key bias under softmax, a
convolution bias before batch norm): they only move by round-off, which no two summation orders
share. Adam's eps is 1e-4 so that such round-off does not become a full-size step.
"""

import math

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from tests.conftest import has_transformers
from tests.distributed import run_ranks

GLOBAL_BATCH = 8
STEPS = 3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def reference(name):
    from tests.test_runtime import _reference
    return _reference(name, optimizer=_optimizer)


def zoo_plan(name, world, force, sharding, batch_size=1):
    small = build_example(name, batch_size=batch_size, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, sharding=sharding,
                     max_pp=force.get("pp", 1))


def _rank(rank, world, name, plan_json):
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(name, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    state = trainer.full_state_dict()           # a collective: every rank calls it
    return losses, {k: v.tolist() for k, v in state.items()}


def assert_equal_to_one_device(name, results, label):
    ref_losses, ref_params = reference(name)
    seen = {}
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5), label
        seen.update(params)
    assert set(seen) == set(ref_params), (label, set(ref_params) ^ set(seen))
    for k, ref in ref_params.items():
        got = torch.tensor(seen[k], dtype=ref.dtype).reshape(ref.shape)
        if not ref.is_floating_point():
            assert torch.equal(got, ref), (label, k)
            continue
        diff = (got - ref).norm().item()
        bound = 1e-5 * ref.norm().item() + 1e-7 * math.sqrt(ref.numel())
        assert diff <= bound, f"{label}: {k} differs by {diff:.2e} (allowed {bound:.2e})"


HF = ("hf-",)
CASES = [
    # (model, world, forced fields, sharding rule)
    ("hf-gpt2-lm-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-gpt2-lm-tiny", 2, dict(tp=2), "ilp"),
    ("hf-gpt2-lm-tiny", 4, dict(tp=2, pp=2), "ilp"),
    ("hf-llama-gqa-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-llama-gqa-tiny", 2, dict(tp=2), "ilp"),
    ("hf-llama-gqa-tiny", 4, dict(dp=2, tp=2, zero_stage=3), "ilp"),
    ("hf-mistral-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-mistral-tiny", 2, dict(tp=2), "ilp"),
    ("hf-mistral-tiny", 2, dict(pp=2), "ilp"),
    ("hf-qwen2-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-qwen2-tiny", 2, dict(tp=2), "ilp"),
    ("hf-qwen2-tiny", 4, dict(tp=1, zero_stage=3), "ilp"),
    ("hf-mixtral-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-mixtral-tiny", 2, dict(tp=2), "ilp"),
    ("hf-mixtral-tiny", 2, dict(tp=1, zero_stage=0), "ilp"),
    ("hf-mixtral-tiny", 4, dict(tp=1, zero_stage=3), "ilp"),
    ("hf-bert-mlm-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-bert-mlm-tiny", 2, dict(tp=2), "ilp"),
    ("hf-bert-mlm-tiny", 2, dict(pp=2), "ilp"),
    ("hf-t5-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("hf-t5-tiny", 2, dict(tp=2), "ilp"),
    ("hf-t5-tiny", 2, dict(pp=2), "ilp"),
    ("hf-vit-tiny", 2, dict(tp=2), "megatron"),     # 17 tokens: no sequence split over 2
    ("hf-vit-tiny", 2, dict(tp=2), "ilp"),
    ("hf-vit-tiny", 2, dict(tp=1, zero_stage=0), "ilp"),
    ("torch-encoder-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("torch-encoder-tiny", 2, dict(tp=2), "ilp"),
    ("torch-encoder-tiny", 2, dict(pp=2), "ilp"),
    ("nanogpt-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("nanogpt-tiny", 2, dict(tp=2), "ilp"),
    ("nanogpt-tiny", 4, dict(pp=2, dp=2), "ilp"),
    ("rootparam-tiny", 2, dict(tp=2), "megatron"),
    ("rootparam-tiny", 2, dict(tp=2), "ilp"),
    ("rootparam-tiny", 2, dict(tp=1, zero_stage=3), "ilp"),
    ("cnn-tiny", 2, dict(tp=2), "megatron"),
    ("cnn-tiny", 2, dict(tp=2), "ilp"),
    ("cnn-tiny", 4, dict(dp=2, tp=2), "ilp"),
    ("titan-llama-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron"),
    ("titan-llama-tiny", 2, dict(tp=2), "ilp"),
    ("titan-llama-tiny", 4, dict(pp=2, tp=2), "ilp"),
]


def _label(case):
    name, world, force, sharding = case
    return f"{name}-{world}ranks-{sharding}-" + ",".join(f"{k}={v}" for k, v in force.items())


@pytest.mark.parametrize("name,world,force,sharding", CASES, ids=[_label(c) for c in CASES])
def test_zoo_model_trains_like_one_device(name, world, force, sharding):
    if name.startswith(HF) and not has_transformers():
        pytest.skip("transformers not installed")
    plan = zoo_plan(name, world, force, sharding)
    for k, v in force.items():
        assert getattr(plan.config, k) == v, (k, plan.config)
    results = run_ranks(_rank, world, name, plan.to_json(), timeout_s=240.0)
    assert_equal_to_one_device(name, results, f"{name} {plan.config.short()} ({sharding})")
