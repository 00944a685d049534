"""Planning time and ILP sizes: trace + search, on this machine, for the issue's targets.

    python benchmarks/search_time.py            # all cases
    python benchmarks/search_time.py llama3-8b  # one
    python benchmarks/search_time.py --sweep    # how it grows: GPT-3 175B on 64 to 16,384
                                                # A100, and 24 to 192 layers on 1,024 A100
    python benchmarks/search_time.py --ilps llama3-8b   # and every ILP solved: its mesh,
                                                        # size, solve time, status and gap

Targets (issue 15): Llama-3-8B on 64 H100 (8 nodes, global batch 16 x 8,192 tokens) plans in
<= 2 s; GPT-3 175B on 1,024 A100 (128 DGX nodes, with pipelines) <= 10 s; no point of the sweep
over 10 s. Each case runs in a fresh process; the planning time is tracing the model plus the
search. The modules torch.export imports on its first use (torch._dynamo, ~0.9 s here, and
torch.export._trace with aot_autograd, ~0.2 s) are timed apart ("imports"): a process pays
them once, whatever it traces after; so is building the model (on the meta device, ~0.1 s):
the user's code, which hands autoplan a model.

Times are wall seconds and, beside them, CPU seconds of the process and of its children (CBC
runs as one): on a shared machine the CPU seconds are the ones to compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CASES = {   # name: (model, preset, nodes, global batch, largest pipeline degree; None: default)
    # the planning-speed issue's setup: 64 H100, global batch 16 x 8,192 tokens
    "llama3-8b": ("llama3-8b", "dgx-h100", 8, 16, None),
    "llama3-8b-512": ("llama3-8b", "dgx-h100", 8, 512, None),
    "gpt3-175b-no-pp": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 1),
    # the full joint search (pipeline degrees up to the layer count, every schedule)
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, None),
    "llama3-70b": ("llama3-70b", "dgx-h100", 32, 1024, None),
    # the scale issue (40, item 6): Llama 3 405B on 16,384 H100 (2,048 DGX nodes), its
    # pre-training batch of 16M tokens (2,048 x 8,192), every dimension the search has
    "llama3-405b": ("llama3-405b", "dgx-h100", 2048, 2048, None),
}


# the growth sweep (GPT-3 175B shapes, global batch 1,536): (label, nodes of 8 A100, layers)
SWEEP = ([(f"{8 * n} GPUs, 96 layers", n, 96) for n in (8, 32, 128, 512, 2048)]
         + [(f"1,024 GPUs, {layers} layers", 128, layers) for layers in (24, 48, 192)])


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (CBC), user and system."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def one(key: str) -> dict:
    t_import = time.perf_counter()
    import torch
    import torch._dynamo  # noqa: F401  (what torch.export imports on its first use)
    import torch.export  # noqa: F401
    import torch.export._trace  # noqa: F401  (and aot_autograd, inductor's caches: ~0.2 s)

    from autoplan import Cluster, plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    torch.set_num_threads(1)
    if key.startswith("sweep:"):
        _, nodes, layers = key.split(":")
        # GPT-3's batch (1,536 x 2,048 tokens), larger where the devices outnumber it
        model, preset, nodes, max_pp = "gpt3-175b", "dgx-a100-80gb", int(nodes), None
        gbs = max(1536, 8 * nodes * 3 // 2)
        sizes = {"num_layers": int(layers)}
    else:
        model, preset, nodes, gbs, max_pp = CASES[key]
        sizes = {}
    t_build = time.perf_counter()
    imports_s = t_build - t_import
    ex = build_example(model, device="meta", batch_size=1, **sizes)   # the user's model
    t0, c0 = time.perf_counter(), _cpu_s()
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=model)
    t1, c1 = time.perf_counter(), _cpu_s()
    cluster = Cluster.preset(preset, nodes=nodes)
    solves: list[str] = []
    p = plan(graph, cluster, global_batch_size=gbs, profile=None, name=model, max_pp=max_pp,
             progress=lambda msg: solves.append(msg.strip()) if msg.startswith("  ILP (") else None)
    t2, c2 = time.perf_counter(), _cpu_s()
    # solved ones (those shown unfittable without CBC say "not solved" and take no time)
    times = [float(line.split(" s, ")[0].rsplit(", ", 1)[1]) for line in solves
             if " variables, " in line]
    gaps = [float(line.rsplit("gap ", 1)[1].rstrip("%")) for line in solves if "gap " in line]
    return {"case": key, "imports_s": imports_s, "build_s": t0 - t_build, "solves": solves,
            "ilp_s": sum(times), "slowest_ilp_s": max(times, default=0.0),
            "worst_gap": max(gaps, default=None), "world": cluster.world_size,
            "ops": len(graph.ops),
            "trace_s": t1 - t0, "search_s": t2 - t1, "total_s": t2 - t0,
            "trace_cpu_s": c1 - c0, "search_cpu_s": c2 - c1, "total_cpu_s": c2 - c0,
            "worst_gap_plan": p.solver.worst_gap,
            "ilps": p.solver.ilps_solved, "candidates": p.solver.candidates_evaluated,
            "vars": p.solver.num_variables, "constraints": p.solver.num_constraints,
            "status": p.solver.status, "config": p.config.short(),
            "step_s": p.predicted["step_time_s"], "mfu": p.predicted["mfu"]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1])))
        return 0
    every = "--ilps" in argv
    argv = [a for a in argv if a != "--ilps"]
    keys = argv or list(CASES)
    if argv == ["--sweep"]:
        keys = [f"sweep:{nodes}:{layers}" for _, nodes, layers in SWEEP]
    for key in keys:
        out = subprocess.run([sys.executable, __file__, "--one", key], capture_output=True,
                             text=True)
        if out.returncode:
            print(f"{key}: FAILED {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        size = f"{r['vars']} variables, {r['constraints']} constraints"
        which = (f"the chosen plan's: {size}, {r['status']}" if r["status"] != "not_solved"
                 else f"the chosen plan's sharding is Megatron's or tp 1; the largest: {size}")
        print(f"{r['case']} on {r['world']} devices: trace {r['trace_s']:.1f} s + search "
              f"{r['search_s']:.1f} s = {r['total_s']:.1f} s (importing torch "
              f"and torch.export {r['imports_s']:.1f} s and building the model on meta "
              f"{r['build_s']:.1f} s apart); {r['ilps']} ILPs ({which}), "
              f"{r['candidates']} configurations costed")
        print(f"    CPU: trace {r['trace_cpu_s']:.2f} s + search {r['search_cpu_s']:.2f} s = "
              f"{r['total_cpu_s']:.2f} s")
        gap = (f", largest gap {r['worst_gap']:.2f}%" if r["worst_gap"] is not None
               else ", every one optimal or infeasible")
        print(f"    ILPs: {r['ilp_s']:.2f} s of solving in all, the slowest "
              f"{r['slowest_ilp_s']:.3f} s"
              f"{gap}")
        for line in r["solves"] if every else ():
            print(f"      {line}")
        print(f"    plan: {r['config']}  step {r['step_s']:.2f} s  MFU {r['mfu'] * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
