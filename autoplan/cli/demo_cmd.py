"""`autoplan demo`: the main job on built-in defaults.

Traces a small GPT, estimates it on this machine and on a DGX A100 node, then traces GPT-3 175B
on the meta device (nothing allocated), estimates the Megatron-LM configuration for it on
1,536 A100s (192 DGX nodes: dp 16 x tp 8 x pp 12, as in Narayanan et al. 2021), and searches
the best plan for it on 1,024 A100s (128 nodes; pipeline parallelism joins the search later).
"""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="trace and estimate example models on preset clusters",
                       description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="trace GPT-3 175B with 8 layers instead of 96 (same per-layer costs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.cluster import Cluster
    from autoplan.estimate.config import ParallelConfig
    from autoplan.estimate.estimator import estimate
    from autoplan.graph import trace
    from autoplan.models import build_example

    print("== 1. a small GPT (gpt-small-cpu) ==")
    ex = build_example("gpt-small-cpu", device="meta", batch_size=4)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                  name="gpt-small-cpu")
    print(graph.summary())
    local = Cluster.local()
    est = estimate(graph, local, global_batch_size=4,
                   config=ParallelConfig(micro_batch_size=4, precision="fp32"))
    print(f"\n-- on this machine ({local.device.name}), fp32, batch 4:")
    print(est.report())
    node = Cluster.preset("dgx-a100-80gb", nodes=1)
    est = estimate(graph, node, global_batch_size=64,
                   config=ParallelConfig(dp=8, micro_batch_size=8, precision="bf16"))
    print(f"\n-- on one DGX A100 node, data parallel x8, bf16, global batch 64:")
    print(est.report())

    layers = 8 if args.quick else 96
    print(f"\n== 2. GPT-3 175B on the meta device ({layers} layers traced) ==")
    t0 = time.perf_counter()
    ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=layers)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                  name="gpt3-175b")
    print(graph.summary())
    print(f"built and traced in {time.perf_counter() - t0:.1f} s")
    cluster = Cluster.preset("dgx-a100-80gb", nodes=192)
    config = ParallelConfig(dp=16, tp=8, pp=min(12, layers), micro_batch_size=1,
                            schedule="1f1b", zero_stage=1, sequence_parallel=True,
                            recompute="full", precision="bf16")
    if layers != 96:
        config = ParallelConfig(**{**config.to_dict(), "dp": 16 * 12 // config.pp})
    est = estimate(graph, cluster, global_batch_size=1536, config=config)
    print(f"\n-- on {cluster.world_size} x {cluster.device.name} ({cluster.num_nodes} nodes), "
          "global batch 1536:")
    print(est.report())

    from autoplan.planner.explain import explain_plan
    from autoplan.planner.search import plan
    cluster = Cluster.preset("dgx-a100-80gb", nodes=128)
    print(f"\n== 3. the best plan for GPT-3 175B on {cluster.world_size} x {cluster.device.name}, "
          "global batch 1536 ==")
    t0 = time.perf_counter()
    best = plan(graph, cluster, global_batch_size=1536, name="gpt3-175b",
                progress=lambda msg: print(f"  {msg}"))
    print(f"searched in {time.perf_counter() - t0:.1f} s\n")
    print(explain_plan(best))
    return 0
