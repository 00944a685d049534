"""Pictures of a plan: the pipeline timeline per rank (a Gantt chart) and memory over time.

Both come from the pipeline simulator run on the plan's predicted stages (per-stage forward and
backward time per micro-batch, activations kept per micro-batch); a stage's ``v`` chunks share
its time evenly and sends are drawn as free (their waiting is in the plan's ``pp_p2p`` time).
matplotlib draws them (``pip install 'autoplan[plot]'``).
"""

from __future__ import annotations

from typing import Any

from autoplan.errors import PlanError
from autoplan.estimate.pipeline_sim import PipelineResult, simulate


def simulate_plan(plan: Any) -> PipelineResult:
    cfg = plan.config
    pred = plan.predicted
    stages = pred["stages"]
    p, v = cfg.pp, cfg.virtual_stages
    m = int(pred["num_microbatches"])
    fwd, bwd, acts = [], [], []
    for c in range(p * v):
        s = stages[c % p]
        fwd.append(s["fwd_s"] / v)
        bwd.append(s["bwd_s"] / v)
        acts.append(s["activation_bytes_per_microbatch"] / v)
    return simulate(schedule=cfg.schedule if p > 1 else "1f1b", p=p, v=v, m=m, fwd_s=fwd,
                    bwd_s=bwd, activation_bytes=acts)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlanError("drawing needs matplotlib: pip install 'autoplan[plot]'") from e
    return plt


def draw_timeline(plan: Any, path: str) -> None:
    """One row per pipeline rank; forward blocks blue, backward orange (zero bubble: input
    gradients orange, weight gradients green), labelled by micro-batch."""
    plt = _pyplot()
    sim = simulate_plan(plan)
    p = plan.config.pp
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.6))
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    for e in sim.events:
        ax.barh(p - 1 - e.rank, e.end_s - e.start_s, left=e.start_s, height=0.8,
                color=colors[e.kind], edgecolor="white", linewidth=0.5)
        if (e.end_s - e.start_s) > sim.makespan_s / 60:
            ax.text((e.start_s + e.end_s) / 2, p - 1 - e.rank, str(e.microbatch), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"stage {p - 1 - r}" for r in range(p)])
    ax.set_xlabel("time per step (s)")
    bubble = sim.bubble_fraction()
    ax.set_title(f"{plan.config.short()}\n{plan.config.schedule if p > 1 else 'no pipeline'}, "
                 f"{len({e.microbatch for e in sim.events})} micro-batches, bubble "
                 f"{bubble * 100:.1f}%  (blue forward, orange backward"
                 + (", green weight gradients)" if any(e.kind == "W" for e in sim.events)
                    else ")"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_memory(plan: Any, path: str) -> None:
    """Memory per rank over one step: model states and buffers, plus activations in flight."""
    plt = _pyplot()
    sim = simulate_plan(plan)
    gib = 2 ** 30
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for r, line in enumerate(sim.memory_timeline):
        mem = plan.predicted["stages"][r]["memory"]
        static = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                      "transient_bytes", "margin_bytes"))
        xs, ys = [], []
        for (t, level) in line:
            if xs:
                xs.append(t)
                ys.append(ys[-1])
            xs.append(t)
            ys.append((static + level) / gib)
        xs.append(sim.makespan_s)
        ys.append(ys[-1])
        ax.plot(xs, ys, label=f"stage {r}")
    ax.axhline(plan.predicted["device_memory_bytes"] / gib, color="red", linestyle="--",
               label="device memory")
    ax.set_xlabel("time per step (s)")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{plan.config.short()}: memory per pipeline rank over one step")
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
