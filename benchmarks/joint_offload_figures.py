"""Activation offload chosen per layer with recomputation (one DP) against recomputation alone.

    python benchmarks/joint_offload_figures.py              # the three cases
    python benchmarks/joint_offload_figures.py llama3-70b   # one

For each case two plans are made: the search with activation offload turned off (recomputation
chosen per layer by the DP alone: ``plan(..., offload_activations=False)``) and the default
search (the joint DP may also offload layers). Then, on the first plan's configuration (mesh,
micro-batch, ZeRO, stage split, sharding), the DP is run both ways
(``recompute_choice.per_layer_config(..., offload=False/True)``) and both are estimated: peak
memory, host memory held, recompute and exposed copy seconds, step time. The issue's cases:
Llama-3-8B on one H100 (``validate.part_of_a_node``), Llama-3-70B on one DGX H100 (8 GPUs),
GPT-3 175B on 128 DGX A100 nodes (1,024 GPUs).
"""

from __future__ import annotations

import sys
import time

CASES = {   # name: (model, preset, nodes, gpus of the node (None: all), global batch, force)
    # autocast fits nowhere on one H100 (88 GiB at least): 16-bit weights, fp32 masters
    "llama3-8b": ("llama3-8b", "dgx-h100", 1, 1, 8, {"mixed_precision": "params"}),
    "llama3-70b": ("llama3-70b", "dgx-h100", 1, None, 64, {}),
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, None, 1536, {}),
}


def _row(label: str, e) -> str:
    lo = e.config.layer_offload
    host = max(s.memory.offloaded_bytes for s in e.stages)
    return (f"  {label:<26} peak {e.peak_memory_bytes / 2**30:6.2f} GiB  host {host / 2**30:7.2f}"
            f" GiB  recompute {e.time.recompute_s:7.3f} s  copies "
            f"{e.time.comm_exposed_s.get('activation_offload', 0.0):6.3f} s  step "
            f"{e.step_time_s:7.3f} s  {'fits' if e.fits else 'DOES NOT FIT'}  "
            f"{e.config.short()}" + ("" if lo is None else f" ({sum(lo)}/{len(lo)} offload)"))


def one(key: str) -> None:
    import torch

    from autoplan import estimate, plan
    from autoplan.estimate.estimator import cost_inputs
    from autoplan.planner.compare import plan_sharding
    from autoplan.planner.recompute_choice import per_layer_config
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from recompute_per_layer import case
    torch.set_num_threads(1)
    model, preset, nodes, gpus, gbs, force = CASES[key]
    g, cluster = case(model, preset, nodes, gpus)
    print(f"{key}: {cluster.world_size} x {cluster.device.name}, global batch {gbs}")
    plans = {}
    for label, offload in (("plan, recompute-only DP", False), ("plan, joint DP", True)):
        t0 = time.perf_counter()
        p = plan(g, cluster, global_batch_size=gbs, profile=None, force=force,
                 offload_activations=offload)
        plans[offload] = p
        e = estimate(g, cluster, config=p.config, global_batch_size=gbs, profile=None,
                     sharding=plan_sharding(p, g))
        print(_row(label, e) + f"  [searched in {time.perf_counter() - t0:.0f} s]")
    p = plans[False]
    sh = plan_sharding(p, g)
    start = estimate(g, cluster, config=p.config, global_batch_size=gbs, profile=None,
                     sharding=sh)
    ci = cost_inputs(g, cluster, p.config, None, sh, 1.0)
    for label, offload in (("same config, DP recompute", False), ("same config, DP joint", True)):
        cfg = per_layer_config(ci, start, offload=offload)
        if cfg is None:
            print(f"  {label:<26} no answer")
            continue
        print(_row(label, estimate(g, cluster, config=cfg, global_batch_size=gbs, profile=None,
                                   sharding=sh)))


if __name__ == "__main__":
    for k in (sys.argv[1:] or list(CASES)):
        one(k)
