"""The host's optimizer step with Adam's moments in fp32, bf16 and 8 bits, on this CPU.

Under optimizer offload (``offload_optimizer``, ZeRO-Offload) the step runs on the host, on the
fp32 host copies of the weights (``runtime/optim.HostOffloadOptimizer``), with the optimizer the
plan names: torch's AdamW for fp32 moments, torchao's ``AdamW8bit`` for 8-bit moments and
``BF16StateAdamW`` (``runtime/bf16_adam.py``) for bf16 moments, all on CPU tensors. The host's
rate in ``cost_models/clusters.yaml`` (``cpu_adam_params_per_s``) is a vectorised fp32 CPU Adam
(ZeRO-Offload's CPU-Adam); this script measures how much slower each low-bit step is than
torch's fused fp32 AdamW (the vectorised one torch ships) on the same tensors and threads.
``estimate/dp_terms.HOST_STEP_SLOWDOWN`` holds the ratios it printed.

On a CPU the low-bit steps do not move fewer bytes for less time, as on a GPU: torchao's
8-bit step searches its 256-entry code map per element (some 50 operations), which a GPU hides
behind memory traffic and a CPU core does not.

    python benchmarks/host_adam_states.py [--elements 4194304] [--tensors 4] [--threads 1]

Output committed as ``benchmarks/data/host_adam_states.txt``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autoplan.torchao_quiet import quiet_torchao_import


def _classes() -> dict[str, tuple[type, dict]]:
    with quiet_torchao_import():
        from torchao.optim import AdamW8bit  # lazily: an optional dependency
    from autoplan.runtime.bf16_adam import BF16StateAdamW
    return {"fp32 fused (reference)": (torch.optim.AdamW, dict(fused=True)),
            "fp32 foreach": (torch.optim.AdamW, dict(foreach=True)),
            "fp32 default (for-loop)": (torch.optim.AdamW, dict(foreach=False)),
            "bf16 (BF16StateAdamW)": (BF16StateAdamW, {}),
            "8bit (torchao AdamW8bit)": (AdamW8bit, {})}


def seconds_per_param(cls: type, kwargs: dict, elements: int, tensors: int,
                      repeats: int) -> float:
    """Median seconds per parameter of one step over ``tensors`` tensors of ``elements``,
    after two warm-up steps (torchao compiles its step on the first)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(elements, generator=gen)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(elements, generator=gen)
    opt = cls(params, lr=1e-3, **kwargs)
    opt.step()
    opt.step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / (elements * tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# python benchmarks/host_adam_states.py --elements {args.elements} --tensors "
          f"{args.tensors} --threads {args.threads}   (torch {torch.__version__}, CPU)")
    ref = None
    for name, (cls, kwargs) in _classes().items():
        s = seconds_per_param(cls, kwargs, args.elements, args.tensors, args.repeats)
        ref = s if ref is None else ref
        print(f"  {name:26s} {s * 1e9:8.2f} ns/param  {1 / s:10.3g} params/s  "
              f"{s / ref:6.2f}x the fused fp32 step", flush=True)


if __name__ == "__main__":
    main()
