"""The collectives one training step of a plan issues, by kind: calls and bytes.

Derived from the same sharding and configuration the cost model prices, so a run can be held to
the plan (``autoplan.runtime.comm_counter`` counts what really happens). Bytes follow
``Cluster.collective_time_s``'s convention. Calls are given where the plan fixes them; data
parallel gradient all-reduces under DDP come in buckets whose number DDP decides (None).
Tensor-parallel gradient all-reduces of replicated weights (phase "step") go in one flattened
call per step, over the ZeRO-2/3 gradient shard when gradients are sharded. Under HSDP every
reduce-scatter (inside a shard group) is followed by an all-reduce of its shard over the
replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph.analysis import analyze
from autoplan.estimate.range_comm import comm_bytes
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.sharding import Sharding
from autoplan.cost.dtypes import held_bytes, own_sizes


@dataclass(frozen=True)
class Expected:
    calls: int | None
    bytes: float


def expected_collectives(graph: OpGraph, config: ParallelConfig, sh: Sharding, *,
                         global_batch_size: int, layer_ranges: list[tuple[int, int]],
                         fsdp_units: int, device_kind: str = "cpu") -> dict[str, Expected]:
    a = analyze(graph)
    held = held_bytes(graph, config.precision, config.mixed_precision, device_kind)
    m = config.microbatches(global_batch_size)
    bs = config.micro_batch_size / graph.batch_size
    calls: dict[str, int | None] = {}
    nbytes: dict[str, float] = {}

    def add(kind: str, n: int | None, b: float) -> None:
        c = calls.get(kind, 0)
        calls[kind] = None if (c is None or n is None) else c + n
        nbytes[kind] = nbytes.get(kind, 0.0) + b

    # the layers whose forward runs again in backward, collectives included (full, ops)
    policies = config.layer_recompute or (config.recompute,) * len(layer_ranges)
    replayed = {i for (s, e), policy in zip(layer_ranges, policies)
                if policy in ("full", "ops") for i in range(s, e)}
    if sh.t > 1:
        events = [(i, c.kind, c.value, c.scale, c.phase) for i, c in sh.comms()]
        events += [(r.op_index, r.kind, r.value, r.scale, r.phase) for r in sh.reshards]
        step_bytes = 0.0
        shard = config.shard_degree if config.zero_stage >= 2 else 1
        for i, kind, value, scale, phase in events:
            b = comm_bytes(graph, a, config.precision, value, scale, sh.t, bs, phase, shard,
                           kind, sizes=own_sizes(held))
            if phase == "step":       # one flattened all-reduce per step, of ZeRO's grad shard
                step_bytes += b
                continue
            times = m
            if phase == "fwd" and i in replayed:
                times *= 2            # the recomputed forward issues its collectives again
            add(kind, times, times * b)
        if step_bytes:
            add("all_reduce", 1, step_bytes)

    if config.dp > 1:
        params, tensors = 0.0, 0
        seen: set[str] = set()
        placements = sh.param_placement(graph)
        for v in graph.param_values:
            if v.base in seen or not v.requires_grad:
                continue
            seen.add(v.base)
            tensors += 1
            split = placements.get(v.fqn)
            params += v.meta.numel / (sh.t if split is not None and split.kind == "S" else 1)
        grad_bytes = 4.0 * params                   # fp32 master weights and gradients
        gather_bytes = (4.0 if config.precision == "fp32" else 2.0) * params
        if config.zero_stage >= 2:
            gathers = 2 if config.zero_stage == 3 else 1
            add("all_gather", gathers * fsdp_units * m, gathers * m * gather_bytes)
            add("reduce_scatter", fsdp_units * m, m * grad_bytes)
            if config.dp_shard is not None:        # HSDP: each shard all-reduced over replicas
                add("all_reduce", fsdp_units * m, m * grad_bytes / config.dp_shard)
        else:
            add("all_reduce", None, grad_bytes)        # DDP's buckets
            if config.zero_stage == 1:
                add("broadcast", tensors, 4.0 * params)
        add("all_reduce", 1, 8.0)                   # the step's loss, averaged for reporting
    return {k: Expected(calls[k], nbytes[k]) for k in sorted(nbytes)}
