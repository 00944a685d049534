"""Megatron-style master weights (``mixed_precision="params"``) run and equal one device running
the same scheme by hand.

The reference is written as a user would write Megatron-LM's --bf16 on one process: the model
cast to bf16 (``model.to(torch.bfloat16)``), an fp32 copy of every weight given to AdamW, the
micro-batches' bf16 gradients added into fp32 buffers, the loss read on fp32 outputs, AdamW on
the fp32 copies, the bf16 weights copied back. The plan's training on 2 gloo ranks must give the
same losses and the same fp32 masters.

Tolerance, and why: every rank computes the same bf16 gradients of its micro-batches as the one
device does (the same shapes, the same kernels; the 1/micro-batches factor is a power of two),
so the schemes differ only in the order of the fp32 sums of those gradients (a rank sums its
micro-batches, the all-reduce adds the ranks; one device sums the micro-batches in a row): an
fp32 round-off, which AdamW's update passes on to the masters (1e-6 of them) and which may round
a bf16 weight the other way (2^-8 of it), moving the next loss by about that much.
"""

import math

import pytest
import torch

from autoplan import Cluster
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.planner.search import plan as make_plan
from autoplan.errors import PlanError
from tests.conftest import has_transformers
from tests.distributed import run_ranks

GLOBAL_BATCH = 4
MICRO_BATCH = 1
STEPS = 3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _by_hand(name, micro_batches, dtype=torch.bfloat16, scale=None, ranks=1):
    """Losses and fp32 masters of the scheme by hand on one process (with ``scale``: fp16's
    dynamic loss scaling from that scale, a step whose gradients overflow skipped and the
    scale halved, as ``torch.amp.GradScaler`` and Megatron-LM's --fp16 do). Each micro-batch's
    backward is scaled as on one of ``ranks`` data-parallel ranks (by 1 / its micro-batches,
    the mean over the ranks taken on the fp32 sums, as Megatron-LM scales): where fp16
    overflows depends on it; each rank sums its own micro-batches first."""
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    model = ex.model.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().requires_grad_(True) for p in params]
    start = [m.detach().clone() for m in masters]
    opt = _optimizer(masters)
    inputs = [x.to(dtype) if x.is_floating_point() else x for x in ex.example_inputs]
    losses, skipped = [], 0
    for _ in range(STEPS):
        per_rank = [[torch.zeros_like(m) for m in masters] for _ in range(ranks)]
        total = 0.0
        rows = GLOBAL_BATCH // micro_batches
        for k in range(micro_batches):
            part = [x[k * rows:(k + 1) * rows] for x in inputs]
            out = model(*part)
            out = out.float() if isinstance(out, torch.Tensor) else type(out)(
                o.float() if o.is_floating_point() else o for o in out)
            loss = ex.loss_fn(out, ex.targets[k * rows:(k + 1) * rows])
            (loss * ((scale or 1.0) * ranks / micro_batches)).backward()
            for b, p in zip(per_rank[k * ranks // micro_batches], params):
                b.add_(p.grad)
                p.grad = None
            total += loss.item()
        losses.append(total / micro_batches)
        main = [sum(bs[1:], bs[0]) for bs in zip(*per_rank)]    # the all-reduce's sum
        if scale is not None and not all(torch.isfinite(b).all() for b in main):
            scale, skipped = scale / 2, skipped + 1
            continue
        for m, b in zip(masters, main):
            m.grad = b / ranks / scale if scale is not None else b / ranks
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    first = {id(p): n for n, p in model.named_parameters()}
    tied = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return (losses, dict(zip(names, (m.detach() for m in masters))), dict(zip(names, start)),
            tied, skipped)


def _masters(trainer):
    """This rank's fp32 masters by FQN (ZeRO-1: the tensors it owns; FSDP: its fp32 shards,
    gathered)."""
    from torch.distributed.tensor import DTensor
    from autoplan.runtime.master_weights import MasterWeightsOptimizer
    from autoplan.runtime.optim import HostOffloadOptimizer
    opt = trainer.optimizer
    mw = opt.inner if hasattr(opt, "src") else opt        # ZeRO-1: what this rank owns
    if mw is None:
        return {}
    assert isinstance(mw, (MasterWeightsOptimizer, HostOffloadOptimizer))
    names = {id(p): n for m in trainer.stage_modules for n, p in m.named_parameters()}
    out = {}
    copies = mw.host if isinstance(mw, HostOffloadOptimizer) else mw.masters
    for p, m in zip(mw.params, copies):
        assert m.dtype == torch.float32
        m = p if isinstance(p, DTensor) else m       # FSDP's fp32 shard (a host copy's twin)
        m = m.full_tensor() if isinstance(m, DTensor) else m
        out[names[id(p)]] = m.detach().tolist()
    return out


def _rank(rank, world, name, plan_json, init_scale=None):
    from autoplan.runtime.grads import LossScaler
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(name, batch_size=MICRO_BATCH, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json),
                      loss_scaler=LossScaler(init_scale=init_scale) if init_scale else None)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch) for _ in range(STEPS)]
    masters = _masters(trainer) if trainer.config.tp == 1 else {}
    weights = {k: (str(v.dtype), v.float().tolist())
               for k, v in trainer.full_state_dict().items()}
    skipped = trainer.loss_scaler.skipped_steps if trainer.loss_scaler else 0
    return losses, masters, weights, skipped


def _plan(name, world, force, max_pp=1, precision="bf16"):
    small = build_example(name, batch_size=MICRO_BATCH, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision=precision,
                     profile=None, max_pp=max_pp,
                     force={"mixed_precision": "params", "micro_batch_size": MICRO_BATCH,
                            **force})


def _check(name, world, force, *, update_error):
    """Train the plan on ``world`` ranks; its losses and fp32 masters against the scheme by
    hand: ``update_error`` bounds ||masters - by hand|| / ||by hand - start|| (0: bitwise)."""
    p = force if isinstance(force, Plan) else _plan(name, world, force)
    assert p.config.mixed_precision == "params" and p.config.precision == "bf16"
    results = run_ranks(_rank, world, name, p.to_json())
    ref_losses, ref_masters, start, tied, _ = _by_hand(name, GLOBAL_BATCH // MICRO_BATCH)
    fsdp = p.config.zero_stage >= 2
    seen = {}
    for losses, masters, weights, _ in results:
        assert losses == results[0][0]                   # one loss on every rank
        # the first loss: the same bf16 weights and inputs
        assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6, abs=1e-6)
        assert losses == pytest.approx(ref_losses, rel=1e-3 if update_error else 0)
        # the weights the program runs are bf16 (FSDP stores its fp32 masters)
        stored = {"torch.float32" if fsdp else "torch.bfloat16", "torch.int64"}
        assert {d for d, _ in weights.values()} <= stored
        seen.update({tied.get(k, k): v for k, v in masters.items()})   # a pp rank's copy
        if p.config.tp > 1:      # masters are tp shards here: the weights, gathered, rounded
            seen.update({k: v for k, (_, v) in weights.items() if k in ref_masters})
    assert set(seen) == set(ref_masters)                  # every master, on some rank
    diff = moved = 0.0
    for k, ref in ref_masters.items():
        got = torch.tensor(seen[k], dtype=torch.float32).reshape(ref.shape)
        if p.config.tp > 1:
            ref = ref.bfloat16().float()
        diff += (got - ref).double().pow(2).sum().item()
        moved += (ref - start[k]).double().pow(2).sum().item()
    assert math.sqrt(diff) <= update_error * math.sqrt(moved), \
        f"{name} {force}: masters off by {math.sqrt(diff / moved):.2e} of the update"
    return results


CASES = [
    ("mlp-tiny", dict(dp=2, tp=1, zero_stage=0)),      # fp32 sums all-reduced, no DDP
    ("mlp-tiny", dict(dp=2, tp=1, zero_stage=1)),      # masters sharded over dp
    ("mlp-tiny", dict(dp=1, tp=2)),
    # FSDP2's fp32 shards are the masters (held on the host: its CPU offload policy)
    ("mlp-tiny", dict(dp=2, tp=1, zero_stage=3, offload_params=True)),
    # the optimizer on the host, stepping FSDP's fp32 shards' host copies (Llama-3-70B's
    # priced plan on 8 H100s); 16-bit weights' host copies are their masters (ZeRO-Offload):
    # test_checkpoints_hold_the_fp32_masters_and_reshard runs them under ZeRO-1
    ("mlp-tiny", dict(dp=2, tp=1, zero_stage=3, offload_optimizer=True)),
]


@pytest.mark.parametrize("name,force", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_master_weights_equal_the_scheme_by_hand(name, force):
    # bitwise, but for the host optimizer: it runs torch's fused CPU Adam (vectorised, as the
    # host rate prices it), whose arithmetic order differs from the by-hand loop's in fp32
    # round-off (1e-8 of the update seen); 1e-6 still catches a wrong master
    _check(name, 2, force, update_error=1e-6 if force.get("offload_optimizer") else 0.0)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_hf_llama_master_weights_equal_the_scheme_by_hand():
    """HF Llama in bf16 (it upcasts in RMSNorm and softmax itself), ZeRO-1 over 2 ranks."""
    _check("hf-llama-gqa-tiny", 2, dict(dp=2, tp=1, zero_stage=1), update_error=0.1)


def test_pipelined_master_weights_equal_the_scheme_by_hand():
    """pp2 1F1B: 16-bit stages, the main grads averaged over the micro-batches here (torch's
    scaling reads p.grad), the loss on fp32 outputs in the last stage. GPT's tied embedding
    and head sit on both ranks: their two bf16 gradients are summed in fp32 between the ranks
    (as Megatron-LM all-reduces its embedding's main grads), where one device's autograd sums
    them in bf16 before the hook, a round-off the update carries (untied: bitwise equal)."""
    p = _plan("gpt-tiny", 2, dict(pp=2, dp=1, tp=1, schedule="1f1b"), max_pp=2)
    _check("gpt-tiny", 2, p, update_error=0.02)


def test_fp16_master_weights_skip_overflowed_steps_as_by_hand():
    """fp16 weights (Megatron-LM's --fp16) under ZeRO-1: the loss scaled, the scaled fp16
    gradients summed in the fp32 main grads, an overflow found there skipping the step on
    every rank and halving the scale, else the main grads unscaled for AdamW on the masters.
    From 2^18 the first step overflows, the next two train: bitwise the scheme by hand with the
    same scaler."""
    scale = 2.0 ** 18
    p = _plan("mlp-tiny", 2, dict(dp=2, tp=1, zero_stage=1), precision="fp16")
    assert p.config.mixed_precision == "params" and p.config.precision == "fp16"
    results = run_ranks(_rank, 2, "mlp-tiny", p.to_json(), scale)
    ref_losses, ref_masters, start, _, ref_skipped = _by_hand(
        "mlp-tiny", GLOBAL_BATCH // MICRO_BATCH, dtype=torch.float16, scale=scale, ranks=2)
    assert ref_skipped == 1 and ref_losses[2] < ref_losses[1] == ref_losses[0]
    seen = {}
    for losses, masters, weights, skipped in results:
        assert (losses, skipped) == (ref_losses, ref_skipped)
        assert {d for d, _ in weights.values()} == {"torch.float16"}
        seen.update(masters)
    assert set(seen) == set(ref_masters)
    for k, ref in ref_masters.items():
        assert not torch.equal(ref, start[k])                  # the step taken moved them
        assert torch.equal(torch.tensor(seen[k]).reshape(ref.shape), ref), k


def test_master_weights_refused_with_zero_bubble_schedules():
    p = _plan("mlp-tiny", 2, dict(pp=2, dp=1, tp=1, schedule="zero_bubble"), max_pp=2)
    from autoplan.runtime.trainer import _refuse_unrunnable
    with pytest.raises(PlanError, match="zero_bubble schedule"):
        _refuse_unrunnable(p, has_loss=True)


def _resume_rank(rank, world, name, plans, ckpt):
    """In the same processes: plans[0] trains STEPS steps, saving after step 1, its fp32
    masters noted after every step; plans[1] resumes from that checkpoint, runs step 2 and
    saves; plans[2] resumes from that one and runs step 3. Returns each run's losses and the
    weights right after its load (full, as the program holds them)."""
    from autoplan.runtime.trainer import compile
    out = []
    for k, plan_json in enumerate(plans):
        ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
        small = build_example(name, batch_size=MICRO_BATCH, seed=0)
        trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                          example_targets=small.targets, loss_fn=ex.loss_fn,
                          optimizer=_optimizer, global_batch_size=GLOBAL_BATCH,
                          plan=Plan.from_json(plan_json), resume=ckpt if k else None)
        loaded = {n: (str(v.dtype), v.float().tolist())
                  for n, v in trainer.full_state_dict().items()}
        batch = tuple(ex.example_inputs) + (ex.targets,)
        losses, masters = [], []
        for _ in range(STEPS - trainer.steps_done if k != 1 else 1):
            losses.append(trainer.step(batch))
            masters.append(_masters(trainer) if k < 2 else {})
            if trainer.steps_done == k + 1 and k < 2:
                trainer.save(ckpt)
        out.append((trainer.steps_done, losses, masters, loaded))
    return out


def test_checkpoints_hold_the_fp32_masters_and_reshard(tmp_path):
    """Saved under params dp2 ZeRO-1 after step 1, resumed under params dp2 with the optimizer
    offloaded (the same scheme: bitwise the same run), saved again after step 2, resumed under
    autocast tp2: the checkpoints' weights are the fp32 masters, bitwise, whatever plan reads
    them (autocast's fp32 weights are the masters; ``autoplan export`` writes them)."""
    from autoplan.runtime.checkpoint_files import export
    ckpt = str(tmp_path / "ckpt")
    zero1 = _plan("mlp-tiny", 2, dict(dp=2, tp=1, zero_stage=1))
    offload = _plan("mlp-tiny", 2, dict(dp=2, tp=1, zero_stage=1, offload_optimizer=True))
    tp2 = _plan("mlp-tiny", 2, dict(dp=1, tp=2, mixed_precision="autocast"))
    assert offload.config.offload_optimizer and tp2.config.mixed_precision == "autocast"
    results = run_ranks(_resume_rank, 2, "mlp-tiny",
                        [p.to_json() for p in (zero1, offload, tp2)], ckpt)
    (end_a, full, masters_a, _), (end_b, resumed, masters_b, loaded_b), \
        (end_c, other, _, loaded_c) = results[0]
    assert (end_a, end_b, end_c) == (STEPS, 2, STEPS)
    assert resumed == full[1:2]                           # bitwise: the same run
    by_step = [{k: v for r in results for k, v in r[0][2][s].items()} for s in range(STEPS)]
    after_b = {k: v for r in results for k, v in r[1][2][0].items()}
    assert after_b == by_step[1]                          # the masters too, bitwise
    # the 16-bit weights read back are the masters rounded; autocast's fp32 weights the masters
    for k, m in by_step[0].items():
        assert loaded_b[k] == ("torch.bfloat16",
                               torch.tensor(m).bfloat16().float().tolist()), k
    for k, m in by_step[1].items():
        assert loaded_c[k] == ("torch.float32", m), k
    assert other[0] == pytest.approx(full[2], rel=2e-2)   # autocast: norms in fp32
    exported = torch.load(tmp_path / "model.pt") if export(ckpt, tmp_path / "model.pt") else {}
    assert {k: v.dtype for k, v in exported.items()} == {k: torch.float32 for k in by_step[1]}
    assert {k: v.tolist() for k, v in exported.items()} == by_step[1]


def _one_gpu_of(preset):
    """One GPU of ``preset``'s node, as benchmarks/master_weights_figures.py builds it."""
    from autoplan.cluster import specs
    entry = {**specs.preset_entry(preset), "num_nodes": 1, "devices_per_node": 1}
    links = []
    for link in entry["node"]["links"]:
        a, b = link["a"], link["b"]
        if isinstance(a, list) and str(a[0]).startswith("gpu"):
            link = {**link, "a": a[:1], "b": b[:1] if isinstance(b, list) else b}
        links.append(link)
    entry["node"] = {**entry["node"], "links": links}
    return Cluster.from_dict({"name": f"{preset}-1gpu", **entry})


def _held_three_ways(graph, cluster, gbs):
    """(best plan with fp32 weights or None where none fits, with 16-bit weights, with both
    offered to one search)."""
    from autoplan.errors import AutoplanError
    kw = dict(global_batch_size=gbs, precision="bf16", profile=None, top_k=0)
    try:
        autocast = make_plan(graph, cluster, force={"mixed_precision": "autocast"}, **kw)
    except AutoplanError as e:
        assert "fits" in str(e)
        autocast = None
    params = make_plan(graph, cluster, force={"mixed_precision": "params"}, **kw)
    either = make_plan(graph, cluster, mixed_precision=("autocast", "params"), **kw)
    return autocast, params, either


def test_search_holds_the_weights_as_priced_memory_and_time_say():
    """Offered both ways of holding 16-bit weights, the search takes what its prices say.
    Llama-3-8B on one H100 (80 GiB, global batch 8): with fp32 weights a plan fits only with
    the weights offloaded too (86 GiB at least with the optimizer alone offloaded; FSDP2's
    parameter offload at dp 1), with 16-bit weights and fp32 masters offloaded one fits
    faster (no weights streamed in): the search picks that one. gpt-tiny on a DGX H100: both fit, and 16-bit weights
    are priced faster (no casts): picked, as fast as the best forced plan. Left to its default
    (autocast alone) the search never offers them."""
    from autoplan.models.registry import build_example as build
    ex = build("llama3-8b", device="meta")
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    autocast, params, either = _held_three_ways(graph, _one_gpu_of("dgx-h100"), 8)
    assert autocast.config.offload_params and autocast.config.zero_stage == 3
    assert params.config.offload_optimizer and not params.config.offload_params
    assert params.predicted["step_time_s"] < autocast.predicted["step_time_s"]
    assert either.config == params.config
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    graph = trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                  targets=small.targets)
    dgx = Cluster.preset("dgx-h100", nodes=1)
    autocast, params, either = _held_three_ways(graph, dgx, 8)
    times = {p.config.mixed_precision: p.predicted["step_time_s"] for p in (autocast, params)}
    assert either.config.mixed_precision == min(times, key=times.get) == "params"
    assert either.predicted["step_time_s"] == min(times.values())
    default = make_plan(graph, dgx, global_batch_size=8, precision="bf16", profile=None,
                        top_k=0)
    assert default.config.mixed_precision == "autocast"


def test_forced_master_weights_search_only_meshes_that_run_them():
    """Forcing 16-bit weights with fp32 masters keeps the search on meshes the runtime runs
    them on: Llama-3-8B at sequence 8192 on a DGX H100 is offered context parallelism, which
    the forced search leaves out (it planned a cp mesh the runtime then refused); forcing cp
    too still plans it, for the runtime to refuse with its reason."""
    from autoplan.models.registry import build_example as build
    ex = build("llama3-8b", device="meta")
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    dgx = Cluster.preset("dgx-h100", nodes=1)
    kw = dict(global_batch_size=8, precision="bf16", profile=None, top_k=60, max_pp=1)
    offered = make_plan(graph, dgx, **kw)
    assert any(a.config.cp > 1 for a in offered.alternatives)     # cp is in the search
    params = make_plan(graph, dgx, force={"mixed_precision": "params"}, **kw)
    assert all(c.cp == 1 and c.mixed_precision == "params"
               for c in [params.config] + [a.config for a in params.alternatives])
    both = make_plan(graph, dgx, force={"mixed_precision": "params", "cp": 2}, **kw)
    assert both.config.cp == 2
