"""`autoplan plan MODEL --cluster SPEC --global-batch N -o plan.json`: search and save a plan."""

from __future__ import annotations

import argparse
import sys
import time

from autoplan.cli.common import (add_capacity_arg, add_model_args, add_seq_lengths_arg,
                                 comma_list, documents_note, graph_from_args, output_arg,
                                 seq_lengths_arg)
from autoplan.estimate.arguments import config_fields


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search the fastest parallel plan that fits and save it",
                       description="Trace MODEL, search meshes, per-op sharding (ILP), ZeRO, "
                                   "recomputation, offload and micro-batching against the "
                                   "cluster, and write the best plan as JSON.")
    add_model_args(p)
    p.add_argument("--cluster", required=True,
                   help="preset[:nodes] (e.g. dgx-h100:4; dgx-h100/1: one GPU of the node), "
                        "'local[:N]', or a cluster file; pools of different nodes joined by "
                        "'+' (dgx-a100-80gb:4+dgx-h100:4), or a file with pools: a "
                        "heterogeneous cluster: its stages or replicas placed on the pools, each "
                        "given work in proportion to its GPU's speed (the cluster as its "
                        "slowest GPU is the baseline reported beside); the plan file runs on "
                        "those pools")
    p.add_argument("--global-batch", type=int, required=True, help="global batch size (samples)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32", "auto"),
                   help="training precision (bf16); auto: the search also tries fp32 where "
                        "16 bits gain nothing, 16-bit weights with an fp32 master copy (as "
                        "--search-mixed-precision) and fp8 linear layers (torchao's tensorwise and "
                        "rowwise recipes) where the GPU has fp8, per linear where it pays")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    p.add_argument("-o", "--output", default="plan.json", help="plan file to write (plan.json)")
    p.add_argument("--top-k", type=int, default=5, help="alternatives kept in the plan")
    p.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel degree")
    p.add_argument("--max-pp", type=int, default=None,
                   help="largest pipeline degree (default: up to the number of layers; 1 turns "
                        "pipeline parallelism off)")
    p.add_argument("--force", action="append", default=[], metavar="FIELD=VALUE",
                   help="pin a ParallelConfig field, e.g. --force tp=2 --force zero_stage=3; "
                        "lists comma-separated: --force chunk_layers=10,12,12,14 "
                        "--force stage_recompute=full,none, one policy per layer: --force "
                        "layer_recompute=none,ops,full,full, activation offload per layer: "
                        "--force layer_offload=true,false,true,false; under ZeRO-3, weights "
                        "kept whole: "
                        "--force dp_whole='layers.*.attention.*', uneven micro-batches per dp "
                        "replica: --force dp_shares=1,3. FIELD is one of: "
                        + ", ".join(config_fields()))
    p.add_argument("--pin", action="append", default=[], metavar="PATTERN=STRATEGY",
                   help="fix the strategy of the ops matching 'module.path:op' (fnmatch), the "
                        "ILP plans the rest around them, e.g. --pin "
                        "'layers.*.attention.wo:linear=seq_gathered'")
    p.add_argument("--allow-lossy", action="store_true",
                   help="let the search choose options whose numerics differ from exact "
                        "training (PowerSGD gradient compression, low-bit optimizer states); "
                        "--force of one works without it")
    p.add_argument("--search-mixed-precision", action="store_true",
                   help="offer 16-bit weights with an fp32 master copy (mixed_precision=params, "
                        "Megatron-LM's --bf16) beside autocast's fp32 weights; norms and "
                        "softmax then run in 16 bits unless the model upcasts them")
    add_capacity_arg(p)
    add_seq_lengths_arg(p)
    _add_objective_args(p)
    p.add_argument("--no-profile", action="store_true", help="roofline only, ignore profiles")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def _add_objective_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "objectives", "with --objective cost or energy, or any of --max-gpus, --tokens, "
        "--deadline, --budget-usd, the search also chooses how many of the cluster's devices "
        "to use (whole nodes, and powers of two inside one; on a heterogeneous cluster also "
        "which pools: each alone, and the pools together) and prints the Pareto front over "
        "time, cost and energy (also in the plan file, and drawn to --pareto-png)")
    g.add_argument("--objective", default="time", choices=("time", "cost", "energy"),
                   help="what the plan is best at: the fastest step or run (time, the "
                        "default), the cheapest run at list prices (cost), or the least GPU "
                        "energy (energy)")
    g.add_argument("--max-gpus", type=int, default=None, metavar="N",
                   help="use at most N of the cluster's devices")
    g.add_argument("--tokens", type=_count, default=None, metavar="N",
                   help="the run's length in tokens (e.g. 2e12): run time = N / tokens per "
                        "second; without it the figures are per step")
    g.add_argument("--deadline", type=float, default=None, metavar="DAYS",
                   help="plans whose run takes longer are excluded (needs --tokens)")
    g.add_argument("--budget-usd", type=float, default=None, metavar="X",
                   help="plans whose run costs more are excluded (needs --tokens)")
    g.add_argument("--usd-per-gpu-hour", type=float, default=None, metavar="X",
                   help="price per GPU-hour (default: the list price in "
                        "cost_models/economics.yaml, or the cluster file's economics)")
    g.add_argument("--tdp-watt", type=float, default=None, metavar="W",
                   help="board power of one device (default: its datasheet TDP)")
    g.add_argument("--pareto-png", default=None, metavar="PNG",
                   help="where to draw the front (default: the plan file's name with "
                        ".pareto.png, when the objectives search runs)")


def _count(text: str) -> int:
    """A whole count written as digits or in e-notation (``2e12``)."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (write 2000000000 or 2e9)") from None
    if not (isinstance(value, int) or (value == value and abs(value) < 1e30
                                       and value == int(value))):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole count")
    return int(value)


def objective_options(args: argparse.Namespace) -> dict:
    """The plan() options of the objectives group."""
    economics = {k: v for k, v in (("usd_per_gpu_hour", args.usd_per_gpu_hour),
                                   ("tdp_watt", args.tdp_watt)) if v is not None}
    return dict(objective=args.objective, max_gpus=args.max_gpus, tokens=args.tokens,
                deadline_days=args.deadline, budget_usd=args.budget_usd, economics=economics)


def _flag(text: str) -> bool:
    """One item of a list of flags (``--force layer_offload=true,false``)."""
    low = text.lower()
    if low not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return low in ("true", "1")


_LIST_FIELDS = {"chunk_layers": int, "stage_recompute": str, "dp_whole": str,
                "fp8_skip": str, "layer_recompute": str, "layer_offload": _flag,
                "dp_shares": int}


def parse_force(items: list[str]) -> dict:
    from autoplan.errors import ConfigError
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--force takes FIELD=VALUE, got {item!r}")
        key = key.strip()
        low = raw.strip().lower()
        value: object = raw.strip()
        if key in _LIST_FIELDS:
            value = comma_list(raw, _LIST_FIELDS[key], f"--force {key}")
        elif low in ("true", "false"):
            value = low == "true"
        elif low.lstrip("+-").isdigit():
            value = int(low)
        out[key] = value
    from autoplan.estimate.arguments import force_arg
    return force_arg(out, "--force")


def parse_pins(items: list[str]) -> dict:
    from autoplan.errors import ConfigError
    out: dict = {}
    for item in items:
        pattern, sep, name = item.rpartition("=")
        if not sep or not pattern.strip() or not name.strip():
            raise ConfigError(f"--pin takes 'module.path:op=STRATEGY', got {item!r}")
        out[pattern.strip()] = name.strip()
    return out


def _run_hetero(graph, cluster, args: argparse.Namespace, kw: dict, t0: float) -> int:
    """A heterogeneous cluster (pools): the slowest-GPU plan, then its candidates balanced on
    the pools (``planner/hetero.py``), the winner written to ``--output`` as a runnable plan
    (``planner/hetero_planfile.py``) that `autoplan run` and `inspect` take."""
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.hetero import plan_hetero
    from autoplan.planner.hetero_planfile import hetero_plan
    from autoplan.planner import objectives_pools
    if objectives_pools.wanted(kw):        # which pools and nodes to use, by the objective
        return _run_pools(graph, cluster, args, kw, t0)
    kw = {k: v for k, v in kw.items() if k not in ("economics", "objective")}
    result = plan_hetero(graph, cluster, **kw)
    print(f"The cluster as its slowest GPU ({cluster.slowest().device.name} on all "
          f"{cluster.world_size} ranks):")
    print(explain_plan(result.baseline))
    print()
    print("\n".join(result.summary_lines()))
    written = hetero_plan(result, graph, cluster, **kw)
    written.save(args.output)
    print(f"\nwrote {args.output} (the heterogeneous plan: `autoplan inspect {args.output}` "
          f"explains it, `autoplan run {args.output} --model ...` runs it; total "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


def _run_pools(graph, cluster, args: argparse.Namespace, kw: dict, t0: float) -> int:
    """The objectives on pools (``planner/objectives_pools.py``): the front over every pool
    alone and the pools together; the winner, on one pool's devices or over several pools, is
    written to ``--output`` with its objectives section (a plan ``autoplan run`` takes)."""
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.objectives_pools import plan_pools
    from autoplan.planner.objectives_report import table
    got = plan_pools(graph, cluster, **kw)
    if got.hetero is None:
        written = got.best.plan
        print(explain_plan(written))
    else:                                  # several pools: their runnable plan, objectives set
        from dataclasses import replace
        from autoplan.planner.hetero_planfile import hetero_plan
        from autoplan.planner.objectives_pools import subsets, OBJECTIVE_KEYS
        sub = next(s for s in subsets(cluster, kw.get("max_gpus"))
                   if s.label == got.best.devices)
        print(table(got.objectives))
        print()
        print("\n".join(got.hetero.summary_lines()))
        inner = {k: v for k, v in kw.items() if k not in OBJECTIVE_KEYS}
        written = replace(hetero_plan(got.hetero, graph, sub.cluster, **inner),
                          objectives=got.objectives)
    written.save(args.output)
    wrote = (f"{args.output} (the plan on {got.best.devices}: `autoplan inspect "
             f"{args.output}` explains it, `autoplan run {args.output} --model ...` runs it)")
    _print_objectives(got, args)
    print(f"\nwrote {wrote}; total {time.perf_counter() - t0:.1f} s")
    return 0


def _trace_for(cluster, args: argparse.Namespace):
    """The model traced where it will run: a CPU cluster's plan is traced on the CPU (HF
    Mixtral, for one, routes with float counts on the CPU and int counts elsewhere, and a plan
    holds the graph's fingerprint), unless the model does not fit in host memory or
    ``--device`` says otherwise."""
    from autoplan.errors import AutoplanError
    if args.device is None and cluster.device.kind == "cpu":
        try:
            return graph_from_args(argparse.Namespace(**{**vars(args), "device": "cpu"}))
        except AutoplanError as e:
            if "memory" not in str(e):
                raise
    return graph_from_args(args)


def _print_objectives(result, args: argparse.Namespace) -> None:
    """The front drawn (where matplotlib is installed); explain_plan printed its table."""
    from autoplan.errors import PlanError
    png = args.pareto_png or f"{args.output.removesuffix('.json')}.pareto.png"
    try:
        from autoplan.planner.objectives_figure import draw_front
        draw_front(result.objectives, png)
        print(f"wrote {png}")
    except PlanError as e:          # no matplotlib: the table says it all
        print(f"(front not drawn: {e})")


def check_args(args: argparse.Namespace) -> tuple[dict, dict]:
    """Everything but the model, checked before the trace (which may take minutes): the
    output file, the batch, the counts, ``--force`` and ``--pin``. Returns (force, pin)."""
    from autoplan.errors import ConfigError
    from autoplan.estimate.arguments import batch_arg, capacity_arg
    output_arg(args.output, "-o")
    batch_arg(args.global_batch, "--global-batch")
    capacity_arg(args.expert_capacity_factor)
    if args.top_k < 0:
        raise ConfigError(f"--top-k takes a count >= 0 (alternatives kept), got {args.top_k}")
    for flag, v in (("--max-tp", args.max_tp), ("--max-pp", args.max_pp)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} takes a degree >= 1 ({flag} 1 turns that axis off), "
                              f"got {v}")
    from autoplan.planner import objectives
    from autoplan.planner.options import SearchOptions
    try:
        objectives.check_request(SearchOptions(**objective_options(args)))
    except ConfigError as e:
        raise ConfigError(_cli_words(str(e))) from None
    if args.pareto_png is not None:
        from autoplan.cli.common import figure_suffixes
        output_arg(args.pareto_png, "--pareto-png", figure_suffixes())
    return parse_force(args.force), parse_pins(args.pin)


def _cli_words(msg: str) -> str:
    """plan()'s option names as the command line spells them."""
    for api, flag in (("plan(): ", ""), ("max_gpus", "--max-gpus"), ("deadline_days", "--deadline"),
                      ("budget_usd", "--budget-usd"), ("objective", "--objective"),
                      ("economics: usd_per_gpu_hour", "--usd-per-gpu-hour"),
                      ("economics: tdp_watt", "--tdp-watt"), ("tokens must", "--tokens must")):
        msg = msg.replace(api, flag)
    return msg


def run(args: argparse.Namespace) -> int:
    from autoplan.cluster import Cluster
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.search import plan
    force, pin = check_args(args)
    seq_lengths = seq_lengths_arg(args)
    cluster = Cluster.from_spec(args.cluster)
    t0 = time.perf_counter()
    graph = _trace_for(cluster, args)
    progress = None if args.quiet else (lambda msg: print(f"  {msg}", file=sys.stderr))
    if progress:
        progress(f"traced {graph.name}: {len(graph.ops)} ops in "
                 f"{time.perf_counter() - t0:.1f} s; searching {cluster.world_size} x "
                 f"{cluster.device.name}")
    kw = dict(global_batch_size=args.global_batch, precision=args.precision,
              optimizer=args.optimizer, profile=None if args.no_profile else "auto",
              name=args.model, progress=progress, top_k=args.top_k, max_tp=args.max_tp,
              max_pp=args.max_pp, expert_capacity_factor=args.expert_capacity_factor,
              force=force, pin=pin, allow_lossy=args.allow_lossy,
              mixed_precision=(("autocast", "params") if args.search_mixed_precision
                               else ("autocast",)), seq_lengths=seq_lengths,
              **objective_options(args))
    if cluster.pools:
        return _run_hetero(graph, cluster, args, kw, t0)
    result = plan(graph, cluster, **kw)
    result.save(args.output)
    print(explain_plan(result))
    if seq_lengths is not None:
        print(documents_note(graph, seq_lengths, result.config,
                             cluster.device.kind))
    if result.objectives is not None:
        _print_objectives(result, args)
    if args.precision == "auto" and "fp8" not in cluster.device.peak_flops:
        print(f"\nprecision auto: fp8 linear layers not tried: the cluster's "
              f"{cluster.device.name} has no fp8 tensor cores (its rates: "
              f"{', '.join(sorted(cluster.device.peak_flops))}); the plan keeps "
              f"{result.config.precision}")
    print(f"\nwrote {args.output} (search {result.solver.time_s:.1f} s, "
          f"total {time.perf_counter() - t0:.1f} s)")
    return 0
