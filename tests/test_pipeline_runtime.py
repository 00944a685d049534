"""Pipelined plans on gloo equal single-process training.

Plans from the planner, forced to each schedule (GPipe, 1F1B, interleaved 1F1B, zero bubble, and
the V-shaped ZB-V and DualPipeV, whose first and last chunks share rank 0),
run by ``autoplan.compile`` on real process groups and stock ``torch.distributed.pipelining``:
pp2 (2 processes), pp2 x dp2, pp2 x dp2 with FSDP2, and pp2 x tp2 (4 processes). After 3 AdamW
steps the loss every rank reports and every updated parameter tensor (gathered from the stage
that holds it) equal single-process training within 1e-5 relative (fp32). One process group
runs all the schedules of a family in turn (process start-up dominates these tiny runs).

The model is gpt-tiny with 4 layers (2 chunks per rank interleaved) and 2 heads: with 4 heads,
tensor parallelism alone (no pipeline) already moves a few zero-initialized biases by 1.2e-5
relative after 3 Adam steps (reduction-order round-off amplified where a gradient is near
Adam's eps), which would hide what this test checks.
"""

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from tests.distributed import run_ranks
from tests.test_runtime import GLOBAL_BATCH, STEPS, _optimizer, _reference

NAME = "gpt-tiny"
OVERRIDES = dict(num_layers=4, num_heads=2)
SCHEDULES = [dict(schedule="gpipe"), dict(schedule="1f1b"),
             dict(schedule="interleaved_1f1b", virtual_stages=2),
             dict(schedule="zero_bubble", virtual_stages=2),
             dict(schedule="zbv", virtual_stages=2), dict(schedule="dualpipev", virtual_stages=2)]


def _example(batch):
    return build_example(NAME, batch_size=batch, seed=0, **OVERRIDES)


@pytest.fixture(scope="module")
def reference():
    return _reference(NAME, **OVERRIDES)


@pytest.fixture(scope="module")
def graph():
    small = _example(1)
    return trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                 targets=small.targets)


def _plan(graph, world, force):
    return make_plan(graph, Cluster.local(world), global_batch_size=GLOBAL_BATCH,
                     precision="fp32", profile=None, force=force, max_pp=2,
                     sharding="megatron")


def _rank(rank, world, plan_jsons):
    from autoplan.runtime.trainer import compile
    out = []
    for plan_json in plan_jsons:
        ex = _example(GLOBAL_BATCH)
        small = _example(1)
        trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                          example_targets=small.targets, loss_fn=ex.loss_fn,
                          optimizer=_optimizer, global_batch_size=GLOBAL_BATCH,
                          plan=Plan.from_json(plan_json))
        batch = tuple(ex.example_inputs) + (ex.targets,)
        losses = [trainer.step(batch) for _ in range(STEPS)]
        params = {k: v.tolist() for k, v in trainer.full_state_dict().items()}
        out.append((losses, params))
    return out


# the planner's own split and recomputation, pinned here: layers 1 / 3, stage 0 recomputes
UNEVEN = dict(schedule="1f1b", chunk_layers=(1, 3), stage_recompute=("full", "none"))

FAMILIES = [
    # (world, forced degrees, schedules, label)
    (2, dict(pp=2), SCHEDULES + [UNEVEN], "pp2"),
    (4, dict(pp=2, dp=2, zero_stage=0), SCHEDULES[1:], "pp2 x dp2"),      # gpipe: pp2 above
    (4, dict(pp=2, dp=2, zero_stage=3), SCHEDULES[1:2], "pp2 x dp2 FSDP2"),
    # FSDP2 that keeps the weights gathered from forward to backward runs zero bubble
    (4, dict(pp=2, dp=2, zero_stage=2), [SCHEDULES[3]], "pp2 x dp2 ZeRO-2 zero bubble"),
    (8, dict(pp=2, dp=4, zero_stage=3, dp_shard=2), SCHEDULES[1:2], "pp2 x HSDP 2x2"),
    (4, dict(pp=2, tp=2), SCHEDULES[1:], "pp2 x tp2"),
]


@pytest.mark.parametrize("world,degrees,schedules,label", FAMILIES,
                         ids=[f[3] for f in FAMILIES])
def test_pipelined_plan_equals_single_device(world, degrees, schedules, label, graph,
                                             reference):
    plans = []
    for sched in schedules:
        p = _plan(graph, world, {**degrees, **sched})
        for k, v in {**degrees, **sched}.items():
            assert getattr(p.config, k) == v, (k, p.config)
        assert len(p.stages) == 2
        plans.append(p)
    results = run_ranks(_rank, world, [p.to_json() for p in plans], timeout_s=240.0)
    ref_losses, ref_params = reference
    for i, p in enumerate(plans):
        seen: dict[str, torch.Tensor] = {}
        for rank_results in results:
            losses, params = rank_results[i]
            # every rank reports the global loss, not only the last stage
            assert losses == pytest.approx(ref_losses, rel=1e-5), (p.config.short(), losses)
            for k, v in params.items():
                seen[k] = torch.tensor(v, dtype=ref_params[k].dtype)
        assert set(seen) == set(ref_params), p.config.short()
        for k, ref in ref_params.items():
            got = seen[k].reshape(ref.shape)
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"{k}: relative error {err:.2e} ({label}, {p.config.short()})"


def _mixed_data():
    torch.manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 32), torch.randn(GLOBAL_BATCH, 32)


def _mixed_model():
    from tests.test_stage_partition import MixedStack
    torch.manual_seed(0)
    return MixedStack(32)


def _mixed_rank(rank, world, plan_json):
    from autoplan.runtime.trainer import compile
    x, y = _mixed_data()
    trainer = compile(_mixed_model(), "local", example_inputs=(x[:1],), example_targets=y[:1],
                      loss_fn=torch.nn.functional.mse_loss, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    losses = [trainer.step((x, y)) for _ in range(STEPS)]
    return losses, {k: v.tolist() for k, v in trainer.full_state_dict().items()}


def test_layers_of_different_kinds_pipeline_like_one_device():
    """A layer container holding two kinds of layers and a one-off layer: the planner's split
    (by each layer's own cost) runs on 2 pipeline ranks and equals single-process training."""
    x, y = _mixed_data()
    model = _mixed_model()
    opt = _optimizer(model.parameters())
    ref_losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    g = trace(_mixed_model(), (x[:1],), loss_fn=torch.nn.functional.mse_loss, targets=y[:1])
    p = make_plan(g, Cluster.local(2), global_batch_size=GLOBAL_BATCH, precision="fp32",
                  profile=None, force=dict(pp=2, schedule="1f1b"))
    layers = [l for s in p.stages for l in s["layers"]]
    assert layers == [f"layers.{i}" for i in range(8)], p.stages
    for losses, params in run_ranks(_mixed_rank, 2, p.to_json(), timeout_s=120.0):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in params.items():
            ref = model.state_dict()[k]
            got = torch.tensor(v, dtype=ref.dtype).reshape(ref.shape)
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7), k


def test_chunks_of_the_rank_program_keep_fqns_and_compose_to_the_model():
    """Pipeline chunks are op ranges of the rank program: each holds only its weights, under
    the user's names (a tied LM head on both ends), and run one after the other they compute
    the model's loss."""
    from autoplan.graph.trace import export_program
    from autoplan.runtime.program import build_program
    from autoplan.runtime.program_check import check_shapes
    from autoplan.runtime.program_modules import layer_ranges, split_chunks
    from autoplan.runtime.state import LocalState
    from autoplan.sharding.sharding import replicated
    ex = _example(2)
    cpu = torch.device("cpu")
    ep, g, prefix = export_program(ex.model, ex.example_inputs, loss_fn=ex.loss_fn,
                                   targets=ex.targets)
    prog = build_program(ep, g, replicated(g), prefix=prefix, t=1, device=cpu,
                         state_tensor=LocalState(ex.model, t=1, rank=0, device=cpu, seed=0))
    check_shapes(prog, tuple(ex.example_inputs) + (ex.targets,), 1)
    ranges = layer_ranges(g)
    first, last = split_chunks(prog.graph_module, [0, ranges[2][1], len(g.ops)])
    names0 = {n for n, _ in first.module.named_parameters()}
    names1 = {n for n, _ in last.module.named_parameters()}
    assert {n.split(".")[1] for n in names0 if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in names1 if n.startswith("layers.")} == {"2", "3"}
    assert "pos_embeddings.weight" in names0 and "pos_embeddings.weight" not in names1
    assert "norm.weight" in names1 and "norm.weight" not in names0
    with torch.no_grad():
        loss = last.module(*first.module(*ex.example_inputs, ex.targets))
        torch.testing.assert_close(loss, ex.loss_fn(ex.model(*ex.example_inputs), ex.targets))
