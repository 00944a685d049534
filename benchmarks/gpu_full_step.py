"""The 1.7B H100 validation row's whole step on one GPU, as Megatron-LM holds it, against the
sum of its parts and autoplan's prediction.

    python benchmarks/gpu_full_step.py --measure out.json    # on a CUDA GPU (under a minute)
    python benchmarks/gpu_full_step.py benchmarks/data/h100-sxm5-full-step.json   # compare

Issue 14: every H100 row of ``benchmarks/validate.py`` takes 1.32-1.51x the compute its busiest
rank does at the rates one H100 ran its layers (``benchmarks/gpu_layers.py``), and the 1.7B row
(TP 1, PP 1, one micro-batch of 4 per rank, its data-parallel gradients a 20 ms reduce-scatter)
1.36x. Its rank's step is what one GPU can run whole: the same forward and backward, the
optimizer, minus only the data-parallel collectives. This runs it: a GPT of the row's shape
(24 layers of ``gpu_layers.RankLayer`` at TP 1: layer norms, fused qkv, causal flash attention,
GELU MLP; learned positions; the output layer tied to the embedding; fp32 cross entropy over
the 131,072-word vocabulary), bf16 weights and activations, gradients accumulated into an fp32
buffer, fp32 master weights in a fused AdamW (Megatron-LM's --bf16 with its distributed
optimizer on one rank: the step, the weights copied back, the buffer zeroed). It times the step and its phases with CUDA events (median
of ``--steps``), profiles one step (the GPU's kernel time against the step's wall time: how
much of the step the GPU was idle), and records the peak of allocated memory.

If this step takes about 0.33 s (the parts' sum), the 1.7B row's missing third is in what a
multi-GPU run adds; if it takes about 0.45 s, one GPU shows it and the profile says where.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_layers  # noqa: E402  (the layer measured part by part)

# the 1.7B row of Megatron-LM's 2024 table, as benchmarks/validate.py prices it
ROW = dict(hidden=2048, heads=16, layers=24, micro_batch=4)


class RowGPT(nn.Module):
    """One rank's whole model at TP 1: embedding + learned positions, ``layers`` layers, final
    norm, output layer tied to the embedding, fp32 cross entropy."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab: int, seq: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(gpu_layers.RankLayer(hidden, heads, 1)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        for table in (self.embedding, self.positions):     # GPT's (and Megatron-LM's) init
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.positions.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.norm(x), self.embedding.weight).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class Step:
    """Megatron-LM's bf16 step on one rank: a bf16 model whose gradients accumulate into a
    persistent fp32 buffer as they arrive (its ``main_grad``), fp32 masters stepped by AdamW
    from that buffer, the weights copied back to bf16, the buffer zeroed for the next step:
    18 bytes a parameter, as autoplan prices ``mixed_precision="params"``."""

    def __init__(self, model: nn.Module, fused: bool):
        self.model = model
        self.params = [p for p in model.parameters()]
        self.masters = [p.detach().float().clone() for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        for p, m in zip(self.params, self.masters):
            p.register_post_accumulate_grad_hook(self._accumulate(m))
        self.opt = torch.optim.AdamW(self.masters, lr=3e-4, fused=fused)

    @staticmethod
    def _accumulate(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            master.grad.add_(p.grad)
            p.grad = None
        return hook

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer(self) -> None:
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        torch._foreach_zero_([m.grad for m in self.masters])


def _clock(device: str) -> Callable[[], Callable[[], float]]:
    """A stopwatch: CUDA events on a GPU, the wall clock elsewhere; ``start()`` returns a
    function giving the seconds since."""
    if device == "cuda":
        def start() -> Callable[[], float]:
            a = torch.cuda.Event(enable_timing=True)
            a.record()

            def since() -> float:
                b = torch.cuda.Event(enable_timing=True)
                b.record()
                b.synchronize()
                return a.elapsed_time(b) / 1e3
            return since
        return start

    def start_cpu() -> Callable[[], float]:
        t0 = time.perf_counter()
        return lambda: time.perf_counter() - t0
    return start_cpu


def measure_step(*, hidden: int, heads: int, layers: int, micro_batch: int, vocab: int,
                 seq: int, device: str, steps: int, warmup: int) -> dict:
    """Median seconds of the whole step and of its forward, backward and optimizer phases (each
    timed alone in another step, so the whole step's figure has no extra synchronization), the
    share of the step the GPU spent in kernels (CUDA), and the peak of allocated memory."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    with torch.device(device):
        model = RowGPT(hidden, heads, layers, vocab, seq).to(dtype)
        tokens = torch.randint(0, vocab, (micro_batch, seq))
        targets = torch.randint(0, vocab, (micro_batch, seq))
    step = Step(model, fused=device == "cuda")
    start = _clock(device)

    def whole() -> None:
        step.backward(step.forward(tokens, targets))
        step.optimizer()

    for _ in range(warmup):
        whole()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    samples: dict[str, list[float]] = {"step_s": [], "fwd_s": [], "bwd_s": [], "optimizer_s": []}
    for _ in range(steps):
        since = start()
        whole()
        samples["step_s"].append(since())
        since = start()
        loss = step.forward(tokens, targets)
        samples["fwd_s"].append(since())
        since = start()
        step.backward(loss)
        samples["bwd_s"].append(since())
        since = start()
        step.optimizer()
        samples["optimizer_s"].append(since())
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["loss"] = float(step.forward(tokens, targets).detach().float())
    if device == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out.update(_profile(whole))
    return out


def _profile(whole: Callable[[], None]) -> dict:
    """One step under torch.profiler: the kernels' total time against the step's wall time,
    and the ten costliest kernels."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        whole()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_s = sum(e.device_time_total for e in kernels) / 1e6
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / 1e6
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"profiled_step_s": wall, "kernel_s": busy_s, "kernels": len(kernels),
            "top_kernels_s": [[name[:120], s] for name, s in top]}


def measure(path: str, *, steps: int, warmup: int, device: str = "cuda",
            row: dict | None = None, seq: int | None = None, vocab: int | None = None) -> dict:
    """Measure the row's step (or ``row``'s, at ``seq`` and ``vocab``) into ``path``."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--measure needs a CUDA GPU")
    row = ROW if row is None else row
    seq = gpu_layers.SEQ if seq is None else seq
    vocab = gpu_layers.VOCAB if vocab is None else vocab
    result = measure_step(**row, vocab=vocab, seq=seq, device=device, steps=steps,
                          warmup=warmup)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    record = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(),
              "command": "python benchmarks/gpu_full_step.py --measure " + path,
              "row": row, "seq": seq, "vocab": vocab, "steps": steps, "warmup": warmup,
              "result": result}
    Path(path).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return result


def predicted() -> dict:
    """autoplan's estimate of this step: the 1.7B row on one H100 (tp 1, dp 1, one micro-batch
    of 4, weights held in 16 bits as Megatron-LM holds them)."""
    import validate
    from autoplan import plan
    graph = validate.gpt_graph(ROW["layers"], ROW["hidden"], ROW["heads"], gpu_layers.SEQ,
                               gpu_layers.VOCAB, "sdpa")
    p = plan(graph, validate.part_of_a_node("dgx-h100", 1), global_batch_size=ROW["micro_batch"],
             precision="bf16", profile=None, sharding="megatron", top_k=1,
             force={"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0, "mixed_precision": "params",
                    "micro_batch_size": ROW["micro_batch"], "recompute": "none"})
    t = p.predicted["time"]
    return {"step_s": p.predicted["step_time_s"], "compute_s": t["compute_s"],
            "optimizer_s": t["optimizer_s"], "peak_memory_bytes": p.predicted["peak_memory_bytes"]}


def compare(path: str) -> list[str]:
    data = json.loads(Path(path).read_text())
    r = data["result"]
    layers = json.loads((Path(__file__).resolve().parent / "data" /
                         "h100-sxm5-layers.json").read_text())["cases"].get("1.7B")
    parts = (ROW["layers"] * layers["layer"]["fwd_bwd_s"] + layers["head"]["fwd_bwd_s"]
             if layers else float("nan"))
    p = predicted()
    lines = [f"measured on {data['device']} (torch {data['torch']}, CUDA {data['cuda']}): {path}",
             "", "| | seconds |", "|---|---|",
             f"| whole step, measured | {r['step_s']:.4f} |",
             f"| forward / backward / optimizer, each timed alone | {r['fwd_s']:.4f} / "
             f"{r['bwd_s']:.4f} / {r['optimizer_s']:.4f} |",
             f"| 24 layers + output layer timed part by part (gpu_layers.py) | {parts:.4f} |",
             f"| autoplan's prediction (compute / optimizer) | {p['step_s']:.4f} "
             f"({p['compute_s']:.4f} / {p['optimizer_s']:.4f}) |",
             "| Megatron-LM's published step of the 1.7B row (48 GPUs) | 0.4516 |"]
    if "kernel_s" in r:
        lines.append(f"| kernels in one profiled step ({r['kernels']} of them) of its "
                     f"{r['profiled_step_s']:.4f} s | {r['kernel_s']:.4f} |")
    if "peak_allocated_bytes" in r:
        lines += ["", f"peak allocated {r['peak_allocated_bytes'] / 2**30:.2f} GiB; autoplan "
                      f"predicts {p['peak_memory_bytes'] / 2**30:.2f} GiB"]
    if r.get("top_kernels_s"):
        lines += ["", "| kernel | seconds in the profiled step |", "|---|---|"]
        lines += [f"| {name} | {s:.4f} |" for name, s in r["top_kernels_s"]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", nargs="?", help="a measured file to compare with the model")
    ap.add_argument("--measure", metavar="OUT", help="measure on this CUDA GPU into OUT")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, steps=args.steps, warmup=args.warmup), indent=1))
        return 0
    if not args.measured:
        ap.error("give a measured file to compare, or --measure OUT on a CUDA GPU")
    print("\n".join(compare(args.measured)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
