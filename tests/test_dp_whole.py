"""ZeRO-3 with some weights kept whole (``ParallelConfig.dp_whole``): FSDP as a per-weight
placement on the data-parallel axis, chosen by the configuration's own ILP
(``planner/dp_problem.py``), priced by ``estimate`` and run by the runtime (the weights stay out
of FSDP, their gradients averaged over dp in buckets behind the last backward).
"""

import pytest

from autoplan import Cluster, ConfigError, ParallelConfig, estimate, plan
from autoplan.cost.memory import bytes_per_param
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_zoo import _rank, assert_equal_to_one_device, zoo_plan


def _held(rank, world, name, plan_json):
    """Which parameters of the rank program FSDP holds (DTensors over dp) and which it left
    whole, by FQN."""
    import torch

    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=8, seed=0)
    small = build_example(name, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      global_batch_size=8, plan=Plan.from_json(plan_json))
    from torch.distributed.tensor import DTensor
    return {k.replace("_checkpoint_wrapped_module.", ""): isinstance(p, DTensor)
            for k, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("fields,says", [
    (dict(dp=4, zero_stage=1), "zero_stage=3"),
    (dict(dp=1, zero_stage=3), "dp > 1"),
    (dict(dp=2, pp=2, zero_stage=3), "pp > 1"),
    (dict(dp=4, zero_stage=3, dp_shard=2), "HSDP"),
])
def test_dp_whole_is_refused_where_it_cannot_run(fields, says):
    with pytest.raises(ConfigError, match=says):
        ParallelConfig(**fields, dp_whole=["layers.*"])


def _gpt():
    ex = build_example("gpt-tiny", device="meta", batch_size=1)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def test_weights_kept_whole_hold_whole_state_and_all_reduce_once():
    """Against all of them sharded: the kept weights' state is whole (ZeRO-0 for them), one
    all-reduce of their gradients is added, and the gathers lose them."""
    g = _gpt()
    cluster = Cluster.preset("dgx-h100", nodes=2)
    kept = [v for v in g.param_values if v.fqn.startswith("layers.") and ".attn." in v.fqn]
    assert kept
    n = sum(v.meta.numel for v in kept)
    base = ParallelConfig(dp=16, zero_stage=3, micro_batch_size=1, num_microbatches=4)
    whole = ParallelConfig(**{**base.to_dict(), "dp_whole": ["layers.*.attn.*"]})
    a, b = (estimate(g, cluster, config=c, global_batch_size=64, profile=None)
            for c in (base, whole))
    ma, mb = a.stages[0].memory, b.stages[0].memory
    states = lambda m: m.params_bytes + m.grads_bytes + m.optimizer_bytes   # noqa: E731
    # weights, gradients and Adam's state, whole instead of over 16 ranks: the runtime's fp32
    # weights (and the bf16 copies autocast makes of the whole ones) beside 16 B over 16
    per_param = sum(bytes_per_param("bf16", "adamw", "autocast"))
    assert states(mb) - states(ma) == pytest.approx(n * (per_param + 2 - per_param / 16),
                                                    rel=1e-9)
    # their fp32 gradients all-reduced once a step, behind the last backward (as DDP)
    from autoplan.estimate.dp_terms import StageParams, stage_terms
    stage = StageParams(params=float(sum(v.meta.numel for v in g.param_values
                                         if v.fqn == g.value(v.base).fqn)),
                        whole=float(n), layers=2)
    from autoplan.cost.compute import compute_model
    compute = compute_model(g, cluster.device, "bf16", None)
    (sync,) = [t for t in stage_terms(whole, cluster, stage, 4, 0, compute, None)
               if t.whole_only]
    assert sync.window == "bwd" and sync.seconds == pytest.approx(
        cluster.collective_time_s("all_reduce", n * 4, base.dp_group()))
    assert b.time.comm_exposed_s["zero_param_gather"] < a.time.comm_exposed_s[
        "zero_param_gather"]


def test_plan_file_records_the_weights_kept_whole(tmp_path):
    g = _gpt()
    p = plan(g, Cluster.preset("dgx-h100", nodes=1), global_batch_size=32, profile=None,
             force=dict(dp=8, tp=1, zero_stage=3, dp_whole=["layers.*.attn.*"]))
    assert p.config.dp_whole == ("layers.*.attn.*",)
    for fqn, pl in p.param_placements.items():
        assert pl.dp == ("R" if ".attn." in fqn else "S(0)"), fqn
    again = Plan.from_json(p.to_json())
    assert again.config == p.config and again.to_json() == p.to_json()
    old = p.to_json().replace(f'"schema_version": {p.schema_version}', '"schema_version": 3')
    with pytest.raises(Exception, match="schema 4 added"):
        Plan.from_json(old)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_ilp_keeps_weights_whole_where_memory_allows(compiled):
    """Llama-3-8B on one 8 x H100 node under ZeRO-3 at tp2, 16 micro-batches: keeping every
    weight whole does not fit in 80 GB, sharding every one gathers each 16 times a step. The
    configuration's ILP keeps some whole (a knapsack over the weights' gathers and bytes) and
    its objective is the plan's predicted step time."""
    ex = build_example("llama3-8b", device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    force = dict(zero_stage=3, tp=2, micro_batch_size=1, compiled=compiled)
    mixed = plan(g, cluster, global_batch_size=64, profile=None, force=force, max_pp=1)
    sharded = plan(g, cluster, global_batch_size=64, profile=None, max_pp=1,
                   force={**force, "dp_whole": []})
    whole = [f for f, pl in mixed.param_placements.items() if pl.dp == "R"]
    assert whole and len(whole) < len(mixed.param_placements)
    assert mixed.predicted["fits"]
    assert mixed.predicted["step_time_s"] < sharded.predicted["step_time_s"]
    assert mixed.solver.objective_s == pytest.approx(mixed.predicted["step_time_s"], rel=1e-5)


LLAMA_ATTENTION = ["model.model.layers.*.self_attn.*", "model.model.embed_tokens.weight"]
GPT2_ATTENTION = ["model.transformer.h.*.attn.*", "model.transformer.wte.weight"]


@pytest.mark.parametrize("name,whole", [
    ("hf-llama-gqa-tiny", LLAMA_ATTENTION),
    ("hf-gpt2-lm-tiny", GPT2_ATTENTION),         # the tied LM head kept whole with wte
    ("nanogpt-tiny", None),                       # the ILP's own choice (m = 4: all whole)
])
def test_weights_kept_whole_train_like_one_device(name, whole):
    """4 gloo ranks, dp2 x tp2 ZeRO-3 with the ILP's tp sharding: the kept weights whole on
    every rank, the rest sharded by FSDP; 3 AdamW steps equal one device."""
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    force = dict(dp=2, tp=2, zero_stage=3, micro_batch_size=1)
    if whole is not None:
        force["dp_whole"] = whole
    p = zoo_plan(name, 4, force, "ilp")
    assert p.config.dp_whole
    kept = {f for f, pl in p.param_placements.items() if pl.dp == "R"}
    assert kept and (whole is None or len(kept) < len(p.param_placements))
    results = run_ranks(_rank, 4, name, p.to_json(), timeout_s=240.0)
    assert_equal_to_one_device(name, results, f"{name} {p.config.short()}")
    if whole is not None:       # the runtime holds them as planned: whole, or FSDP's shards
        held = run_ranks(_held, 4, name, p.to_json(), timeout_s=240.0)[0]
        sharded = {f for f, dt in held.items() if dt}
        assert sharded and all((f in kept) != (f in sharded) for f in held), (kept, sharded)


def _buckets_in_backward(rank, world):
    import torch
    import torch.distributed as dist

    from autoplan.runtime import optim
    dist.init_process_group("gloo", rank=rank, world_size=world)
    optim.BUCKET_BYTES = 4 * 64 * 64                 # about one weight a bucket
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    grads = optim.DataParallelGrads(list(net.parameters()), None, world)
    grads.overlap_with_backward()
    x = torch.randn(8, 64) * (rank + 1)
    net(x).sum().backward()                          # a first micro-batch: nothing sent
    assert not grads._sent
    grads.arm()
    net(x).sum().backward()
    sent = len(grads._sent)                          # sent while backward ran
    grads.all_reduce()
    return sent, [p.grad.tolist() for p in net.parameters()]


def test_whole_weights_gradients_go_out_in_buckets_behind_the_last_backward():
    """The weights FSDP leaves whole: their buckets are all-reduced while the last
    micro-batch's backward runs (DDP's overlap), and the result is the dp mean."""
    import torch
    (s0, g0), (s1, g1) = run_ranks(_buckets_in_backward, 2, timeout_s=60.0)
    assert s0 >= 3 and s0 == s1
    assert g0 == g1
    ref = []
    for rank in (0, 1):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        x = torch.randn(8, 64) * (rank + 1)
        for _ in range(2):
            net(x).sum().backward()
        ref.append([p.grad for p in net.parameters()])
    for got, a, b in zip(g0, *ref):
        assert torch.allclose(torch.tensor(got), (a + b) / 2, rtol=1e-6, atol=1e-6)
