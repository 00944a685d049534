"""Memory and predicted step time of the two ways of holding 16-bit weights (issue 39 part 4):
autocast (fp32 weights, 16-bit products) against "params" (Megatron-LM's --bf16: 16-bit weights
and activations, the fp32 master copy with the optimizer), each the planner's best plan with the
other fields searched, then both offered to one search (``mixed_precision=("autocast",
"params")``, ``plan --search-mixed-precision``): its pick, on the issue's three setups (bf16,
AdamW, roofline).

    python benchmarks/master_weights_figures.py [llama3-8b|llama3-70b|gpt3-175b ...]
"""

import sys
import time

import autoplan
from autoplan.models.registry import build_example
from autoplan.planner.search import plan

SETUPS = {   # example, preset, nodes, global batch (as tests/test_golden_plans' figures)
    "llama3-8b": ("llama3-8b", "dgx-h100", None, 8),
    "llama3-70b": ("llama3-70b", "dgx-h100", 1, 64),
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 16, 1536),
}


def _first_gpu(link):
    """A node link with its GPU lists cut to gpu0 (paired lists cut alike)."""
    a, b = link["a"], link["b"]
    if isinstance(a, list) and a and str(a[0]).startswith("gpu"):
        return {**link, "a": a[:1], "b": b[:1] if isinstance(b, list) else b}
    return link


def main(names):
    for name in names:
        example, preset, nodes, gbs = SETUPS[name]
        ex = build_example(example, device="meta")
        graph = autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn,
                               targets=ex.targets)
        if nodes is None:           # one GPU of the preset's node
            from autoplan.cluster import specs
            entry = {**specs.preset_entry(preset), "num_nodes": 1, "devices_per_node": 1}
            node = dict(entry["node"])
            node["links"] = [_first_gpu(ln) for ln in node["links"]]
            entry["node"] = node
            cluster = autoplan.Cluster.from_dict({"name": f"{preset}-1gpu", **entry})
        else:
            cluster = autoplan.Cluster.preset(preset, nodes=nodes)
        for held in ("autocast", "params", "either"):
            t0 = time.perf_counter()
            offered = {"mixed_precision": ("autocast", "params")} if held == "either" \
                else {"force": {"mixed_precision": held}}
            try:
                p = plan(graph, cluster, global_batch_size=gbs, precision="bf16",
                         profile=None, top_k=0, **offered)
            except autoplan.errors.AutoplanError as e:
                print(f"{name:11s} {held:11s} no plan: {str(e)[:120]}")
                continue
            pr = p.predicted
            if held == "either":
                held = f"-> {p.config.mixed_precision}"
            print(f"{name:11s} {held:11s} {p.config.short():60s} step "
                  f"{pr['step_time_s']:8.3f} s  peak {pr['peak_memory_bytes'] / 2**30:6.1f} GiB  "
                  f"(search {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SETUPS))
