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
