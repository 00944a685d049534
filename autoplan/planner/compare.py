"""A plan's sharding next to Megatron-LM's, on the model it was made for (``autoplan inspect
PLAN --model M``).

The plan file names a strategy per op; with the model traced again (its fingerprint must match
the plan's) both the plan's sharding and Megatron-LM's rule for the same tensor-parallel degree
(and sequence parallelism) are rebuilt and estimated under the plan's configuration, with the
same cost inputs. What differs is listed per parameter (its tp placement) and per op, and the
difference in predicted step time is the saving the plan's per-op choice makes (or costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.errors import PlanError
from autoplan.estimate.estimator import estimate
from autoplan.graph.opgraph import OpGraph
from autoplan.planner.explain import generic_name
from autoplan.planner.text_format import fmt_bytes, fmt_s
from autoplan.planner.op_binding import bind_strategies
from autoplan.planner.planfile import Plan, model_fingerprint
from autoplan.sharding.sharding import Sharding, megatron_sharding
from autoplan.sharding.strategies import strategies_by_name


@dataclass(frozen=True)
class ShardingComparison:
    """The plan's sharding and Megatron-LM's under one configuration."""

    tp: int
    sequence_parallel: bool
    plan_step_s: float
    megatron_step_s: float
    plan_peak_bytes: float
    megatron_peak_bytes: float
    megatron_fits: bool
    params: tuple[tuple[str, str, str], ...]    # (fqn, plan's tp placement, Megatron's)
    num_params: int
    ops: tuple[tuple[str, str, str], ...]       # (op, plan's strategy, Megatron's)
    num_ops: int

    @property
    def saving(self) -> float:
        """Step time the plan saves against Megatron-LM's rule (negative: it costs more)."""
        return 1.0 - self.plan_step_s / self.megatron_step_s


def plan_sharding(plan: Plan, graph: OpGraph) -> Sharding:
    """The plan's per-op strategies on ``graph`` (the model the plan was made for)."""
    if plan.model.fingerprint != model_fingerprint(plan, graph):
        raise PlanError(f"the model's graph (fingerprint {graph.fingerprint()[:12]}) is not the "
                        f"one the plan was made for ({plan.model.fingerprint[:12]}); pass the "
                        "same model, sequence length and layers as to `autoplan plan`")
    t = plan.config.tp
    chosen = []
    bound = bind_strategies(plan, graph).strategies      # by canonical key (op_binding)
    for op in graph.ops:
        options = strategies_by_name(graph, op, t)
        name = bound.get(op.name)
        if name not in options:
            raise PlanError(f"op {op.name!r}: the plan's strategy {name!r} is not one of "
                            f"{sorted(options)}; re-plan with this autoplan version")
        chosen.append(options[name])
    return Sharding.build(graph, t, chosen)


def vs_megatron(plan: Plan, graph: OpGraph, cluster: Any,
                profile: Any = "auto") -> ShardingComparison | None:
    """The comparison, or None when the plan has no tensor parallelism (nothing to compare)."""
    cfg = plan.config
    if cfg.tp == 1:
        return None
    mine = plan_sharding(plan, graph)
    theirs = megatron_sharding(graph, cfg.tp, cfg.sequence_parallel)
    gbs = plan.training.global_batch_size
    cf = plan.training.expert_capacity_factor
    docs = plan.training.length_histogram()
    a = estimate(graph, cluster, config=cfg, global_batch_size=gbs, profile=profile,
                 sharding=mine, expert_capacity_factor=cf, seq_lengths=docs)
    b = estimate(graph, cluster, config=cfg, global_batch_size=gbs, profile=profile,
                 sharding=theirs, expert_capacity_factor=cf, seq_lengths=docs)
    params = [(fqn, plan.param_placements[fqn].tp, meg)
              for fqn, meg in theirs.param_placement_text(graph).items()
              if fqn in plan.param_placements and plan.param_placements[fqn].tp != meg]
    ops = [(op.name, s.name, m.name) for op, s, m in zip(graph.ops, mine.op_strategy,
                                                         theirs.op_strategy) if s.name != m.name]
    return ShardingComparison(
        tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, plan_step_s=a.step_time_s,
        megatron_step_s=b.step_time_s, plan_peak_bytes=a.peak_memory_bytes,
        megatron_peak_bytes=b.peak_memory_bytes, megatron_fits=b.fits, params=tuple(params),
        num_params=len(plan.param_placements), ops=tuple(ops), num_ops=len(graph.ops))


def explain_comparison(plan: Plan, cmp: ShardingComparison | None, shown: int = 12) -> str:
    """The text ``autoplan inspect --model`` adds."""
    if cmp is None:
        return ("vs Megatron-LM: the plan has no tensor parallelism (tp = 1), so there is no "
                "per-op sharding to compare\n")
    sp = " with sequence parallelism" if cmp.sequence_parallel else ""
    verdict = (f"the plan saves {cmp.saving * 100:.1f}%" if cmp.saving > 5e-4 else
               f"the plan costs {-cmp.saving * 100:.1f}% more" if cmp.saving < -5e-4 else
               "the same predicted step time")
    lines = [f"vs Megatron-LM's sharding (tp {cmp.tp}{sp}), the plan's configuration otherwise "
             f"({plan.config.short()}); both estimated now, on the same inputs",
             f"  this plan     {fmt_s(cmp.plan_step_s):>10}   peak "
             f"{fmt_bytes(cmp.plan_peak_bytes)}",
             f"  Megatron-LM   {fmt_s(cmp.megatron_step_s):>10}   peak "
             f"{fmt_bytes(cmp.megatron_peak_bytes)}"
             + ("" if cmp.megatron_fits else " (does not fit)") + f"   -> {verdict}"]
    blocks = sorted(plan.recompute, key=len, reverse=True)
    rows: dict[tuple[str, str, str], int] = {}
    for fqn, mine, theirs in cmp.params:
        key = (generic_name(fqn, blocks), mine, theirs)
        rows[key] = rows.get(key, 0) + 1
    lines.append(f"  parameters placed differently on tp: {len(cmp.params):,} of "
                 f"{cmp.num_params:,}" + (":" if rows else ""))
    if rows:
        w = max(len(k[0]) for k in rows) + 2
        for (name, mine, theirs) in list(rows)[:shown]:
            lines.append(f"    {name:<{w}}plan {mine:<6} Megatron {theirs}")
        if len(rows) > shown:
            lines.append(f"    ... {len(rows) - shown} more")
    kinds: dict[tuple[str, str], int] = {}
    for _, mine, theirs in cmp.ops:
        kinds[(mine, theirs)] = kinds.get((mine, theirs), 0) + 1
    lines.append(f"  ops with another strategy: {len(cmp.ops):,} of {cmp.num_ops:,}"
                 + (" (plan <- Megatron: " + ", ".join(
                     f"{n} {m} <- {t}" for (m, t), n in sorted(
                         kinds.items(), key=lambda kv: -kv[1])[:6]) + ")" if kinds else ""))
    return "\n".join(lines) + "\n"
