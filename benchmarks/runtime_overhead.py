"""Runtime overhead: a plan run through ``autoplan.compile`` against the same placements written
by hand with PyTorch's APIs, on 4 gloo processes; also measured vs predicted step time.

    python benchmarks/runtime_overhead.py              # launches torchrun itself
    python benchmarks/runtime_overhead.py --family fsdp|tp

Families: ``fsdp`` (dp4, ZeRO-3: FSDP2 per layer + root) and ``tp`` (dp2 x tp2, Megatron
column/row parallel + FSDP2 over dp). Both versions train the same model on the same batches,
alternating in blocks so that machine noise hits both alike. Target (issue 4): ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MODEL = "gpt-small-cpu"
GLOBAL_BATCH = 16


def _plan(family: str, world: int):
    from autoplan import Cluster, plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    small = build_example(MODEL, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    force = (dict(tp=1, zero_stage=3, micro_batch_size=GLOBAL_BATCH // world)
             if family == "fsdp" else dict(dp=2, tp=2, zero_stage=3, sequence_parallel=False,
                                           micro_batch_size=GLOBAL_BATCH // 2))
    return plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                force=force, sharding="megatron", max_pp=1)


def _by_hand(family: str, dp: int, tp: int):
    """The same placements with PyTorch's APIs, written out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)

    from autoplan.models import build_example
    ex = build_example(MODEL, batch_size=GLOBAL_BATCH, seed=0)
    model = ex.model
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if family == "tp":
        styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                  "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
                  "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(model.layers)):
            styles.update({f"layers.{i}.attn.qkv": ColwiseParallel(),
                           f"layers.{i}.attn.proj": RowwiseParallel(),
                           f"layers.{i}.mlp.fc": ColwiseParallel(),
                           f"layers.{i}.mlp.proj": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], styles)
        model.lm_head.weight = model.tok_embeddings.weight        # keep the tie
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = dist.get_rank() // tp
    per = GLOBAL_BATCH // dp
    inputs = ex.example_inputs[0][dp_rank * per:(dp_rank + 1) * per]
    targets = ex.targets[dp_rank * per:(dp_rank + 1) * per]

    def step() -> float:
        if family == "tp":
            with loss_parallel():
                loss = ex.loss_fn(model(inputs), targets)
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = ex.loss_fn(model(inputs), targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1).double()
        dist.all_reduce(t, group=mesh["dp"].get_group())
        return float(t[0]) / dp
    return step


def worker(family: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from autoplan.models import build_example
    from autoplan.runtime.trainer import compile
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    p = _plan(family, world)
    ex = build_example(MODEL, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(MODEL, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      global_batch_size=GLOBAL_BATCH, plan=p)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    hand = _by_hand(family, p.config.dp, p.config.tp)
    times = {"autoplan": [], "by hand": []}
    runs = {"autoplan": lambda: trainer.step(batch), "by hand": hand}
    for fn in runs.values():          # warm-up both
        fn()
    for _round in range(3):
        for name, fn in runs.items():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        a = statistics.median(times["autoplan"])
        h = statistics.median(times["by hand"])
        print(f"family {family}: {p.config.short()}")
        print(f"  autoplan.compile  {a * 1e3:8.1f} ms/step (median of {len(times['autoplan'])})")
        print(f"  by hand           {h * 1e3:8.1f} ms/step")
        print(f"  overhead ratio    {a / h:8.3f}   (target <= 1.05)")
        print(f"  predicted         {p.predicted['step_time_s'] * 1e3:8.1f} ms/step; "
              f"measured / predicted {a / p.predicted['step_time_s']:.2f}")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("fsdp", "tp", "all"), default="all")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        worker(args.family, args.steps)
        return 0
    for family in (("fsdp", "tp") if args.family == "all" else (args.family,)):
        code = subprocess.call([sys.executable, "-m", "torch.distributed.run",
                                "--nproc-per-node=4", "--master-port=29533", __file__, "--worker",
                                "--family", family, "--steps", str(args.steps)],
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
