"""Recomputation chosen per layer (planner/recompute_dp.py) against the best uniform policy.

    python benchmarks/recompute_per_layer.py              # both cases
    python benchmarks/recompute_per_layer.py llama3-8b    # one

For each case the planner's plan is made; then, on the plan's configuration (its mesh, micro-
batch, ZeRO stage, offload and stage split, its sharding), every uniform policy (none,
selective, ops, full) and the per-layer choice are estimated: recompute seconds per step, peak
memory, step time, and whether it fits. The issue's cases: Llama-3-8B on one H100 (the
largest micro-batch that fits), GPT-3 175B on 128 DGX A100 (1,024 GPUs).
"""

from __future__ import annotations

import sys
from dataclasses import replace

CASES = {   # name: (model, preset, nodes, gpus of the node (None: all), global batch, force)
    # one H100 holds Llama-3-8B's weights only with FSDP2's parameter offload (ZeRO-3 at dp 1)
    "llama3-8b": ("llama3-8b", "dgx-h100", 1, 1, 8, {"zero_stage": 3, "offload_params": True}),
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, None, 1536, {}),
}


def case(model: str, preset: str, nodes: int, gpus: int | None) -> tuple:
    """(graph, cluster) of a case: ``model`` traced on meta, ``nodes`` nodes of ``preset`` or,
    with ``gpus``, its first ``gpus`` GPUs of one node (``validate.part_of_a_node``)."""
    from autoplan import Cluster
    from autoplan.graph import trace
    from autoplan.models import build_example
    if gpus is None:
        cluster = Cluster.preset(preset, nodes=nodes)
    else:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from validate import part_of_a_node
        cluster = part_of_a_node(preset, gpus)
    ex = build_example(model, device="meta", batch_size=1)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets), cluster


def one(key: str) -> None:
    import torch

    from autoplan import estimate, plan
    from autoplan.estimate.estimator import cost_inputs
    from autoplan.planner.compare import plan_sharding
    from autoplan.planner.recompute_choice import per_layer_config
    torch.set_num_threads(1)
    model, preset, nodes, gpus, gbs, force = CASES[key]
    g, cluster = case(model, preset, nodes, gpus)
    p = plan(g, cluster, global_batch_size=gbs, profile=None, force=force)
    sh = plan_sharding(p, g)
    print(f"{key}: plan {p.config.short()}  step {p.predicted['step_time_s']:.3f} s")
    # recomputation alone: the plan's offloaded layers (the joint DP's) dropped, since the
    # uniform selective policy cannot offload (benchmarks/joint_offload_figures.py compares both)
    base = replace(p.config, layer_recompute=None, stage_recompute=None, layer_offload=None,
                   offload_activations=0, chunk_layers=p.config.chunk_layers)
    rows = []

    def est_of(cfg):
        return estimate(g, cluster, config=cfg, global_batch_size=gbs, profile=None,
                        sharding=sh)
    for policy in ("none", "selective", "ops", "full"):
        rows.append((f"uniform {policy}", est_of(replace(base, recompute=policy))))
    fitting = [e for _, e in rows if e.fits]
    start = min(fitting, key=lambda e: e.step_time_s) if fitting else rows[-1][1]
    chosen = per_layer_config(cost_inputs(g, cluster, start.config, None, sh, 1.0), start)
    if chosen is not None:
        rows.append(("per layer (DP)", est_of(chosen)))
    for label, e in rows:
        lr = e.config.layer_recompute
        mix = "" if lr is None else "  " + "/".join(
            f"{r}*{lr.count(r)}" for r in dict.fromkeys(lr))
        print(f"  {label:<18} recompute {e.time.recompute_s:8.3f} s  peak "
              f"{e.peak_memory_bytes / 2**30:7.2f} GiB  step {e.step_time_s:8.3f} s  "
              f"{'fits' if e.fits else 'DOES NOT FIT'}{mix}")


if __name__ == "__main__":
    for k in (sys.argv[1:] or list(CASES)):
        one(k)
