"""How far a pipelined configuration's prices are from its simulated step (issue 15, item 2).

    python benchmarks/pipe_ilp_gap.py

For each pipelined case of ``tests/test_ilp_objective.py`` (small models you did not write among
them, every schedule the search offers, random per-stage recompute policies, ZeRO 0/1, bf16 and
fp32), at the pipelined ILP's optimum and at ten random walks from the shared ILP's answer,
prints the worst relative difference from ``estimate``'s step (the schedule simulated event by
event) of
- the estimate's closed form (``simulate_pipeline=False``: the bottleneck's micro-batches and
  one micro-batch through every other rank; the search's screen), and
- the pipelined ILP's objective built at that choice (``pipe_problem``: the longest of the
  schedule's critical paths, the dp terms in closed form).
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

from autoplan import estimate                                              # noqa: E402
from autoplan.estimate.cost_inputs import CostInputs                       # noqa: E402
from autoplan.estimate.layout import chunks_for                            # noqa: E402
from autoplan.estimate.overlap import overlap_interference                 # noqa: E402
from autoplan.graph.analysis import analyze                                # noqa: E402
from autoplan.planner.ilp import solve                                     # noqa: E402
from autoplan.planner.dp_problem import DpPricing                          # noqa: E402
from autoplan.planner.pipe_problem import build                            # noqa: E402
from autoplan.planner.problem import reduce_graph, sharding_from_choice    # noqa: E402
from tests.test_ilp_objective import PIPE_CASES, _pipe_case, walks         # noqa: E402


def main() -> None:
    print(f"{'model':<20} {'schedule':<18} {'closed form':>12} {'pipelined ILP':>14}")
    for seed in range(len(PIPE_CASES)):
        rng, name, g, cluster, config, m, compute, context_for, reference = _pipe_case(seed)
        sh = sharding_from_choice(g, config.tp, reduce_graph(context_for("none")), reference)
        chunks = chunks_for(CostInputs(graph=g, analysis=analyze(g), sharding=sh,
                                       compute=compute, cluster=cluster, config=config))
        interference = overlap_interference(cluster)
        pricing = DpPricing(config=config, cluster=cluster, microbatches=m, compute=compute,
                            interference=interference)
        pipe = build(g, pricing, chunks=chunks, context_for=context_for, reference=reference)
        best = solve(pipe.problem, time_limit_s=30).choice
        gbs = config.dp * config.micro_batch_size * m
        closed_gap = ilp_gap = 0.0
        for choice in [best] + walks(reference, pipe.problem, pipe.problem.objective, rng, 10,
                                     3):
            at = build(g, pricing, chunks=chunks, context_for=context_for, reference=choice,
                       made=pipe.terms)
            kw = dict(config=config, global_batch_size=gbs, profile=None,
                      sharding=sharding_from_choice(g, config.tp, pipe.red, choice))
            step = estimate(g, cluster, **kw).step_time_s
            closed = estimate(g, cluster, simulate_pipeline=False, **kw).step_time_s
            closed_gap = max(closed_gap, abs(closed / step - 1))
            ilp_gap = max(ilp_gap, abs(at.problem.objective(choice) / step - 1))
        print(f"{name:<20} {config.schedule:<18} {closed_gap * 100:>11.2f}% "
              f"{ilp_gap * 100:>13.2f}%")


if __name__ == "__main__":
    main()
