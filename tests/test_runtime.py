"""Same numbers as one device: plans from the planner, run on 2 and 4 gloo ranks.

For each (model, plan family), the planner makes the plan (forced where a family must be
exercised), every rank runs it through ``autoplan.compile`` on real process groups, and the
losses and updated parameters after 3 AdamW steps must equal single-process training: loss
within 1e-5 relative, each parameter tensor within 1e-5 relative (Frobenius norm of the
difference over the norm of the reference).
"""

import contextlib

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
    # eps 1e-6: a parameter whose exact gradient is zero (a key bias under softmax) gets
    # round-off-sized gradients; Adam would turn their noise into full-size steps
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _reference(name, optimizer=None, **overrides):
    """Losses and final state of single-process training (STEPS AdamW steps)."""
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0, **overrides)
    opt = (optimizer or _optimizer)(ex.model.parameters())
    return train_one_device(ex, opt)


def train_one_device(ex, opt, steps=STEPS, *, loss_fn=None, targets=None, autocast=None):
    """``steps`` plain steps of ``ex`` on one device: the losses and the final state dict.
    ``loss_fn`` and ``targets`` stand in for the example's; ``autocast`` (a dtype): the
    forward and the loss run under CPU autocast of it, as eager mixed precision does."""
    loss_fn = loss_fn or ex.loss_fn
    targets = ex.targets if targets is None else targets
    losses = []
    for _ in range(steps):
        with (torch.autocast("cpu", dtype=autocast) if autocast is not None
              else contextlib.nullcontext()):
            loss = loss_fn(ex.model(*ex.example_inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in ex.model.state_dict().items()}


def _compiled(name, plan_json, traced_batch=1, **overrides):
    """(trainer, global batch) for ``name`` (built with ``overrides``) under the plan (traced
    at ``traced_batch`` samples), on this rank."""
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0, **overrides)
    small = build_example(name, batch_size=traced_batch, seed=0, **overrides)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    return trainer, tuple(ex.example_inputs) + (ex.targets,)


def _rank(rank, world, name, plan_json):
    trainer, batch = _compiled(name, plan_json)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    sd = trainer.full_state_dict()                  # collective: every rank calls it
    return losses, ({k: v.tolist() for k, v in sd.items()} if rank == 0 else None)


def _plan(name, world, force, sharding="ilp"):
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, sharding=sharding, max_pp=1)


CASES = [
    # (model, world, forced fields, sharding rule, family)
    ("mlp-tiny", 2, dict(tp=1, zero_stage=0), "ilp", "data parallel"),
    ("mlp-tiny", 2, dict(tp=2), "megatron", "tensor parallel"),
    ("mlp-tiny", 4, dict(dp=2, tp=2, zero_stage=3), "megatron", "FSDP x TP"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=0), "ilp", "data parallel"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=1), "ilp", "ZeRO-1"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=2), "ilp", "ZeRO-2"),
    ("gpt-tiny", 4, dict(tp=1, zero_stage=3), "ilp", "ZeRO-3 (FSDP2)"),
    ("gpt-tiny", 2, dict(tp=2, sequence_parallel=False, zero_stage=0), "megatron",
     "tensor parallel"),
    ("gpt-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron", "TP + sequence parallel"),
    ("gpt-tiny", 4, dict(dp=2, tp=2, zero_stage=3), "megatron", "FSDP x TP"),
    ("gpt-tiny", 4, dict(dp=2, tp=2, zero_stage=1), "ilp", "ZeRO-1 x the ILP's tp sharding"),
    ("gpt-tiny", 2, dict(tp=2), "ilp", "ILP sharding"),
    ("gpt-tiny", 2, dict(tp=1, recompute="full"), "ilp", "full recompute"),
    ("gpt-tiny", 2, dict(tp=2, recompute="selective"), "megatron", "selective recompute x TP"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=0, offload_optimizer=True), "ilp",
     "optimizer offload"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=3, offload_params=True), "ilp",
     "parameter offload (FSDP2 CPU offload)"),
    ("llama-tiny", 2, dict(tp=2, sequence_parallel=True), "megatron", "TP + SP (GQA, RoPE)"),
    ("hf-gpt2-tiny", 2, dict(tp=1, zero_stage=3), "ilp", "HF GPT-2, ZeRO-3"),
    # HSDP: FSDP2 on a 2-D (dp_replicate, dp_shard) mesh, sharded in pairs, pairs replicated
    ("gpt-tiny", 4, dict(tp=1, zero_stage=3, dp_shard=2), "ilp", "HSDP (ZeRO-3, 2 x 2)"),
    ("hf-gpt2-tiny", 4, dict(tp=1, zero_stage=2, dp_shard=2), "ilp", "HF GPT-2, HSDP ZeRO-2"),
    # batch norm over a split batch: statistics all-reduced over the dp group (one micro-batch
    # per step, as one device computes them over the whole batch)
    ("resnet-tiny", 2, dict(tp=1, zero_stage=0, micro_batch_size=4), "ilp", "CNN data parallel"),
    ("resnet-tiny", 4, dict(tp=1, zero_stage=3, micro_batch_size=2), "ilp", "CNN ZeRO-3"),
    ("dlrm-tiny", 2, dict(tp=1, zero_stage=0), "ilp", "DLRM data parallel"),
    ("dlrm-tiny", 2, dict(tp=2), "ilp", "DLRM ILP tables"),
    ("dlrm-tiny", 2, dict(tp=2), "megatron", "DLRM row-sharded embedding tables"),
]


@pytest.mark.parametrize("name,world,force,sharding,family", CASES,
                         ids=[f"{c[0]}-{c[1]}ranks-{c[4]}" for c in CASES])
def test_plan_run_equals_single_device(name, world, force, sharding, family):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    plan = _plan(name, world, force, sharding)
    for k, v in force.items():
        assert getattr(plan.config, k) == v, (k, plan.config)
    assert_equals_one_device(run_ranks(_rank, world, name, plan.to_json()), name, family)


def assert_equals_one_device(results, name, family):
    """Every rank's losses and rank 0's gathered parameters equal single-process training."""
    ref_losses, ref_params = _reference(name)
    for losses, _ in results:                       # every rank reports the global loss
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    params = results[0][1]
    assert set(params) == set(ref_params)
    for k, ref in ref_params.items():
        got = torch.tensor(params[k], dtype=ref.dtype).reshape(ref.shape)
        if not ref.is_floating_point():                 # counters (batch norm's batches seen)
            assert torch.equal(got, ref), k
            continue
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e} ({family})"


def _grad_storages_rank(rank, world, name, plan_json):
    """(parameters with a gradient, distinct storages those gradients live in) when the
    optimizer steps, on the second step (DDP makes its gradients views on the first)."""
    trainer, batch = _compiled(name, plan_json)
    seen = []
    inner = trainer.optimizer.step

    def step(*args, **kwargs):
        grads = [p.grad for g in trainer.optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        seen.append((len(grads), len({x.untyped_storage().data_ptr() for x in grads})))
        return inner(*args, **kwargs)
    trainer.optimizer.step = step
    for _ in range(2):
        trainer.step(batch)
    return seen[-1]


def test_ddp_gradients_live_in_its_buckets():
    """Under DDP (ZeRO-0, dp 2) the gradients the optimizer reads are views of DDP's
    all-reduce buckets, a handful of storages for all of them, not one tensor each beside the
    buckets: the memory the estimate prices (one fp32 gradient copy)."""
    plan = _plan("gpt-tiny", 2, dict(tp=1, zero_stage=0))
    grads, storages = run_ranks(_grad_storages_rank, 2, "gpt-tiny", plan.to_json())[0]
    assert grads > 10 and storages <= 2, (grads, storages)


# ---- the run does what the plan said -------------------------------------------------------

def _count_rank(rank, world, name, plan_json, traced_batch=1):
    from autoplan.runtime.comm_counter import CommCounter
    trainer, batch = _compiled(name, plan_json, traced_batch)
    trainer.step(batch)                       # warm-up: DDP's first step differs
    with CommCounter() as counter:
        trainer.step(batch)
    return counter.counts


COUNT_CASES = [
    ("gpt-tiny", 2, dict(tp=1, zero_stage=0), "ilp"),
    ("gpt-tiny", 2, dict(tp=1, zero_stage=1), "ilp"),
    ("gpt-tiny", 4, dict(tp=1, zero_stage=3), "ilp"),
    ("mlp-tiny", 2, dict(tp=2), "megatron"),
    ("gpt-tiny", 4, dict(dp=2, tp=2, zero_stage=2, sequence_parallel=True), "megatron"),
    ("gpt-tiny", 4, dict(tp=1, zero_stage=3, dp_shard=2), "ilp"),
    # op-level recomputation replays a layer's tp collectives as full recomputation does
    ("gpt-tiny", 2, dict(tp=2, layer_recompute=("ops", "none")), "megatron"),
]


@pytest.mark.parametrize("name,world,force,sharding", COUNT_CASES,
                         ids=[f"{c[0]}-{c[1]}ranks-{c[2]}" for c in COUNT_CASES])
def test_collectives_match_the_plan(name, world, force, sharding):
    """Calls and bytes per collective kind, counted at run time, within 10% of the plan's
    prediction (kinds carrying under 1% of the bytes are noise: buffer broadcasts)."""
    plan = _plan(name, world, force, sharding)
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    assert_collectives_match(name, world, plan, g)


def assert_collectives_match(name, world, plan, g):
    """The collectives one step of ``plan`` issues (counted at run time) are those the
    estimate prices for it on ``g`` (a graph of the model the plan's strategies name)."""
    from autoplan.estimate.collectives import expected_collectives
    from autoplan.estimate.partition import partition
    from autoplan.runtime.emit import strategies_by_position
    sh = strategies_by_position(g, dict(plan.op_strategies), g, plan.config.tp)
    chunk = partition(g, 1)[0]
    expected = expected_collectives(g, plan.config, sh, global_batch_size=GLOBAL_BATCH,
                                    layer_ranges=list(chunk.layer_ranges),
                                    fsdp_units=len(plan.recompute) + 1)
    counted = run_ranks(_count_rank, world, name, plan.to_json(), g.batch_size)[0]
    total = sum(e.bytes for e in expected.values())
    for kind, e in expected.items():
        if e.bytes < 0.01 * total:
            continue
        calls, nbytes = counted.get(kind, (0, 0.0))
        assert nbytes == pytest.approx(e.bytes, rel=0.10), (kind, counted, expected)
        if e.calls is not None:
            assert calls == pytest.approx(e.calls, rel=0.10), (kind, counted, expected)
    for kind, (calls, nbytes) in counted.items():      # nothing big the plan did not predict
        assert kind in expected or nbytes < 0.01 * total, (kind, counted, expected)
