"""A plan made where `autoplan plan` traces (the meta device, for a GPU cluster) matches the
model traced where the ranks trace it (the CPU): a meta model is traced as fake CPU tensors, so
its graph is the CPU's; and the fingerprint and op keys leave out whether a reshape is a view
or a copy, which follows the device's kernel layouts. Plans written with the older form
(autoplan 0.1) still match and bind."""

import dataclasses

import pytest

from autoplan.graph import trace
from autoplan.models import build_example


def _graph(name, device):
    ex = build_example(name, device=device, batch_size=1, seed=0)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)


@pytest.mark.parametrize("name", ["llama-tiny", "torch-encoder-tiny", "hf-mixtral-tiny",
                                  "region-llama-tiny"])
def test_a_model_built_on_meta_traces_as_on_the_cpu(name):
    """The meta device lays SDPA's output out otherwise (llama-tiny, torch's encoder), HF
    Mixtral's router counts experts in floats on the CPU only, a region keyed on the tensors'
    device has no autocast on meta (it failed to trace): the meta model is traced as fake CPU
    tensors, so its graph is the CPU's, value for value."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    meta, cpu = _graph(name, "meta"), _graph(name, "cpu")
    assert meta.values == cpu.values and meta.ops == cpu.ops
    assert meta.fingerprint() == cpu.fingerprint()


def test_the_fingerprint_leaves_out_whether_a_reshape_is_a_view():
    """A trace whose reshape after attention is a copy (as the meta device's or another
    device's kernel layout makes it) has the fingerprint and op keys of one where it is a
    view; the older form (autoplan 0.1's plans) tells them apart."""
    from autoplan.graph.opgraph import OpGraph
    cpu = _graph("llama-tiny", "cpu")
    d = cpu.to_dict()
    views = [v for v in d["values"] if v["kind"] == "activation" and v["base"] != v["name"]
             and v["base"].startswith("scaled_dot_product_attention")]
    assert views
    for v in views:
        v["base"] = v["name"]                    # a copy, not a view of the kernel's output
    copied = OpGraph.from_dict(d)
    assert copied.aliasing_fingerprint() != cpu.aliasing_fingerprint()
    assert copied.fingerprint() == cpu.fingerprint()
    assert dict(copied.op_keys()) == dict(cpu.op_keys())


def test_a_gpu_plan_traced_on_meta_binds_every_op_of_the_cpu_trace():
    from autoplan import Cluster
    from autoplan import plan as make_plan
    from autoplan.planner.op_binding import bind_strategies
    from autoplan.planner.planfile import model_fingerprint, plan_mismatch
    meta, cpu = _graph("llama-tiny", "meta"), _graph("llama-tiny", "cpu")
    plan = make_plan(meta, Cluster.from_spec("dgx-h100/2"), global_batch_size=8,
                     precision="bf16", profile=None, force=dict(tp=2), sharding="ilp")
    assert not plan_mismatch(plan, graph=cpu)
    bound = bind_strategies(plan, cpu)
    assert bound.unmatched == () and bound.by_name == ()
    assert len(bound.strategies) == len(plan.op_strategies)
    # a plan as autoplan 0.1 wrote it (the aliasing form) matches the trace it was made from,
    # and binds by its keys
    old_keys = meta.op_keys(aliasing=True)
    old = dataclasses.replace(
        plan, model=dataclasses.replace(plan.model, fingerprint=meta.aliasing_fingerprint()),
        op_keys={n: old_keys[n] for n in plan.op_keys})
    assert model_fingerprint(old, meta) == old.model.fingerprint
    assert not plan_mismatch(old, graph=meta)
    again = bind_strategies(old, meta)
    assert again.unmatched == () and again.by_name == ()
    assert again.strategies == bind_strategies(plan, meta).strategies


@pytest.mark.parametrize("name", ["hf-mixtral-tiny", "region-llama-tiny"])
def test_a_gpu_presets_plan_runs_on_the_model_built_on_the_cpu(name, tmp_path):
    """As a user meets it: `autoplan plan` for an H100 (the model built on meta) and `autoplan
    run` on ranks that build it on the CPU. HF Mixtral was refused (its router's float expert
    counts on the CPU), the model whose autocast region is keyed on its tensors' device failed
    to trace on meta."""
    import subprocess
    import sys

    from tests.distributed import free_port
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    plan = str(tmp_path / "p.json")

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "autoplan.cli.main", *argv],
                              capture_output=True, text=True, timeout=300)
    from autoplan.cli.main import main                 # planned in this process
    assert main(["plan", name, "--cluster", "dgx-h100/1", "--global-batch", "4", "-q",
                 "-o", plan]) == 0
    out = cli("run", plan, "--model", name, "--steps", "2", "--allow-cluster-mismatch",
              "--master-port", str(free_port()))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step   1  loss" in out.stdout


class _PicksByDevice(nn.Module if (nn := __import__("torch").nn) else object):
    """A model that computes otherwise on a GPU, as HF's MoE routers and autocast regions do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", __import__("torch").full((8,), 2.0))

    def forward(self, x):
        y = self.lin(x) * self.scale
        return y.float().cumsum(-1) if y.device.type == "cuda" else y.relu()


@pytest.mark.parametrize("name", ["hf-mixtral-tiny", "picks-by-device"])
def test_a_model_on_a_gpu_is_planned_from_the_cpu_graph(name):
    """`compile()` of a model the user moved to a GPU: its planning trace is the CPU's graph
    (fakes), as a meta model's is, so a plan `autoplan plan` made for a GPU cluster binds. The
    GPU here is fake CUDA tensors (no CUDA on this machine): weights, buffers and inputs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
        ex = build_example(name, device="cpu", batch_size=1, seed=0)
        model, inputs, kw = ex.model, ex.example_inputs, dict(loss_fn=ex.loss_fn,
                                                              targets=ex.targets)
    else:
        model, inputs, kw = _PicksByDevice(), (torch.randn(2, 8),), {}
    cpu = trace(model, inputs, **kw)
    mode = FakeTensorMode()

    made = {}

    def on_gpu(t):               # (targets that are a view of the tokens stay one)
        if id(t) not in made:
            base = on_gpu(t._base) if t._base is not None else None
            with mode:
                made[id(t)] = (base.as_strided(t.shape, t.stride(), t.storage_offset())
                               if base is not None else torch.empty_strided(
                                   t.shape, t.stride(), dtype=t.dtype, device="cuda"))
        return made[id(t)]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is not None:
                    g = on_gpu(t)
                    table[attr] = nn.Parameter(g, t.requires_grad) if isinstance(
                        t, nn.Parameter) else g
    gpu_inputs = tuple(on_gpu(x) for x in inputs)
    gpu_kw = {k: (on_gpu(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    assert next(model.parameters()).device.type == "cuda"
    gpu = trace(model, gpu_inputs, **gpu_kw)
    assert gpu.values == cpu.values and gpu.ops == cpu.ops
    assert gpu.fingerprint() == cpu.fingerprint()
