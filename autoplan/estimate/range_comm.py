"""Communication inside an op range: the tensor-parallel (and context-parallel) collectives its
ops issue and the reshards between them, and the expert-parallel exchanges, priced as the
runtime runs them (``comm_bytes`` is also the sharding ILP's and the collective count's byte
rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.cost.dtypes import own_sizes
from autoplan.cost.memory import GRAD_BYTES, PRECISION_BYTES, held_meta_bytes, meta_bytes
from autoplan.estimate.cost_inputs import CostInputs, work_scale
from autoplan.estimate.overlap import overlap_exposed_s, overlap_interference
from autoplan.graph.analysis import GraphAnalysis
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.context_axis import share_at
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.strategy import divided_split


def comm_bytes(graph: OpGraph, a: GraphAnalysis, precision: str, value: str, scale: float,
               t: int, batch_scale: float, phase: str = "fwd", grad_shard: int = 1,
               kind: str = "", held: float = 1.0, sizes: Mapping[str, int] | None = None
               ) -> float:
    """Bytes of one tp-axis collective ``kind`` on ``value`` (``scale`` < 0: one tp shard of
    it), as the estimate, the sharding ILP and the runtime's collective count all take them: an
    activation at its micro-batch share, in the dtype autocast computes it in (``sizes``: bytes
    per element by value, ``HeldBytes.own``; its gradient has its dtype), else the precision's;
    a weight's gradient in fp32, as the runtime reduces gradients, and once per step (``phase``
    "step") of ZeRO-2/3's ``grad_shard``-way shard; a weight gathered again in backward
    (``all_gather``) in the training precision. ``held``: the share of the value the other axis
    leaves this rank (a cp axis's sequence piece)."""
    v = graph.value(value)
    nbytes = (meta_bytes(v.meta, precision) if v.kind == "param"
              else held_meta_bytes(value, v.meta, precision, sizes)) * held
    if value in a.batch_dependent:
        nbytes *= batch_scale
    nbytes *= 1.0 / t if scale < 0 else scale
    if phase == "step" or phase == "bwd" and v.kind == "param" and kind != "all_gather":
        nbytes *= GRAD_BYTES / PRECISION_BYTES[precision]
    if phase == "step":
        nbytes /= grad_shard
    return nbytes


def tp_comm_s(ci: CostInputs, start: int, stop: int) -> tuple[float, float, float, float]:
    """(forward, backward, per-step, ring) seconds of tp-axis collectives issued by
    ops[start:stop]: the strategies' own collectives and the reshards between producers and
    consumers, and those of a cp axis (``ci.context``); ``ring``: of forward + backward, what
    ring attention's passes leave exposed, and the cp axis's other traffic."""
    sh, graph, a, config, cx = ci.sharding, ci.graph, ci.analysis, ci.config, ci.context
    if sh.t == 1 and cx is None:
        return 0.0, 0.0, 0.0, 0.0
    t = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
    # ZeRO-2/3: the gradient is already sharded over dp when the tp step all-reduces it
    shard = config.shard_degree if config.zero_stage >= 2 else 1
    ring: dict[int, dict[str, float]] = {}
    own = own_sizes(ci.held)      # activations' autocast dtypes

    def held(i: int, name: str) -> float:
        return cx.held_scale(i, name) if cx is not None else 1.0
    # (axis, its sharding, group, the share of each value the other axis leaves a rank)
    axes = []
    if sh.t > 1:
        axes.append((sh, config.tp_group(), held))
    if cx is not None:
        # the cp axis: its ring passes and any reshard, at the tp piece of each value;
        # weights' gradients go with the dp x cp average (``dp_terms``), not here
        axes.append((cx.sharding, config.cp_group(),
                     lambda i, name: share_at(graph.ops[i], sh.op_strategy[i], name, sh.t)
                     or 1.0))
    ring_s = 0.0                  # ring passes and the rest of the cp axis's traffic
    for ax, group, share in axes:
        on_cp = ax is not sh
        for i, c in ax.comms(start, stop):
            if on_cp and c.phase == "step":
                continue
            nbytes = comm_bytes(graph, a, config.precision, c.value, c.scale, ax.t,
                                ci.batch_scale, c.phase, shard, c.kind, share(i, c.value), own)
            s = ci.cluster.collective_time_s(c.kind, nbytes, group)
            if ax.op_strategy[i].kernel == "ring_attention":
                ring.setdefault(i, {"fwd": 0.0, "bwd": 0.0})[c.phase] += s
            else:
                t[c.phase] += s
                ring_s += s if on_cp and c.phase != "step" else 0.0
        for r in ax.reshards_in(start, stop):
            nbytes = comm_bytes(graph, a, config.precision, r.value, r.scale, ax.t,
                                ci.batch_scale, r.phase, held=share(r.op_index, r.value),
                                sizes=own)
            s = ci.cluster.collective_time_s(r.kind, nbytes, group)
            t[r.phase] += s
            ring_s += s if on_cp else 0.0
    for i, parts in ring.items():
        # ring attention passes each block on while the previous one computes: only what
        # the attention's own compute does not cover is exposed
        c = ci.compute.op_cost(i, work_scale(a, graph, sh, i, ci.batch_scale, cx,
                                              ci.documents),
                               divided_split(graph, graph.ops[i], sh.op_strategy[i]))
        x = overlap_interference(ci.cluster)
        exposed = (overlap_exposed_s(parts["fwd"], c.fwd_s, 0.0, x),
                   overlap_exposed_s(parts["bwd"], c.bwd_s, 0.0, x))
        t["fwd"] += exposed[0]
        t["bwd"] += exposed[1]
        ring_s += sum(exposed)
    return t["fwd"], t["bwd"], t["step"], ring_s


def ep_comm_s(ci: CostInputs, start: int, stop: int) -> tuple[float, float]:
    """(forward, backward) seconds of the expert-parallel exchanges of ops[start:stop], where
    ``sharding/expert_regions.py`` puts them (as the runtime runs them): each dispatch sends a
    value's rows all-to-all to their experts' ranks (after an all-gather of the per-expert row
    counts), each combine brings a dispatched value's rows home; the backward sends the rows'
    gradients the same ways. Rows move at their tp-local size, and the busiest rank's at
    ``expert_load`` times the balanced share (1: every rank receives as many rows as it
    sends)."""
    config = ci.config
    regions = expert_regions(ci.graph, ci.sharding) if config.ep > 1 else None
    if regions is None:
        return 0.0, 0.0
    graph, sh, a = ci.graph, ci.sharding, ci.analysis
    group = config.ep_group()
    experts = find_experts(graph).num_experts
    own = own_sizes(ci.held)      # rows in autocast's dtype

    def a2a(value: str, p: Any) -> float:
        b = held_meta_bytes(value, graph.value(value).meta, config.precision, own)
        if value in a.batch_dependent:
            b *= ci.batch_scale
        return ci.cluster.collective_time_s(
            "all_to_all", ci.expert_load * b / (sh.t if p.kind == "S" else 1), group)
    fwd = bwd = 0.0
    seen = set()
    for i, x in regions.dispatch:
        p = sh.op_strategy[i].inputs[0]
        if start <= i < stop and (x, str(p)) not in seen:
            seen.add((x, str(p)))
            t = a2a(x, p)
            fwd += t + ci.cluster.collective_time_s("all_gather", 8.0 * experts * config.ep,
                                                    group)
            bwd += t
    for v in regions.combine:
        if start <= a.producer[v] < stop:
            t = a2a(v, sh.placement_of(graph, v))
            fwd += t
            bwd += t
    return fwd, bwd
