"""The planner: ILP optimality against brute force, baselines, regimes, plan files, CLI."""

import json
import itertools
import random
from dataclasses import replace

import pytest
import torch

import autoplan
from autoplan import Cluster, NoFeasiblePlanError, ParallelConfig, PlanError, estimate
from autoplan.cost.compute import ComputeModel
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.ilp import ILPProblem, brute_force, solve
from autoplan.planner.cost_context import CostContext
from autoplan.planner.problem import reduce_graph, sharding_from_choice
from autoplan.planner.search import plan
from autoplan.sharding.sharding import megatron_sharding, replicated


def _graph(name, **kw):
    batch = kw.pop("batch_size", 1)
    ex = build_example(name, device="meta", batch_size=batch, **kw)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)


@pytest.fixture(scope="module")
def gpt3_175b():
    return _graph("gpt3-175b")


# ---- the ILP is exact ---------------------------------------------------------------------

def _random_problem(seed: int, budget: bool) -> ILPProblem:
    rng = random.Random(seed)
    n = 7
    k = [rng.randint(1, 4) for _ in range(n)]
    costs = tuple(tuple(rng.uniform(0, 10) for _ in range(k[v])) for v in range(n))
    mems = tuple(tuple(rng.uniform(0, 5) for _ in range(k[v])) for v in range(n))
    edges = []
    for v in range(1, n):
        for u in rng.sample(range(v), min(v, 2)):
            edges.append((u, v, tuple(tuple(rng.uniform(0, 4) for _ in range(k[v]))
                                      for _ in range(k[u]))))
    cap = sum(min(m) for m in mems) + 3.0 if budget else None
    return ILPProblem(node_costs=costs, node_memory=mems, edges=tuple(edges), memory_budget=cap)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [False, True])
def test_ilp_equals_brute_force_on_random_problems(seed, budget):
    p = _random_problem(seed, budget)
    sol = solve(p, time_limit_s=20)
    best = brute_force(p)
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.objective == pytest.approx(best[1], rel=1e-6)
    if budget:
        assert p.memory(sol.choice) <= p.memory_budget + 1e-6


@pytest.mark.parametrize("seed", range(8))
def test_ilp_with_memory_rows_equals_brute_force(seed):
    """Per-device memory rows (a pipelined configuration's ranks, ``pipe_problem``): the
    optimum among the choices within every row."""
    from dataclasses import replace as with_
    from autoplan.planner.ilp import Linear
    rng = random.Random(100 + seed)
    p = _random_problem(seed, budget=False)
    rows = []
    inside = tuple(rng.randrange(len(cs)) for cs in p.node_costs)    # within every row
    for _ in range(3):
        nodes = tuple(tuple(rng.uniform(0, 5) if rng.random() < 0.7 else 0.0 for _ in cs)
                      for cs in p.node_costs)
        lin = Linear(rng.uniform(0, 1), nodes)
        rows.append((lin, lin.value(p, inside) + rng.uniform(0.0, 1.0)))
    p = with_(p, memory_rows=tuple(rows))
    sol = solve(p, time_limit_s=20)
    best = brute_force(p)
    assert best is not None and sol.status == "optimal"
    assert sol.objective == pytest.approx(best[1], rel=1e-6)
    assert p.fits(sol.choice)
    unconstrained = brute_force(with_(p, memory_rows=()))
    assert unconstrained[1] <= best[1] + 1e-12


def _with_overlaps(p: ILPProblem, seed: int) -> ILPProblem:
    """``p`` with two overlap terms (communication behind a compute window), windows and
    communication both depending on the choice, one of them on the edges too."""
    from autoplan.planner.ilp import Linear, Overlap
    rng = random.Random(seed)

    def lin(scale: float, edges: bool) -> Linear:
        nodes = tuple(tuple(rng.uniform(0, scale) for _ in cs) for cs in p.node_costs)
        mats = (tuple(tuple(tuple(rng.uniform(0, scale / 2) for _ in row) for row in r)
                      for _, _, r in p.edges) if edges else ())
        return Linear(rng.uniform(0, scale), nodes, mats)
    overlaps = (Overlap(lin(3.0, False), lin(3.0, True), lin(0.5, False), 0.15, 2.0),
                Overlap(lin(4.0, True), lin(2.0, False), lin(1.0, False), 0.3, 1.0))
    return replace(p, overlaps=overlaps, constant_s=1.5)


@pytest.mark.parametrize("seed", range(8))
def test_ilp_with_overlap_terms_equals_brute_force(seed):
    """Communication hidden behind compute as far as it lasts (max(C - W, F) + phi min(C, W),
    the estimate's overlap rule) is exact in the ILP, whichever of C and W is longer."""
    p = _with_overlaps(_random_problem(seed, seed % 2 == 1), seed)
    sol = solve(p, time_limit_s=20)
    best = brute_force(p)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best[1], rel=1e-6)
    longer = {o.comm.value(p, c) > o.window.value(p, c)
              for o in p.overlaps for c in itertools.product(*[range(len(cs))
                                                               for cs in p.node_costs])}
    assert longer == {True, False}       # both sides of the min occur among the choices


@pytest.mark.parametrize("seed", range(8))
def test_ilp_with_maxima_equals_brute_force(seed):
    """The longest of several affine functions of the choice (a pipelined step: the longest of
    its critical paths, ``pipe_problem``), one group on nodes and edges and one with a
    switched amount, is exact in the ILP."""
    from autoplan.planner.ilp import Linear
    rng = random.Random(200 + seed)
    p = _random_problem(seed, seed % 2 == 1)

    def lin(scale: float, edges: bool, switched: bool = False) -> Linear:
        nodes = tuple(tuple(rng.uniform(0, scale) for _ in cs) for cs in p.node_costs)
        mats = (tuple(tuple(tuple(rng.uniform(0, scale / 2) for _ in row) for row in r)
                      for _, _, r in p.edges) if edges else ())
        when = (((0, 0), (3, len(p.node_costs[3]) - 1)),)
        return Linear(rng.uniform(0, scale), nodes, mats,
                      tuple((rng.uniform(0, scale), w) for w in when) if switched else ())
    a = lin(20.0, False)
    against = Linear(0.0, tuple(tuple(20.0 - c for c in cs) for cs in a.nodes))   # a's mirror
    p = replace(p, maxima=((a, against, lin(10.0, True)),
                           (lin(5.0, False, switched=True), lin(5.0, False))))
    sol = solve(p, time_limit_s=20)
    best = brute_force(p)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best[1], rel=1e-6)
    alone = [brute_force(replace(p, maxima=((f,), p.maxima[1])))[1] for f in p.maxima[0]]
    assert all(a <= best[1] + 1e-9 for a in alone)     # each form alone: no longer


def test_ilp_reports_infeasible_memory():
    p = _random_problem(0, False)
    tight = ILPProblem(node_costs=p.node_costs, node_memory=p.node_memory, edges=p.edges,
                       memory_budget=0.01)
    assert solve(tight, time_limit_s=10).status == "infeasible"


class _FFNBlock(torch.nn.Module):
    """A pre-norm transformer MLP block with an LM-style loss: norms, column/row linears."""

    def __init__(self, h=64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)
        self.fc = torch.nn.Linear(h, 4 * h)
        self.proj = torch.nn.Linear(4 * h, h)
        self.head = torch.nn.Linear(h, 128)

    def forward(self, x):
        x = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))
        return self.head(x)


def _ffn_graph():
    x = torch.empty(4, 16, 64, device="meta")
    y = torch.empty(4, 16, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = _FFNBlock()
    return trace(model, (x,), loss_fn=lambda out, t: torch.nn.functional.cross_entropy(
        out.reshape(-1, 128), t.reshape(-1)), targets=y)


@pytest.mark.parametrize("which,t", [("mlp-tiny", 2), ("ffn-block", 2), ("ffn-block", 4)])
def test_ilp_equals_brute_force_on_model_graphs(which, t):
    """Reduced sharding problems of real traced graphs, small enough to enumerate."""
    g = _ffn_graph() if which == "ffn-block" else _graph(which, batch_size=8)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    group = tuple(range(t))
    ctx = CostContext(graph=g, t=t, compute=ComputeModel(g, cluster.device, "bf16", None),
                      collective_s=lambda kind, b: cluster.collective_time_s(kind, b, group),
                      batch_scale=1.0, microbatches=4, precision="bf16", recompute="none",
                      state_bytes_per_param=16.0, activation_multiplier=1.0)
    red = reduce_graph(ctx)
    sizes = [len(c) for c in red.problem.node_costs]
    combos = 1
    for s in sizes:
        combos *= s
    assert 1 < combos <= 2_000_000
    sol = solve(red.problem, time_limit_s=20)
    best = brute_force(red.problem)
    assert sol.objective == pytest.approx(best[1], rel=1e-9)
    sharding = sharding_from_choice(g, t, red, sol.choice)
    assert len(sharding.op_strategy) == len(g.ops)


def test_graph_reduction_folds_layers(gpt3_175b):
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    ctx = CostContext(graph=gpt3_175b, t=8,
                      compute=ComputeModel(gpt3_175b, cluster.device, "bf16", None),
                      collective_s=lambda kind, b: cluster.collective_time_s(kind, b, range(8)),
                      batch_scale=1.0, microbatches=4, precision="bf16", recompute="none",
                      state_bytes_per_param=16.0, activation_multiplier=1.0)
    red = reduce_graph(ctx)
    # 2,698 ops and 96 layers become one layer's problem
    assert red.problem.num_nodes < 30
    assert max(n.mult for n in red.nodes) == 96


# ---- the search ---------------------------------------------------------------------------

def _best_baselines(graph, cluster, gbs):
    """Pure DP, FSDP only, Megatron (TP in node + DP across), each at its best fitting mbs."""
    world = cluster.world_size
    out = {}
    specs = {"dp": (dict(dp=world, tp=1, zero_stage=0), replicated(graph)),
             "fsdp": (dict(dp=world, tp=1, zero_stage=3), replicated(graph))}
    tp = cluster.devices_per_node
    specs["megatron"] = (dict(dp=world // tp, tp=tp, zero_stage=0, sequence_parallel=True),
                         megatron_sharding(graph, tp, True))
    for label, (fields, sh) in specs.items():
        best = None
        per_replica = gbs // fields["dp"]
        for mbs in (1, 2, 4, 8):
            if per_replica % mbs:
                continue
            for r in ("none", "selective", "full"):
                e = estimate(graph, cluster, config=ParallelConfig(**fields, micro_batch_size=mbs,
                                                                   recompute=r),
                             global_batch_size=gbs, profile=None, sharding=sh)
                if e.fits and (best is None or e.step_time_s < best):
                    best = e.step_time_s
        out[label] = best
    return out


def test_plan_is_never_slower_than_the_baselines(gpt3_175b):
    cluster = Cluster.preset("dgx-a100-80gb", nodes=16)
    p = plan(gpt3_175b, cluster, global_batch_size=256, profile=None)
    for label, t in _best_baselines(gpt3_175b, cluster, 256).items():
        if t is not None:
            assert p.predicted["step_time_s"] <= t * (1 + 1e-6), label
    # multi-node: tensor parallelism stays inside a node, on NVSwitch
    assert p.config.tp <= cluster.devices_per_node
    if p.config.tp > 1:
        assert p.mesh.tp_domain == "nvswitch"
    assert p.solver.status in ("optimal", "feasible") and p.solver.ilps_solved > 0


def test_small_model_gets_data_parallelism():
    g = _graph("gpt2-small")
    p = plan(g, Cluster.preset("dgx-a100-80gb", nodes=1), global_batch_size=64, profile=None)
    assert p.config.tp == 1 and p.config.dp == 8


def test_memory_bound_model_gets_sharded():
    g = _graph("gpt3-13b")          # 13B x 16 bytes of model state: no single A100 holds it
    p = plan(g, Cluster.preset("dgx-a100-80gb", nodes=1), global_batch_size=16, profile=None)
    assert p.config.zero_stage >= 1 or p.config.tp > 1
    assert p.predicted["fits"]


def test_tight_memory_chooses_recompute_or_offload():
    g = _graph("gpt3-6.7b")
    cluster = Cluster.preset("dgx-a100-40gb", nodes=1)
    p = plan(g, cluster, global_batch_size=64, profile=None, force={"tp": 1})
    assert p.predicted["fits"]
    assert (p.config.recompute != "none" or p.config.offload_optimizer
            or p.config.offloads_activations)
    # the same plan without any of them would not fit
    plain = ParallelConfig(**{**p.config.to_dict(), "recompute": "none",
                              "layer_recompute": None, "offload_optimizer": False,
                              "layer_offload": None, "offload_activations": 0})
    assert not estimate(g, cluster, config=plain, global_batch_size=64, profile=None).fits


def test_one_gpu_offloads_the_weights_where_they_do_not_fit():
    """GPT-3 6.7B on one A100 40 GB: fp32 weights and gradients alone (54 GB) overflow it, so
    only FSDP2's parameter offload at dp 1 (ZeRO-3 over one rank, weights and gradients in
    host memory) fits; the default search offers it."""
    g = _graph("gpt3-6.7b")
    cluster = Cluster.from_spec("dgx-a100-40gb/1")
    p = plan(g, cluster, global_batch_size=8, profile=None, top_k=3)
    assert p.predicted["fits"] and p.config.dp == 1
    assert p.config.zero_stage == 3 and p.config.offload_params and p.config.offload_optimizer
    kept = ParallelConfig(**{**p.config.to_dict(), "zero_stage": 0, "offload_params": False})
    assert not estimate(g, cluster, config=kept, global_batch_size=8, profile=None).fits


def test_nothing_fits_says_what_would(gpt3_175b):
    # a node without NVMe (on a DGX A100's drives ZeRO-Infinity fits it: tests/test_nvme_offload)
    with pytest.raises(NoFeasiblePlanError) as info:
        plan(gpt3_175b, Cluster.preset("dgx-h100", nodes=1), global_batch_size=8,
             profile=None)
    err = info.value
    assert (err.min_memory_bytes > err.device_memory_bytes
            or err.min_host_memory_bytes > err.host_memory_bytes)
    msg = str(err)
    assert "least memory any plan needs" in msg and "more devices" in msg
    assert any("memory" in s for s in err.suggestions)


# ---- plan files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_plan():
    g = _graph("gpt-tiny", batch_size=1)
    return g, plan(g, Cluster.local(4), global_batch_size=16, profile=None)


def test_same_inputs_give_byte_identical_plans(tiny_plan, tmp_path):
    g, p = tiny_plan
    again = plan(g, Cluster.local(4), global_batch_size=16, profile=None)
    assert again.to_json() == p.to_json()
    path = tmp_path / "p.json"
    p.save(path)
    assert path.read_text() == p.to_json()
    loaded = autoplan.load_plan(path, graph=g, cluster=Cluster.local(4))
    assert loaded == p
    json.loads(path.read_text())["config"]   # plain JSON


def test_load_plan_refuses_other_model_or_cluster(tiny_plan, tmp_path):
    g, p = tiny_plan
    path = tmp_path / "p.json"
    p.save(path)
    with pytest.raises(PlanError, match="model"):
        autoplan.load_plan(path, graph=_graph("llama-tiny"))
    with pytest.raises(PlanError, match="cluster"):
        autoplan.load_plan(path, cluster=Cluster.local(2))
    replanned = autoplan.load_plan(path, graph=g, cluster=Cluster.local(2), replan=True,
                                   profile=None)
    assert replanned.cluster.world_size == 2


def test_plan_records_what_the_runtime_needs(tiny_plan):
    g, p = tiny_plan
    assert set(p.op_strategies) == {op.name for op in g.ops}
    assert {pp for pp in p.param_placements} == {v.fqn for v in g.param_values}
    assert len(p.mesh.rank_to_device) == 4
    assert set(p.recompute) == {i.path for b in g.blocks for i in b.instances}
    assert p.alternatives and all(a.why_lost for a in p.alternatives)


def test_cli_plan_inspect_diff(tmp_path, capsys):
    from autoplan.cli.main import main
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", "mlp-tiny", "--cluster", "local:2", "--global-batch", "8", "-o", str(a),
                 "-q", "--no-profile"]) == 0
    assert main(["plan", "mlp-tiny", "--cluster", "local:2", "--global-batch", "8", "-o", str(b),
                 "-q", "--no-profile", "--force", "tp=2"]) == 0
    assert main(["inspect", str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "solver" in out and "step time" in out


def test_a_weight_read_by_two_ops_gets_one_placement():
    """GPT's LM head is tied to the token embedding: one tensor, so the ILP may not lay it out
    two ways (the runtime could not run that)."""
    from autoplan.planner.search_costing import SearchContext, Stats, ilp_sharding
    from autoplan.planner.search import SearchOptions
    g = _graph("gpt-tiny", batch_size=4)
    tied = [n for n, v in ((n, g.value(n)) for op in g.ops for n in op.inputs)
            if v.kind == "param" and sum(n in op.inputs for op in g.ops) > 1]
    assert tied, "gpt-tiny ties lm_head to tok_embeddings"
    for mbs in (1, 4):
        cfg = ParallelConfig(dp=1, tp=2, micro_batch_size=mbs, precision="fp32")
        sc = SearchContext(graph=g, cluster=Cluster.local(2), global_batch_size=mbs,
                           profile=None, opts=SearchOptions(), stats=Stats())
        sh, _ = ilp_sharding(sc, cfg, 1)
        seen = {str(s.inputs[k]) for op, s in zip(g.ops, sh.op_strategy)
                for k, n in enumerate(op.inputs) if n == tied[0] and k < len(s.inputs)}
        assert len(seen) == 1, (mbs, seen)


def test_dgx_a100_gets_tensor_parallel_in_node_and_pipeline_across_nodes(gpt3_175b):
    """GPT-3 175B on 1,024 A100 (128 DGX nodes, HDR InfiniBand), global batch 1,536: Megatron's
    regime. ZeRO-3 over 512 ranks would regather 175 GB of weights for every micro-batch."""
    p = plan(gpt3_175b, Cluster.preset("dgx-a100-80gb", nodes=128), global_batch_size=1536,
             profile=None, name="gpt3-175b")
    assert p.model.name == "gpt3-175b"
    assert 1 < p.config.tp <= 8 and p.mesh.tp_domain == "nvswitch"
    assert p.config.pp > 1 and len(p.stages) == p.config.pp
    node = {r: r // 8 for r in range(1024)}
    first, second = p.stages[0]["ranks"], p.stages[1]["ranks"]
    assert not {node[r] for r in first} & {node[r] for r in second}   # stages on other nodes
    assert p.predicted["fits"]
    # forcing the plan's own degrees and schedule finds it again: the tp-axis ILP is priced at
    # one micro-batch count per (tp, micro-batch), whichever mesh asks first (it once took the
    # first mesh's, so a forced pp=16 got a memory-hungrier sharding and a plan 30 % slower)
    c = p.config
    again = plan(gpt3_175b, Cluster.preset("dgx-a100-80gb", nodes=128), global_batch_size=1536,
                 profile=None, name="gpt3-175b",
                 force=dict(tp=c.tp, pp=c.pp, schedule=c.schedule))
    # (forcing the mesh, the compiled twin's DualPipeV gets the finalists' re-solved pipelined
    # sharding the free search spends on other meshes: 23.954 s against the free search's
    # eager 23.975 s; the free search is within 0.5 % of what forcing its mesh finds)
    assert again.config.tp == c.tp and again.config.pp == c.pp
    assert p.predicted["step_time_s"] == pytest.approx(again.predicted["step_time_s"], rel=5e-3)
    assert p.predicted["step_time_s"] >= again.predicted["step_time_s"]



def test_a_force_that_cannot_fit_says_so_and_what_fits_without_it(gpt3_24_layers):
    """The message is about the forced configurations (not one the force excluded), and names
    the fastest configuration that fits without the force."""
    with pytest.raises(NoFeasiblePlanError) as info:
        plan(gpt3_24_layers, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=64,
             profile=None, force={"dp": 16, "zero_stage": 0})
    err = info.value
    msg = str(err)
    assert "no configuration with force=" in msg and "dropping force dp=16, zero_stage=0" in msg
    assert err.min_memory_bytes > err.device_memory_bytes     # the forced plans' own need

@pytest.fixture(scope="module")
def gpt3_24_layers():
    return _graph("gpt3-175b", num_layers=24)      # ~45B parameters: more than a node holds


def test_slow_ethernet_gets_a_pipeline_heavy_plan(gpt3_24_layers):
    """Nodes joined by 25 Gb/s Ethernet: stages across nodes (point-to-point sends) beat
    data-parallel gradient and ZeRO traffic over the slow links."""
    eth = plan(gpt3_24_layers, Cluster.preset("eth-a100-80gb", nodes=8), global_batch_size=256,
               profile=None, max_pp=8)
    assert eth.config.pp >= 4 and eth.config.tp <= 8
    assert eth.mesh.axes == ("pp", "dp", "tp") and len(eth.stages) == eth.config.pp
    assert sorted(r for s in eth.stages for r in s["ranks"]) == list(range(64))
    assert sum(len(s["layers"]) for s in eth.stages) == 24
    # on InfiniBand the same model needs no pipeline
    ib = plan(gpt3_24_layers, Cluster.preset("dgx-a100-80gb", nodes=8), global_batch_size=256,
              profile=None, max_pp=8)
    assert ib.config.pp < eth.config.pp


def test_a_forced_pipeline_deeper_than_the_layers_says_why():
    """An ALBERT-style model (one block called three times) has one layer to cut: forcing pp=2
    is refused with the reason, not only 'no mesh matches'."""
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())

        def forward(self, x):
            for _ in range(3):
                x = self.block(x)
            return x
    g = trace(Shared(), (torch.randn(4, 8),))
    with pytest.raises(autoplan.ConfigError, match="pp=2 needs at least 2 layers.*no repeated"):
        plan(g, Cluster.local(2), global_batch_size=4, profile=None, force={"pp": 2})
    ex = build_example("gpt-tiny", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    with pytest.raises(autoplan.ConfigError, match=r"pp=4 needs at least 4 layers.*has 2 \(layers.0"):
        plan(g, Cluster.local(4), global_batch_size=4, profile=None, force={"pp": 4}, max_pp=4)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_ilp_with_dp_terms_equals_brute_force_on_a_model_graph(zero):
    """One configuration's own ILP (``dp_problem``: gradient sync and ZeRO gathers behind the
    compute the choice makes) on a real traced graph: the ILP's optimum is brute force's, and
    it prices that choice at ``estimate``'s step time."""
    from autoplan.cost.compute import compute_model
    from autoplan.cost.dtypes import held_bytes
    from autoplan.planner.dp_problem import DpPricing, whole_patterns, with_dp_terms
    g = _ffn_graph()
    cluster = Cluster.preset("pcie-8gpu", nodes=2)
    config = ParallelConfig(dp=8, tp=2, micro_batch_size=4, zero_stage=zero, precision="bf16")
    compute = compute_model(g, cluster.device, "bf16", None)
    group = config.tp_group()
    ctx = CostContext(graph=g, t=2, compute=compute,
                      collective_s=lambda kind, b: cluster.collective_time_s(kind, b, group),
                      batch_scale=1.0, microbatches=2, precision="bf16", recompute="none",
                      state_bytes_per_param=16.0, activation_multiplier=1.0,
                      step_shard=8 if zero >= 2 else 1,
                      held=held_bytes(g, "bf16", config.mixed_precision, cluster.device.kind))
    red = reduce_graph(ctx)
    reference = solve(red.problem, time_limit_s=20).choice
    pricing = DpPricing(config=config, cluster=cluster, microbatches=2, compute=compute,
                        interference=ctx.interference)
    dp = with_dp_terms(red, g, pricing, reference=reference, whole_extra_bytes=2.0)
    p = dp.problem
    assert p.overlaps
    sol = solve(p, time_limit_s=20, start=dp.lift(reference))
    best = brute_force(p)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best[1], rel=1e-9)
    whole = whole_patterns(g, red, dp.whole_nodes(sol.choice))
    est = estimate(g, cluster, config=replace(config, dp_whole=whole),
                   global_batch_size=8 * 4 * 2, profile=None,
                   sharding=sharding_from_choice(g, 2, red, dp.strategies(sol.choice)))
    assert sol.objective == pytest.approx(est.step_time_s, rel=1e-3)


class _FFNStack(torch.nn.Module):
    """Two pre-norm MLP blocks in a layer list (pipeline stages cut between them), a head."""

    def __init__(self, h=64):
        super().__init__()
        self.layers = torch.nn.ModuleList(_FFNLayer(h) for _ in range(2))
        self.head = torch.nn.Linear(h, 128)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _FFNLayer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)
        self.fc = torch.nn.Linear(h, 4 * h)
        self.proj = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


@pytest.mark.parametrize("schedule,recompute", [("1f1b", ("none", "none")),
                                                ("zero_bubble", ("full", "none"))])
def test_pipelined_ilp_equals_brute_force_on_a_model_graph(schedule, recompute):
    """One pipelined configuration's own ILP (``pipe_problem``: the longest of the schedule's
    critical paths, the dp terms of the largest stage) on a real traced graph of two layers on
    two stages: its optimum is brute force's, and it prices that choice at ``estimate``'s step
    time (the schedule simulated) within 2 %."""
    from autoplan.cost.compute import compute_model
    from autoplan.cost.dtypes import held_bytes
    from autoplan.estimate.cost_inputs import CostInputs
    from autoplan.estimate.layout import chunks_for, with_layout
    from autoplan.graph.analysis import analyze
    from autoplan.planner.dp_problem import DpPricing
    from autoplan.planner.pipe_problem import build
    x = torch.empty(4, 16, 64, device="meta")
    y = torch.empty(4, 16, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = _FFNStack()
    g = trace(model, (x,), loss_fn=lambda out, t: torch.nn.functional.cross_entropy(
        out.reshape(-1, 128), t.reshape(-1)), targets=y)
    cluster = Cluster.preset("pcie-8gpu", nodes=1)
    config = with_layout(ParallelConfig(pp=2, dp=2, tp=2, micro_batch_size=4, zero_stage=1,
                                        schedule=schedule), (1, 1), recompute)
    compute = compute_model(g, cluster.device, "bf16", None)
    group = config.tp_group()
    m = 4

    def context_for(policy):
        return CostContext(graph=g, t=2, compute=compute,
                           collective_s=lambda kind, b: cluster.collective_time_s(kind, b,
                                                                                  group),
                           batch_scale=1.0, microbatches=m, precision="bf16",
                           recompute=policy, state_bytes_per_param=16.0,
                           activation_multiplier=1.0,
                           held=held_bytes(g, "bf16", config.mixed_precision,
                                           cluster.device.kind))
    red = reduce_graph(context_for("none"))
    reference = solve(red.problem, time_limit_s=20).choice
    sh = sharding_from_choice(g, 2, red, reference)
    chunks = chunks_for(CostInputs(graph=g, analysis=analyze(g), sharding=sh, compute=compute,
                                   cluster=cluster, config=config))
    pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=compute,
                        interference=0.189)
    pipe = build(g, pricing, chunks=chunks, context_for=context_for, reference=reference)
    p = pipe.problem
    sol = solve(p, time_limit_s=20, start=reference)
    best = brute_force(p)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best[1], rel=1e-9)
    at = build(g, pricing, chunks=chunks, context_for=context_for, reference=sol.choice)
    est = estimate(g, cluster, config=config, global_batch_size=config.dp * 4 * m,
                   profile=None, sharding=sharding_from_choice(g, 2, pipe.red, sol.choice))
    assert at.problem.objective(sol.choice) == pytest.approx(est.step_time_s, rel=0.02)
    if (at.path, at.worst) == (pipe.path, pipe.worst):
        assert sol.objective == pytest.approx(at.problem.objective(sol.choice), rel=1e-3)


# ---- batch statistics ---------------------------------------------------------------------

def test_a_model_with_batch_statistics_is_planned_on_whole_per_replica_batches():
    """A batch norm in training mode normalizes with its batch's statistics: one device sees
    the whole per-replica batch (data-parallel ranks share their statistics), so a plan that
    accumulated gradients over smaller micro-batches would train another model. Unforced, the
    search keeps the per-replica batch whole; a transformer gets the usual choice."""
    from autoplan.planner.search_space import batch_statistics, mbs_options
    from autoplan.planner.search import SearchOptions
    cnn, gpt = _graph("cnn-tiny"), _graph("gpt-tiny")
    assert batch_statistics(cnn) and not batch_statistics(gpt)
    assert mbs_options(16, SearchOptions(), cnn) == [16]
    assert mbs_options(16, SearchOptions(), gpt) == [1, 2, 4, 8, 16]
    assert mbs_options(16, SearchOptions(micro_batch_sizes=(4,)), cnn) == [4]   # asked for
    for world in (1, 2):
        p = plan(cnn, Cluster.local(world), global_batch_size=16, precision="fp32",
                 profile=None)
        assert p.config.micro_batch_size == 16 // p.config.dp, p.config


def test_a_pipeline_that_fits_on_megatron_sharding_is_found():
    """The tp axis's ILP is solved once per micro-batch for every pp, with the whole model's
    memory: on GPT-3 175B over 128 A100 at tp4 it keeps the vocabulary whole, and a 16-stage
    pipeline's first and last stages cannot hold that. Full recomputation on Megatron's
    sharding fits (the estimator: about 45 GiB), so the search must find it rather than say
    nothing fits."""
    ex = build_example("gpt3-175b", device="meta")
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.from_spec("dgx-a100-80gb:16")
    force = dict(dp=2, tp=4, pp=16, recompute="full", schedule="1f1b", zero_stage=1,
                 compiled=False)   # (compiled, the ILP's own sharding fits: 79.7 GiB)
    p = plan(g, cluster, global_batch_size=1536, precision="bf16", profile=None, top_k=0,
             force=force)
    assert p.predicted["fits"] and p.config.pp == 16
    est = estimate(g, cluster, config=ParallelConfig(
        dp=2, tp=4, pp=16, micro_batch_size=1, schedule="1f1b", zero_stage=1,
        sequence_parallel=True, recompute="full", precision="bf16"),
        global_batch_size=1536, profile=None)
    assert p.predicted["peak_memory_bytes"] <= est.peak_memory_bytes * 1.05
