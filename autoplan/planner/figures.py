"""Pictures of a plan: the pipeline timeline per rank (a Gantt chart) and memory over time.

Both come from the pipeline simulator run on the plan's predicted stages (per-stage forward and
backward time per micro-batch, activations kept per micro-batch); a stage's ``v`` chunks share
its time evenly and sends are drawn as free. What the step spends outside the drawn schedule
(waiting on sends, data-parallel sync not hidden, the optimizer step) is one grey block at the
end, so the timeline ends at the plan's step time. The memory lines reach, per rank, exactly the
activation memory the plan reports. matplotlib draws them (``pip install 'autoplan[plot]'``).

Communication that runs inside the forward and backward blocks and is not hidden (tensor-
parallel collectives, ring attention's passes, expert parallelism's all-to-all) is drawn as a
strip along the bottom of every block: its share of the bottleneck stage's per-micro-batch
time, by kind, since the plan records these totals for that stage only.
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
        s = stages[cfg.chunk_rank(c)]
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


# communication inside the compute blocks: comm_exposed_s key -> (legend, colour)
IN_BLOCK_COMM = {"tp": ("tensor-parallel collectives", "#8172B3"),
                 "cp_ring": ("context parallel: ring attention passes", "#C44E52"),
                 "ep_all_to_all": ("expert all-to-all", "#937860")}


def in_block_comm_shares(plan: Any) -> dict[str, float]:
    """Of a forward or backward block's time, the share of each kind of exposed communication
    inside it (``IN_BLOCK_COMM``), on the bottleneck stage: its totals per micro-batch over the
    stage's forward + backward time."""
    stages = plan.predicted["stages"]
    m = max(1, int(plan.predicted["num_microbatches"]))
    per_mb = max(s["fwd_s"] + s["bwd_s"] for s in stages)
    comm = plan.predicted["time"]["comm_exposed_s"]
    return {k: comm[k] / m / per_mb for k in IN_BLOCK_COMM
            if comm.get(k, 0.0) > 0 and per_mb > 0}


def draw_timeline(plan: Any, path: str) -> float:
    """One row per pipeline rank; forward blocks blue, backward orange (zero bubble: input
    gradients orange, weight gradients green), labelled by micro-batch; the exposed
    communication inside them as a strip along their bottom. Returns where the timeline ends
    (seconds)."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    sim = simulate_plan(plan)
    p = plan.config.pp
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 2.0))
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    shares = in_block_comm_shares(plan)
    for e in sim.events:
        y, width = p - 1 - e.rank, e.end_s - e.start_s
        ax.barh(y, width, left=e.start_s, height=0.8, color=colors[e.kind], edgecolor="white",
                linewidth=0.5)
        left = e.start_s
        # the block's exposed traffic, by kind (a weight gradient sends nothing)
        for k, share in (shares.items() if e.kind != "W" else ()):
            ax.barh(y - 0.3, width * share, left=left, height=0.2,
                    color=IN_BLOCK_COMM[k][1], linewidth=0)
            left += width * share
        if width > sim.makespan_s / 60:
            ax.text((e.start_s + e.end_s) / 2, p - 1 - e.rank, str(e.microbatch), ha="center",
                    va="center", fontsize=7, color="white")
    step_s = plan.predicted["step_time_s"]
    rest = step_s - sim.makespan_s
    if rest > 0:                        # p2p waits, exposed collectives, optimizer: after it
        for r in range(p):
            ax.barh(p - 1 - r, rest, left=sim.makespan_s, height=0.8, color="#B0B0B0",
                    edgecolor="white", linewidth=0.5)
        ax.text(sim.makespan_s + rest / 2, -0.7, f"not overlapped {rest:.3g} s", ha="center",
                va="center", fontsize=7)
    end = max(step_s, sim.makespan_s)
    ax.set_xlim(0, end)
    ax.set_yticks(range(p), [f"stage {p - 1 - r}" for r in range(p)])
    ax.set_xlabel(f"time per step (s): {step_s:.4g} s")
    bubble = sim.bubble_fraction()
    ax.set_title(f"{plan.config.short()}\n{plan.config.schedule if p > 1 else 'no pipeline'}, "
                 f"{len({e.microbatch for e in sim.events})} micro-batches, bubble "
                 f"{bubble * 100:.1f}%")
    legend = [Patch(color=colors["F"], label="forward"),
              Patch(color=colors["B"], label="backward")]
    if any(e.kind == "W" for e in sim.events):
        legend.append(Patch(color=colors["W"], label="weight gradients"))
    legend += [Patch(color=IN_BLOCK_COMM[k][1], label=f"{IN_BLOCK_COMM[k][0]} {v * 100:.1f}%")
               for k, v in shares.items()]
    legend.append(Patch(color="#B0B0B0", label="rest of the step"))
    # the legend below the axis label, in space of its own whatever the figure's height
    height = fig.get_size_inches()[1]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return end


def draw_memory(plan: Any, path: str) -> list[float]:
    """Memory per rank over one step: model states and buffers, plus activations in flight.
    Returns each rank's peak (bytes)."""
    plt = _pyplot()
    sim = simulate_plan(plan)
    gib = 2 ** 30
    fig, ax = plt.subplots(figsize=(12, 4.5))
    peaks: list[float] = []
    for r, line in enumerate(sim.memory_timeline):
        mem = plan.predicted["stages"][r]["memory"]
        static = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                      "transient_bytes", "margin_bytes"))
        # the plan's activation figure is the peak (its simulation also has sends and
        # collectives): scale this one's levels to reach it
        peak = max((level for _, level in line), default=0.0)
        scale = mem["activations_bytes"] / peak if peak > 0 else 0.0
        xs, ys = [], []
        for (t, level) in line:
            if xs:
                xs.append(t)
                ys.append(ys[-1])
            xs.append(t)
            ys.append((static + level * scale) / gib)
        peaks.append(max(ys, default=static / gib) * gib)
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
    return peaks
