"""Which layers each pipeline chunk holds and how each stage recomputes.

Two entry points, both over ``partition.pipeline_units``:
- ``chunks_for``: the chunks of a config: its ``chunk_layers`` when given, else the split that
  makes the slowest chunk fastest under the config's recompute policy (what ``estimate`` does
  for a hand-written config);
- ``search_layout``: what the planner does per mesh, micro-batch, ZeRO stage and schedule: the
  min-max split (``partition.min_max_split``) with each chunk's memory as a constraint and the
  recomputation policy chosen per stage. Each stage's memory follows the schedule: under 1F1B
  stage ``s`` of ``p`` keeps ``p - s`` micro-batches in flight, interleaving adds the extra
  warm-up of its chunks, GPipe keeps all ``m``; so early stages may recompute (or take fewer
  layers) where later ones need not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from autoplan.cost.memory import PRECISION_BYTES, model_state_bytes
from autoplan.estimate.chunk_cost import cached_on_graph, chunk_parts, range_cost, unit_costs
from autoplan.estimate.cost_inputs import CostInputs, RangeCost
from autoplan.sharding.parallel_config import (MULTI_CHUNK_SCHEDULES, RECOMPUTE, V_SCHEDULES,
                                               ParallelConfig, chunk_ranks, strongest_recompute,
                                               SPLIT_BACKWARD)
from autoplan.estimate.partition import (Chunk, Split, UnitChoice, chunks_from_counts,
                                         min_max_split, partition, pipeline_units)
from autoplan.estimate.schedule_orders import W_KEEPS, order_peak_chunks
from autoplan.estimate.pipeline_sim import W_FRACTION


def in_flight(config: ParallelConfig, m: int, stage: int) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak (in units of
    the rank's activations per micro-batch, all its chunks together)."""
    p, v = config.pp, config.virtual_stages
    if p == 1:
        return 1.0
    if config.schedule == "gpipe":
        return float(m)
    if config.schedule in V_SCHEDULES:     # read off the schedule's own action order
        return order_peak_chunks(config.schedule, p, v, m)[stage] / v
    extra = 0.0
    if config.schedule == "zero_bubble":   # deferred W's keep half their chunk's activations
        extra = W_KEEPS * min(m * v, p * v) / v
    if config.schedule in MULTI_CHUNK_SCHEDULES and v > 1:
        chunks = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
        return chunks / v + extra
    return float(min(m, p - stage)) + extra


def chunks_for(ci: CostInputs) -> tuple[Chunk, ...]:
    config = ci.config
    n = config.pp * config.virtual_stages
    if config.chunk_layers is not None:
        return chunks_from_counts(ci.graph, config.chunk_layers)
    units = pipeline_units(ci.graph)
    if n == 1 or not units:
        return partition(ci.graph, n)
    times = [c.time_s for c in unit_costs(ci, units, config.recompute)]
    before, after = _outside(ci)
    return partition(ci.graph, n, times, before.time_s, after.time_s)


def _outside(ci: CostInputs) -> tuple[UnitChoice, UnitChoice]:
    """The ops before the first unit and after the last, as fixed extras of the end chunks."""
    units = pipeline_units(ci.graph)
    out = []
    for start, stop in ((0, units[0].start), (units[-1].stop, len(ci.graph.ops))):
        if start >= stop:
            out.append(UnitChoice(time_s=0.0))
            continue
        rc = range_cost(ci, start, stop, "none")
        out.append(UnitChoice(time_s=rc.time_s, activation_bytes=rc.activation_bytes,
                              state_bytes=_state_bytes(rc, ci.config)))
    return out[0], out[1]


def _state_bytes_per_param(config: ParallelConfig, *, expert: bool = False) -> float:
    """Device bytes of one parameter's state: sharded over the ZeRO group, or for an expert
    weight over the ranks holding the same experts (dp / ep of them)."""
    shard = config.dp // config.ep if expert else config.shard_degree
    return model_state_bytes(1.0, dp=shard, zero_stage=config.zero_stage,
                             precision=config.precision, optimizer=config.optimizer,
                             offload_optimizer=config.offload_optimizer,
                             offload_params=config.offload_params,
                             mixed_precision=config.mixed_precision,
                             optimizer_state=config.optimizer_state).total_bytes


def _state_bytes(rc: RangeCost, config: ParallelConfig,
                 per_param: tuple[float, float] | None = None) -> float:
    """``rc``'s model-state bytes on one device; ``per_param``: ``_state_bytes_per_param``
    of ``config`` (plain, expert) where already worked out."""
    plain, expert = per_param or (_state_bytes_per_param(config),
                                  _state_bytes_per_param(config, expert=True))
    return (rc.params - rc.expert_params) * plain + rc.expert_params * expert


def search_layout(ci: CostInputs, m: int, policies: Sequence[str],
                  budget_bytes: float) -> ParallelConfig | None:
    """The config with its stage split and per-stage recomputation chosen (module doc), or
    None when no split fits ``budget_bytes`` per device (weights, gradients, optimizer state,
    activations and transient buffers; the margin already taken off)."""
    config = ci.config
    p, v = config.pp, config.virtual_stages
    n = p * v
    units = pipeline_units(ci.graph)
    if not units or len(units) < n:
        return None
    order = [r for r in RECOMPUTE if r in policies]      # cheapest in time first
    by_policy = {r: unit_costs(ci, units, r) for r in order}
    # units of one block share their range costs: one choice table per distinct cost
    tables: dict[tuple[int, ...], dict[str, UnitChoice]] = {}
    per_param = (_state_bytes_per_param(config), _state_bytes_per_param(config, expert=True))
    costs = []
    for k in range(len(units)):
        key = tuple([id(by_policy[r][k]) for r in order])
        if key not in tables:
            tables[key] = {r: UnitChoice(time_s=by_policy[r][k].time_s,
                                         activation_bytes=by_policy[r][k].activation_bytes,
                                         state_bytes=_state_bytes(by_policy[r][k], config,
                                                                  per_param))
                           for r in order}
        costs.append(tables[key])
    transient = max(c.working_set_bytes for r in order for c in by_policy[r])
    if config.zero_stage == 3 and config.grad_degree > 1:   # two layers gathered, with their gradients
        widest = max(c.params for c in by_policy[order[0]])
        transient += 4 * widest * PRECISION_BYTES[config.precision]
    first, last = _outside(ci)
    rank_of = chunk_ranks(config.schedule, p, v)
    per_rank = [in_flight(config, m, r) for r in range(p)]
    flight = [per_rank[rank_of[c]] for c in range(n)]
    # a rank's chunks share its memory: each gets an equal share of what the embeddings (first
    # chunk) and the head (last chunk) leave on that rank, plus its own fixed part
    fixed = [0.0] * n
    for c, extra in ((0, first), (n - 1, last)):
        fixed[c] += extra.state_bytes + flight[c] * extra.activation_bytes
    left = [(budget_bytes - transient - sum(fixed[k] for k in config.rank_chunks(r))) / v
            for r in range(p)]
    budget = [left[rank_of[c]] + fixed[c] for c in range(n)]
    split = min_max_split(costs, n, first=first, last=last, in_flight=flight,
                          budget_bytes=budget)
    if split is None:
        return None
    stage = _per_stage(split, config)
    if v > 1 and any(split.policies[c] != stage[rank_of[c]] for c in range(n)):
        # a stage recomputes one way on all its chunks: split again with that fixed
        split = min_max_split(costs, n, first=first, last=last, in_flight=flight,
                              budget_bytes=budget, allowed=[[stage[rank_of[c]]]
                                                            for c in range(n)])
        if split is None:
            return None
        stage = _per_stage(split, config)
    return with_layout(config, split.counts, stage)


def _per_stage(split: Split, config: ParallelConfig) -> list[str]:
    """Per pipeline rank: the most memory-saving policy among its chunks."""
    return [strongest_recompute([split.policies[c] for c in config.rank_chunks(s)])
            for s in range(config.pp)]


def with_layout(config: ParallelConfig, counts: Sequence[int],
                stage_policies: Sequence[str], canonical: bool = True) -> ParallelConfig:
    """``config`` with its split and per-stage policies; ``canonical`` writes one policy for
    all stages as ``recompute`` alone."""
    uniform = canonical and len(set(stage_policies)) == 1
    return replace(config, chunk_layers=tuple(counts),
                   recompute=strongest_recompute(stage_policies),
                   stage_recompute=None if uniform else tuple(stage_policies))



def step_floor_s(ci: CostInputs, m: int, policies: Sequence[str]) -> float:
    """A lower bound on the closed-form step time (``estimate(simulate_pipeline=False)``) of
    ``ci.config`` under any stage split and any per-stage choice among ``policies``, for
    the search to skip a pipelined config that cannot come near its best without choosing its
    layout. The bottleneck rank does at least ``1/p`` of the model's work ``S`` per micro-batch
    (its parts under the cheapest policy: layers, the ops around them), ``m`` times, plus the
    bubble, the other ranks' stage-times over ``v``: ``m T + (S - T) / v`` grows with the
    bottleneck's ``T`` (``m >= 1/v``), least at ``T = S/p``, i.e. ``(p-1)/v`` such
    stage-times. Under a split backward the bubble is ``(p-1)/v`` of the bottleneck's
    forwards, at least the smallest forward share of any part under the costliest policy (a
    stage's share is a weighted mean of its parts'). Communication beyond the tp axis, the
    optimizer step and the overheads only add to it."""
    config = ci.config
    p, v = config.pp, config.virtual_stages
    order = [r for r in RECOMPUTE if r in policies] or ["none"]
    total, share = cached_on_graph(ci, "_autoplan_floor_parts", (order[0], order[-1]),
                                   lambda: _floor_parts(ci, order[0], order[-1]))
    per_rank = total / p
    stage_time = per_rank
    if config.schedule in SPLIT_BACKWARD:
        stage_time = per_rank * (share + (1 - share) * max(0.0, 1 - 2 * W_FRACTION))
    return m * per_rank + (p - 1) / v * stage_time


def _floor_parts(ci: CostInputs, cheapest: str, costliest: str) -> tuple[float, float]:
    """The model's seconds per micro-batch (its layers under ``cheapest``, the ops around them
    as they are), and the smallest forward share of any of those parts under ``costliest``."""
    (whole,) = chunks_from_counts(ci.graph, [len(pipeline_units(ci.graph))])
    like = {(u.start, u.stop): u.like for u in whole.units}

    def parts(policy: str) -> list[RangeCost]:
        return [range_cost(ci, *like.get((s, e), (s, e)), policy) if is_layer
                else range_cost(ci, s, e, "none") for s, e, is_layer in chunk_parts(whole)]
    share = min((c.fwd_total_s / c.time_s for c in parts(costliest) if c.time_s > 0),
                default=0.0)
    return sum(c.time_s for c in parts(cheapest)), share
