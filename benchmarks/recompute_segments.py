"""Chen's segments (several layers under one checkpoint) against one checkpoint per layer, on
the plans the planner makes: what the recompute DP would gain if the runtime ran them.

    python benchmarks/recompute_segments.py              # both cases
    python benchmarks/recompute_segments.py llama3-8b    # one

``planner/recompute_dp.solve_chain`` can price runs of up to ``max_segment`` consecutive layers
sharing one checkpoint (Chen et al. 2016): the run keeps its first layer's input only, replays
every forward, and rebuilds all its layers' activations at once in backward. The planner solves
with ``max_segment=1`` because the runtime checkpoints one layer per wrapper. For each case
(``recompute_per_layer.CASES``: Llama-3-8B on one H100, GPT-3 175B on 1,024 A100) the plan is
made; then each pipeline stage's chain (its layers' options as ``recompute_choice.stage_chain``
prices them, a layer's input bytes and forward seconds taken from its ``full`` option, which
keeps its input and replays its forward) is solved with ``max_segment`` 1 and 8, at the plan's
budget (recompute seconds per micro-batch) and at the least budget each can meet (bisection).
"""

from __future__ import annotations

import sys
from dataclasses import replace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from recompute_per_layer import CASES, case  # noqa: E402

_GIB = 2.0 ** 30


def chains(g, cluster, p, gbs: int):
    """(chain, budget bytes, micro-batches in flight) of each stage of plan ``p``."""
    from autoplan import estimate
    from autoplan.estimate.estimator import cost_inputs
    from autoplan.estimate.layout import chunks_for
    from autoplan.planner.compare import plan_sharding
    from autoplan.planner.recompute_choice import stage_budget, stage_chain
    from autoplan.planner.recompute_dp import ChainLayer
    sh = plan_sharding(p, g)
    cfg = replace(p.config, layer_offload=None, offload_activations=0)
    est = estimate(g, cluster, config=cfg, global_batch_size=gbs,
                   profile=None, sharding=sh)
    ci = cost_inputs(g, cluster, est.config, None, sh, 1.0)
    chunks = chunks_for(ci)
    first = [sum(len(ch.layer_ranges) for ch in chunks[:k]) for k in range(len(chunks))]
    out = []
    for s, stage in enumerate(est.stages):
        layers, _ = stage_chain(ci, chunks, est.config.rank_chunks(s), stage, first)
        if not layers:
            continue
        filled = []
        for layer in layers:
            full = next(o for o in layer.options if o.policy == "full")
            filled.append(ChainLayer(options=layer.options, input_bytes=full.kept_bytes,
                                     fwd_s=full.recompute_s))
        out.append((filled, stage_budget(ci, chunks, est.config.rank_chunks(s), stage),
                    stage.microbatches_in_flight))
    return out


def least_budget(layers, in_flight, max_segment) -> float:
    """The least device budget at which the chain has an answer (bisection to 0.1 %)."""
    from autoplan.planner.recompute_dp import solve_chain
    hi = sum(max(o.kept_bytes for o in l.options) for l in layers) * in_flight * 2 + 1e12
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        ok = solve_chain(layers, budget_bytes=mid, in_flight=in_flight,
                         max_segment=max_segment) is not None
        lo, hi = (lo, mid) if ok else (mid, hi)
    return hi


def one(key: str) -> None:
    from autoplan import plan
    from autoplan.planner.recompute_dp import solve_chain
    model, preset, nodes, gpus, gbs, force = CASES[key]
    g, cluster = case(model, preset, nodes, gpus)
    p = plan(g, cluster, global_batch_size=gbs, profile=None, force=force)
    print(f"{key}: plan {p.config.short()}  step {p.predicted['step_time_s']:.3f} s")
    for s, (layers, budget, fl) in enumerate(chains(g, cluster, p, gbs)):
        row = [f"  stage {s}: {len(layers)} layers, {fl:g} micro-batches in flight, budget "
               f"{budget / _GIB:.2f} GiB"]
        for k in (1, 8):
            sol = solve_chain(layers, budget_bytes=budget, in_flight=fl, max_segment=k)
            at = ("no answer" if sol is None else
                  f"recompute {sol.recompute_s * 1e3:.2f} ms/micro-batch, "
                  f"{len(sol.segments)} segments")
            row.append(f"    max_segment={k}: {at}; least budget "
                       f"{least_budget(layers, fl, k) / _GIB:.2f} GiB")
        print("\n".join(row), flush=True)
        if s >= 2:
            print("  (further stages alike)")
            break


if __name__ == "__main__":
    for k in (sys.argv[1:] or list(CASES)):
        one(k)
