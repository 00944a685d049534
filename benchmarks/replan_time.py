"""Elastic re-planning time (issue 40 item 3): Llama-3-8B planned for 64 H100 (8 DGX nodes),
then re-planned for the nodes left or added, warm-started from the 64-GPU plan.

    python benchmarks/replan_time.py            # global batch 16 x 8,192 tokens (issue 15's)
    python benchmarks/replan_time.py 512        # another global batch
    python benchmarks/replan_time.py 16 3       # each timing the least of 3 runs (a loaded
                                                # machine only adds time)

Target: re-planning for 56 of 64 GPUs takes <= 1 s of CPU time on this machine. Each re-plan
runs in a fresh process, as a restarted rank does, and times ``replan`` alone: CPU time of the
process and of the CBC solver processes it runs. The rank traces the model for its program
anyway, so the trace is timed apart. Both batch policies (``--elastic-batch keep`` and
``nearest``), and beside them the full search on the same world from scratch (its CPU time and
its plan's predicted step), to show what the warm start gives up, if anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

MODEL, PRESET, NODES = "llama3-8b", "dgx-h100", 8
TARGETS = (7, 6, 4, 9)          # nodes after the change: 56, 48, 32 GPUs, and 72 (grown)


def _graph():
    import torch
    torch.set_num_threads(1)
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example(MODEL, device="meta", batch_size=1)
    t0 = time.process_time()
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets, name=MODEL)
    return g, time.process_time() - t0


def first(gbs: int) -> dict:
    from autoplan import Cluster, plan
    g, _ = _graph()
    p = plan(g, Cluster.preset(PRESET, nodes=NODES), global_batch_size=gbs, profile=None,
             name=MODEL)
    return {"config": p.config.to_dict(), "short": p.config.short(),
            "step_s": p.predicted["step_time_s"]}


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it waited for (CBC's solves)."""
    import resource
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one(nodes: int, gbs: int, config: dict, how: str) -> dict:
    from autoplan import Cluster, plan
    from autoplan.planner.replan import replan
    from autoplan.sharding.parallel_config import ParallelConfig
    g, trace_s = _graph()
    cluster = Cluster.preset(PRESET, nodes=nodes)
    t0 = _cpu_s()
    if how != "full":
        r = replan(g, cluster, last=ParallelConfig.from_dict(config), global_batch_size=gbs,
                   batch=how, name=MODEL)
        p, note, way = r.plan, r.batch_note, r.how
    else:
        p = plan(g, cluster, global_batch_size=gbs, profile=None, name=MODEL)
        note, way = "", "full search from scratch"
    cpu_s = _cpu_s() - t0
    return {"cpu_s": cpu_s, "trace_s": trace_s, "how": way, "note": note,
            "short": p.config.short(), "step_s": p.predicted["step_time_s"],
            "gbs": p.training.global_batch_size}


def _child(*args: str, repeat: int = 1) -> dict:
    """The answer of a fresh process; timed ``repeat`` times, the least CPU time kept (the
    planner is deterministic: every run finds the same plan)."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(runs, key=lambda r: r.get("cpu_s", 0.0))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--first"]:
        print(json.dumps(first(int(argv[1]))))
        return 0
    if argv[:1] == ["--one"]:
        print(json.dumps(one(int(argv[1]), int(argv[2]), json.loads(argv[3]), argv[4])))
        return 0
    gbs = int(argv[0]) if argv else 16
    repeat = int(argv[1]) if len(argv) > 1 else 1
    base = _child("--first", str(gbs))
    print(f"{MODEL}, global batch {gbs}, on {NODES * 8} H100: {base['short']}, predicted step "
          f"{base['step_s'] * 1e3:.1f} ms" + (f" (CPU times: the least of {repeat} runs)"
                                             if repeat > 1 else ""))
    cfg = json.dumps(base["config"])
    for nodes in TARGETS:
        f = _child("--one", str(nodes), str(gbs), cfg, "full", repeat=repeat)
        print(f"  -> {nodes * 8} GPUs (trace {f['trace_s']:.2f} s CPU apart): full search from "
              f"scratch {f['cpu_s']:.2f} s CPU: {f['short']}, step {f['step_s'] * 1e3:.1f} ms")
        for policy in ("keep", "nearest"):
            r = _child("--one", str(nodes), str(gbs), cfg, policy, repeat=repeat)
            kept = "batch kept" if r["gbs"] == gbs else f"batch {gbs} -> {r['gbs']}"
            print(f"     re-plan, batch {policy}: {r['cpu_s']:.2f} s CPU ({r['how']}, {kept}):"
                  f" {r['short']}, step {r['step_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
