"""``autoplan diff A B``: what changed from plan A to plan B, and its predicted effect (the
formatting helpers are ``explain``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from autoplan.planner.explain import collapse_names, elide_rows
from autoplan.planner.text_format import fmt_bytes, fmt_change, fmt_pct, fmt_s, natural_key
from autoplan.planner.planfile import Plan

_FIRST = 5                 # changed items named in a diff


def diff_plans(a: Plan, b: Plan) -> str:
    """The text of ``autoplan diff A B``: what changed from plan A to plan B, and its effect."""
    if a.to_json() == b.to_json():
        return "no differences: the plans are identical\n"
    lines: list[str] = []
    ma, mb = a.model, b.model
    lines.append("model    same" + f" ({ma.name!r}, fingerprint {ma.fingerprint[:12]})"
                 if ma == mb else
                 f"model    {ma.name!r} ({ma.fingerprint[:12]}, {ma.num_params:,} parameters) -> "
                 f"{mb.name!r} ({mb.fingerprint[:12]}, {mb.num_params:,} parameters)")
    ca, cb = a.cluster, b.cluster
    if ca == cb:
        lines.append(f"cluster  same ({ca.name!r}, {ca.world_size:,} devices, fingerprint "
                     f"{ca.fingerprint[:12]})")
    else:
        lines.append(f"cluster  {ca.name!r} {ca.num_nodes}x{ca.devices_per_node} {ca.device} "
                     f"({ca.fingerprint[:12]}) -> {cb.name!r} {cb.num_nodes}x"
                     f"{cb.devices_per_node} {cb.device} ({cb.fingerprint[:12]})")
    training = _field_changes(a.training, b.training)
    if training:
        lines.append(f"training {training}")
    mesh_a = f"{' x '.join(a.mesh.axes)} = {' x '.join(map(str, a.mesh.shape))}"
    mesh_b = f"{' x '.join(b.mesh.axes)} = {' x '.join(map(str, b.mesh.shape))}"
    moved = sum(x != y for x, y in zip(a.mesh.rank_to_device, b.mesh.rank_to_device))
    if a.mesh == b.mesh:
        lines.append(f"mesh     same ({mesh_a}, TP over {a.mesh.tp_domain})")
    else:
        lines.append(f"mesh     {mesh_a} -> {mesh_b}; TP over {a.mesh.tp_domain} -> "
                     f"{b.mesh.tp_domain}" + (f"; {moved:,} ranks on other devices"
                                              if moved else ""))
    lines.append("config   " + (_field_changes(a.config, b.config) or "same")
                 + f"   [{a.config.short()} -> {b.config.short()}]")
    lines += _map_changes("module styles", a.module_styles, b.module_styles)
    lines += _map_changes("op strategies", a.op_strategies, b.op_strategies)
    def where(v: Any) -> str:
        return f"tp {v.tp} dp {v.dp}" + (f" ep {v.ep}" if v.ep != "R" else "")

    place_a = {k: where(v) for k, v in a.param_placements.items()}
    place_b = {k: where(v) for k, v in b.param_placements.items()}
    lines += _map_changes("placements", place_a, place_b)
    lines += _recompute_changes(a.recompute, b.recompute)
    lines += _stage_changes(a, b)
    offload = [f"{k} {a.offload.get(k)} -> {b.offload.get(k)}"
               for k in sorted(set(a.offload) | set(b.offload)) if a.offload.get(k) != b.offload.get(k)]
    if offload:
        lines.append("offload  " + ", ".join(offload))
    pa, pb = a.predicted, b.predicted
    lines += [
        "predicted effect",
        (f"  step time   {fmt_s(pa['step_time_s'])} -> {fmt_s(pb['step_time_s'])} "
        f"({fmt_change(pa['step_time_s'], pb['step_time_s'])})"),
        f"  peak memory {fmt_bytes(pa['peak_memory_bytes'])} -> {fmt_bytes(pb['peak_memory_bytes'])} "
        f"({fmt_change(pa['peak_memory_bytes'], pb['peak_memory_bytes'])})"
        + ("" if pb["fits"] else "  ** B DOES NOT FIT **"),
        f"  MFU         {fmt_pct(pa['mfu'])} -> {fmt_pct(pb['mfu'])}",
        f"  bubble      {fmt_s(pa['time']['bubble_s'])} -> {fmt_s(pb['time']['bubble_s'])}",
        (f"  throughput  {pa['samples_per_s']:,.2f} -> {pb['samples_per_s']:,.2f} samples/s "
        f"({fmt_change(pa['samples_per_s'], pb['samples_per_s'])})"),
    ]
    return "\n".join(lines) + "\n"


def _stage_of(plan: Plan) -> dict[str, int]:
    """Layer -> pipeline stage (0 for every layer of a plan without stages)."""
    if not plan.stages:
        return {path: 0 for path in plan.recompute}
    return {layer: st["index"] for st in plan.stages for layer in st["layers"]}


def _stage_changes(a: Plan, b: Plan) -> list[str]:
    if not a.stages and not b.stages:
        return []
    na, nb = max(1, len(a.stages)), max(1, len(b.stages))
    sa, sb = _stage_of(a), _stage_of(b)
    moved: dict[tuple[int, int], list[str]] = {}
    for layer in sa:
        if layer in sb and sa[layer] != sb[layer]:
            moved.setdefault((sa[layer], sb[layer]), []).append(layer)
    head = (f"stages   {na} -> {nb}" if na != nb else f"stages   same count ({na})")
    count = sum(len(v) for v in moved.values())
    lines = [head + f"; {count} of {len(sa)} layers on another stage"]
    rows = [f"  stage {x} -> {y}: {collapse_names(layers)}"
            for (x, y), layers in sorted(moved.items())]
    return lines + elide_rows(rows)


def _field_changes(x: Any, y: Any) -> str:
    return ", ".join(f"{f.name} {getattr(x, f.name)} -> {getattr(y, f.name)}" for f in fields(x)
                     if getattr(x, f.name) != getattr(y, f.name))


def _map_changes(title: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    changed = sorted((k for k in a.keys() & b.keys() if a[k] != b[k]), key=natural_key)
    added = sorted(b.keys() - a.keys(), key=natural_key)
    removed = sorted(a.keys() - b.keys(), key=natural_key)
    if not (changed or added or removed):
        return [f"{title}: same ({len(a):,})"]
    items = ([f"{k} {a[k]} -> {b[k]}" for k in changed] + [f"+{k} {b[k]}" for k in added]
             + [f"-{k} {a[k]}" for k in removed])
    more = len(items) - _FIRST
    return [(f"{title}: {len(changed):,} changed, {len(added):,} added, {len(removed):,} removed "
            f"(of {len(a):,} -> {len(b):,})"),
            *(f"  {s}" for s in items[:_FIRST])] + ([f"  ... {more:,} more"] if more > 0 else [])


def _recompute_changes(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    moves: dict[tuple[str, str], list[str]] = {}
    for k in sorted(a.keys() | b.keys(), key=natural_key):
        if a.get(k) != b.get(k):
            moves.setdefault((a.get(k, "-"), b.get(k, "-")), []).append(k)
    if not moves:
        return [f"recompute: same ({_summary(a)})"]
    n = sum(len(v) for v in moves.values())
    return [f"recompute: {n:,} block{'s' * (n != 1)} changed"] + [
        f"  {old} -> {new}: {collapse_names(paths)}" for (old, new), paths in moves.items()]


def _summary(m: Mapping[str, str]) -> str:
    counts: dict[str, int] = {}
    for v in m.values():
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none"
