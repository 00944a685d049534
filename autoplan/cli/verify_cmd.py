"""`autoplan verify PLAN --model MODEL`: check a plan's numerics here, against one device.

The plan's family (its parallel axes at degree 2, ZeRO stage, sequence parallelism,
recomputation, schedule, offload) and its per-op strategies run on a shrunk copy of the model
(fewer layers, same widths: every split the plan makes still divides) on the ranks at hand:
CPU processes on gloo where there is no GPU. After a few AdamW steps in fp32 every parameter is
compared with the same training on one device. A plan for packed documents (`plan
--seq-lengths`) runs both on rows packed as its documents, as `autoplan run` trains. Prints the
worst relative error per parameter group and a verdict; exits 0 when all are within
--tolerance, 1 when not, 2 when the run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a plan's numerics on this machine vs one device",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan.json written by `autoplan plan`")
    p.add_argument("--model", required=True,
                   help="the model the plan was made for: an example name or "
                        "'package.module:function' returning an autoplan.models.Example")
    p.add_argument("--ranks", type=int, default=4, help="processes to run on (4)")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the shrunk model (default: 2 per pipeline chunk)")
    p.add_argument("--seq-len", type=int, default=32,
                   help="sequence length of example language models (32)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps (3)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest relative error accepted per tensor (1e-4)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.cluster import Cluster
    from autoplan.errors import PlanError
    from autoplan.graph import trace
    from autoplan.planner.planfile import plan_from_file
    from autoplan.planner.search import plan as make_plan
    from autoplan.planner.shrink import layers_needed, shrunk_force, transfer_sharding
    from autoplan.runtime.packed_data import packed_run_examples
    from autoplan.runtime.verify import build
    from autoplan.sharding.mesh_axes import BASE_AXES, ParallelDims

    import math
    if not (1 <= args.ranks <= 1024 and 1 <= args.steps <= 10_000 and math.isfinite(
            args.tolerance) and args.tolerance > 0 and 1 <= (args.layers or 1) <= 1024
            and args.seq_len >= 1):
        raise PlanError(f"--ranks takes 1 to 1,024 processes, --steps 1 to 10,000, --layers "
                        f"and --seq-len a count >= 1, --tolerance a positive number; got "
                        f"--ranks {args.ranks} --steps {args.steps} --layers {args.layers} "
                        f"--seq-len {args.seq_len} --tolerance {args.tolerance}")
    plan = plan_from_file(args.plan)
    force = shrunk_force(plan.config, args.ranks)
    world = ParallelDims(**{a.value: force.get(a.value, 1) for a in BASE_AXES}).world_size
    layers = args.layers or min(layers_needed(force), max(len(plan.recompute), 1))
    seq = args.seq_len if ":" not in args.model else None
    try:
        small = build(args.model, layers=layers, batch=1, seq_len=seq)
    except ValueError as e:                     # e.g. seq_len on a model without sequences
        if seq is None or "seq_len" not in str(e):
            raise PlanError(str(e)) from e
        seq = None
        small = build(args.model, layers=layers, batch=1, seq_len=None)
    documents = plan.training.length_histogram()    # packed documents, as `run` trains them
    if documents is not None:
        _, small = packed_run_examples(None, small, documents)
    graph = trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                  targets=small.targets, name=plan.model.name)
    full_layers = len(plan.recompute)
    sh, adapted = transfer_sharding(plan.op_strategies, full_layers, graph, force["tp"])
    per_replica = 2 * force["pp"] * force.get("virtual_stages", 1) if force["pp"] > 1 else 2
    gbs = force["dp"] * per_replica
    shrunk = make_plan(graph, Cluster.local(world), global_batch_size=gbs, precision="fp32",
                       profile=None, force=force, fixed_sharding=sh, max_pp=force["pp"],
                       name=plan.model.name, seq_lengths=documents)
    cfg = shrunk.config
    print(f"verify {args.plan} ({plan.model.name}, {plan.config.short()}) on this machine:")
    print(f"  family {cfg.short()} on {world} CPU rank(s) (gloo), the plan's per-op "
          f"strategies on {layers} of its {full_layers} layers"
          + (f", sequence {seq}" if seq else "")
          + (f" packed with documents of {documents.describe()}" if documents else "")
          + f", global batch {gbs}, "
          f"{args.steps} AdamW steps in fp32 with dropout off (low precision and random masks "
          "would hide sharding errors)")
    if adapted:
        print(f"  {len(adapted)} op(s) took their inputs as they come (their split does not "
              f"exist at this size): {', '.join(adapted[:4])}{', ...' if len(adapted) > 4 else ''}")
    with tempfile.TemporaryDirectory(prefix="autoplan-verify-") as tmp:
        plan_path = os.path.join(tmp, "shrunk.plan.json")
        shrunk.save(plan_path)
        out = os.path.join(tmp, "report.json")
        worker = ["-m", "autoplan.runtime.verify", "--plan", plan_path, "--model", args.model,
                  "--layers", str(layers), "--steps", str(args.steps), "--out", out]
        if seq:
            worker += ["--seq-len", str(seq)]
        if world > 1:
            from autoplan.cli.demo_cmd import free_port
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={free_port()}"] + worker
        else:
            cmd = [sys.executable] + worker
        from autoplan.cli.demo_cmd import rank_env
        env = {**rank_env(), "PYTHONWARNINGS": "ignore"}
        code = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
        if code or not os.path.exists(out):
            print(f"verify: the shrunk plan failed to run (exit {code})", file=sys.stderr)
            return 2
        with open(out) as f:
            report = json.load(f)
    return _print_report(report, args.tolerance)


def _print_report(report: dict, tolerance: float) -> int:
    groups = report["groups"]
    width = max([len(g) for g in groups] + [16])
    print(f"\n  {'parameter group':<{width}}  worst rel. error")
    for g in sorted(groups):
        mark = "" if groups[g] <= tolerance else "   <-- over tolerance"
        print(f"  {g:<{width}}  {groups[g]:.1e}{mark}")
    losses, ref = report["losses"], report["reference_losses"]
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
    print(f"\n  losses: plan {', '.join(f'{x:.6f}' for x in losses)}")
    print(f"          one device {', '.join(f'{x:.6f}' for x in ref)} "
          f"(worst rel. error {loss_err:.1e})")
    worst = max(list(groups.values()) + [loss_err])
    problems = []
    if report["missing"]:
        problems.append(f"tensors missing from the plan's run: {report['missing'][:3]}")
    if report["extra"]:
        problems.append(f"tensors the model does not have: {report['extra'][:3]}")
    if worst > tolerance:
        problems.append(f"worst relative error {worst:.1e} over the tolerance {tolerance:.0e}")
    if problems:
        print("\nFAIL: " + "; ".join(problems))
        return 1
    print(f"\nPASS: every parameter group and loss within {tolerance:.0e} of one device "
          f"(worst {worst:.1e})")
    return 0
