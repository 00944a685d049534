"""The sharding ILP prices what ``estimate`` prices (issue 15, item 2, for the terms the sharding
decides): on random small models, meshes, micro-batch counts and recompute policies, the ILP's
objective for *any* choice of strategies (not only its optimum) equals the estimate's compute,
recomputation, exposed tensor-parallel collectives and per-step tensor-parallel gradient
all-reduces of the sharding those strategies make (one pipeline stage); and its memory for the
choice equals the estimate's model state and one micro-batch's kept activations.

Outside that shared ILP (it serves every ZeRO stage and policy): data-parallel gradient sync and
its overlap, ZeRO gathers, the optimizer step and host traffic, the framework's per-op overhead.
One configuration's own ILP (``dp_problem``) adds them, and its objective is then the estimate's
whole step time. A pipelined configuration's own ILP (``pipe_problem``) prices its whole
step: its schedule as simulated (the longest chain of forwards, backwards and sends), the
largest stage's dp terms (the last tests). Outside them all: in memory, full recomputation's kept layer
inputs, the transient working set and the margin; a pipelined problem's memory is the
estimate's check of the plan it makes.
"""

import random

import pytest

from autoplan import Cluster
from autoplan.cost.compute import compute_model
from autoplan.cost.dtypes import held_bytes
from autoplan.estimate.chunk_cost import chunk_cost
from autoplan.estimate.cost_inputs import CostInputs
from autoplan.estimate.layout import chunks_for
from autoplan.graph import trace
from autoplan.graph.analysis import analyze
from autoplan.models import build_example
from autoplan.planner.ilp import solve
from autoplan.estimate.overlap import overlap_interference
from autoplan.planner.cost_context import CostContext
from autoplan.planner.problem import INFEASIBLE_S, reduce_graph, sharding_from_choice
from autoplan.sharding.parallel_config import ParallelConfig
from tests.conftest import has_transformers

MODELS = ["gpt-tiny", "nanogpt-tiny", "torch-encoder-tiny", "llama-tiny"] + (
    ["hf-llama-gqa-tiny", "hf-t5-tiny", "hf-mixtral-tiny", "hf-gpt2-lm-tiny"]
    if has_transformers() else [])
PRESETS = ["dgx-h100", "dgx-a100-80gb", "pcie-8gpu"]


def _case(seed: int):
    rng = random.Random(seed)
    name = rng.choice(MODELS)
    ex = build_example(name, device="meta", batch_size=rng.choice([1, 2]))
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    heads = analyze(g).head_counts
    t = rng.choice([d for d in (2, 4, 8) if all(h % d == 0 for h in heads)] or [2])
    cluster = Cluster.preset(rng.choice(PRESETS), nodes=1)
    config = ParallelConfig(dp=8 // t, tp=t, micro_batch_size=rng.choice([1, 2, 4]),
                            precision=rng.choice(["bf16", "fp32"]),
                            recompute=rng.choice(["none", "selective"]))
    return rng, name, g, cluster, config, rng.choice([1, 3, 8])


def config_context(g, cluster, config, m, compute, **overrides):
    """The tp-axis cost context of ``config`` with ``m`` micro-batches (16 bytes of model state
    per parameter, one micro-batch of activations held in the dtypes ``config`` trains them
    in), ``overrides`` replacing fields."""
    fields = dict(graph=g, t=config.tp, compute=compute,
                  collective_s=lambda kind, nbytes: cluster.collective_time_s(
                      kind, nbytes, config.tp_group()),
                  batch_scale=config.micro_batch_size / g.batch_size, microbatches=m,
                  precision=config.precision, recompute=config.recompute,
                  state_bytes_per_param=16.0, activation_multiplier=1.0,
                  interference=overlap_interference(cluster),
                  held=held_bytes(g, config.precision, config.mixed_precision,
                                  cluster.device.kind))
    return CostContext(**{**fields, **overrides})


@pytest.mark.parametrize("seed", range(12))
def test_the_ilp_objective_is_the_estimates_price_of_its_sharding(seed):
    rng, name, g, cluster, config, m = _case(seed)
    compute = compute_model(g, cluster.device, config.precision, None)
    t = config.tp
    ctx = config_context(g, cluster, config, m, compute)
    red = reduce_graph(ctx)
    problem = red.problem
    objective = shared_objective(problem)
    choices = walks(solve(problem, time_limit_s=30).choice, problem, objective, rng, 12, 2)
    assert len(set(choices)) > 3, name
    for choice in choices:
        sh = sharding_from_choice(g, t, red, choice)
        ci = CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                        cluster=cluster, config=config)
        (chunk,) = chunks_for(ci)
        c = chunk_cost(ci, chunk, config.recompute)
        priced = m * (c.fwd_s + c.bwd_s + c.recompute_s + c.tp_fwd_s + c.tp_bwd_s) + c.tp_step_s
        assert objective(choice) == pytest.approx(priced, rel=_tolerance(g)), (name, t, m,
                                                                              choice)
        # memory: model state per parameter on this rank plus one micro-batch's activations
        held = sum(problem.node_memory[v][j] for v, j in enumerate(choice))
        assert held == pytest.approx(c.params * 16.0 + c.activation_bytes, rel=1e-9), (
            name, t, choice)


def _tolerance(g) -> float:
    """Exact, but for a weight read by three ops or more (T5's embedding, shared by encoder,
    decoder and LM head): where some readers' gradients are partial and others' whole, every
    partial one is all-reduced per micro-batch, which the ILP's pairwise terms count once per
    whole reader (within the issue's 2 %)."""
    readers: dict[str, set[int]] = {}
    for i, op in enumerate(g.ops):
        for n in op.inputs:
            v = g.value(n)
            if v.kind == "param" and v.requires_grad:
                readers.setdefault(v.base, set()).add(i)
    return 0.02 if any(len(r) > 2 for r in readers.values()) else 1e-9


def shared_objective(problem):
    """The shared ILP's price of a choice: its nodes' and edges' costs (what ``chunk_cost``
    prices per micro-batch count; the constant of ops no node holds left out)."""
    def objective(choice):
        return (sum(problem.node_costs[v][j] for v, j in enumerate(choice))
                + sum(mat[choice[u]][choice[v]] for u, v, mat in problem.edges))
    return objective


def walks(start, problem, objective, rng, count: int, share: int) -> list[tuple[int, ...]]:
    """``start`` and ``count`` random walks from it, each redrawing 1 / ``share`` of the nodes'
    choices among those that can run (an in-place op resharded, a tied weight laid out two
    ways: ``INFEASIBLE_S``)."""
    choices = [tuple(start)]
    for _ in range(count):
        choice = list(start)
        for v in rng.sample(range(len(choice)), k=max(1, len(choice) // share)):
            was, choice[v] = choice[v], rng.randrange(len(problem.node_costs[v]))
            if objective(choice) >= INFEASIBLE_S:
                choice[v] = was
        choices.append(tuple(choice))
    return choices


MOE_MODELS = ["titan-moe-tiny"] + (["hf-mixtral-tiny"] if has_transformers() else [])


@pytest.mark.parametrize("seed", range(4))
def test_the_ilp_prices_the_expert_exchanges_as_the_estimate(seed):
    """Expert parallelism over tp (ep 2 of dp 4, tp 2): the ILP's objective adds each
    dispatch's and combine's all-to-all at the tp-local size its strategies give the rows, and
    the busiest rank's extra work under a capacity factor, as ``estimate`` does. Where a choice
    breaks an MoE block's region (rows split over tp between its grouped products), the
    estimate pays an exchange the ILP does not see, so the ILP's price is then a lower bound."""
    from autoplan.planner.axis_costs import expert_exchanges
    from autoplan.sharding.expert_regions import expert_regions
    from autoplan.sharding.sharding import replicated
    rng = random.Random(seed)
    name = MOE_MODELS[seed % len(MOE_MODELS)]
    ex = build_example(name, device="meta", batch_size=2)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset(rng.choice(PRESETS), nodes=1)
    load = rng.choice([1.0, 1.5])
    config = ParallelConfig(dp=4, tp=2, ep=2, micro_batch_size=rng.choice([1, 2]),
                            precision="fp32", recompute="none")
    m = rng.choice([1, 4])
    compute = compute_model(g, cluster.device, config.precision, None)
    group = config.ep_group()
    experts = expert_exchanges(
        g, lambda nbytes: cluster.collective_time_s("all_to_all", nbytes, group),
        cluster.collective_time_s("all_gather", 8.0 * 4 * 2, group), load)
    ctx = config_context(g, cluster, config, m, compute, experts=experts)
    red = reduce_graph(ctx)
    problem = red.problem

    objective = shared_objective(problem)
    widest = expert_regions(g, replicated(g))
    choices = walks(solve(problem, time_limit_s=30).choice, problem, objective, rng, 10, 3)
    exact = 0
    for choice in choices:
        sh = sharding_from_choice(g, 2, red, choice)
        ci = CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                        cluster=cluster, config=config, expert_load=load)
        (chunk,) = chunks_for(ci)
        c = chunk_cost(ci, chunk, config.recompute)
        assert c.ep_fwd_s > 0
        priced = m * (c.fwd_s + c.bwd_s + c.tp_fwd_s + c.tp_bwd_s + c.ep_fwd_s
                      + c.ep_bwd_s) + c.tp_step_s
        regions = expert_regions(g, sh)
        if regions.members == widest.members:
            exact += 1
            assert objective(choice) == pytest.approx(priced, rel=1e-9), (name, choice)
        else:
            assert objective(choice) <= priced * (1 + 1e-9), (name, choice)
    assert exact >= 1


def _dp_case(seed: int):
    """A random model, one or two nodes, tp, ZeRO stage, recompute policy, micro-batches and
    offload: the configuration whose own ILP (``dp_problem``) is built."""
    from dataclasses import replace as _replace
    rng, name, g, _, config, m = _case(seed)
    nodes = rng.choice([1, 2])
    preset = rng.choice(PRESETS + ["local"])      # local: CPU ranks on gloo
    cluster = (Cluster.local(8 * nodes) if preset == "local"
               else Cluster.preset(preset, nodes=nodes))
    config = _replace(config, dp=8 * nodes // config.tp, zero_stage=seed % 4,
                      recompute=("none", "selective", "full")[seed % 3],
                      offload_optimizer=rng.random() < 0.2)
    return rng, name, g, cluster, config, m


@pytest.mark.parametrize("seed", range(12))
def test_with_its_dp_terms_the_ilp_objective_is_the_estimated_step_time(seed):
    """For one configuration (pp 1), the ILP with data parallelism's terms (gradient sync and
    ZeRO's gathers hidden behind the compute the choice makes, the optimizer, host traffic;
    under ZeRO-3 each weight sharded or kept whole) prices any choice at the estimate's step
    time of the plan it makes. Within 0.1 % (the issue asks 2 %): exact but for ZeRO-1's
    first gathered share, a ratio of the weights a rank holds linearized at the reference, and
    T5's thrice-read embedding (``_tolerance``). Its memory for a choice is the estimate's
    model state and activations (under full recomputation: the layers' inputs, as their
    producers' choices leave them)."""
    from dataclasses import replace as _replace

    from autoplan import estimate
    from autoplan.cost.memory import model_state_bytes
    from autoplan.planner.dp_problem import (DpPricing, keeps_weights_whole, whole_patterns,
                                             with_dp_terms)
    rng, name, g, cluster, config, m = _dp_case(seed)
    compute = compute_model(g, cluster.device, config.precision, None)
    gbs = config.dp * config.micro_batch_size * m

    def state(dp, zero):
        return model_state_bytes(1.0, dp=dp, zero_stage=zero, precision=config.precision,
                                 optimizer=config.optimizer,
                                 offload_optimizer=config.offload_optimizer,
                                 mixed_precision=config.mixed_precision).total_bytes
    ctx = config_context(g, cluster, config, m, compute,
                         state_bytes_per_param=state(config.shard_degree, config.zero_stage),
                         step_shard=config.shard_degree if config.zero_stage >= 2 else 1)
    red = reduce_graph(ctx)
    reference = solve(red.problem, time_limit_s=30).choice
    pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=compute,
                        interference=ctx.interference)
    dp = with_dp_terms(red, g, pricing, reference=reference,
                       whole_extra_bytes=state(1, 0) - ctx.state_bytes_per_param)
    problem = dp.problem
    assert problem.overlaps or config.offload_optimizer is False
    whole_offered = any(w for opts in dp.options for _, w in opts)
    assert whole_offered == keeps_weights_whole(config)
    choices = walks(dp.lift(reference), problem, problem.objective, rng, 10, 2)
    choices.insert(1, solve(problem, time_limit_s=30).choice)
    mixed = 0
    for choice in choices:
        sh = sharding_from_choice(g, config.tp, red, dp.strategies(choice))
        whole = whole_patterns(g, red, dp.whole_nodes(choice))
        mixed += bool(whole) and len(dp.whole_nodes(choice)) < len(
            [opts for opts in dp.options if len(opts) > 1 and any(w for _, w in opts)])
        est = estimate(g, cluster, config=_replace(config, dp_whole=whole),
                       global_batch_size=gbs, profile=None, sharding=sh)
        assert problem.objective(choice) == pytest.approx(
            est.step_time_s, rel=max(_tolerance(g), 1e-3)), (name, config.short(), choice)
        if _tolerance(g) < 0.01:
            # (T5's embedding, read by three nodes, is held once per reader where they lay it
            # out differently: its memory is the estimate's only where they agree)
            mem = est.stages[0].memory
            assert problem.memory(choice) == pytest.approx(
                mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
                + mem.activations_bytes, rel=1e-6), (name, choice)
    if whole_offered:
        assert mixed            # some weights whole, others sharded


# (llama-tiny and gpt-tiny with 4 layers, for two chunks per rank; gpt-tiny and nanoGPT tie
# their LM head to the embedding, on the other end of the pipeline)
PIPE_CASES = [("llama-tiny", "1f1b", 1), ("llama-tiny", "zero_bubble", 1),
              ("llama-tiny", "interleaved_1f1b", 2), ("llama-tiny", "zbv", 2),
              ("gpt-tiny", "dualpipev", 2), ("gpt-tiny", "1f1b", 1),
              ("nanogpt-tiny", "zero_bubble", 1), ("torch-encoder-tiny", "1f1b", 1)] + (
    [("hf-llama-gqa-tiny", "1f1b", 1), ("hf-gpt2-lm-tiny", "zero_bubble", 1)]
    if has_transformers() else [])


def _pipe_case(seed: int, compiled: bool = False):
    """A pipelined configuration (pp 2, its stage split and per-stage policies fixed) of a
    random small model, and the cost context of each recompute policy at its mesh;
    ``compiled``: its program compiled (element-wise chains priced fused)."""
    from autoplan.estimate.layout import chunks_for, with_layout
    rng = random.Random(1000 + seed)
    name, schedule, v = PIPE_CASES[seed % len(PIPE_CASES)]
    try:
        ex = build_example(name, device="meta", batch_size=1, num_layers=4)
    except (TypeError, ValueError):      # (a config without that field: its own depth)
        ex = build_example(name, device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.preset(rng.choice(PRESETS), nodes=1)
    m = rng.choice([4, 8])
    config = ParallelConfig(pp=2, dp=2, tp=2, micro_batch_size=rng.choice([1, 2]),
                            precision=rng.choice(["bf16", "fp32"]),
                            zero_stage=rng.choice([0, 1]), schedule=schedule,
                            virtual_stages=v, recompute="none", compiled=compiled)
    compute = compute_model(g, cluster.device, config.precision, None,
                            config.mixed_precision, compiled)

    def context_for(policy):
        return config_context(g, cluster, config, m, compute, recompute=policy)
    red = reduce_graph(context_for("none"))
    reference = solve(red.problem, time_limit_s=30).choice
    sh = sharding_from_choice(g, config.tp, red, reference)
    ci = CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                    cluster=cluster, config=config)
    counts = tuple(len(c.layers) for c in chunks_for(ci))
    policies = tuple(rng.choice(["none", "selective", "full"]) for _ in range(config.pp))
    config = with_layout(config, counts, policies)
    return rng, name, g, cluster, config, m, compute, context_for, reference


def _pipeline_part(est) -> float:
    """What a step's pipeline takes: its compute, sends and bubble (every term of the estimate
    but the data-parallel ones, the optimizer and the framework's overhead)."""
    t = est.time
    return est.step_time_s - (t.comm_exposed_s.get("dp_grad_sync", 0.0)
                              + t.comm_exposed_s.get("zero_param_gather", 0.0)
                              + t.comm_exposed_s.get("offload", 0.0)
                              + t.optimizer_s + t.overhead_s)


@pytest.mark.parametrize("seed,compiled", [(k, False) for k in range(len(PIPE_CASES))]
                         + [(0, True), (1, True)])
def test_a_pipelined_configs_ilp_objective_is_its_estimated_step_time(seed, compiled):
    """For one pipelined configuration (its stage split and each stage's recompute policy
    fixed), the ILP of ``pipe_problem`` prices any choice at the estimate of the plan it makes,
    the schedule simulated: built at a choice, its pipeline (the critical path's forwards,
    backwards and sends) is the simulated schedule's to 1e-6 and its dp terms the closed
    form's; the whole within 0.5 % of the estimate (which simulates the dp collectives too;
    the estimate's closed form, one micro-batch through every other rank, was up to 8.7 %
    off it here).
    Built at the reference (the shared ILP's answer), equal to the one built at the choice
    (within 0.1 %: the dp terms linearized there, as ``dp_problem``'s) for every choice that
    keeps the reference's critical path and dp rank, and some choices do; priced no higher
    than the estimate at every other choice (the longest of the reference's paths is a chain
    there too) but under zero bubble, whose weight gradients go where they fit. The ILP's
    optimum is no worse than any choice tried. Every schedule the search offers, each stage
    with its own recompute policy. Compiled (llama-tiny): its first layer's input comes from
    outside the fused chains, so the first layer costs more than the others, on the rank that
    runs it."""
    from autoplan import estimate
    from autoplan.estimate.layout import chunks_for
    from autoplan.planner.dp_problem import DpPricing
    from autoplan.planner.pipe_problem import build
    rng, name, g, cluster, config, m, compute, context_for, reference = _pipe_case(seed,
                                                                                   compiled)
    sh = sharding_from_choice(g, config.tp, reduce_graph(context_for("none")), reference)
    chunks = chunks_for(CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                                   cluster=cluster, config=config))
    interference = overlap_interference(cluster)
    pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=compute,
                        interference=interference)
    pipe = build(g, pricing, chunks=chunks, context_for=context_for, reference=reference)
    problem = pipe.problem
    best = solve(problem, time_limit_s=30).choice
    choices = [best] + walks(reference, problem, problem.objective, rng, 10, 3)
    gbs = config.dp * config.micro_batch_size * m
    priced = 0
    for choice in choices:
        assert problem.objective(best) <= problem.objective(choice) + 1e-9
        at = build(g, pricing, chunks=chunks, context_for=context_for, reference=choice,
                   made=pipe.terms)
        kw = dict(config=config, global_batch_size=gbs, profile=None,
                  sharding=sharding_from_choice(g, config.tp, pipe.red, choice))
        simulated = estimate(g, cluster, **kw)
        closed = estimate(g, cluster, simulate_pipeline=False, **kw)
        exact = closed.step_time_s - _pipeline_part(closed) + _pipeline_part(simulated)
        assert at.problem.objective(choice) == pytest.approx(exact, rel=1e-6), (
            name, config.short(), choice)
        # (within 0.11 % on these cases; the issue asks 2 %)
        assert at.problem.objective(choice) == pytest.approx(simulated.step_time_s,
                                                             rel=5e-3), (name, choice)
        if (at.path, at.worst) == (pipe.path, pipe.worst):
            priced += 1      # (the dp terms linearized at the reference: within 0.1 %)
            assert problem.objective(choice) == pytest.approx(exact, rel=1e-3), (
                name, config.short(), choice)
        elif config.schedule != "zero_bubble" and at.worst == pipe.worst:
            assert problem.objective(choice) <= exact * (1 + 1e-3), (name, choice)
    assert priced >= 2, (name, config.short())


@pytest.mark.parametrize("seed", range(len(PIPE_CASES)))
def test_a_pipelined_configs_memory_rows_are_its_estimated_stage_memory(seed):
    """Each rank's memory row (``pipe_problem.rank_memory``: the state of the parameters it
    holds, the activations of the micro-batches it keeps in flight, its layers' inputs alone
    where it recomputes in full) is the estimate's memory of that stage less its transient
    buffers and margin, for random choices: with the closed form's micro-batches in flight,
    the closed-form estimate's; with the simulated estimate's at the reference (the search's
    rows), the simulated estimate's there, and within 1 % of it wherever the schedule keeps
    the same micro-batches in flight."""
    from autoplan import estimate
    from autoplan.planner import pipe_problem
    rng, name, g, cluster, config, m, compute, context_for, reference = _pipe_case(seed)
    red = reduce_graph(context_for("none"))
    sh = sharding_from_choice(g, config.tp, red, reference)
    chunks = chunks_for(CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                                   cluster=cluster, config=config))
    made = pipe_problem.terms(g, cluster, config, chunks, context_for)
    rows = pipe_problem.rank_memory(made, config, m)
    gbs = config.dp * config.micro_batch_size * m
    at_reference = estimate(g, cluster, config=config, global_batch_size=gbs, profile=None,
                            sharding=sh)
    flights = [st.microbatches_in_flight for st in at_reference.stages]
    simulated_rows = pipe_problem.rank_memory(made, config, m, flights)
    checked = 0
    for k in range(6):
        choice = (tuple(reference) if k == 0 else
                  tuple(rng.randrange(len(node.choices)) for node in made.red.nodes))
        kw = dict(config=config, global_batch_size=gbs, profile=None,
                  sharding=sharding_from_choice(g, config.tp, made.red, choice))
        est = estimate(g, cluster, simulate_pipeline=False, **kw)
        sim = estimate(g, cluster, **kw)
        for r, (stage, simulated) in enumerate(zip(est.stages, sim.stages)):
            held = lambda mem: (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes  # noqa
                                + mem.activations_bytes)
            mine = simulated_rows[r].value(made.red.problem, choice)
            if k == 0:
                assert mine == pytest.approx(held(simulated.memory), rel=3e-3), (name, r)
            elif simulated.microbatches_in_flight == pytest.approx(flights[r], rel=1e-9):
                assert mine == pytest.approx(held(simulated.memory), rel=1e-2), (name, r)
            mem = stage.memory
            want = held(mem)
            # within 0.3 %: HF Llama GQA's first rank is short of the estimate by its rotary
            # cos and sin tables (made before the layers, kept by every layer: the estimate
            # holds them per micro-batch in flight, the row leaves them out), 0.05 % in bf16,
            # 0.21 % (2 KiB of 1 MiB) in the fp32 autocast keeps them in
            assert rows[r].value(made.red.problem, choice) == pytest.approx(want, rel=3e-3), (
                name, r, config.stage_policy(r), choice)
            checked += 1
    assert checked >= 6 * config.pp
