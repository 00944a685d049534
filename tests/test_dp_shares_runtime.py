"""Uneven data parallelism trains as one device does (gloo): replica d runs ``dp_shares[d]``
micro-batches of the global batch, its losses weighted by ``dp x share / sum`` so that the
gradients averaged over dp are one device's mean over the whole batch. Under DDP, ZeRO-1 and
FSDP2 (ZeRO-3), beside tensor and pipeline parallelism, in fp32 and bf16 (CPU autocast), an own
GPT and Llama and HF Llama built from its config, ZeRO-2, HSDP and context parallelism too; the reported loss is the global batch's mean, the
gradient clipped on its global norm; a checkpoint saved under one split resumes under another
at the same step. One launch per world size runs every plan of it in turn."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from tests.distributed import run_ranks
from tests.test_token_mean_loss import _padded

STEPS = 3
CLIP = 0.05                       # below the first steps' gradient norms: clipping bites


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _example(name, batch):
    return build_example(name, batch_size=batch, seed=0, **({"num_layers": 2}
                                                            if name == "gpt-tiny" else {}))


def _summed(out, y):
    """The token mean written as a sum over the count: not a token mean to autoplan
    (``graph/loss.token_mean_loss``), so its micro-batches weigh dp x share / sum each."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                           reduction="sum") / y.numel()


def _loss_fn(ex, loss):
    return _summed if loss == "summed" else ex.loss_fn


def _targets(ex, padded):
    """The example's targets, or with 0-6 trailing tokens of each sample ignored (a token
    mean then weighs each micro-batch by its counted targets)."""
    return _padded(ex) if padded else ex.targets.clone()


def with_shares(plan: Plan, shares: tuple[int, ...]) -> Plan:
    """``plan`` (micro-batch size 1 here) with uneven dp shares and the global batch they
    make; its prediction is left the even plan's (these tests run the plan, they do not price
    it)."""
    config = replace(plan.config, dp_shares=shares)
    gbs = config.micro_batch_size * sum(shares)
    predicted = json.loads(json.dumps(plan.to_dict()["predicted"]))
    predicted.update(config=config.to_dict(), global_batch_size=gbs,
                     num_microbatches=config.microbatches(gbs))
    return replace(plan, config=config, predicted=predicted,
                   training=replace(plan.training, global_batch_size=gbs))


def _plan(name, world, shares, precision="fp32", loss=None, **force):
    """The planner's plan with micro-batches of 1 over ``len(shares)`` replicas, given those
    shares; ``shares=(k, k, ...)`` and ``even=True``: the even plan of that batch."""
    even = force.pop("even", False)
    small = _example(name, 1)
    g = trace(small.model, small.example_inputs, loss_fn=_loss_fn(small, loss),
              targets=small.targets)
    dp = len(shares)
    p = make_plan(g, Cluster.local(world), global_batch_size=shares[0] * dp if even else 2 * dp,
                  precision=precision, profile=None,
                  force=dict(dp=dp, micro_batch_size=1, **force), max_pp=force.get("pp", 1))
    return p if even else with_shares(p, shares)


def _reference(name, gbs, precision, clip, loss=None, padded=False):
    """One device, STEPS AdamW steps: in fp32 the whole batch in one forward and backward; in
    bf16 (CPU autocast) one sample at a time, gradients accumulated, as the plans' micro-batches
    of 1 run (a product's bf16 rounding depends on the batch it runs in: one forward of the
    whole batch ends up to 5 % off in the near-zero biases after 3 steps, even data
    parallelism as far)."""
    ex = _example(name, gbs)
    opt = _optimizer(ex.model.parameters())
    x, y = ex.example_inputs, _targets(ex, padded)
    micro = [(tuple(t[i:i + 1] for t in x), y[i:i + 1]) for i in range(gbs)] \
        if precision == "bf16" else [(x, y)]
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for xs, ys in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                value = _loss_fn(ex, loss)(ex.model(*xs), ys)
            (value / len(micro)).backward()
            total += value.item() / len(micro)
        if clip:
            torch.nn.utils.clip_grad_norm_(ex.model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in ex.model.state_dict().items()}


def _rank(rank, world, jobs, ckpt):
    """Each job in turn: compile its plan, train (or resume and train), return the losses,
    the step it started at and this rank's full parameters."""
    from autoplan.runtime.trainer import compile
    out = []
    for job in jobs:
        plan = Plan.from_json(job["plan"])
        gbs = plan.training.global_batch_size
        ex, small = _example(job["name"], gbs), _example(job["name"], 1)
        trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                          example_targets=small.targets,
                          loss_fn=_loss_fn(ex, job.get("loss")),
                          optimizer=_optimizer, global_batch_size=gbs, plan=plan,
                          max_grad_norm=job.get("clip"),
                          resume=ckpt if job.get("resume") else None)
        start = trainer.steps_done
        batch = tuple(ex.example_inputs) + (_targets(ex, job.get("padded")),)
        losses, held = [], []
        if job.get("probe"):
            hook = trainer.runner.model.register_forward_pre_hook(
                lambda module, args: held.append(_unsharded_bytes(module)))
        while trainer.steps_done < job.get("steps", STEPS):
            losses.append(trainer.step(batch))
            if job.get("probe") and trainer.steps_done == 1:
                hook.remove()
            if trainer.steps_done == job.get("save_at"):
                trainer.save(ckpt)
        trainer.wait_for_checkpoint()
        sd = trainer.full_state_dict()
        out.append((start, losses, {k: v.tolist() for k, v in sd.items()}, held))
    return out


def _unsharded_bytes(module):
    """(bytes of the weights FSDP2 holds unsharded, bytes of their gradients) as a micro-batch's
    forward starts: its unsharded parameters are plain tensors, its shards DTensors."""
    from torch.distributed.tensor import DTensor
    whole = [p for p in module.parameters() if not isinstance(p, DTensor)]
    return (sum(p.numel() * p.element_size() for p in whole),
            sum(p.grad.numel() * p.grad.element_size() for p in whole if p.grad is not None))


def _check_held(results, jobs, i, rank):
    """Job ``i`` on ``rank`` (a share of 2 or more, fp32) holds, from its second micro-batch's
    forward on, the whole weights and gradients the estimate counts for a rank of its share
    (``cost.memory.holds_step_whole``): ``cost.memory.unsharded_step_bytes`` of its parameters
    (ZeRO-2: its weights whole as ``model_state_bytes`` counts them, gradients whole)."""
    from autoplan.cost.memory import model_state_bytes, unsharded_step_bytes
    plan = Plan.from_json(jobs[i]["plan"])
    cfg = plan.config
    small = _example(jobs[i]["name"], 1)
    params = sum(p.numel() for p in small.model.parameters())
    weights, grads = unsharded_step_bytes(params, precision=cfg.precision,
                                          zero_stage=cfg.zero_stage)
    if cfg.zero_stage == 2:
        weights = model_state_bytes(params, dp=cfg.dp, zero_stage=2,
                                    precision=cfg.precision).params_bytes
    held = results[rank][i][3]
    assert len(held) == cfg.dp_shares[rank] >= 2, jobs[i]["label"]
    assert held[0][1] == 0, jobs[i]["label"]        # no gradient before the first backward
    for step_held in held[1:]:
        assert step_held == (weights, grads), (jobs[i]["label"], held, weights, grads)


def _whole(results, i):
    """Job ``i``'s losses (rank 0's) and every rank's tensors in one dict."""
    whole = {}
    for per_rank in results:
        whole.update({k: torch.tensor(v) for k, v in per_rank[i][2].items()})
    return results[0][i][1], whole


def _check(results, jobs, refs):
    """Each job against its reference: one device's run (``refs``), or an earlier job's
    (``ref`` its index); None: none."""
    for i, job in enumerate(jobs):
        ref = job["ref"]
        if ref is None:
            continue
        ref_losses, ref_sd = _whole(results, ref) if isinstance(ref, int) else refs[ref]
        whole = {}
        for per_rank in results:
            start, losses, sd, _ = per_rank[i]
            assert start == job.get("start", 0), job["label"]
            want = ref_losses[start:]
            assert losses == pytest.approx(want, rel=1e-6), (job["label"], losses, want)
            whole.update(sd)
        assert set(whole) <= set(ref_sd), job["label"]
        # each tensor within a relative error (Frobenius norm of the difference over the
        # reference's) of 1e-5, as tests/test_runtime.py
        for k, v in whole.items():
            ref = ref_sd[k]
            err = ((torch.as_tensor(v, dtype=ref.dtype) - ref).norm()
                   / ref.norm().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"{job['label']}: {k}: {err:.2e}"


def test_uneven_shares_train_as_one_device_on_two_ranks(tmp_path):
    jobs = [
        # a token mean over padded targets: each micro-batch weighs its counted targets
        dict(label="DDP 1:3, padded", name="gpt-tiny", precision="fp32", padded=True,
             plan=_plan("gpt-tiny", 2, (1, 3), tp=1, zero_stage=0), ref="gpt4padded"),
        dict(label="FSDP2 ZeRO-3 2:1, clipped", name="gpt-tiny", precision="fp32",
             plan=_plan("gpt-tiny", 2, (2, 1), tp=1, zero_stage=3), ref="gpt3clip",
             clip=CLIP, probe=True),
        dict(label="FSDP2 ZeRO-2 1:3", name="gpt-tiny", precision="fp32",
             plan=_plan("gpt-tiny", 2, (1, 3), tp=1, zero_stage=2), ref="gpt4", probe=True),
        dict(label="ZeRO-1 1:3 bf16", name="gpt-tiny", precision="bf16",
             plan=_plan("gpt-tiny", 2, (1, 3), "bf16", tp=1, zero_stage=1), ref="gpt4bf16"),
        # HF Llama under ZeRO-3 in bf16, whose gathers round the weights to bf16 where eager
        # autocast keeps some in fp32 (its losses differ from one device's from the first
        # step, even shares or not: tests/test_zoo_16bit.py measures how far): the reference
        # is the even plan, job 4
        dict(label="HF Llama ZeRO-3 even bf16", name="hf-llama-tiny", precision="bf16",
             plan=_plan("hf-llama-tiny", 2, (2, 2), "bf16", tp=1, zero_stage=3, even=True),
             ref=None),
        # 3:1, saved after 2 of its steps
        dict(label="HF Llama ZeRO-3 3:1 bf16", name="hf-llama-tiny", precision="bf16",
             plan=_plan("hf-llama-tiny", 2, (3, 1), "bf16", tp=1, zero_stage=3),
             ref=4, save_at=2),
        # ... resumed under the other split of the same batch, at step 2 with its state
        dict(label="HF Llama resumed 1:3", name="hf-llama-tiny", precision="bf16",
             plan=_plan("hf-llama-tiny", 2, (1, 3), "bf16", tp=1, zero_stage=3),
             ref=4, resume=True, start=2),
    ]
    for job in jobs:
        job["plan"] = job["plan"].to_json()
    refs = {"gpt4": _reference("gpt-tiny", 4, "fp32", None),
            "gpt4padded": _reference("gpt-tiny", 4, "fp32", None, padded=True),
            "gpt3clip": _reference("gpt-tiny", 3, "fp32", CLIP),
            "gpt4bf16": _reference("gpt-tiny", 4, "bf16", None)}
    results = run_ranks(_rank, 2, jobs, str(tmp_path / "ckpt"), timeout_s=300.0)
    _check(results, jobs, refs)
    _check_held(results, jobs, 1, 0)        # ZeRO-3, rank 0's share of 2
    _check_held(results, jobs, 2, 1)        # ZeRO-2, rank 1's share of 3


def test_uneven_shares_with_tensor_pipeline_and_context_parallelism(tmp_path):
    jobs = [
        # a loss autoplan does not read as a token mean: each replica's micro-batches weigh
        # dp x share / sum (in the loop, and in the pipeline's loss function)
        dict(label="tp2 x dp2 1:3, summed", name="gpt-tiny", precision="fp32", loss="summed",
             plan=_plan("gpt-tiny", 4, (1, 3), tp=2, zero_stage=0, loss="summed"),
             ref="gpt4summed"),
        dict(label="pp2 x dp2 3:2 1F1B, summed", name="gpt-tiny", precision="fp32",
             loss="summed", ref="gpt5summed",
             plan=_plan("gpt-tiny", 4, (3, 2), tp=1, pp=2, schedule="1f1b", loss="summed")),
        dict(label="pp2 x dp2 ZeRO-2 2:3 1F1B", name="gpt-tiny", precision="fp32",
             plan=_plan("gpt-tiny", 4, (2, 3), tp=1, pp=2, zero_stage=2, schedule="1f1b"),
             ref="gpt5"),
        # context parallelism: the cp ranks of a replica share its count (own Llama, whose
        # attention runs as ring attention; padded targets)
        dict(label="cp2 x dp2 ZeRO-3 3:1, padded", name="llama-tiny", precision="fp32",
             padded=True, ref="llama4padded",
             plan=_plan("llama-tiny", 4, (3, 1), tp=1, cp=2, zero_stage=3)),
        # shares of 8: weights 1/2 and 3/2, exact in binary (with 1:3:2:1, weights in
        # sevenths, a layer norm bias whose gradient is near zero ended 0.65-1.25e-5 off
        # after Adam's three steps, against 1.5e-6 for the even plan: rounding of the weights)
        dict(label="HSDP 2x2 ZeRO-3 1:3:3:1", name="gpt-tiny", precision="fp32",
             plan=_plan("gpt-tiny", 4, (1, 3, 3, 1), tp=1, zero_stage=3, dp_shard=2),
             ref="gpt8"),
    ]
    for job in jobs:
        job["plan"] = job["plan"].to_json()
    refs = {"gpt4summed": _reference("gpt-tiny", 4, "fp32", None, loss="summed"),
            "gpt5summed": _reference("gpt-tiny", 5, "fp32", None, loss="summed"),
            "gpt5": _reference("gpt-tiny", 5, "fp32", None),
            "gpt8": _reference("gpt-tiny", 8, "fp32", None),
            "llama4padded": _reference("llama-tiny", 4, "fp32", None, padded=True)}
    results = run_ranks(_rank, 4, jobs, str(tmp_path / "ckpt"), timeout_s=300.0)
    _check(results, jobs, refs)
