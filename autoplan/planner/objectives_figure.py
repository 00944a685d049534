"""The objectives search as a picture: run time against cost, and run time against energy, one
point per device count, drawn from the plan file's ``objectives`` section
(``objectives_report.section``). Filled points are on the Pareto front over (time, cost,
energy), hollow ones are beaten on all three, crosses were excluded (deadline, budget); the
plan's count is ringed; the deadline and the budget are drawn as lines. matplotlib is imported
when drawing (``figures_draw.pyplot``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.planner.figures_draw import WIDTH_IN, pyplot, save_figure
from autoplan.planner.objectives_report import JOULES_PER_KWH, gpus_text, is_chosen

FRONT, BEATEN, EXCLUDED, CHOSEN = "#2E4A7D", "#8C8C8C", "#C44E52", "#F28E2B"
MAX_LABELLED = 8


def _time_unit(seconds: list[float]) -> tuple[float, str]:
    top = max(seconds)
    for div, name in ((86_400.0, "days"), (3600.0, "hours"), (60.0, "minutes"), (1.0, "s"),
                      (1e-3, "ms")):
        if top >= 2 * div or div == 1e-3:
            return div, name
    return 1.0, "s"


def _panel(ax: Any, sec: Mapping[str, Any], key: str, scale: float, ylabel: str,
           tdiv: float, tname: str) -> None:
    pts = [p for p in sec["points"] if key in p]
    shown = 0
    for p in pts:
        x, y = p["run_time_s"] / tdiv, p[key] / scale
        if p["excluded"]:
            ax.scatter([x], [y], marker="x", s=70, color=EXCLUDED, zorder=3)
        elif p["pareto"]:
            ax.scatter([x], [y], s=70, color=FRONT, zorder=3)
        else:
            ax.scatter([x], [y], s=70, facecolors="white", edgecolors=BEATEN, zorder=3)
        if is_chosen(sec, p):
            ax.scatter([x], [y], s=320, facecolors="none", edgecolors=CHOSEN, linewidths=2.5,
                       zorder=2)
        label = p.get("devices") or f"{p['gpus']} GPU{'s' if p['gpus'] > 1 else ''}"
        # many points (pools: each pool's counts and the pools together): names on the front
        # and the plan only, the table lists the rest
        if len(pts) <= MAX_LABELLED or is_chosen(sec, p) or (p["pareto"] and not p["excluded"]):
            shown += 1            # alternately above and below: neighbours on a flat front
            ax.annotate(label, (x, y), textcoords="offset points",
                        xytext=(8, 6 if shown % 2 else -16), fontsize=10)
    front = sorted((p for p in pts if p["pareto"] and not p["excluded"]),
                   key=lambda p: p["run_time_s"])
    if len(front) > 1:
        ax.plot([p["run_time_s"] / tdiv for p in front], [p[key] / scale for p in front],
                color=FRONT, alpha=0.35, zorder=1)
    if "deadline_days" in sec:
        ax.axvline(sec["deadline_days"] * 86_400 / tdiv, color=EXCLUDED, linestyle="--",
                   linewidth=1.2, label=f"deadline {sec['deadline_days']:g} days")
    if key == "cost_usd" and "budget_usd" in sec:
        ax.axhline(sec["budget_usd"] / scale, color=EXCLUDED, linestyle=":", linewidth=1.2,
                   label=f"budget ${sec['budget_usd']:,.0f}")
    times = [p["run_time_s"] for p in pts]
    if times and max(times) > 8 * min(times) > 0:     # counts over decades: a log axis
        from matplotlib.ticker import FuncFormatter  # lazily: matplotlib is optional
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel(f"run time ({tname}{', log scale' if ax.get_xscale() == 'log' else ''})")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.margins(0.15)


def draw_front(sec: Mapping[str, Any], path: str) -> None:
    """Draw the objectives section ``sec`` to ``path`` (PNG, SVG or PDF by its suffix)."""
    plt = pyplot()
    from matplotlib.lines import Line2D    # lazily: matplotlib is optional (pyplot says so)
    e = sec["economics"]
    tdiv, tname = _time_unit([p["run_time_s"] for p in sec["points"]])
    panels = [(k, s, lab) for k, s, lab in (
        ("cost_usd", 1.0, "cost (USD at each pool's price per GPU-hour)"
         if len(sec.get("pool_economics", ())) > 1 else
         f"cost (USD at ${e['usd_per_gpu_hour']:g}/GPU-hour)"
         if e.get("usd_per_gpu_hour") is not None else "cost"),
        ("energy_joules", JOULES_PER_KWH, "energy (kWh, GPU boards)"))
        if any(k in p for p in sec["points"])]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(WIDTH_IN, 5.6), squeeze=False)
    for ax, (key, scale, label) in zip(axes[0], panels):
        _panel(ax, sec, key, scale, label, tdiv, tname)
    per = f"{sec['tokens']:,} tokens" if "tokens" in sec else "one step"
    won = sec.get("winners", {})
    where = sec.get("winner_devices", {})
    wins = ", ".join(f"{k}: {where.get(k) or gpus_text(won[k])}"
                     for k in ("time", "cost", "energy") if k in won)
    fig.suptitle(f"Device counts for {per}: objective {sec['objective']}, plan on "
                 f"{sec.get('chosen_devices') or gpus_text(sec['chosen_gpus'])} (ringed)\n"
                 f"best by {wins}", fontsize=12)
    handles = [Line2D([], [], marker="o", linestyle="", color=FRONT, label="Pareto front"),
               Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
                      markeredgecolor=BEATEN, label="beaten on time, cost and energy"),
               Line2D([], [], marker="x", linestyle="", color=EXCLUDED,
                      label="excluded (deadline or budget)"),
               Line2D([], [], marker="o", linestyle="", markerfacecolor="none",
                      markeredgecolor=CHOSEN, markersize=14, markeredgewidth=2.5,
                      label="the plan")]
    extra = list({h.get_label(): h for ax in axes[0]
                  for h in ax.get_legend_handles_labels()[0]}.values())
    fig.legend(handles=handles + extra, loc="lower center", ncol=len(handles) + len(extra),
               frameon=False, fontsize=10)
    power = (f"{e['tdp_watt']:g} W TDP x {e['compute_fraction']:g} computing / "
             f"{e['communication_fraction']:g} communicating / {e['idle_fraction']:g} idle "
             "(assumed)" if e.get("tdp_watt") is not None else "no power figure")
    fig.text(0.01, 0.005, f"{e['device']}; {power}; "
             + (f"{e['price_kind']} list price {e['price_date']}"
                if e.get("usd_per_gpu_hour") is not None else "no price")
             + ("; " + ", ".join(f"{x['device']} ${x['usd_per_gpu_hour']:g}/GPU-hour"
                                 for x in sec["pool_economics"][1:]
                                 if x.get("usd_per_gpu_hour") is not None)
                if len(sec.get("pool_economics", ())) > 1 else ""),
             fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.08, 1, 0.98))
    save_figure(fig, path)
    plt.close(fig)
