"""A tied weight (gpt-tiny's embedding and LM head) is one tensor: the estimate counts it once
on a rank, however many of the rank's parts or chunks read it, and once on each of two ranks
that both hold it (a pipeline's first and last stage each keep a copy)."""

import functools

from autoplan import Cluster, ParallelConfig
from autoplan.estimate.estimator import estimate
from autoplan.graph.trace import trace
from autoplan.models.registry import build_example


@functools.lru_cache(maxsize=None)
def _model():
    ex = build_example("gpt-tiny", batch_size=1, num_layers=4)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    unique = sum(p.numel() for p in ex.model.parameters())
    tied = ex.model.get_input_embeddings().weight.numel() if hasattr(
        ex.model, "get_input_embeddings") else None
    both = sum(p.numel() for _, p in ex.model.named_parameters(remove_duplicate=False))
    return graph, unique, both - unique, tied


def _per_stage(**kw):
    graph, *_ = _model()
    config = ParallelConfig(micro_batch_size=1, precision="fp32", **kw)
    est = estimate(graph, Cluster.local(config.pp), config=config, global_batch_size=4,
                   profile=None)
    return [s.params_per_device for s in est.stages], est


def test_tied_weight_counted_once_per_rank():
    _, unique, tied, _ = _model()
    assert tied > 0                          # gpt-tiny ties its embedding and LM head
    (one,), est = _per_stage()
    assert one == unique
    assert est.stages[0].memory.params_bytes == 4 * unique
    # pp2: the first and last stage each hold the tied weight
    assert sum(_per_stage(pp=2, schedule="1f1b")[0]) == unique + tied
    # a V schedule puts both ends on rank 0: once there
    v, _ = _per_stage(pp=2, schedule="zbv", virtual_stages=2)
    assert sum(v) == unique


def test_ilp_holds_the_tied_weight_once():
    """The sharding ILP's held parameters (``planner/dp_problem.held_params``) and memory row
    (``planner/problem.reduce_graph``) count the tied weight once, as the estimate does (at
    tp 1 every choice holds every weight whole)."""
    from autoplan.cost.compute import compute_model
    from autoplan.planner.dp_problem import held_params
    from autoplan.planner.problem import reduce_graph
    from tests.test_ilp_objective import config_context
    graph, unique, _, _ = _model()
    cluster = Cluster.local(1)
    config = ParallelConfig(micro_batch_size=1, precision="fp32")
    compute = compute_model(graph, cluster.device, "fp32", None)
    red = reduce_graph(config_context(graph, cluster, config, 1, compute,
                                      activation_multiplier=0.0))
    first = tuple(0 for _ in red.nodes)
    assert held_params(graph, red, 1, 1).dense.value(red.problem, first) == unique
    assert red.problem.memory(first) == 16.0 * unique


def _walked(ci, spans):
    """The plain walk over every op's inputs that ``held_params.repeated_params`` replaces by
    bisecting the graph's parameter reads: the oracle it must agree with."""
    from autoplan.estimate.held_params import Repeated, experts_of, held_elements
    graph, found = ci.graph, experts_of(ci)
    counted, fqns = set(), set()
    elements = experts = 0.0
    tensors = 0
    for start, stop in spans:
        mine = {}
        for i in range(start, stop):
            for n in graph.ops[i].inputs:
                v = graph.value(n)
                if v.kind == "param" and v.base not in mine:
                    mine[v.base] = held_elements(ci, i, n, found)
        for base, (held, expert) in mine.items():
            if base in counted:
                elements += held
                experts += held if expert else 0.0
                tensors += 1
                fqns.add(graph.value(base).fqn)
        counted.update(mine)
    return Repeated(elements, experts, tensors, frozenset(fqns))


def test_repeated_weights_agree_with_walking_every_op():
    import random

    from autoplan.estimate.estimator import cost_inputs
    from autoplan.estimate.held_params import repeated_params
    tiny, *_ = _model()
    moe = build_example("titan-moe-tiny", batch_size=1)
    moe_graph = trace(moe.model, moe.example_inputs, loss_fn=moe.loss_fn, targets=moe.targets)
    rng = random.Random(0)
    for graph, kw in ((tiny, dict(tp=2)), (tiny, {}), (moe_graph, dict(ep=2, dp=2))):
        config = ParallelConfig(micro_batch_size=1, precision="fp32", **kw)
        ci = cost_inputs(graph, Cluster.local(config.world_size), config, None, None, 1.0)
        n = len(graph.ops)
        for _ in range(40):
            cuts = sorted(rng.sample(range(n + 1), rng.randint(2, 6)))
            spans = [(a, b) for a, b in zip(cuts, cuts[1:])]
            rng.shuffle(spans)
            assert repeated_params(ci, spans) == _walked(ci, spans), spans
        assert repeated_params(ci, [(0, n), (0, n)]).tensors == len(
            {graph.value(b).name for _, b in graph.param_reads[1]})
