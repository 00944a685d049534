"""matplotlib drawing of ``figures``' values: what is drawn is decided there, how here.

matplotlib is imported inside the functions, not at the top: it is an optional dependency
(``pip install 'autoplan[plot]'``), and importing the planner must not need it.
"""

from __future__ import annotations

import textwrap
from typing import Any

from autoplan import plotting
from autoplan.errors import PlanError
from autoplan.planner.text_format import fmt_bytes, fmt_s
from autoplan.planner.figures import (BLOCK_COLORS, BLOCK_NAMES, PARTS, MemoryFigure, Part,
                                      TimelineFigure, memory_figure, timeline_figure)

WIDTH_IN = 13.0
IDLE_FACE, IDLE_HATCH = "#F7F7F7", "#F09A9B"
GIB = 2 ** 30


def pyplot() -> Any:
    return plotting.pyplot(PlanError)


def _ink(color: str) -> str:
    """Black text on light colours, white on dark ones ("#RRGGBB", by relative luminance)."""
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.6 else "white"


def _share(x: float, whole: float) -> str:
    return f"{x / whole * 100:.1f}%" if whole > 0 else ""


# ================================================================ timeline
def timeline(fig_data: TimelineFigure, path: str) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle
    f = fig_data
    p = f.ranks
    grouped = bool(f.columns)
    heights = [0.9] + ([0.32 * p + 0.7] if grouped else []) + [0.42 * p + 0.8]
    notes = [textwrap.fill(n, 170) for n in f.notes]
    note_lines = sum(n.count("\n") + 1 for n in notes)
    legend_rows = (len(f.parts) + 3 + len(f.strips)) // 3 + 1
    foot = 0.25 + 0.16 * (legend_rows + note_lines)
    fig = plt.figure(figsize=(WIDTH_IN, sum(heights) + 1.1 + foot))
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    _breakdown(axes[0], f)
    if grouped:
        _grouped(axes[1], f)
        lo, hi = f.window
        axes[1].add_patch(Rectangle((lo, -0.55), hi - lo, p + 0.1, fill=False, lw=1.2,
                                    ec="black", ls="--", zorder=5))
        axes[1].set_title("the whole step, grouped (dashed: the start, enlarged below)",
                          fontsize=9, loc="left")
        _blocks(axes[2], f, xlim=f.window)
        axes[2].set_title(f"the first {fmt_s(hi)} of the step, block by block", fontsize=9,
                          loc="left")
    else:
        _blocks(axes[1], f, xlim=(0.0, f.end_s))
        axes[1].set_title("per pipeline rank" if p > 1 else "the step", fontsize=9, loc="left")
    for ax in axes:
        _time_axis(ax, f.end_s, label=ax is axes[-1])
    fig.suptitle(f.title, fontsize=11)

    handles = [Patch(color=BLOCK_COLORS[k], label=BLOCK_NAMES[k]) for k in "FBW"
               if any(b.kind == k for b in f.blocks) or
               any(k == s for c in f.columns for s, _ in c.shares)]
    idle = [x.short for x in f.parts if x.where == "idle"]
    if any(b.kind == "idle" for b in f.blocks) or f.columns:
        handles.append(Patch(facecolor=IDLE_FACE, edgecolor=IDLE_HATCH, hatch="////",
                             label="idle" + (": " + " and ".join(idle) if idle else "")))
    handles += [Patch(color=x.color, label=f"{x.label}: {fmt_s(x.seconds)}, "
                      f"{_share(x.seconds, f.step_s)}") for x in f.parts]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, (0.1 + 0.16 * note_lines) / fig.get_figheight()))
    if notes:
        fig.text(0.01, 0.08 / fig.get_figheight(), "\n".join(notes), fontsize=7,
                 va="bottom", ha="left", color="#333333")
    fig.tight_layout(rect=(0, foot / fig.get_figheight(), 1, 1))
    save_figure(fig, path)
    plt.close(fig)


def _ordered(parts: tuple[Part, ...]) -> list[Part]:
    where = {"blocks": 0, "idle": 1, "after": 2}
    return sorted(parts, key=lambda x: where[x.where])


def _breakdown(ax: Any, f: TimelineFigure) -> None:
    """One bar, the step split into its parts, each named on the bar where it is wide enough
    (and in the legend in any case)."""
    t = 0.0
    for x in _ordered(f.parts):
        ax.barh(0, x.seconds, left=t, height=0.8, color=x.color, edgecolor="white",
                linewidth=0.8)
        text = f"{x.short}\n{fmt_s(x.seconds)}, {_share(x.seconds, f.step_s)}"
        # named on the bar where the text fits (about 1/160 of the width a character)
        if x.seconds >= f.end_s * (max(map(len, text.split("\n"))) + 2) / 160:
            ax.text(t + x.seconds / 2, 0, text, ha="center", va="center", fontsize=7.5,
                    color=_ink(x.color))
        t += x.seconds
    ax.set_xlim(0, f.end_s)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_title("where the step goes (the slowest stage, as `autoplan inspect` reports it)",
                 fontsize=9, loc="left")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _rank_axis(ax: Any, p: int) -> None:
    ax.set_yticks(range(p), [f"stage {p - 1 - y}" for y in range(p)] if p > 1 else ["rank"])
    ax.set_ylim(-0.6, p - 0.4)


def _after(ax: Any, f: TimelineFigure) -> None:
    """The parts after the schedule, on every rank, named on the first where they fit."""
    p = f.ranks
    parts = {x.key: x for x in f.parts}
    for b in f.after:
        y = p - 1 - b.rank
        ax.barh(y, b.end_s - b.start_s, left=b.start_s, height=0.8,
                color=parts[b.kind].color, linewidth=0)
        if b.rank == 0 and b.end_s - b.start_s >= 0.05 * f.end_s:
            ax.text((b.start_s + b.end_s) / 2, y, parts[b.kind].short, ha="center",
                    va="center", fontsize=7, color=_ink(parts[b.kind].color),
                    rotation=90 if p > 2 else 0)


def _rects(ax: Any, rects: list[tuple[float, float, float, float]], **style: Any) -> None:
    """Rectangles (x, y, width, height) as one collection: thousands of blocks draw in a
    fraction of a second, where one patch each takes seconds."""
    if not rects:
        return
    from matplotlib.collections import PolyCollection
    ax.add_collection(PolyCollection(
        [((x, y), (x + w, y), (x + w, y + h), (x, y + h)) for x, y, w, h in rects], **style))


def _idle_style() -> dict[str, Any]:
    return dict(facecolor=IDLE_FACE, hatch="////", edgecolor=IDLE_HATCH, linewidth=0)


def _grouped(ax: Any, f: TimelineFigure) -> None:
    """The whole step, each rank's row split into columns stacked by what the rank did."""
    p = f.ranks
    rects: dict[str, list] = {k: [] for k in ("F", "B", "W", "idle")}
    for c in f.columns:
        y = p - 1 - c.rank - 0.4
        for kind, share in c.shares:
            rects[kind].append((c.start_s, y, c.end_s - c.start_s, share * 0.8))
            y += share * 0.8
    for kind in ("F", "B", "W"):
        _rects(ax, rects[kind], facecolor=BLOCK_COLORS[kind], linewidth=0)
    _rects(ax, rects["idle"], **_idle_style())
    _after(ax, f)
    ax.set_xlim(0, f.end_s)
    _rank_axis(ax, p)


def _blocks(ax: Any, f: TimelineFigure, xlim: tuple[float, float]) -> None:
    """Each block: forward, backward, weight gradients labelled by micro-batch, the strips of
    communication and recomputation inside them, idle time hatched."""
    p = f.ranks
    span = xlim[1] - xlim[0]
    parts = {x.key: x for x in f.parts}
    rects: dict[str, list] = {}
    for b in f.blocks:
        y, width = p - 1 - b.rank, b.end_s - b.start_s
        rects.setdefault(b.kind, []).append((b.start_s, y - 0.4, width, 0.8))
        if b.kind == "idle":
            continue
        left = b.start_s
        for key, kinds, share in f.strips:
            if b.kind in kinds:
                rects.setdefault(key, []).append((left, y - 0.4, width * share, 0.2))
                left += width * share
        if width > span / 70 and b.microbatch >= 0:
            ax.text(b.start_s + width / 2, y + 0.08, str(b.microbatch), ha="center",
                    va="center", fontsize=6.5, color="white")
    _rects(ax, rects.pop("idle", []), **_idle_style())
    for kind in ("F", "B", "W"):
        _rects(ax, rects.pop(kind, []), facecolor=BLOCK_COLORS[kind], edgecolor="white",
               linewidth=0.5)
    for key, strip in rects.items():           # the strips, over their blocks
        color = parts[key].color if key in parts else PARTS[key][2]
        _rects(ax, strip, facecolor=color, linewidth=0)
    if xlim[1] >= f.end_s:
        _after(ax, f)
    ax.set_xlim(*xlim)
    _rank_axis(ax, p)


# ================================================================ memory
MEMORY_COLORS = ("#4C72B0", "#DD8452", "#59A14F", "#BAB0AC", "#E15759")


def memory(fig_data: MemoryFigure, path: str) -> None:
    """Left: the fullest stage over the step, stacked. Right (with a pipeline): every stage at
    its peak, stacked the same way."""
    plt = pyplot()
    f = fig_data
    many = len(f.series) > 1
    fig, axes = plt.subplots(1, 2 if many else 1, figsize=(WIDTH_IN, 5.2), squeeze=False,
                             gridspec_kw={"width_ratios": [4, 1.2] if many else [1]},
                             sharey=True)
    ax = axes[0][0]
    full = f.series[f.fullest]
    ax.stackplot(full.times_s, *[[v / GIB for v in vals] for _, vals in full.bands],
                 labels=[label for label, _ in full.bands], colors=MEMORY_COLORS,
                 alpha=0.9, linewidth=0)
    totals = full.totals
    i = max(range(len(totals)), key=totals.__getitem__)
    ax.plot([full.times_s[i]], [totals[i] / GIB], "kv", ms=5)
    ax.annotate(f"peak {fmt_bytes(totals[i])} (the plan predicts "
                f"{fmt_bytes(f.predicted_peak_bytes)})", (full.times_s[i], totals[i] / GIB),
                xytext=(4, 6), textcoords="offset points", fontsize=8)
    ax.axhline(f.device_bytes / GIB, color="red", linestyle="--", lw=1,
               label=f"device memory {fmt_bytes(f.device_bytes)}")
    top = max(f.device_bytes, max(totals)) / GIB * 1.1
    if f.step_s - f.schedule_end_s > 0.03 * f.step_s:
        ax.axvspan(f.schedule_end_s, f.step_s, color="#EEEEEE", zorder=0)
        ax.text((f.schedule_end_s + f.step_s) / 2, top * 0.97, "after the schedule",
                ha="center", va="top", fontsize=7)
    ax.set_xlim(0, f.step_s)
    ax.set_ylim(0, top)
    _time_axis(ax, f.step_s)
    ax.set_ylabel("GiB per device")
    ax.set_title((f"stage {f.fullest} (the fullest) over the step" if many else
                  "over the step") + ": activations grow through each forward, drain through "
                 "each backward", fontsize=9, loc="left")
    handles, labels = ax.get_legend_handles_labels()
    # the legend on the side away from the peak's note
    ax.legend(handles[::-1], labels[::-1], fontsize=8, ncol=2,
              loc="upper right" if full.times_s[i] < f.step_s / 2 else "upper left")
    if many:
        _stage_peaks(axes[0][1], f)
    fig.suptitle(f.title, fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _stage_peaks(ax: Any, f: MemoryFigure) -> None:
    """Each stage at its peak: the bands where its total is highest."""
    for s in f.series:
        tot = s.totals
        i = max(range(len(tot)), key=tot.__getitem__)
        bottom = 0.0
        for (label, vals), color in zip(s.bands, MEMORY_COLORS):
            ax.bar(s.stage, vals[i] / GIB, bottom=bottom, color=color, width=0.75,
                   edgecolor="black" if s.stage == f.fullest else "white",
                   linewidth=1.0 if s.stage == f.fullest else 0.3)
            bottom += vals[i] / GIB
    ax.axhline(f.device_bytes / GIB, color="red", linestyle="--", lw=1)
    ax.set_xticks([s.stage for s in f.series])
    ax.set_xlabel("pipeline stage")
    ax.set_title("each stage at its peak", fontsize=9, loc="left")


def _time_axis(ax: Any, end_s: float, label: bool = True) -> None:
    """Seconds on the time axis, or milliseconds for a step under a second."""
    from matplotlib.ticker import FuncFormatter
    ms = end_s < 1.0
    if ms:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 1e3:g}"))
    if label:
        ax.set_xlabel(f"time in the step ({'ms' if ms else 's'})")


def save_figure(fig: Any, path: str) -> None:
    fig.savefig(path, dpi=120)


# ---- entry points ----------------------------------------------------------------------------

def draw_timeline(plan: Any, path: str) -> float:
    """Draw :func:`figures.timeline_figure` to ``path`` (PNG, SVG or PDF by its suffix);
    returns where the timeline ends (seconds): the plan's step time."""
    fig = timeline_figure(plan)
    timeline(fig, path)
    return fig.end_s


def draw_memory(plan: Any, path: str) -> list[float]:
    """Draw :func:`figures.memory_figure` to ``path``; returns each stage's peak (bytes),
    which is its predicted memory."""
    fig = memory_figure(plan)
    memory(fig, path)
    return [max(s.totals) for s in fig.series]
