"""Tracing: any model -> a frozen, JSON round-trippable OpGraph in topological order."""

import pytest
import torch
from torch import nn

import autoplan
from autoplan.errors import TraceError
from autoplan.graph import OpGraph, trace
from autoplan.models import build_example
from tests.conftest import has_transformers

EXAMPLES = ["mlp-tiny", "gpt-tiny", "llama-tiny", "resnet-tiny", "dlrm-tiny"]
HF = ["hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]


def _trace(name: str, device: str, batch_size: int = 2) -> OpGraph:
    ex = build_example(name, device=device, batch_size=batch_size)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)


def _check_graph(graph: OpGraph, model: nn.Module) -> None:
    # topological order: every op input exists before the op
    known = {v.name for v in graph.values if v.kind != "activation"}
    for op in graph.ops:
        for n in op.inputs:
            assert n in known, f"{op.name} reads {n} before it is produced"
        known.update(op.outputs)
    # parameters carry FQN, shape and dtype of the model's own parameters
    model_params = dict(model.named_parameters(remove_duplicate=False))
    for p in graph.param_values:
        assert p.fqn in model_params, p.fqn
        assert p.meta.shape == tuple(model_params[p.fqn].shape)
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert graph.fwd_flops > 0 and graph.bwd_flops > graph.fwd_flops
    # JSON round trip is exact, and the fingerprint survives it
    text = graph.to_json()
    again = OpGraph.from_json(text)
    assert again == graph
    assert again.to_json() == text
    assert again.fingerprint() == graph.fingerprint()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_trace(name, device):
    ex = build_example(name, device=device, batch_size=2)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    _check_graph(graph, ex.model)
    assert graph.batch_size == 2
    assert any(op.kind == "loss" for op in graph.ops)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", HF)
def test_hf_models_trace(name, device):
    ex = build_example(name, device=device, batch_size=2)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    _check_graph(graph, ex.model)
    assert graph.blocks and len(graph.blocks[0].instances) == 2


@pytest.mark.parametrize("name,container", [("gpt-tiny", "layers"), ("llama-tiny", "layers")])
def test_repeated_blocks_found(name, container):
    graph = _trace(name, "meta")
    block = graph.blocks[0]
    assert block.name == container
    assert [i.path for i in block.instances] == [f"{container}.0", f"{container}.1"]
    a, b = block.instances
    assert a.stop - a.start == b.stop - b.start
    # the instances really are alike op by op
    for i, j in zip(range(a.start, a.stop), range(b.start, b.stop)):
        assert graph.ops[i].target == graph.ops[j].target
        assert graph.ops[i].fwd_flops == graph.ops[j].fwd_flops


def test_linear_flops_bytes_and_params():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    graph = trace(model, (torch.randn(16, 32),))
    lin = [op for op in graph.ops if op.kind == "matmul"]
    assert len(lin) == 2
    assert lin[0].fwd_flops == 2 * 16 * 32 * 64 + 16 * 64
    assert lin[0].params == ("0.weight", "0.bias")
    assert lin[0].module_path == "0"
    assert lin[0].bytes_written == 16 * 64 * 4
    assert lin[0].bytes_read == (16 * 32 + 64 * 32 + 64) * 4
    # the first linear's input needs no gradient: no data-gradient product in its backward
    assert lin[0].bwd_flops == lin[0].fwd_flops
    assert lin[1].bwd_flops == 2 * lin[1].fwd_flops


def test_views_share_their_base():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return (q.transpose(0, 1) @ k + v.sum()).sum()
    graph = trace(M(), (torch.randn(4, 8),))
    mm = next(op for op in graph.ops if op.target.startswith("aten.matmul"))
    bases = {graph.value(n).base for n in mm.saved}
    assert len(bases) == 1 and graph.value(bases.pop()).meta.shape == (4, 24)


def test_gpt3_175b_meta_trace(gpt3_two_layers):
    g = gpt3_two_layers
    # 2 layers of 12*h^2 plus embeddings; the full 96-layer model is in benchmarks/trace_scale.py
    h, v, s = 12288, 51200, 2048
    expected = 2 * (12 * h * h + 13 * h) + v * h + s * h + 2 * h
    assert abs(g.num_params - expected) / expected < 0.01
    # forward FLOPs of the matmuls: 2 * params * tokens for the linears + attention
    assert g.fwd_flops > 2 * 2 * 12 * h * h * s


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.inner(x))


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:   # data-dependent control flow: export cannot trace this
            return x * 2
        return x


def test_trace_error_names_module_and_line():
    with pytest.raises(TraceError) as info:
        trace(_DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "module: gate" in msg
    assert "test_trace.py" in msg and "x.sum().item()" in msg
    assert "what to try" in msg


def test_trace_rejects_bad_arguments():
    with pytest.raises(TraceError):
        trace("not a model", (torch.randn(1),))
    with pytest.raises(TraceError):
        trace(nn.Linear(2, 2), ())


def test_malformed_graph_json():
    with pytest.raises(TraceError):
        OpGraph.from_json("{not json")
    with pytest.raises(TraceError):
        OpGraph.from_json('{"schema_version": 1, "name": "x"}')


def test_public_api():
    assert autoplan.trace is trace


@pytest.mark.parametrize("name,layers", [("gpt-tiny", 5), ("llama-tiny", 4), ("hf-gpt2-tiny", 4),
                                         ("hf-llama-tiny", 3), ("hf-bert-tiny", 3)])
def test_stamped_trace_equals_full_trace(name, layers):
    """Tracing two layers and stamping the rest gives the graph a full trace gives."""
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    from autoplan.cost.memory import activation_bytes
    ex = build_example(name, device="meta", batch_size=2, num_layers=layers)
    kw = dict(loss_fn=ex.loss_fn, targets=ex.targets)
    fast = trace(ex.model, ex.example_inputs, **kw)
    full = trace(ex.model, ex.example_inputs, fold_repeats=False, **kw)
    assert fast.meta["stamped"]["layers"] == layers and "stamped" not in full.meta
    assert [op.target for op in fast.ops] == [op.target for op in full.ops]
    assert [op.fwd_flops for op in fast.ops] == [op.fwd_flops for op in full.ops]
    assert [op.module_path for op in fast.ops] == [op.module_path for op in full.ops]
    assert sorted((v.fqn, v.meta) for v in fast.param_values) == \
        sorted((v.fqn, v.meta) for v in full.param_values)
    assert [(b.name, [(i.path, i.start, i.stop) for i in b.instances]) for b in fast.blocks] == \
        [(b.name, [(i.path, i.start, i.stop) for i in b.instances]) for b in full.blocks]
    for rc in ("none", "selective", "full"):
        assert activation_bytes(fast, 0, len(fast.ops), micro_batch_size=2, recompute=rc) == \
            activation_bytes(full, 0, len(full.ops), micro_batch_size=2, recompute=rc)
    _check_graph(fast, ex.model)


def test_stamping_falls_back_when_layers_cannot_be_cut():
    """DLRM's tables are identical modules, but the model needs all of them: full trace."""
    ex = build_example("dlrm-tiny", device="meta", batch_size=2)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    assert "stamped" not in g.meta
    _check_graph(g, ex.model)


def test_fingerprint_is_the_same_on_meta_and_cpu():
    """Plan on a laptop (meta), run on real devices: the graph must be recognised."""
    fp = []
    for device in ("meta", "cpu"):
        ex = build_example("gpt-tiny", device=device, batch_size=2)
        fp.append(trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn,
                        targets=ex.targets).fingerprint())
    assert fp[0] == fp[1]


def test_a_graph_traced_on_meta_equals_the_one_traced_on_the_cpu():
    """SDPA's output is laid out differently on the meta device, so export records a copying
    ``contiguous`` there and none on the CPU: the graph treats it as the value itself, and a plan
    made on meta is for the same model as the one run on CPU."""
    pytest.importorskip("transformers")
    from autoplan.models import build_example
    prints = []
    for device in ("meta", "cpu"):
        ex = build_example("hf-llama-gqa-tiny", batch_size=1, device=device)
        g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
        prints.append(g.fingerprint())
    assert prints[0] == prints[1]
