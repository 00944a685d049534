"""A plan made where `autoplan plan` traces (the meta device, for a GPU cluster) matches the
model traced where the ranks trace it (the CPU): the fingerprint and op keys leave out whether a
reshape is a view or a copy, which follows the device's kernel layouts (SDPA's output is
(B, S, H, D)-strided on the CPU and CUDA, contiguous on meta). Plans written with the older form
(autoplan 0.1) still match and bind."""

import dataclasses

import pytest

from autoplan.graph import trace
from autoplan.models import build_example


def _graph(name, device):
    ex = build_example(name, device=device, batch_size=1, seed=0)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)


@pytest.mark.parametrize("name", ["llama-tiny", "torch-encoder-tiny"])
def test_meta_and_cpu_traces_get_one_fingerprint_and_one_set_of_op_keys(name):
    meta, cpu = _graph(name, "meta"), _graph(name, "cpu")
    # the traces do differ: a reshape after attention is a copy on meta, a view on the CPU
    assert [v.base for v in meta.values] != [v.base for v in cpu.values]
    assert meta.aliasing_fingerprint() != cpu.aliasing_fingerprint()
    assert meta.fingerprint() == cpu.fingerprint()
    assert sorted(meta.op_keys().values()) == sorted(cpu.op_keys().values())


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
