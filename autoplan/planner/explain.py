"""Human-readable text for plans: ``autoplan inspect`` (:func:`explain_plan`) and ``autoplan diff``
(:func:`diff_plans`).

Everything here reads a :class:`~autoplan.planner.planfile.Plan` only (no model, no cluster), so a
plan file explains itself on any machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from autoplan.cost.memory import bytes_per_param
from autoplan.estimate.dp_terms import HOST_STEP_SLOWDOWN, step_bytes_per_param
from autoplan.planner.explain_memory import memory_text, stage_total, time_text
from autoplan.planner.hetero_explain import hetero_text
from autoplan.planner.objectives_report import table as objectives_table
from autoplan.planner.planfile import Plan
from autoplan.planner.text_format import (fmt_bytes, fmt_change, fmt_pct, fmt_ranges, fmt_s,
                                          natural_key)
from autoplan.sharding import ring_work
from autoplan.sharding.mesh_axes import MeshAxis as A

_GRID_NODES = 4            # nodes shown before "...", then the last one
_GRID_COLUMNS = 16         # devices per node shown in full; more: the first 8 and the last
_ROWS = 20                 # table rows shown in full; more: the first 12 and the last 4
_STYLE_ORDER = ("colwise", "rowwise", "sequence_parallel", "vocab_parallel", "loss_parallel",
                "replicate")
_TP_DOMAIN = {
    "nvswitch": "NVSwitch (every GPU pair of a node at full NVLink bandwidth)",
    "nvlink": "direct NVLink links",
    "pcie": "PCIe (no NVLink: TP all-reduces are slow)",
    "node": "the node's internal links",
    "network": "the inter-node network (TP spans nodes: every layer's all-reduce crosses it)",
    "none": "nothing (tp = 1: no tensor parallelism)",
}
_INDEX = re.compile(r"^(.*?)(\d+)$")
_DEVICE = re.compile(r"^n(\d+)\.(.+)$")


# ================================================================ inspect
def explain_plan(plan: Plan) -> str:
    """The text of ``autoplan inspect``: what the plan is, where it runs, what it costs, why."""
    sections = (_header(plan), hetero_text(plan), _mesh_grid(plan), _chosen(plan), _blocks(plan),
                _placements(plan), _stages(plan), memory_text(plan), time_text(plan), _fp8(plan),
                _alternatives(plan), _solver(plan), _objectives(plan))
    return "\n\n".join(s for s in sections if s) + "\n"


def _objectives(plan: Plan) -> str:
    """The device-count search's front (plans of ``--objective`` and its options only)."""
    if plan.objectives is None:
        return ""
    return objectives_table(plan.objectives)


def _header(plan: Plan) -> str:
    m, c, t = plan.model, plan.cluster, plan.training
    return "\n".join([
        (f"model    {m.name!r}: {m.num_params:,} parameters, {m.num_ops:,} ops "
        f"(fingerprint {m.fingerprint[:12]})"),
        (f"cluster  {c.name!r}: {c.num_nodes} node{'s' * (c.num_nodes != 1)} x "
        f"{c.devices_per_node} {c.device if plan.hetero is None else 'devices: ' + c.device}"
        f" = {c.world_size:,} devices "
        f"(fingerprint {c.fingerprint[:12]})"),
        (f"training global batch {t.global_batch_size:,}, {t.precision}, {t.optimizer}"
        + (f", expert capacity factor {t.expert_capacity_factor:g}"
           if t.expert_capacity_factor != 1.0 else "") + "   "
        f"(autoplan {plan.autoplan_version}, plan schema {plan.schema_version})"),
    ] + _documents(plan) + _held_weights(plan))


def _documents(plan: Plan) -> list[str]:
    """What a plan for packed documents was priced for (``--seq-lengths``)."""
    h = plan.training.length_histogram()
    if h is None:
        return []
    return [f"data     priced for packed documents behind a document mask: "
            f"{h.describe().split(' (')[0]} in {len(h.lengths)} bins (training.seq_lengths); "
            "attention at what the kernel that runs computes: the expected masked work on a "
            "GPU (flex attention's block mask), the whole square on a CPU (SDPA's dense mask) "
            "and on a ring (every block whole, 1/c a rank)"]


def _held_weights(plan: Plan) -> list[str]:
    """A line for 16-bit weights with the fp32 master copy (``mixed_precision="params"``)."""
    cfg = plan.config
    if cfg.mixed_precision != "params" or cfg.precision == "fp32":
        return []
    return [f"weights  {cfg.precision} weights and activations, the fp32 master copy and "
            "gradient sums with the optimizer (mixed_precision=params, Megatron-LM's "
            f"--{cfg.precision}); no autocast: norms and softmax run in {cfg.precision} unless "
            "the model upcasts them"]


def _axis_labels(axes: Sequence[str]) -> list[str]:
    first = [a[0] for a in axes]
    return first if len(set(first)) == len(first) else [f"{a}=" for a in axes]


def _mesh_grid(plan: Plan) -> str:
    mesh = plan.mesh
    labels = _axis_labels(mesh.axes)
    where: dict[tuple[int, str], str] = {}
    for rank, dev in enumerate(mesh.rank_to_device):
        m = _DEVICE.match(dev)
        node, local = (int(m.group(1)), m.group(2)) if m else (0, dev)
        where[(node, local)] = ".".join(f"{lab}{c}" for lab, c in
                                        zip(labels, mesh.coordinates(rank)))
    nodes = sorted({n for n, _ in where})
    columns = sorted({d for _, d in where}, key=natural_key)
    shown_nodes: list[int | None] = list(nodes)
    if len(nodes) > _GRID_NODES + 1:
        shown_nodes = nodes[:_GRID_NODES] + [None] + nodes[-1:]
    shown_cols: list[str | None] = list(columns)
    if len(columns) > _GRID_COLUMNS:
        shown_cols = columns[:8] + [None] + columns[-1:]
    width = max([len(v) for v in where.values()] + [len(c) for c in columns] + [3])
    row_label = max(len(f"n{nodes[-1]}") if nodes else 2, 4)
    lines = [
        (f"mesh {' x '.join(mesh.axes)} = {' x '.join(map(str, mesh.shape))} on "
        f"{len(mesh.rank_to_device):,} devices; a TP group ({plan.config.tp} rank"
        f"{'s' * (plan.config.tp != 1)}) is joined by {_TP_DOMAIN.get(mesh.tp_domain, mesh.tp_domain)}"),
        "cell = " + ".".join(f"{lab}<i>" for lab in labels) + ": the index on mesh axes "
        + ", ".join(mesh.axes) + " of the rank on that device",
        (" " * (row_label + 4) + "  ".join((c or "...").ljust(width) for c in shown_cols)).rstrip(),
    ]
    for n in shown_nodes:
        if n is None:
            lines.append(f"  {'...':<{row_label}}  ({len(nodes) - _GRID_NODES - 1:,} more nodes)")
            continue
        cells = ["...".ljust(width) if c is None else where.get((n, c), "-").ljust(width)
                 for c in shown_cols]
        lines.append(f"  {'n' + str(n):<{row_label}}" + "  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _chosen(plan: Plan) -> str:
    p = plan.predicted
    tokens = p.get("tokens_per_s")
    line2 = (f"predicted step time {fmt_s(p['step_time_s'])}   MFU {fmt_pct(p['mfu'])}   "
             f"{p['samples_per_s']:,.2f} samples/s"
             + (f"   {tokens:,.0f} tokens/s" if tokens else "")
             + f"   peak memory {fmt_bytes(p['peak_memory_bytes'])}"
             + ("" if p["fits"] else "   ** DOES NOT FIT **"))
    off = [k for k, v in plan.offload.items() if v]
    return "\n".join([
        f"chosen   {plan.config.short()}   ({p['num_microbatches']:,} micro-batch"
        f"{'es' * (p['num_microbatches'] != 1)} per step"
        + (f", offload {' + '.join(off)} to "
           + ("NVMe" if plan.config.offload_nvme else "host") if off else "") + ")",
        line2,
    ] + _dimensions(plan) + _lossy(plan) + _optimizer_state(plan)
        + [f"warning: {w}" for w in p.get("warnings", ())])


def _lossy(plan: Plan) -> list[str]:
    """Lines saying where the plan's numerics differ from exact training."""
    cfg = plan.config
    if cfg.grad_compression != "powersgd":
        return []
    return [f"lossy    PowerSGD rank {cfg.powersgd_rank} compresses the dp all-reduce (torch's "
            f"DDP hook, error feedback): the gradients each step are a low-rank approximation, "
            f"so the numerics differ from exact training (its loss is not the one device's)"]
_STATE_LIBRARY = {"bf16": "bf16 (Megatron-Core's precision-aware optimizer; torchao's step)",
                  "8bit": "8 bits (torchao's AdamW8bit: blocks of 256, one fp32 scale each)"}


def _optimizer_state(plan: Plan) -> list[str]:
    """The line for Adam's moments held in less memory: the optimizer memory saved on the
    fullest device and the step's time against fp32 moments (on the device priced by the
    bytes it moves, ``estimate.dp_terms.step_bytes_per_param``; on the host slower than fp32,
    ``HOST_STEP_SLOWDOWN``), and that it is lossy."""
    cfg = plan.config
    if cfg.optimizer_state == "fp32":
        return []
    w, g, held = bytes_per_param(cfg.precision, cfg.optimizer, cfg.mixed_precision,
                                 cfg.optimizer_state)
    full = bytes_per_param(cfg.precision, cfg.optimizer, cfg.mixed_precision)[2]
    stages = plan.predicted.get("stages", ())
    opt_bytes = max((st["memory"]["optimizer_bytes"] for st in stages), default=0.0)
    off = max((st["memory"].get("offloaded_bytes", 0.0) for st in stages), default=0.0)
    where = "host" if cfg.offload_optimizer or cfg.offload_params else "device"
    # FSDP's CPU offload holds the weight and gradient shards on the host beside the state
    now = (off * held / (w + g + held) if cfg.offload_params
           else off if where == "host" else opt_bytes)
    step_s = plan.predicted["time"]["optimizer_s"]
    ratio = step_bytes_per_param(cfg) / step_bytes_per_param(replace(cfg, optimizer_state="fp32"))
    slow = HOST_STEP_SLOWDOWN[cfg.optimizer_state]
    step = (f"the step moves {ratio:.0%} of fp32's bytes: {fmt_s(step_s)} (about "
            f"{fmt_s(step_s / ratio)} with fp32 moments)" if where == "device" else
            f"the host's step runs torchao's on CPU tensors, {slow:g}x slower than the host's "
            f"fp32 Adam: {fmt_s(step_s)} (about {fmt_s(step_s / slow)} with fp32 moments)")
    return [f"optimizer Adam's moments in {_STATE_LIBRARY[cfg.optimizer_state]}: "
            f"{held:g} bytes of optimizer state per parameter instead of {full:g}, "
            f"{fmt_bytes(now)} per device{' in host memory' if where == 'host' else ''} "
            f"instead of {fmt_bytes(now * full / held)} "
            f"(saves {fmt_bytes(now * (full - held) / held)}); {step}. "
            "Lossy: numerics differ from exact AdamW"]


def _dimensions(plan: Plan) -> list[str]:
    """Lines for the parallel dimensions beside dp and tp: context parallelism (ring attention
    on the tp axis, or over a cp axis of its own) and expert parallelism (experts over ep dp
    ranks)."""
    cfg = plan.config
    out = []
    rings = sum(1 for k, v in plan.op_strategies.items()
                if k.startswith("scaled_dot_product") and v == "seq")
    if rings and cfg.tp > 1:
        out.append(f"context  the sequence split over tp ({cfg.tp} ranks): {rings} attention "
                   "op(s) run as ring attention (key/value blocks passed around the ring)")
    if cfg.cp > 1:
        attn = sum(1 for k in plan.op_strategies if k.startswith("scaled_dot_product"))
        out.append(f"context  every micro-batch's sequence split over cp ({cfg.cp} ranks), an "
                   f"axis of its own between dp and tp: {attn} attention op(s) run as ring "
                   "attention over it, every other op on its sequence piece; weights whole on "
                   f"it, gradients averaged over dp x cp ({cfg.grad_degree} ranks)")
        out.append(f"context  sequence layout {ring_work.describe(cfg.cp, cfg.cp_layout, True)}"
                   + (" (with a causal mask; without one every rank computes 1/cp)"
                      if cfg.cp_layout == "contiguous" else
                      "; inputs, labels, positions and masks are sliced so and gathers put "
                      "the sequence back in order"))
    if cfg.ep > 1:
        experts = sum(1 for p in plan.param_placements.values() if p.ep != "R")
        edp = cfg.dp // cfg.ep
        held = ("sharded over edp ({}) by FSDP, gathered per layer" if cfg.zero_stage == 3
                and edp > 1 else "replicated over edp ({})").format(edp)
        out.append(f"experts  {experts} expert weight(s) split over ep ({cfg.ep} dp ranks), "
                   f"{held}; routed rows exchanged all-to-all, once into and once out of "
                   "each MoE block")
    return out


# ---- per-block table --------------------------------------------------------------------------
def _block_paths(plan: Plan) -> list[str]:
    paths = set(plan.recompute)
    for st in plan.predicted.get("stages", ()):
        paths.update(st["layers"])
    return sorted(paths, key=natural_key)


def _style_summary(styles: Mapping[str, str]) -> str:
    """{"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": ...} -> "attn+mlp colwise/rowwise"."""
    if not styles:
        return "replicated (no module styles)"
    by_child: dict[str, set[str]] = {}
    for rel, style in styles.items():
        by_child.setdefault(rel.split(".", 1)[0] or "(block)", set()).add(style)
    groups: dict[tuple[str, ...], list[str]] = {}
    for child in sorted(by_child, key=natural_key):
        key = tuple(sorted(by_child[child], key=_style_key))
        groups.setdefault(key, []).append(child)
    return ", ".join(f"{_join_names(children)} {'/'.join(key)}" for key, children in groups.items())


def _join_names(names: list[str]) -> str:
    if len(names) <= 4:
        return "+".join(names)
    return f"{'+'.join(names[:3])} and {len(names) - 3} more"


def _blocks(plan: Plan) -> str:
    paths = _block_paths(plan)
    stage_of = {layer: st["index"] for st in plan.predicted.get("stages", ())
                for layer in st["layers"]}
    multi_stage = len(plan.predicted.get("stages", ())) > 1
    act = plan.predicted.get("activation_bytes_per_layer", 0.0)
    inner: dict[str, dict[str, str]] = {path: {} for path in paths}
    rest: dict[str, str] = {}
    for fqn, style in plan.module_styles.items():      # each module to its innermost block
        parts = fqn.split(".")
        for n in range(len(parts), 0, -1):
            block = ".".join(parts[:n])
            if block in inner:
                inner[block][".".join(parts[n:])] = style
                break
        else:
            rest[fqn] = style
    # stages recomputing differently keep different activations: there, a stage's average
    per_stage = {st["index"]: st["activation_bytes_per_microbatch"] / max(1, len(st["layers"]))
                 for st in plan.predicted.get("stages", ())} if plan.config.stage_recompute else {}
    # recomputation chosen per layer: each layer's own bytes, and why (saved / time it costs)
    per_layer = {row["layer"]: row for row in plan.predicted.get("layer_recompute", ())}
    rows = [(path, (_style_summary(inner[path]), plan.recompute.get(path, "-"),
                    stage_of.get(path) if multi_stage else None, _why(per_layer.get(path))))
            for path in paths]
    lines = [(f"blocks   (module styles, recompute, activations kept per micro-batch"
             f"{', pipeline stage' if multi_stage else ''}"
             f"{'; per layer: memory saved, recompute time per micro-batch' if per_layer else ''})")]
    table = []
    for label, (styles, recompute, stage, why) in _collapse(rows):
        kept = (why[0] if why else f"~{fmt_bytes(per_stage[stage])}" if stage in per_stage
                else fmt_bytes(act))
        table.append(f"  {label:<16} {styles}, recompute {recompute}, {kept} act"
                     + (f" ({why[1]})" if why else "")
                     + (f", stage {stage}" if multi_stage and stage is not None else ""))
    if not table:
        table.append("  (no repeated blocks)")
    lines += elide_rows(table)
    if rest:
        names = sorted(rest, key=natural_key)
        shown = ", ".join(f"{k} {rest[k]}" for k in names[:8])
        lines.append(f"  other modules: {shown}"
                     + (f" (+{len(names) - 8} more)" if len(names) > 8 else ""))
    return "\n".join(lines)


# ---- per-parameter placements -----------------------------------------------------------------
_STATE_NOTE = {1: "optimizer state", 2: "gradients and optimizer state"}


def axis_placement(plan: Plan, fqn: str, axis: str) -> str:
    """Where parameter ``fqn`` lies on mesh axis ``axis``: "R" (whole on every rank of the
    axis) or "S(d)" (dim d split over it). ZeRO-3/FSDP shards over dp, or under HSDP over
    dp_shard and replicates over dp_replicate; expert parallelism splits expert weights over
    ep and replicates them over edp; under context parallelism FSDP's shard spans the cp axis
    too (dp x cp flattened); a pipeline axis holds each weight on one stage."""
    p = plan.param_placements[fqn]
    return {A.TP: p.tp, A.DP: p.dp, A.DP_SHARD: p.dp, A.CP: p.dp, A.EP: p.ep}.get(axis, "R")


def generic_name(fqn: str, blocks: Sequence[str]) -> str:
    """``layers.7.attn.qkv.weight`` -> ``layers.*.attn.qkv.weight`` when layers.7 is a block."""
    for b in blocks:
        if fqn.startswith(b + "."):
            m = _INDEX.match(b)
            if m:
                return f"{m.group(1)}*{fqn[len(b):]}"
    return fqn


def _placements(plan: Plan) -> str:
    axes = [a for a in plan.mesh.axes if a != A.PP]
    blocks = sorted(_block_paths(plan), key=len, reverse=True)
    rows: dict[tuple[str, tuple[str, ...], tuple[int, ...]], int] = {}
    for fqn in sorted(plan.param_placements, key=natural_key):
        sig = tuple(axis_placement(plan, fqn, a) for a in axes)
        key = (generic_name(fqn, blocks), sig, plan.param_placements[fqn].shape)
        rows[key] = rows.get(key, 0) + 1
    if not rows:
        return ""
    shapes = {k: " x ".join(map(str, k[2])) or "scalar" for k in rows}
    wn = max(len(k[0]) for k in rows) + 2
    ws = max(len(s) for s in shapes.values()) + 2
    widths = [max(len(a), 4) + 2 for a in axes]
    lines = [("parameters   (placement on each mesh axis: R whole on every rank, S(d) dim d "
              "split; * = every layer)"),
             f"  {'name':<{wn}}{'shape':<{ws}}" + "".join(f"{a:<{w}}" for a, w in
                                                          zip(axes, widths)).rstrip()]
    table = [f"  {name:<{wn}}{shapes[(name, sig, shape)]:<{ws}}"
             + "".join(f"{s:<{w}}" for s, w in zip(sig, widths)).rstrip()
             for (name, sig, shape) in rows]
    lines += elide_rows(table)
    cfg = plan.config
    if cfg.grad_degree > 1 and cfg.zero_stage in _STATE_NOTE:
        over = f"dp_shard ({cfg.dp_shard})" if cfg.dp_shard else f"dp ({cfg.dp})"
        if cfg.cp > 1:
            over += f" x cp ({cfg.cp})"
        if cfg.ep > 1:
            over += f", the expert weights' over edp ({cfg.dp // cfg.ep})"
        lines.append(f"  ZeRO-{cfg.zero_stage}: {_STATE_NOTE[cfg.zero_stage]} sharded over "
                     f"{over}; the weights as above")
    return "\n".join(lines)


def _why(row: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(kept, "saves X, costs Y recompute") of a layer's chosen policy; None without one."""
    if row is None:
        return None
    # per-layer offload (``layer_offload``): what goes to the host and its exposed copies
    sent = (f"offloads {fmt_bytes(row['offloaded_bytes'])} to host, "
            f"{fmt_s(row['offload_s'])} exposed" if row.get("offloaded_bytes") else "")
    if row["policy"] == "none":
        if sent:
            return fmt_bytes(row["kept_bytes"]), f"recomputes nothing, {sent}"
        return fmt_bytes(row["kept_bytes"]), "recomputes nothing"
    return (fmt_bytes(row["kept_bytes"]), f"saves {fmt_bytes(row['saved_bytes'])}, costs "
            f"{fmt_s(row['recompute_s'])} recompute" + (f", {sent}" if sent else ""))


def _collapse(rows: list[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, tuple[Any, ...]]]:
    """Consecutive instances ("layers.3", "layers.4", ...) with one signature -> "layers.3-4"."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    run: list[Any] = []                  # [prefix, first, last, signature]
    for path, sig in rows:
        m = _INDEX.match(path)
        if m and run and run[0] == m.group(1) and run[2] + 1 == int(m.group(2)) and run[3] == sig:
            run[2] += 1
            continue
        if run:
            out.append((_run_label(run), run[3]))
        run = [m.group(1), int(m.group(2)), int(m.group(2)), sig] if m else []
        if not m:
            out.append((path, sig))
    if run:
        out.append((_run_label(run), run[3]))
    return out


def _run_label(run: list[Any]) -> str:
    prefix, first, last, _ = run
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"


def _stages(plan: Plan) -> str:
    if not plan.stages:
        return ""
    cfg, p = plan.config, plan.predicted
    step, bubble = p["step_time_s"], p["time"]["bubble_s"]
    sched = cfg.schedule + (f" x{cfg.virtual_stages} chunks per rank"
                            if cfg.virtual_stages > 1 else "")
    lines = [f"pipeline stages   {sched}, {p['num_microbatches']} micro-batches; bubble "
             f"{fmt_s(bubble)} ({fmt_pct(bubble / step if step else 0.0)} of the step)",
             f"  {'stage':<6} {'ranks':<12} {'devices':<20} {'fwd/mb':>10} {'bwd/mb':>10} "
             f"{'memory':>11}  {'recompute':<10} layers"]
    predicted = {st["index"]: st for st in p.get("stages", ())}
    devices = plan.mesh.rank_to_device
    rows = []
    for st in plan.stages:
        est = predicted.get(st["index"], {})
        chunks = st.get("chunks") or [st["layers"]]
        layers = " + ".join(collapse_names(c) for c in chunks)
        nodes = sorted({devices[r].split(".")[0] for r in st["ranks"] if r < len(devices)},
                       key=lambda n: (len(n), n))
        where = (nodes[0] if len(nodes) == 1 else f"{nodes[0]}..{nodes[-1]} ({len(nodes)} nodes)"
                 if nodes else "")
        mem = fmt_bytes(stage_total(est)) if est else ""
        policy = cfg.stage_policy(st["index"])
        rows.append(f"  {st['index']:<6} {fmt_ranges(st['ranks']):<12} {where:<20} "
                    f"{fmt_s(est.get('fwd_s', 0.0)):>10} {fmt_s(est.get('bwd_s', 0.0)):>10} "
                    f"{mem:>11}  {policy:<10} {layers}")
    return "\n".join(lines + elide_rows(rows))


def _fp8(plan: Plan) -> str:
    """fp8 plans: per linear layer (a repeated block's instances as one row when they agree),
    its (M, N, K) on one rank and one micro-batch's forward plus backward time in bf16 and in
    fp8, and whether fp8 pays there (the layers where it does not stay in bf16: fp8_skip)."""
    rows = plan.predicted.get("fp8_linears") or ()
    if plan.config.fp8 == "none" or not rows:
        return ""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        key = (re.sub(r"(?<![^.])\d+(?=\.)", "*", r["linear"]), r["m"], r["n"], r["k"],
               r["bf16_s"], r["fp8_s"], r["pays"])
        groups.setdefault(key, []).append(r["linear"])
    pays = sum(r["pays"] for r in rows)
    lines = [f"fp8 linear layers ({plan.config.fp8} scaling, torchao float8): {pays} of "
             f"{len(rows)} run in fp8, where the faster GEMMs outweigh the casts; the rest "
             f"stay in bf16 (config.fp8_skip)",
             f"  {'linear':<34} {'M x N x K (one rank)':>24} {'bf16':>10} {'fp8':>10}  pays"]
    for (name, m, n, k, t16, t8, ok), paths in groups.items():
        label = name if len(paths) > 1 else paths[0]
        lines.append(f"  {label:<34} {f'{m:,.0f} x {n:,.0f} x {k:,.0f}':>24} "
                     f"{fmt_s(t16):>10} {fmt_s(t8):>10}  {'yes' if ok else 'no'}"
                     + (f"  (x{len(paths)})" if len(paths) > 1 else ""))
    return "\n".join(elide_rows(lines))


def _alternatives(plan: Plan) -> str:
    if not plan.alternatives:
        return "alternatives: none recorded"
    chosen = plan.predicted["step_time_s"]
    # fitting ones first, fastest first; those that do not fit after, smallest first
    alternatives = sorted(plan.alternatives, key=lambda a: (not a.fits, a.step_time_s
                                                           if a.fits else a.peak_memory_bytes))
    names = [a.config.short() for a in alternatives]
    w = max(len(n) for n in names + ["config"])
    lines = [f"alternatives ({len(plan.alternatives)}; chosen {fmt_s(chosen)})",
             (f"  {'#':>2}  {'config':<{w}}  {'step time':>10}  {'vs chosen':>9}  "
             f"{'peak memory':>11}  fits  why it lost")]
    for i, (a, name) in enumerate(zip(alternatives, names), 1):
        lines.append(f"  {i:>2}  {name:<{w}}  {fmt_s(a.step_time_s):>10}  "
                     f"{fmt_change(chosen, a.step_time_s):>9}  "
                     f"{fmt_bytes(a.peak_memory_bytes):>11}  {'yes' if a.fits else 'NO ':<4}  "
                     f"{a.why_lost}")
    return "\n".join(lines)


def _solver(plan: Plan) -> str:
    s = plan.solver
    note = {"feasible": " (time limit hit: the solution is not proven optimal)",
            "infeasible": " (no sharding satisfied the constraints)",
            "not_solved": " (this plan's sharding needs no ILP: tensor parallelism 1 or a "
                          "baseline; the problem shown is the search's largest)"}.get(s.status, "")
    bound = "n/a" if s.bound_s is None else fmt_s(s.bound_s)
    gap = "n/a" if s.gap is None else f"{s.gap * 100:.2f}%"
    # a pipelined plan's ILP prices its schedule by critical paths and its collectives in
    # closed form; its prediction simulates both
    simulated = (f" (the schedule's critical paths, collectives in closed form; simulated, "
                 f"the plan's step is {fmt_s(plan.predicted['step_time_s'])})"
                 if plan.config.pp > 1 else "")
    return "\n".join([
        f"solver   {s.solver} {s.status}{note}",
        (f"  objective {fmt_s(s.objective_s)} per step{simulated}, bound {bound}, gap {gap}"
         if s.status != "not_solved" else f"  step time {fmt_s(s.objective_s)}"),
        (f"  problem {s.num_variables:,} variables, {s.num_constraints:,} constraints; search "
        f"{s.ilps_solved:,} ILPs solved, {s.candidates_evaluated:,} candidates evaluated"),
        *([f"  worst gap of the search's ILPs {_worst_gap(s.worst_gap)}"]
          if s.ilps_solved else []),
    ])


def _worst_gap(gap: float | None) -> str:
    if gap is None:
        return "unknown (an ILP stopped at its time limit with no bound to read)"
    return "0 (each proven optimal or infeasible)" if gap == 0 else f"{gap * 100:.2f}%"


def collapse_names(paths: Iterable[str]) -> str:
    """Module paths as few labels: the instances of a repeated block as one range."""
    rows = [(p, ()) for p in sorted(paths, key=natural_key)]
    return ", ".join(label for label, _ in _collapse(rows)) or "none"


def elide_rows(rows: list[str]) -> list[str]:
    """A long table's first 12 and last 4 rows, with how many are left out between."""
    if len(rows) <= _ROWS:
        return rows
    return rows[:12] + [f"  ... {len(rows) - 16:,} more"] + rows[-4:]


def _style_key(style: str) -> tuple[int, str]:
    return (_STYLE_ORDER.index(style) if style in _STYLE_ORDER else len(_STYLE_ORDER), style)

