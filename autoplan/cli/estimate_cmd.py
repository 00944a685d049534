"""`autoplan estimate MODEL --cluster SPEC ...`: cost one parallel configuration."""

from __future__ import annotations

import argparse
import json

from autoplan.cli.common import (add_capacity_arg, add_model_args, add_seq_lengths_arg,
                                 comma_list, documents_note, graph_from_args,
                                 seq_lengths_arg)
from autoplan.sharding.parallel_config import SCHEDULES


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel configuration")
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: devices / (tp * pp * cp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (MoE models; divides the data-parallel degree)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: each sequence split over an axis of its own "
                        "(attention as ring attention over it)")
    g.add_argument("--cp-layout", default="contiguous", choices=("contiguous", "zigzag"),
                   help="how the cp axis lays the sequence out: contiguous pieces, or zigzag "
                        "head-tail chunks (rank r holds chunks r and 2cp-1-r), which balance "
                        "causal attention over the ring; plan picks zigzag for causal models")
    g.add_argument("--micro-batch-size", "--mbs", type=int, default=1)
    g.add_argument("--dp-shares", default=None, metavar="N,N,...",
                   help="uneven data parallelism: micro-batches each data-parallel replica "
                        "runs per step, in dp-index order, e.g. 1,3 (--global-batch is then "
                        "the micro-batch size x their sum); on equal devices priced as the "
                        "replica with the most, on a heterogeneous cluster each replica on "
                        "its pool's device")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    g.add_argument("--virtual-stages", type=int, default=1)
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (with tp > 1)")
    g.add_argument("--recompute", default=None, choices=("none", "selective", "ops", "full"))
    g.add_argument("--stage-recompute", default=None, metavar="P,P,...",
                   help="one recompute policy per pipeline stage, e.g. full,none "
                        "(--recompute then defaults to the most memory-saving of them)")
    g.add_argument("--layer-recompute", default=None, metavar="P,P,...",
                   help="one recompute policy per layer, in model order, e.g. ops,full,none "
                        "(--recompute then defaults to the most memory-saving of them)")
    g.add_argument("--chunk-layers", default=None, metavar="N,N,...",
                   help="layers per pipeline chunk (pp x virtual-stages counts), e.g. 10,14; "
                        "default: balanced")
    g.add_argument("--offload-optimizer", action="store_true")
    g.add_argument("--offload-params", action="store_true",
                   help="weights and gradients in host memory (needs --zero 3)")
    g.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    g.add_argument("--optimizer-state", default="fp32", choices=("fp32", "bf16", "8bit"),
                   help="Adam's moments in fp32, bf16 or 8 bits (torchao; lossy)")


def config_from_args(args: argparse.Namespace, world_size: int):
    from autoplan.errors import ConfigError
    from autoplan.sharding.parallel_config import RECOMPUTE, ParallelConfig
    for flag in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "virtual_stages"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} takes a degree >= 1, got {v}")
    dp = args.dp
    if dp is None:
        dp, rem = divmod(world_size, args.tp * args.pp * args.cp)
        if rem or dp < 1:
            raise ConfigError(f"tp {args.tp} x pp {args.pp} x cp {args.cp} does not divide the "
                              f"cluster's {world_size} devices; pass --dp or change "
                              "--tp/--pp/--cp")
    from autoplan.sharding.parallel_config import strongest_recompute
    stage = comma_list(args.stage_recompute, str, "--stage-recompute")
    if stage is not None and (not stage or any(s not in RECOMPUTE for s in stage)):
        raise ConfigError(f"--stage-recompute takes one policy per pipeline stage from "
                          f"{', '.join(RECOMPUTE)}, e.g. full,none; got {args.stage_recompute!r}")
    layers = comma_list(getattr(args, "layer_recompute", None), str, "--layer-recompute")
    if layers is not None and (not layers or any(s not in RECOMPUTE for s in layers)):
        raise ConfigError(f"--layer-recompute takes one policy per layer from "
                          f"{', '.join(RECOMPUTE)}, e.g. ops,full,none; got "
                          f"{args.layer_recompute!r}")
    chunks = comma_list(args.chunk_layers, int, "--chunk-layers")
    shares = comma_list(getattr(args, "dp_shares", None), int, "--dp-shares")
    recompute = args.recompute or strongest_recompute(stage or layers or ["none"])
    return ParallelConfig(dp=dp, tp=args.tp, pp=args.pp, micro_batch_size=args.micro_batch_size,
                          ep=args.ep, cp=args.cp, cp_layout=args.cp_layout,
                          schedule=args.schedule,
                          virtual_stages=args.virtual_stages,
                          zero_stage=args.zero, sequence_parallel=args.sp,
                          recompute=recompute, stage_recompute=stage, chunk_layers=chunks,
                          layer_recompute=layers,
                          offload_optimizer=args.offload_optimizer,
                          offload_params=args.offload_params,
                          precision=args.precision, optimizer=args.optimizer,
                          optimizer_state=args.optimizer_state,
                          dp_shares=tuple(shares) if shares is not None else None)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="predict step time and memory of one configuration",
                       description="Trace MODEL and predict step time, memory per device, MFU "
                                   "and their breakdowns for one parallel configuration.")
    add_model_args(p)
    p.add_argument("--cluster", required=True,
                   help="preset[:nodes] (e.g. dgx-a100-80gb:4; dgx-h100/1: one GPU of the "
                        "node), 'local[:N]', or a cluster file")
    p.add_argument("--global-batch", type=int, required=True, help="global batch size (samples)")
    add_config_args(p)
    add_capacity_arg(p)
    add_seq_lengths_arg(p)
    p.add_argument("--no-profile", action="store_true",
                   help="ignore measured profiles; use the roofline only")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.cluster import Cluster
    from autoplan.estimate.arguments import batch_arg
    from autoplan.estimate.estimator import estimate
    cluster = Cluster.from_spec(args.cluster)
    batch_arg(args.global_batch, "--global-batch")
    config = config_from_args(args, cluster.world_size)     # before the trace: cheap first
    seq_lengths = seq_lengths_arg(args)
    graph = graph_from_args(args)
    if cluster.pools:
        return _run_hetero(graph, cluster, config, args)
    est = estimate(graph, cluster, config=config, global_batch_size=args.global_batch,
                   profile=None if args.no_profile else "auto",
                   expert_capacity_factor=args.expert_capacity_factor,
                   seq_lengths=seq_lengths)
    if args.json:
        print(json.dumps(est.to_dict(), indent=1, sort_keys=True))
    else:
        print(f"model {graph.name}: {graph.num_params / 1e9:,.2f} B parameters, "
              f"{len(graph.ops)} ops; cluster {cluster.name}: {cluster.world_size} x "
              f"{cluster.device.name}")
        print(est.report())
        if seq_lengths is not None:
            print(documents_note(graph, seq_lengths, config,
                                 cluster.device.kind))
    return 0


def _run_hetero(graph, cluster, config, args: argparse.Namespace) -> int:
    """A heterogeneous cluster: the config priced on the pools, and the same config on the
    cluster as its slowest GPU (even split, balanced layers) for the gain."""
    from dataclasses import replace
    from autoplan.estimate.estimator import estimate
    from autoplan.estimate.hetero import estimate_hetero
    profile = None if args.no_profile else "auto"
    het = estimate_hetero(graph, cluster, config=config, global_batch_size=args.global_batch,
                          profile=profile,
                          expert_capacity_factor=args.expert_capacity_factor)
    slow = estimate(graph, cluster.slowest(),
                    config=replace(config, chunk_layers=None, dp_shares=None),
                    global_batch_size=args.global_batch, profile=profile,
                    expert_capacity_factor=args.expert_capacity_factor)
    gain = slow.step_time_s / het.step_time_s
    if args.json:
        print(json.dumps({**het.estimate.to_dict(), "heterogeneous": {
            "placement": het.placement, "pool_of_unit": list(het.pool_of_unit),
            "dp_shares": list(het.dp_shares) if het.dp_shares else None,
            "slowest_gpu_step_s": slow.step_time_s, "speedup": gain}}, indent=1,
            sort_keys=True))
        return 0
    pools = " + ".join(f"{p.label()} ({p.device.name})" for p in cluster.pools)
    print(f"model {graph.name}: {graph.num_params / 1e9:,.2f} B parameters, {len(graph.ops)} "
          f"ops; cluster {cluster.name}: {cluster.world_size} ranks in pools {pools}")
    print(het.estimate.report())
    from autoplan.planner.hetero import runs
    units = "stages" if het.placement == "stages" else "dp replicas"
    print(f"\nPools of the {units} in order: {runs(het.pool_of_unit)}"
          + (f"; micro-batches per replica {runs(het.dp_shares)}" if het.dp_shares else ""))
    print(f"The same config on the cluster as its slowest GPU ({cluster.slowest().device.name} "
          f"x {cluster.world_size}, even split): {slow.step_time_s:.6g} s; on the pools "
          f"{het.step_time_s:.6g} s: {gain:.3f}x")
    return 0
