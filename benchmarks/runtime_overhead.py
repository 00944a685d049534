"""Runtime overhead: a plan run through ``autoplan.compile`` against the same placements written
by hand with PyTorch's APIs, on 4 gloo processes; also measured vs predicted step time.

    python benchmarks/runtime_overhead.py                 # every case, launches torchrun itself
    python benchmarks/runtime_overhead.py --case llama-tp

Cases (model x family):
- ``gpt-fsdp``, ``llama-fsdp``, ``nanogpt-fsdp``: dp4, ZeRO-3 (FSDP2 per layer + root);
- ``gpt-tp``, ``llama-tp``: dp2 x tp2, Megatron column/row parallel (vocab-parallel embedding and
  loss) + FSDP2 over dp. By hand: ``parallelize_module`` with Colwise/RowwiseParallel and
  ``loss_parallel``, then ``fully_shard``.

``gpt`` is autoplan's example GPT, ``llama`` a Hugging Face ``LlamaForCausalLM`` built from a
config, ``nanogpt`` a nanoGPT-style model (fused qkv, literal head count; its tensor-parallel form
cannot be written with the stock styles, which is the reason autoplan runs the traced graph).
Both versions train the same model on the same batches, alternating in blocks so that machine
noise hits both alike. Target: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

GLOBAL_BATCH = 16
MODELS = {
    "gpt": ("gpt-small-cpu", {}),
    "llama": ("hf-llama-gqa-tiny", dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=704,
                                        vocab=2048, seq_len=128, max_positions=128)),
    "nanogpt": ("nanogpt-tiny", dict(hidden=256, layers=4, vocab=2048, seq_len=128,
                                     max_positions=128)),
}
CASES = ("gpt-fsdp", "gpt-tp", "llama-fsdp", "llama-tp", "nanogpt-fsdp")


def _example(model: str, batch: int):
    from autoplan.models import build_example
    name, overrides = MODELS[model]
    return build_example(name, batch_size=batch, seed=0, **overrides)


def _plan(model: str, family: str, world: int):
    from autoplan import Cluster, plan
    from autoplan.graph import trace
    small = _example(model, 1)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    force = (dict(tp=1, zero_stage=3, micro_batch_size=GLOBAL_BATCH // world)
             if family == "fsdp" else dict(dp=2, tp=2, zero_stage=3, sequence_parallel=False,
                                           micro_batch_size=GLOBAL_BATCH // 2))
    return plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                force=force, sharding="megatron", max_pp=1)


def _tp_styles(model: str, net):
    """Megatron's placements for the model, written with PyTorch's parallel styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if model == "gpt":
        styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                  "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
                  "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(net.layers)):
            styles.update({f"layers.{i}.attn.qkv": ColwiseParallel(),
                           f"layers.{i}.attn.proj": RowwiseParallel(),
                           f"layers.{i}.mlp.fc": ColwiseParallel(),
                           f"layers.{i}.mlp.proj": RowwiseParallel()})
        return styles, list(net.layers)
    inner = net.model.model
    styles = {"model.model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
              "model.lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                               use_local_output=False)}
    for i in range(len(inner.layers)):
        p = f"model.model.layers.{i}"
        styles.update({f"{p}.self_attn.q_proj": ColwiseParallel(),
                       f"{p}.self_attn.k_proj": ColwiseParallel(),
                       f"{p}.self_attn.v_proj": ColwiseParallel(),
                       f"{p}.self_attn.o_proj": RowwiseParallel(),
                       f"{p}.mlp.gate_proj": ColwiseParallel(),
                       f"{p}.mlp.up_proj": ColwiseParallel(),
                       f"{p}.mlp.down_proj": RowwiseParallel()})
    return styles, list(inner.layers)


def _layers(model: str, net):
    if model == "gpt":
        return list(net.layers)
    if model == "llama":
        return list(net.model.model.layers)
    return list(net.h)


def _by_hand(model: str, family: str, dp: int, tp: int):
    """The same placements with PyTorch's APIs, written out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    ex = _example(model, GLOBAL_BATCH)
    net = ex.model
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if family == "tp":
        styles, _ = _tp_styles(model, net)
        tied = model == "gpt"
        parallelize_module(net, mesh["tp"], styles)
        if tied:
            net.lm_head.weight = net.tok_embeddings.weight        # keep the tie
    for layer in _layers(model, net):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    dp_rank = dist.get_rank() // tp
    per = GLOBAL_BATCH // dp
    inputs = ex.example_inputs[0][dp_rank * per:(dp_rank + 1) * per]
    targets = ex.targets[dp_rank * per:(dp_rank + 1) * per]

    def step() -> float:
        if family == "tp":
            with loss_parallel():
                loss = ex.loss_fn(net(inputs), targets)
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = ex.loss_fn(net(inputs), targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1).double()
        dist.all_reduce(t, group=mesh["dp"].get_group())
        return float(t[0]) / dp
    return step


def worker(case: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from autoplan.runtime.trainer import compile
    torch.set_num_threads(1)
    model, family = case.split("-")
    world = int(os.environ["WORLD_SIZE"])
    p = _plan(model, family, world)
    ex = _example(model, GLOBAL_BATCH)
    small = _example(model, 1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      global_batch_size=GLOBAL_BATCH, plan=p)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    hand = _by_hand(model, family, p.config.dp, p.config.tp)
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
        print(f"case {case} ({MODELS[model][0]}): {p.config.short()}")
        print(f"  autoplan.compile  {a * 1e3:8.1f} ms/step (median of {len(times['autoplan'])})")
        print(f"  by hand           {h * 1e3:8.1f} ms/step")
        print(f"  overhead ratio    {a / h:8.3f}   (target <= 1.05)")
        print(f"  predicted         {p.predicted['step_time_s'] * 1e3:8.1f} ms/step; "
              f"measured / predicted {a / p.predicted['step_time_s']:.2f}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=CASES + ("all",), default="all")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        worker(args.case, args.steps)
        return 0
    for case in (CASES if args.case == "all" else (args.case,)):
        code = subprocess.call([sys.executable, "-m", "torch.distributed.run",
                                "--nproc-per-node=4", "--master-port=29533", __file__, "--worker",
                                "--case", case, "--steps", str(args.steps)],
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
