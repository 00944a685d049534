"""Pictures of a plan: the step on a timeline per pipeline rank, and memory over the step.

Each picture is built in two stages: a function here computes what it shows from the plan alone
(typed values: :class:`TimelineFigure`, :class:`MemoryFigure`; tests check these), and
``figures_draw`` draws that with matplotlib (``draw_timeline``, ``draw_memory``) (``pip install 'autoplan[plot]'``).

The timeline accounts for the whole step, every item of the text report's time breakdown
(``autoplan inspect``'s "time per step") by name:

- a bar across the top splits the step into those items, each labelled with its time and share;
- below, per pipeline rank, the schedule as the pipeline simulator runs it on the plan's stages
  (a stage's ``v`` chunks share its forward and backward time evenly): forward, backward and
  weight-gradient blocks, the communication and recomputation inside them as a strip along
  their bottom, and the rank's idle time between them (the fill and drain bubble, and waiting
  on point-to-point sends). The plan records the exposed p2p time, not each send's, so every
  send across a rank boundary is drawn at one time, the one that makes the simulated step wait
  exactly that long (found by bisection; said on the picture);
- after the schedule, the parts of the step outside it: the gradient sync and ZeRO gathers not
  hidden behind compute, offload traffic, the optimizer step, the framework's per-op overhead.

A schedule with more blocks per rank than can be labelled (``MAX_BLOCKS``; 128 micro-batches
give hundreds) is drawn twice: the whole step with each rank's time grouped into columns (per
column, the share spent in forward, backward, weight gradients and idle), and one window at its
start (the warm-up and the first steady-state cycles) block by block. The picture says so.

The memory chart follows the fullest pipeline rank through the whole step, stacked: weights,
gradients, optimizer state, the largest op's temporaries plus the reserve, and activations,
which grow through each forward block and drain through each backward block as the schedule
runs them. The bands are the estimator's own per-stage figures, and the activations are scaled
so that their peak is the stage's predicted activation memory: the chart's peak is the plan's
predicted peak memory. The other ranks' totals are drawn as lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.estimate.pipeline_sim import Event, PipelineResult, simulate
from autoplan.planner.text_format import fmt_s as _fmt_s
from autoplan.sharding.parallel_config import SPLIT_BACKWARD

MAX_BLOCKS = 60        # blocks per rank drawn one by one; more: the whole step grouped + a window
COLUMNS = 150          # columns of the grouped whole-step view
WINDOW_CYCLES = 4      # steady-state cycles of the last rank to start shown in the window

# items of the text report's time breakdown (explain._time): key -> (what the legend calls it,
# the short name written on the bar, colour); other communication keys are drawn as "comm <key>"
PARTS = {
    "compute": ("compute (forward and backward blocks)", "compute", "#2E4A7D"),
    "recompute": ("recomputation (inside backward blocks)", "recompute", "#9C9EDE"),
    "comm tp": ("tensor-parallel collectives (inside blocks)", "tp comm", "#8172B3"),
    "comm cp_ring": ("ring attention passes (inside blocks)", "ring attention", "#C44E52"),
    "comm ep_all_to_all": ("expert all-to-all (inside blocks)", "all-to-all", "#937860"),
    "bubble": ("pipeline bubble (fill and drain, idle)", "bubble", "#C8C8C8"),
    "comm pp_p2p": ("waiting on pipeline sends (exposed p2p, idle)", "waiting on sends (p2p)",
                    "#E15759"),
    "comm dp_grad_sync": ("gradient sync not hidden by backward", "grad sync", "#17BECF"),
    "comm zero_param_gather": ("ZeRO weight gathers not hidden", "ZeRO gathers", "#8C564B"),
    "comm offload": ("offload transfers", "offload", "#C49C94"),
    "comm activation_offload": ("activation copies to the host and back, not hidden (inside "
                                "blocks)", "activation offload", "#B07AA1"),
    "optimizer": ("optimizer step", "optimizer", "#EDC948"),
    "overhead": ("framework overhead per op", "overhead", "#7F7F7F"),
}
IN_BLOCK = ("compute", "recompute", "comm tp", "comm cp_ring", "comm ep_all_to_all",
            "comm activation_offload")
IDLE = ("bubble", "comm pp_p2p")
# communication inside the compute blocks, drawn as strips: comm_exposed_s key -> PARTS key
# (an activation's copies wait in the blocks of the layer that saved it: estimator.py adds
# them to each chunk's forward and backward)
IN_BLOCK_COMM = {"tp": "comm tp", "cp_ring": "comm cp_ring", "ep_all_to_all": "comm ep_all_to_all",
                 "activation_offload": "comm activation_offload"}
BLOCK_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
BLOCK_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients"}


@dataclass(frozen=True)
class Part:
    """One item of the step's time breakdown, as the text report names it (``key``)."""
    key: str
    label: str
    short: str
    seconds: float
    color: str
    where: str           # "blocks" (inside forward/backward), "idle" (between them), "after"


@dataclass(frozen=True)
class Block:
    """A bar on a rank's row: a schedule action (kind F/B/W), idle time ("idle"), or a part of
    the step after the schedule (kind = a ``PARTS`` key)."""
    rank: int
    kind: str
    start_s: float
    end_s: float
    microbatch: int = -1


@dataclass(frozen=True)
class Column:
    """Of a rank's time in [start_s, end_s), the share in each block kind (F, B, W, idle)."""
    rank: int
    start_s: float
    end_s: float
    shares: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class TimelineFigure:
    title: str
    step_s: float
    ranks: int
    parts: tuple[Part, ...]              # the step's breakdown, in the report's order
    blocks: tuple[Block, ...]            # drawn one by one: all, or those in the window
    after: tuple[Block, ...]             # the parts after the schedule, on every rank
    columns: tuple[Column, ...]          # the grouped whole step (empty: blocks are all)
    window: tuple[float, float] | None   # the span ``blocks`` cover when grouped
    strips: tuple[tuple[str, str, float], ...]   # (part key, block kinds, share of the block)
    schedule_end_s: float                # where the schedule (and so the idle time) ends
    send_s: float                        # the time drawn for one send across a rank boundary
    notes: tuple[str, ...]               # what the picture says about how it is drawn

    @property
    def end_s(self) -> float:
        return max([self.step_s, self.schedule_end_s] + [b.end_s for b in self.after])


@dataclass(frozen=True)
class MemorySeries:
    """One pipeline rank's memory over the step: ``bands`` (label, bytes at each time), stacked
    in this order."""
    stage: int
    times_s: tuple[float, ...]
    bands: tuple[tuple[str, tuple[float, ...]], ...]

    @property
    def totals(self) -> tuple[float, ...]:
        return tuple(sum(vals) for vals in zip(*(v for _, v in self.bands)))


@dataclass(frozen=True)
class MemoryFigure:
    title: str
    step_s: float
    schedule_end_s: float
    device_bytes: float
    predicted_peak_bytes: float
    fullest: int                         # the stage drawn stacked
    series: tuple[MemorySeries, ...]     # every stage, by index


# ================================================================ the time breakdown
def time_parts(plan: Any) -> tuple[Part, ...]:
    """The items of the plan's time breakdown with a time above zero, in the order of the text
    report (compute, recompute, communication by kind, bubble, optimizer, overhead), each with
    where the timeline draws it."""
    t = plan.predicted["time"]
    items = [("compute", t["compute_s"]), ("recompute", t["recompute_s"])]
    items += [(f"comm {k}", v) for k, v in sorted(t["comm_exposed_s"].items())]
    items += [("bubble", t["bubble_s"]), ("optimizer", t["optimizer_s"]),
              ("overhead", t["overhead_s"])]
    out = []
    for key, secs in items:
        if secs <= 1e-9 * plan.predicted["step_time_s"]:      # zero, or rounding's residue
            continue
        label, short, color = PARTS.get(key, (key, key, "#A0A0A0"))
        where = "blocks" if key in IN_BLOCK else "idle" if key in IDLE else "after"
        out.append(Part(key, label, short, float(secs), color, where))
    return tuple(out)


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


def _strips(plan: Any) -> tuple[tuple[str, str, float], ...]:
    """The strips along the blocks' bottom: each in-block communication's share of forward and
    backward blocks, and recomputation's share of the backward blocks (where it runs)."""
    out = [(IN_BLOCK_COMM[k], "FB", share) for k, share in in_block_comm_shares(plan).items()]
    stages = plan.predicted["stages"]
    m = max(1, int(plan.predicted["num_microbatches"]))
    bwd = max(s["bwd_s"] for s in stages)
    recompute = plan.predicted["time"]["recompute_s"]
    if recompute > 0 and bwd > 0:
        out.append(("recompute", "B", min(1.0, recompute / m / bwd)))
    return tuple(out)


# ================================================================ the simulated schedule
def _simulate(plan: Any, send_s: float) -> PipelineResult:
    cfg = plan.config
    pred = plan.predicted
    stages = pred["stages"]
    p, v = cfg.pp, cfg.virtual_stages
    m = int(pred["num_microbatches"])
    fwd, bwd, acts = [], [], []
    for c in range(p * v):
        r = cfg.chunk_rank(c)
        s, share = stages[r], _chunk_shares(plan, r)[list(cfg.rank_chunks(r)).index(c)]
        fwd.append(s["fwd_s"] * share)
        bwd.append(s["bwd_s"] * share)
        acts.append(s["activation_bytes_per_microbatch"] * share)
    # one time per boundary; the simulator sends nothing between two chunks of one rank
    sends = [send_s] * (p * v - 1) if p > 1 and send_s > 0 else []
    return simulate(schedule=cfg.schedule if p > 1 else "1f1b", p=p, v=v, m=m, fwd_s=fwd,
                    bwd_s=bwd, send_s=sends, activation_bytes=acts)


def _chunk_shares(plan: Any, stage: int) -> list[float]:
    """Of a stage's time and activations, each of its chunks' share: by their layers (the plan
    records per-stage figures; a chunk's layers of one model cost alike), evenly when the plan
    does not list the chunks' layers."""
    v = plan.config.virtual_stages
    chunks = next((st.get("chunks") for st in plan.stages if st["index"] == stage), None)
    if not chunks or len(chunks) != v:
        return [1.0 / v] * v
    layers = [max(1, len(c)) for c in chunks]
    return [n / sum(layers) for n in layers]


def _after_parts(plan: Any) -> tuple[Part, ...]:
    return tuple(x for x in time_parts(plan) if x.where == "after")


def send_time_s(plan: Any) -> float:
    """The time of one send across a pipeline-rank boundary that makes the simulated schedule
    end where the plan's does (its step less the parts after the schedule): 0 without a
    pipeline or without exposed p2p. The simulated end grows with the send time, piecewise
    linearly (by the sends on the critical path), so false position finds it in a few
    simulations (Illinois variant, to 1e-6 of the step)."""
    p2p = plan.predicted["time"]["comm_exposed_s"].get("pp_p2p", 0.0)
    if plan.config.pp <= 1 or p2p <= 0:
        return 0.0
    target = plan.predicted["step_time_s"] - sum(x.seconds for x in _after_parts(plan))
    tol = 1e-6 * target

    def miss(send: float) -> float:
        return _simulate(plan, send).makespan_s - target

    lo, f_lo = 0.0, miss(0.0)
    if f_lo >= -tol:
        return 0.0
    hi, f_hi = p2p, miss(p2p)
    for _ in range(30):                  # every schedule sends at least once on its path
        if f_hi >= 0:
            break
        lo, f_lo, hi = hi, f_hi, 2 * hi
        f_hi = miss(hi)
    side = 0
    for _ in range(100):
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo) if f_hi != f_lo else (lo + hi) / 2
        f_mid = miss(mid)
        if abs(f_mid) <= tol or hi - lo <= 1e-12 * hi:
            return mid
        if f_mid < 0:
            lo, f_lo = mid, f_mid
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            hi, f_hi = mid, f_mid
            if side == 1:
                f_lo /= 2
            side = 1
    return (lo + hi) / 2


def simulate_plan(plan: Any) -> PipelineResult:
    """The plan's schedule as the pictures draw it: its stages, sends at ``send_time_s``."""
    return _simulate(plan, send_time_s(plan))


# ================================================================ the timeline
def timeline_figure(plan: Any) -> TimelineFigure:
    """What :func:`draw_timeline` draws (module doc)."""
    cfg, pred = plan.config, plan.predicted
    p, m = cfg.pp, int(pred["num_microbatches"])
    send = send_time_s(plan)
    sim = _simulate(plan, send)
    step = pred["step_time_s"]
    parts = time_parts(plan)
    # the parts after the schedule, one after another from its end
    after, t = [], sim.makespan_s
    for part in (x for x in parts if x.where == "after"):
        after += [Block(r, part.key, t, t + part.seconds) for r in range(p)]
        t += part.seconds
    blocks = tuple(_with_idle(sim.events, p, sim.makespan_s))
    per_rank = max((sum(1 for e in sim.events if e.rank == r) for r in range(p)), default=0)
    notes = []
    if send > 0:
        p2p = pred["time"]["comm_exposed_s"]["pp_p2p"]
        notes.append(f"each send between pipeline ranks drawn at {_fmt_s(send)}: the time that "
                     f"makes the simulated waits add up to the plan's exposed p2p "
                     f"({_fmt_s(p2p)}); the plan records that total, not each send")
    spread = [x.short for x in parts if x.key in ("overhead", "comm zero_param_gather",
                                                  "comm offload")]
    if spread:
        notes.append(f"{' and '.join(spread)}: spent through the step (before or between the "
                     "blocks), drawn after the schedule as one total")
    columns: tuple[Column, ...] = ()
    window = None
    if per_rank > MAX_BLOCKS:
        window = (0.0, _window_end(sim.events, p, cfg.schedule in SPLIT_BACKWARD))
        columns = tuple(_columns(sim.events, p, sim.makespan_s, COLUMNS))
        blocks = tuple(_clip(b, *window) for b in blocks if b.start_s < window[1])
        notes.insert(0, f"{m} micro-batches, {per_rank} blocks per rank: too many to draw one "
                        f"by one. Middle: the whole step, each rank's time grouped into "
                        f"{COLUMNS} columns (the share of each spent in forward, backward"
                        + (", weight gradients" if any(e.kind == "W" for e in sim.events)
                           else "")
                        + f" and idle). Bottom: its first {_fmt_s(window[1])} block by block "
                        "(the warm-up and the first steady-state cycles, which then repeat)")
    sched = cfg.schedule + (f" x{cfg.virtual_stages} chunks" if cfg.virtual_stages > 1 else "")
    title = (f"{cfg.short()}\n" + (f"{sched}, " if p > 1 else "no pipeline, ")
             + f"{m} micro-batch{'es' * (m != 1)}, step {_fmt_s(step)}")
    return TimelineFigure(title=title, step_s=step, ranks=p, parts=parts, blocks=blocks,
                          after=tuple(after), columns=columns, window=window,
                          strips=_strips(plan), schedule_end_s=sim.makespan_s, send_s=send,
                          notes=tuple(notes))


def _with_idle(events: tuple[Event, ...], p: int, end_s: float):
    """The schedule's blocks per rank, with the idle time between them (to ``end_s``)."""
    for r in range(p):
        t = 0.0
        for e in sorted((e for e in events if e.rank == r), key=lambda e: e.start_s):
            if e.start_s > t:
                yield Block(r, "idle", t, e.start_s)
            yield Block(r, e.kind, e.start_s, e.end_s, e.microbatch)
            t = max(t, e.end_s)
        if end_s > t:
            yield Block(r, "idle", t, end_s)


def _clip(b: Block, start: float, end: float) -> Block:
    return Block(b.rank, b.kind, max(b.start_s, start), min(b.end_s, end), b.microbatch)


def _window_end(events: tuple[Event, ...], p: int, split: bool) -> float:
    """Where the window at the start of a long schedule ends: ``WINDOW_CYCLES`` steady-state
    cycles (a forward and a backward, and a weight gradient under a split backward) after the
    first backward of the rank that starts last, with no rank past ``MAX_BLOCKS`` blocks in it."""
    by_rank = [sorted((e for e in events if e.rank == r), key=lambda e: e.start_s)
               for r in range(p)]
    last = by_rank[max((r for r in range(p) if by_rank[r]),
                       key=lambda r: by_rank[r][0].start_s)]
    first_b = next((i for i, e in enumerate(last) if e.kind == "B"), 0)
    k = min(len(last), first_b + 1 + WINDOW_CYCLES * (3 if split else 2))
    while k > 1:
        end = last[k - 1].end_s
        if max(sum(1 for e in evs if e.start_s < end) for evs in by_rank) <= MAX_BLOCKS:
            return end
        k -= 1
    return last[0].end_s


def _columns(events: tuple[Event, ...], p: int, end_s: float, n: int):
    """Per rank, ``n`` equal columns over [0, end_s): the share of each in F, B, W and idle."""
    width = end_s / n
    for r in range(p):
        busy = [dict.fromkeys("FBW", 0.0) for _ in range(n)]
        for e in events:
            if e.rank != r:
                continue
            i = min(n - 1, int(e.start_s / width))
            while i < n and i * width < e.end_s:
                lo, hi = max(e.start_s, i * width), min(e.end_s, (i + 1) * width)
                busy[i][e.kind] += max(0.0, hi - lo)
                i += 1
        for i, col in enumerate(busy):
            shares = [(k, col[k] / width) for k in "FBW" if col[k] > 0]
            idle = max(0.0, 1.0 - sum(s for _, s in shares))
            yield Column(r, i * width, (i + 1) * width, tuple(shares) + (("idle", idle),))


# ================================================================ memory
MEMORY_BANDS = (("weights", "params_bytes"), ("gradients", "grads_bytes"),
                ("optimizer state", "optimizer_bytes"))
WORKSPACE = "largest op's temporaries + reserve"


def memory_figure(plan: Any) -> MemoryFigure:
    """What :func:`draw_memory` draws (module doc)."""
    pred = plan.predicted
    sim = simulate_plan(plan)
    step = max(pred["step_time_s"], sim.makespan_s)
    series = []
    for st in pred["stages"]:
        r = st["index"]
        mem = st["memory"]
        times, acts = _activation_curve([e for e in sim.events if e.rank == r],
                                        sim.memory_timeline[r], step)
        peak = max(acts, default=0.0)
        scale = mem["activations_bytes"] / peak if peak > 0 else 0.0
        n = len(times)
        bands = [(label, (float(mem[key]),) * n) for label, key in MEMORY_BANDS]
        bands.append((WORKSPACE, (float(mem["transient_bytes"] + mem["margin_bytes"]),) * n))
        bands.append(("activations", tuple(a * scale for a in acts)))
        series.append(MemorySeries(r, tuple(times), tuple(bands)))
    fullest = max(series, key=lambda s: max(s.totals)).stage
    return MemoryFigure(
        title=f"{plan.config.short()}: memory per device over one step",
        step_s=step, schedule_end_s=sim.makespan_s, device_bytes=pred["device_memory_bytes"],
        predicted_peak_bytes=pred["peak_memory_bytes"], fullest=fullest, series=tuple(series))


def _activation_curve(events: list[Event], timeline: tuple[tuple[float, float], ...],
                      end_s: float) -> tuple[list[float], list[float]]:
    """A rank's activations over [0, end_s] as a piecewise-linear curve: each action changes
    them by what the simulator records at its end (a forward adds its micro-batch's, a backward
    frees them, under a split backward part at B and the rest at W), spread evenly over the
    action, as layers run one after another. At every action's end the curve equals the
    simulator's level, so its peak is the simulator's."""
    level_at: dict[float, float] = {}
    for t, level in timeline:              # the level once every change at t is applied
        level_at[t] = level
    times, levels = [0.0], [0.0]
    level = 0.0
    for e in sorted(events, key=lambda e: e.start_s):
        after = level_at.get(e.end_s, level)
        if e.start_s > times[-1]:
            times.append(e.start_s)
            levels.append(level)
        times.append(e.end_s)
        levels.append(after)
        level = after
    if end_s > times[-1]:
        times.append(end_s)
        levels.append(level)
    return times, levels
