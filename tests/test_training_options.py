"""Training options across shardings, on gloo, against one device:

- gradient clipping by the global norm (``compile(max_grad_norm=...)``): the norm each rank
  reports and the clipped update equal ``torch.nn.utils.clip_grad_norm_`` on one device, for
  DDP, ZeRO-1, FSDP2, TP + SP, FSDP x TP and a pipeline whose stages share a tied weight;
- gradient accumulation in plans without pipelines (several micro-batches per replica);
- fp16 dynamic loss scaling: every rank skips the same overflowing steps as one process does,
  and the losses that follow agree (fp16 round-off);
- a dp=1 parameter-offload plan runs FSDP2's CPU offload instead of silently dropping it.
"""

import pytest
import torch

from autoplan.planner.planfile import Plan
from tests.distributed import run_ranks
from tests.test_checkpoint import GLOBAL_BATCH, _example, _plan

MAX_NORM = 0.05          # well below gpt-tiny's gradient norm (about 1.5): clipping is active
STEPS = 3


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _compiled(plan_json, **kw):
    """(trainer, global batch) of gpt-tiny under the plan, on this rank."""
    from autoplan.runtime.trainer import compile
    ex = _example(GLOBAL_BATCH)
    small = _example(1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_opt,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json), **kw)
    return trainer, tuple(ex.example_inputs) + (ex.targets,)


def _reference_clipped():
    ex = _example(GLOBAL_BATCH)
    opt = _opt(ex.model.parameters())
    losses, norms = [], []
    for _ in range(STEPS):
        loss = ex.loss_fn(ex.model(*ex.example_inputs), ex.targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ex.model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in ex.model.state_dict().items()}


def _rank(rank, world, plan_json, kw):
    from autoplan.runtime.grads import LossScaler
    scaler = LossScaler(init_scale=kw["init_scale"]) if "init_scale" in kw else None
    trainer, batch = _compiled(plan_json, max_grad_norm=kw.get("max_grad_norm"),
                               loss_scaler=scaler)
    losses, norms, skipped = [], [], []
    for _ in range(kw.get("steps", STEPS)):
        losses.append(trainer.step(batch))
        norms.append(trainer.last_grad_norm)
        skipped.append(trainer.loss_scaler.skipped_steps if trainer.loss_scaler else 0)
    sd = trainer.full_state_dict()
    return losses, norms, skipped, {k: v.tolist() for k, v in sd.items()}


def _close(results, ref_params, rel=1e-5):
    got = {}
    for *_, sd in results:
        got.update(sd)
    assert set(got) == set(ref_params)
    for k, ref in ref_params.items():
        g = torch.tensor(got[k], dtype=ref.dtype).reshape(ref.shape)
        if not ref.is_floating_point():
            continue
        err = ((g - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err <= rel, (k, err)


CLIP = [
    (2, dict(tp=1, zero_stage=0), "ilp", 1, "DDP"),
    (2, dict(tp=1, zero_stage=1), "ilp", 1, "ZeRO-1"),
    (2, dict(tp=1, zero_stage=3), "ilp", 1, "FSDP2"),
    (2, dict(tp=2, sequence_parallel=True), "megatron", 1, "TP + SP"),
    (4, dict(dp=2, tp=2, zero_stage=3), "megatron", 1, "FSDP x TP"),
    (2, dict(pp=2, schedule="1f1b"), "megatron", 2, "pp2, tied embedding and head"),
]


@pytest.fixture(scope="module")
def clipped():
    return _reference_clipped()


@pytest.mark.parametrize("world,force,sharding,max_pp,label", CLIP, ids=[c[-1] for c in CLIP])
def test_clipping_by_global_norm_equals_one_device(clipped, world, force, sharding, max_pp,
                                                   label):
    ref_losses, ref_norms, ref_params = clipped
    plan = _plan(world, force, sharding, max_pp)
    results = run_ranks(_rank, world, plan.to_json(), dict(max_grad_norm=MAX_NORM))
    for losses, norms, _, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)      # the same on every rank
    _close(results, ref_params)


ACCUMULATE = [
    (2, dict(tp=1, zero_stage=0, micro_batch_size=1), "ilp", "DDP, 4 micro-batches"),
    (2, dict(tp=1, zero_stage=3, micro_batch_size=2), "ilp", "FSDP2, 2 micro-batches"),
    (2, dict(tp=2, micro_batch_size=2), "megatron", "TP, 4 micro-batches"),
]


@pytest.mark.parametrize("world,force,sharding,label", ACCUMULATE,
                         ids=[c[-1] for c in ACCUMULATE])
def test_gradient_accumulation_equals_one_device(world, force, sharding, label):
    from tests.test_runtime import _reference
    plan = _plan(world, force, sharding)
    assert plan.config.micro_batch_size == force["micro_batch_size"]
    ref_losses, ref_params = _reference("gpt-tiny", optimizer=_opt, num_layers=4, num_heads=2)
    results = run_ranks(_rank, world, plan.to_json(), {})
    for losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    _close(results, ref_params)


@pytest.mark.parametrize("world,force,label,scale", [
    (2, dict(tp=1, zero_stage=1), "ZeRO-1", 2.0 ** 20),
    (2, dict(tp=1, zero_stage=3), "FSDP2", 2.0 ** 20),
    # the vocabulary-parallel loss is fp32 (as autocast's cross entropy): the scaled fp16
    # gradients overflow from a larger scale on
    (2, dict(tp=2, sequence_parallel=True), "TP + SP", 2.0 ** 24),
], ids=["ZeRO-1", "FSDP2", "TP + SP"])
def test_fp16_loss_scaling_agrees_across_ranks(world, force, label, scale):
    """Where fp16 overflows depends on each rank's local values (half the batch, a slice of
    the hidden dim), so a sharded run may skip other steps than one device; what must hold is
    that every rank skips the same ones (one verdict, all-reduced), that the scale backs off
    and training goes on, and, where nothing overflows, the losses of one device."""
    plan = _fp16_plan(world, force).to_json()
    results = run_ranks(_rank, world, plan, dict(init_scale=scale, steps=8,
                                                 max_grad_norm=1.0))
    skipped = results[0][2]
    assert 1 <= skipped[-1] <= 6                # overflowing steps skipped, then training
    for losses, _, ranks_skipped, _ in results:
        assert ranks_skipped == skipped
        assert losses == results[0][0]
    assert results[0][0][-1] < results[0][0][0]
    calm = dict(init_scale=2.0 ** 8, steps=3, max_grad_norm=1.0)
    one = run_ranks(_rank, 1, _fp16_plan(1, dict(tp=1)).to_json(), calm)[0]
    sharded = run_ranks(_rank, world, plan, calm)
    assert one[2][-1] == 0
    for losses, _, ranks_skipped, _ in sharded:
        assert ranks_skipped[-1] == 0
        assert losses == pytest.approx(one[0], rel=2e-2)


def _fp16_plan(world, force):
    from autoplan import Cluster
    from autoplan import plan as make_plan
    from autoplan.graph import trace
    small = _example(1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp16",
                     profile=None, force=force, sharding="megatron", max_pp=1)


def test_dp1_parameter_offload_runs_fsdp_cpu_offload():
    from tests.test_runtime import _reference
    plan = _plan(2, dict(tp=2, dp=1, zero_stage=3, offload_params=True), "megatron")
    assert plan.config.dp == 1 and plan.config.offload_params
    ref_losses, ref_params = _reference("gpt-tiny", optimizer=_opt, num_layers=4, num_heads=2)
    results = run_ranks(_offload_check_rank, 2, plan.to_json())
    for losses, fsdp_units, *_ in results:
        assert fsdp_units > 0                          # FSDP2 with CPUOffloadPolicy ran
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def _offload_check_rank(rank, world, plan_json):
    from torch.distributed.fsdp import FSDPModule
    trainer, batch = _compiled(plan_json)
    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    return [trainer.step(batch) for _ in range(STEPS)], units


def _pp_count_rank(rank, world, plan_json):
    from torch.nn.parallel import DistributedDataParallel

    from autoplan.runtime.comm_counter import CommCounter
    trainer, batch = _compiled(plan_json)
    trainer.step(batch)                        # DDP's first step rebuilds its buckets
    with CommCounter() as counter:
        trainer.step(batch)
    stages = trainer.runner.schedule._stages if hasattr(trainer.runner.schedule, "_stages") else \
        [trainer.runner.schedule._stage]
    params = sum(p.numel() for c in trainer.runner.chunks.values() for p in c.parameters())
    tensors = sum(1 for c in trainer.runner.chunks.values() for _ in c.parameters())
    tied = sum(p.numel() for sync in trainer.grad_syncs for p, _ in getattr(sync, "pairs", []))
    return (all(isinstance(s.submod, DistributedDataParallel) for s in stages),
            counter.counts.get("all_reduce", (0, 0.0)), params, tensors, tied)


@pytest.mark.parametrize("schedule,ddp", [("1f1b", True), ("zero_bubble", False)])
def test_pipeline_data_parallel_gradient_sync_is_bucketed_once_per_step(schedule, ddp):
    """pp2 x dp2: each chunk's gradients are all-reduced once per step (not per micro-batch)
    in a few buckets, not one call per tensor: by DDP during the last backward (1F1B), or after
    the schedule (zero bubble, whose split backward DDP cannot follow; priced so)."""
    plan = _plan(4, dict(pp=2, dp=2, zero_stage=0, schedule=schedule, micro_batch_size=1),
                 max_pp=2)
    for wrapped, (calls, nbytes), params, tensors, tied in run_ranks(_pp_count_rank, 4,
                                                                     plan.to_json()):
        assert wrapped == ddp
        # the gradients once, the tied embedding/head's between the pipeline ranks (one
        # call), the step's loss (8 bytes, one call)
        assert nbytes == 4 * params + 4 * tied + 8
        assert calls <= 5 < tensors


def _zero1_overlap_rank(rank, world):
    import torch.distributed as dist

    from autoplan.runtime.optim import TensorShardedOptimizer, wait_gathers
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = TensorShardedOptimizer(list(model.parameters()),
                                 lambda ps: torch.optim.SGD(ps, lr=0.1), dist.group.WORLD)
    opt.overlap_with_forward([model], [model[0], model[1]])
    x = torch.full((3, 4), float(rank + 1))       # different data: different gradients
    model(x).sum().backward()
    for p in model.parameters():                  # what DDP would do: average the gradients
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    in_flight = len(opt._pending)
    model(x)                                       # every layer waits for its own weights
    after_forward = len(opt._pending)
    wait_gathers(opt)
    return in_flight, after_forward, [p.detach().flatten().tolist() for p in model.parameters()]


def test_zero1_broadcasts_overlap_the_next_forward_and_arrive_before_use():
    """The updated tensors are in flight after step() and each layer's forward pre-hook waits
    for its own: after one forward nothing is pending and every rank holds the same weights."""
    results = run_ranks(_zero1_overlap_rank, 2)
    for in_flight, after_forward, _ in results:
        assert in_flight == 4 and after_forward == 0
    assert results[0][2] == results[1][2]


def _refusal_rank(rank, world, plan_json):
    from autoplan.errors import PlanError
    try:
        _compiled(plan_json)
    except PlanError as e:
        return str(e)
    return "ran"


def test_a_plan_with_tp_comm_overlap_is_refused_at_run_time():
    """Priced (the validation prices Megatron-LM's --tp-comm-overlap) but not runnable here:
    compile() says so on every rank, and never runs the plan without the overlap."""
    plan = _plan(2, dict(tp=2, sequence_parallel=True, tp_comm_overlap=True))
    assert plan.config.tp_comm_overlap
    for message in run_ranks(_refusal_rank, 2, plan.to_json()):
        assert "tp_comm_overlap" in message and "cannot run" in message
