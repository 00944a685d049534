"""Tests of the example models and their registry (autoplan.models)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from autoplan.models import (
    Example,
    build_example,
    example_family,
    example_param_count,
    get_config,
    list_examples,
    materialize,
)

NATIVE_TINY = ["mlp-tiny", "gpt-tiny", "llama-tiny", "resnet-tiny", "dlrm-tiny"]
HF_TINY = ["hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]


def _train_step_grads(ex: Example) -> torch.Tensor:
    loss = ex.compute_loss()
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, param in ex.model.named_parameters():
        assert param.grad is not None, f"{ex.name}: {name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{ex.name}: {name} has a non-finite gradient"
    return loss


def test_registry_lists_every_family():
    names = list_examples()
    expected = {
        "mlp-tiny", "mlp", "gpt-tiny", "gpt-small-cpu", "gpt2-small", "gpt2-medium",
        "gpt2-large", "gpt2-xl", "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b", "gpt-1t",
        "llama-tiny", "llama3-8b", "llama3-70b", "resnet-tiny", "resnet18", "resnet50",
        "dlrm-tiny", "dlrm", "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny",
        "hf-mistral-tiny", "hf-qwen2-tiny", "hf-mixtral-tiny", "hf-bert-mlm-tiny", "hf-t5-tiny",
        "hf-vit-tiny", "torch-encoder-tiny", "nanogpt-tiny", "rootparam-tiny", "cnn-tiny",
        "hf-llama3-8b", "hf-mixtral-8x7b", "hf-t5-large", "hf-bert-large", "hf-gpt2-xl",
        "hf-vit-l", "titan-llama-tiny", "titan-llama3-8b", "titan-moe-tiny",
        "region-llama-tiny", "region-cuda-llama-tiny", "titan-ecmoe-tiny", "titan-ecmoe-8x7b",
    }
    assert expected <= set(names)
    assert len(names) == len(set(names))
    families = {example_family(n) for n in names}
    assert families == {"mlp", "gpt", "llama", "cnn", "dlrm", "hf-gpt2", "hf-llama", "hf-bert",
                        "zoo-gpt2", "zoo-llama", "zoo-mistral", "zoo-qwen2", "zoo-mixtral",
                        "zoo-bert-mlm", "zoo-t5", "zoo-vit", "zoo-torch-encoder",
                        "zoo-nanogpt", "zoo-rootparam", "zoo-cnn",
                        "zoo-titan-llama", "zoo-titan-moe", "zoo-region-llama",
                        "zoo-titan-ecmoe"}


@pytest.mark.parametrize("name", NATIVE_TINY)
def test_tiny_trains_and_exports_on_cpu(name):
    ex = build_example(name, batch_size=2)
    assert ex.model.training
    _train_step_grads(ex)
    exported = torch.export.export(ex.model, ex.example_inputs)
    stacks = [n.meta.get("nn_module_stack") for n in exported.graph.nodes
              if n.op == "call_function"]
    assert any(stacks), "exported nodes should carry nn_module_stack"


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "resnet-tiny", "dlrm-tiny"])
def test_tiny_exports_on_meta(name):
    ex = build_example(name, device="meta", batch_size=2)
    assert all(p.is_meta for p in ex.model.parameters())
    assert all(t.is_meta for t in ex.example_inputs)
    torch.export.export(ex.model, ex.example_inputs)


def test_output_shapes_and_dtypes():
    gpt = build_example("gpt-tiny", batch_size=3, seq_len=16)
    (tokens,) = gpt.example_inputs
    assert tokens.shape == (3, 16) and tokens.dtype == torch.int64
    assert gpt.targets.shape == (3, 16)
    assert torch.equal(tokens[:, 1:], gpt.targets[:, :-1])  # next-token targets
    assert gpt.model(tokens).shape == (3, 16, 256)
    dlrm = build_example("dlrm-tiny", batch_size=5)
    dense, sparse = dlrm.example_inputs
    assert dense.shape == (5, 13) and sparse.shape == (5, 4, 1) and sparse.dtype == torch.int64
    assert dlrm.model(dense, sparse).shape == (5,)
    assert set(dlrm.targets.tolist()) <= {0.0, 1.0}
    cnn = build_example("resnet-tiny", batch_size=2)
    assert cnn.example_inputs[0].shape == (2, 3, 32, 32)
    assert cnn.model(*cnn.example_inputs).shape == (2, 10)


def test_gpt_has_tied_head_and_block_paths():
    model = build_example("gpt-tiny").model
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert isinstance(model.get_submodule("layers.1"), nn.Module)
    assert isinstance(model.get_submodule("layers.0.attn.qkv"), nn.Linear)
    untied = build_example("gpt-tiny", tie_embeddings=False).model
    assert untied.lm_head.weight is not untied.tok_embeddings.weight


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_math_and_sdpa_attention_agree(name):
    kwargs = {"dropout": 0.0} if name == "gpt-tiny" else {}
    math_ex = build_example(name, batch_size=2, attention="math", **kwargs)
    sdpa_ex = build_example(name, batch_size=2, attention="sdpa", **kwargs)
    out_math = math_ex.model(*math_ex.example_inputs)
    out_sdpa = sdpa_ex.model(*sdpa_ex.example_inputs)
    torch.testing.assert_close(out_math, out_sdpa, rtol=1e-4, atol=1e-5)


def _shard_linear(linear: nn.Linear, *, dim: int, rank: int, world: int,
                  keep_bias: bool = True) -> nn.Linear:
    """A Megatron column (dim=0) or row (dim=1) shard of ``linear``."""
    weight = linear.weight.detach().chunk(world, dim=dim)[rank]
    shard = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    with torch.no_grad():
        shard.weight.copy_(weight)
        if linear.bias is not None:
            bias = linear.bias.detach()
            shard.bias.copy_(bias.chunk(world)[rank] if dim == 0 else
                             (bias if keep_bias else torch.zeros_like(bias)))
    return shard


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_attention_runs_on_head_shards(name):
    """Column-sharding the input projections and row-sharding the output projection (what
    ColwiseParallel/RowwiseParallel do) gives partial outputs that sum to the full one, so the
    forward infers local head counts instead of using the global ones."""
    import copy

    world = 2
    model = build_example(name).model
    attn = model.layers[0].attn if name == "gpt-tiny" else model.layers[0].attention
    x = torch.randn(2, 8, model.config.hidden_size)
    full = attn(x)
    partial = torch.zeros_like(full)
    for rank in range(world):
        shard = copy.deepcopy(attn)
        if name == "gpt-tiny":
            shard.qkv = _shard_linear(attn.qkv, dim=0, rank=rank, world=world)
            shard.proj = _shard_linear(attn.proj, dim=1, rank=rank, world=world,
                                       keep_bias=rank == 0)
        else:
            for proj in ("q_proj", "k_proj", "v_proj"):
                setattr(shard, proj, _shard_linear(getattr(attn, proj), dim=0, rank=rank,
                                                   world=world))
            shard.o_proj = _shard_linear(attn.o_proj, dim=1, rank=rank, world=world)
        partial += shard(x)
    torch.testing.assert_close(partial, full, rtol=1e-4, atol=1e-5)


def test_same_seed_gives_identical_models_and_inputs():
    for name in ["gpt-tiny", "llama-tiny", "dlrm-tiny"]:
        a = build_example(name, batch_size=2, seed=3)
        b = build_example(name, batch_size=2, seed=3)
        for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
            assert na == nb and torch.equal(pa, pb), f"{name}: {na} differs between builds"
        for ta, tb in zip(a.example_inputs, b.example_inputs):
            assert torch.equal(ta, tb)
        assert torch.equal(a.targets, b.targets)
    c = build_example("gpt-tiny", seed=4)
    a = build_example("gpt-tiny", seed=3)
    assert not torch.equal(a.model.layers[0].attn.qkv.weight, c.model.layers[0].attn.qkv.weight)


@pytest.mark.parametrize("name", NATIVE_TINY)
def test_materialized_meta_build_equals_cpu_build(name):
    cpu = build_example(name, seed=5).model
    meta = build_example(name, device="meta", seed=5).model
    materialize(meta, device="cpu", seed=5)
    for (key, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), f"{name}: {key} differs after materialize"
    if name == "gpt-tiny":
        assert meta.lm_head.weight is meta.tok_embeddings.weight


def test_meta_param_counts_match_published():
    # GPT-3 175B with 51,200-token vocabulary and tied head: 174.6e9 (Narayanan et al. 2021).
    gpt3 = build_example("gpt3-175b", device="meta")
    n = sum(p.numel() for p in gpt3.model.parameters())
    assert abs(n - 174.6e9) / 174.6e9 < 0.02
    assert example_param_count("gpt3-175b") == n
    # Llama 3 8B: 8.03e9 (Llama 3 Herd of Models, Table 3).
    llama = build_example("llama3-8b", device="meta")
    n = sum(p.numel() for p in llama.model.parameters())
    assert abs(n - 8.03e9) / 8.03e9 < 0.02
    assert example_param_count("llama3-8b") == n
    # Megatron-LM 1T (Narayanan et al. 2021, Table 1: 1008B) and the CNN references.
    assert abs(example_param_count("gpt-1t") - 1008e9) / 1008e9 < 0.01
    assert example_param_count("resnet18") == 11_689_512
    assert example_param_count("resnet50") == 25_557_032
    assert example_param_count("gpt2-small") == 124_439_808


@pytest.mark.parametrize("name", ["mlp", "gpt-small-cpu", "llama-tiny", "dlrm", "resnet-tiny"])
def test_analytical_param_count_matches_meta_build(name):
    model = build_example(name, device="meta").model
    assert example_param_count(name) == sum(p.numel() for p in model.parameters())
    config = get_config(name)
    if hasattr(config, "num_layers"):
        assert example_param_count(name, num_layers=1) < example_param_count(name)


def test_gpt3_175b_two_layers_exports_on_meta():
    ex = build_example("gpt3-175b", device="meta", num_layers=2, batch_size=1)
    exported = torch.export.export(ex.model, ex.example_inputs)
    out = [n for n in exported.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["val"].shape) == (1, 2048, 51200)


def test_pipeline_stage_can_drop_embeddings_and_head():
    model = build_example("gpt-tiny").model
    model.tok_embeddings = None
    model.pos_embeddings = None
    model.lm_head = None
    hidden = torch.randn(2, 8, 64)
    assert model(hidden).shape == (2, 8, 64)


def test_example_pickles():
    ex = build_example("gpt-tiny", batch_size=2)
    clone = pickle.loads(pickle.dumps(ex))
    torch.testing.assert_close(clone.compute_loss(), ex.compute_loss())


def test_errors_are_clear():
    with pytest.raises(ValueError, match="known names: .*gpt-tiny"):
        build_example("gpt-nope")
    with pytest.raises(ValueError, match="unknown config field"):
        build_example("gpt-tiny", num_layer=2)
    with pytest.raises(ValueError, match="max_positions=64"):
        build_example("gpt-tiny", seq_len=64)
    assert build_example("gpt-tiny", seq_len=64, max_positions=64).example_inputs[0].shape[1] == 64
    with pytest.raises(ValueError, match="sequence models only"):
        build_example("mlp-tiny", seq_len=8)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        build_example("gpt-tiny", num_heads=5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_example("llama-tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="attention"):
        build_example("gpt-tiny", attention="flash")
    with pytest.raises(ValueError, match="batch_size"):
        build_example("mlp-tiny", batch_size=0)
    with pytest.raises(ValueError, match="device='meta'"):
        build_example("gpt-1t", device="cpu")  # 4 TB of fp32 parameters


def test_llama_sequence_length_is_free():
    ex = build_example("llama-tiny", seq_len=48, batch_size=1)
    assert ex.model(*ex.example_inputs).shape == (1, 48, 256)
    assert math.isclose(ex.compute_loss().item(), math.log(256), rel_tol=0.05)


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_TINY)
def test_hf_tiny_trains_and_exports(name):
    pytest.importorskip("transformers")
    ex = build_example(name, batch_size=2)
    _train_step_grads(ex)
    torch.export.export(ex.model, ex.example_inputs)
    meta = build_example(name, device="meta", batch_size=2)
    assert all(p.is_meta for p in meta.model.parameters())
    exported = torch.export.export(meta.model, meta.example_inputs)
    out = [n for n in exported.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].shape[:2] == (2, 32)


@pytest.mark.hf
def test_hf_same_seed_identical():
    pytest.importorskip("transformers")
    a = build_example("hf-llama-tiny", seed=1).model.state_dict()
    b = build_example("hf-llama-tiny", seed=1).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
