"""Trace time and peak memory (RSS) of the example models on the meta device, up to GPT-3 175B
and the Megatron 1T config. Each model is traced in a fresh process so its peak RSS is its own.

    python benchmarks/trace_scale.py                 # all models
    python benchmarks/trace_scale.py gpt3-175b       # some models

Target (issue 2): GPT-3 175B traced in <= 30 s and <= 2 GB RSS on a 2-core laptop-class CPU.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

DEFAULT = ["mlp", "resnet50", "dlrm", "gpt2-small", "gpt2-xl", "llama3-8b", "gpt3-13b",
           "llama3-70b", "gpt3-175b", "gpt-1t"]


def one(name: str) -> dict:
    import torch

    from autoplan.graph import trace
    from autoplan.models import build_example
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ex = build_example(name, device="meta", batch_size=1)
    t1 = time.perf_counter()
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=name)
    t2 = time.perf_counter()
    text = graph.to_json()
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": name, "params_b": graph.num_params / 1e9, "ops": len(graph.ops),
            "blocks": sum(len(b.instances) for b in graph.blocks), "build_s": t1 - t0,
            "trace_s": t2 - t1, "json_mb": len(text) / 1e6, "peak_rss_gb": rss_kib / 1e6}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1])))
        return 0
    names = argv or DEFAULT
    print(f"{'model':12s} {'params':>9s} {'ops':>6s} {'layers':>6s} {'build s':>8s} "
          f"{'trace s':>8s} {'JSON MB':>8s} {'peak RSS GB':>12s}")
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                             text=True)
        if out.returncode != 0:
            print(f"{name:12s} FAILED: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['model']:12s} {r['params_b']:8.2f}B {r['ops']:6d} {r['blocks']:6d} "
              f"{r['build_s']:8.2f} {r['trace_s']:8.2f} {r['json_mb']:8.2f} "
              f"{r['peak_rss_gb']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
