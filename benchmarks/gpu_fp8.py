"""fp8 against bf16 on one GPU (issue 39, part 5): HF Llama 0.89B (hidden 2048, 16 layers,
16/8 heads, ffn 5632, vocab 32000: every linear's sides divisible by 16), 8 x 2048 tokens in
one micro-batch, trained by two one-GPU autoplan plans that differ only in fp8 (none against
torchao's tensorwise recipe on every linear), both compiled (fp8 needs compiled=True:
torchao's float8 training is fast only with its casts fused; eager it was 1.88x slower than
bf16 on an H200, benchmarks/data/h200-gpu-check-20261127/fp8.json), fused AdamW. Per plan: ms
per step (median of ``--steps`` after two warm-up steps), peak memory, and autoplan's
predicted step time and memory beside them.

    python benchmarks/gpu_fp8.py --out fp8.json            # on a CUDA GPU of 8.9 or later
    python benchmarks/gpu_fp8.py --small --out fp8.json    # width 64, on a CPU: refused there

Run by ``benchmarks/gpu_check.sh`` after ``tests/test_fp8_precision.py``'s GPU test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

LLAMA_1B = dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000,
                seq_len=2048, max_positions=2048)
SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32,
             max_positions=64)
VARIANTS = {"bf16": "none", "fp8 tensorwise": "tensorwise"}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run(fp8: str, over: dict[str, Any], gbs: int, steps: int) -> dict[str, Any]:
    from autoplan import Cluster, plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.runtime.trainer import compile
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    meta = build_example("hf-llama-gqa-tiny", batch_size=1, device="meta", **over)
    g = trace(meta.model, meta.example_inputs, loss_fn=meta.loss_fn, targets=meta.targets)
    force = dict(micro_batch_size=gbs, zero_stage=0, recompute="none", compiled=True)
    if fp8 != "none":
        force.update(fp8=fp8, fp8_skip=())
    p = plan(g, Cluster.local(1), global_batch_size=gbs, precision="bf16", force=force,
             max_pp=1, top_k=0)
    ex = build_example("hf-llama-gqa-tiny", batch_size=gbs, seed=0, device=dev, **over)
    small = build_example("hf-llama-gqa-tiny", batch_size=1, seed=0, device=dev, **over)
    tr = compile(ex.model, "local", example_inputs=small.example_inputs,
                 example_targets=small.targets, loss_fn=ex.loss_fn,
                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-5,
                                                        fused=torch.cuda.is_available()),
                 global_batch_size=gbs, plan=p)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    losses = [tr.step(batch) for _ in range(2)]
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        losses.append(tr.step(batch))
        _sync()
        times.append(time.perf_counter() - t0)
    return dict(plan=p.config.short(), step_s=statistics.median(times),
                peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                else None, predicted_step_s=p.predicted["step_time_s"],
                predicted_peak_bytes=p.predicted["peak_memory_bytes"], losses=losses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write the results (JSON) here")
    ap.add_argument("--small", action="store_true", help="a tiny model (refused on a CPU)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    args = ap.parse_args(argv)
    over, gbs = (SMALL, 2) if args.small else (LLAMA_1B, 8)
    rows: dict[str, Any] = dict(device=torch.cuda.get_device_name()
                                if torch.cuda.is_available() else "cpu",
                                torch=torch.__version__, tokens=f"{gbs} x {over['seq_len']}")
    for label, fp8 in VARIANTS.items():
        try:
            rows[label] = _run(fp8, over, gbs, args.steps)
        except Exception as e:          # one variant's failure leaves the other's figures
            rows[label] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
        print(label, {k: v for k, v in rows[label].items() if k != "losses"}, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    a, b = rows["bf16"], rows["fp8 tensorwise"]
    if "step_s" in a and "step_s" in b:
        rows["measured_speedup"] = a["step_s"] / b["step_s"]
        rows["predicted_speedup"] = a["predicted_step_s"] / b["predicted_step_s"]
        print("fp8 speedup: measured", rows["measured_speedup"], "predicted",
              rows["predicted_speedup"], flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
