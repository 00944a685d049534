"""Device figures the cost model falls back on where no op was profiled (``Calibration``):
the matrix products' rate in a forward and backward pass and how it falls with their size, a
copy's bandwidth, a tiny op's launch cost, AdamW per parameter and per tensor, a one-parameter
step's fixed cost, and the eager framework's time per op. ``autoplan profile --calibrate-only``
and the first use of ``Cluster.local()`` on a CPU without a profile run it.

Why the products' rate comes from a training pass rather than one GEMM run in a loop: a loop
reads the same operands from the cache every time, while a step's products read what the op
before wrote and, in the backward, transposed operands, and write fresh gradients. On a 2-core
AMD EPYC, a 1024^3 GEMM in a loop runs at 110 GFLOP/s, a step's products (gpt-small-cpu in
eager mode, timed by torch's profiler) at 96, a reference MLP's forward and backward at 100-104:
priced from the loop, every step came out 13-20 % short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoplan.cluster.profile_db import Calibration
from autoplan.cost.compute import size_efficiency
from autoplan.cost.host_allocator import keep_freed_host_memory
from autoplan.machine.timing import Clock, check_device, measure


def calibrate(device: str | torch.device = "cpu", *, seed: int = 0) -> Calibration:
    """Measure the device figures the cost model falls back on (1-2 s on 2 idle CPU cores).

    Sizes: CPU, an fp32 reference network of 512 tokens through widths 512-2048-512, square
    GEMMs of 32 to 1024, a 128 MiB copy, AdamW over 4M parameters; CUDA, a bf16 network of
    8192 tokens through 4096-16384-4096, GEMMs of 256 to 8192, a 1 GiB copy, AdamW over 32M
    parameters. The optimizer is the default
    ``torch.optim.AdamW`` (foreach on CUDA; torch's default on CPU is the per-tensor loop).
    """
    dev = check_device(device)
    if dev.type == "cpu":
        keep_freed_host_memory()
    clock = Clock(dev)
    cuda = dev.type == "cuda"
    torch.manual_seed(seed)

    mm_dtype = torch.bfloat16 if cuda else torch.float32
    mm_rate = _pass_matmul_rate(clock, dev, mm_dtype)
    curve = _size_curve(clock, dev, mm_dtype)

    numel = (1 << 28) if cuda else (1 << 25)
    src = torch.empty(numel, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = measure(clock, lambda: dst.copy_(src), warmup=2, repeats=7,
                     min_time_s=0.0, max_time_s=0.5).median_s
    copy_bytes = 2 * src.numel() * src.element_size()
    del src, dst

    x = torch.ones(1, device=dev)
    launch_s = measure(clock, lambda: torch.add(x, x), warmup=20, repeats=15,
                       min_time_s=2e-3, max_time_s=0.5).median_s

    # Two AdamW measurements: large tensors (beyond the caches, as real weights are) give the
    # cost per parameter; many one-element tensors give the fixed cost per tensor.
    def adamw_step_s(tensors: int, per: int) -> float:
        params = [nn.Parameter(torch.randn(per, device=dev)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        # warm-up steps allocate the optimizer state (first-touch page faults are slow in VMs)
        return measure(clock, opt.step, warmup=2, repeats=5, min_time_s=0.0,
                       max_time_s=0.5).median_s
    big_tensors, big = (8, 1 << 24) if cuda else (16, 1 << 20)
    per_tensor_s = adamw_step_s(64, 1) / 64
    opt_s = adamw_step_s(big_tensors, big) - big_tensors * per_tensor_s
    opt_per_param_s = max(opt_s, 0.0) / (big_tensors * big) or 1e-12

    w = nn.Parameter(torch.zeros(1, device=dev))
    one = torch.ones(1, device=dev)
    tiny_opt = torch.optim.AdamW([w], lr=1e-3)

    def tiny_step() -> None:
        tiny_opt.zero_grad(set_to_none=True)
        (w * one).sum().backward()
        tiny_opt.step()
    step_s = measure(clock, tiny_step, warmup=5, repeats=15, min_time_s=5e-3,
                     max_time_s=0.5).median_s
    framework_s = _framework_s_per_op(clock, dev, launch_s) if not cuda else 0.0
    elementwise = _elementwise_rates(clock, dev, mm_dtype)

    return Calibration(matmul_flops_per_s=mm_rate, matmul_size_efficiency=curve,
                       memory_bandwidth_bytes_per_s=copy_bytes / copy_s, launch_s=launch_s,
                       optimizer_s_per_param=opt_per_param_s,
                       optimizer_s_per_tensor=per_tensor_s, step_overhead_s=step_s,
                       matmul_dtype=str(mm_dtype).removeprefix("torch."),
                       framework_s_per_op=framework_s, elementwise_s_per_element=elementwise)


# the reference network whose forward and backward give the products' rate: tokens, then the
# widths of its bias-free linear layers (one product of M*K*N = tokens * width_in * width_out
# each way, three per layer: forward, input gradient, weight gradient)
_REFERENCE = {"cpu": (512, (512, 2048, 512)), "cuda": (8192, (4096, 16384, 4096))}
# sizes of the square products timed in a loop for the size curve; the curve is their rates
# relative to the loop's rate at the reference network's size
_CURVE_SIZES = {"cpu": (32, 64, 128, 256, 512, 1024), "cuda": (256, 512, 1024, 2048, 4096, 8192)}


def reference_size(kind: str) -> float:
    """The product size (cube root of M*K*N) of the reference network's layers."""
    tokens, widths = _REFERENCE[kind]
    sizes = [(tokens * a * b) ** (1.0 / 3.0) for a, b in zip(widths, widths[1:])]
    return sum(sizes) / len(sizes)


def _pass_matmul_rate(clock: Any, dev: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the products in the forward and backward of the reference network."""
    tokens, widths = _REFERENCE[dev.type]
    net = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:])])
    net = net.to(device=dev, dtype=dtype)
    # the input needs a gradient too: every layer's backward runs both of its products
    x = torch.randn(tokens, widths[0], device=dev, dtype=dtype, requires_grad=True)
    flops = 6.0 * tokens * sum(a * b for a, b in zip(widths, widths[1:]))

    def fwd_bwd() -> None:
        for p in net.parameters():
            p.grad = None
        x.grad = None
        net(x).sum().backward()
    t = measure(clock, fwd_bwd, warmup=2, repeats=5, min_time_s=0.0, max_time_s=1.0).median_s
    return flops / t


def _size_curve(clock: Any, dev: torch.device, dtype: torch.dtype
                ) -> tuple[tuple[float, float], ...]:
    """((size, fraction), ...): square products' rates in a loop, relative to the loop's rate
    at the reference network's size (interpolated in log size)."""
    rates = []
    for n in _CURVE_SIZES[dev.type]:
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        s = measure(clock, lambda: torch.mm(a, b, out=c), warmup=2, repeats=7,
                    min_time_s=2e-3, max_time_s=0.3).median_s
        rates.append((float(n), 2.0 * n ** 3 / s))
    ref = size_efficiency(rates, reference_size(dev.type))
    return tuple((n, r / ref) for n, r in rates)


# the element-wise functions timed (``cost.compute.elementwise_key`` names them); their
# arithmetic, not their bytes, can set their time: on a 2-core AMD EPYC, per fp32 element
# forward, tanh 2.1 ns, GELU's tanh form 1.2, exp 0.6, softmax 0.4, sigmoid 0.2, where the
# copy bandwidth gives 0.2
_ELEMENTWISE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "exp": torch.exp, "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(-1),
}


def _elementwise_rates(clock: Any, dev: torch.device, dtype: torch.dtype
                       ) -> tuple[tuple[str, float, float], ...]:
    """(name, forward, backward) seconds per element of each element-wise function, on a
    tensor of 1M elements (64M on CUDA) in rows of 1024."""
    n = (1 << 26) if dev.type == "cuda" else (1 << 20)
    x = torch.randn(n // 1024, 1024, device=dev, dtype=dtype)
    grad = torch.randn_like(x)
    out = []
    for name, fn in _ELEMENTWISE_FUNCTIONS.items():
        xg = x.clone().requires_grad_(True)

        def fwd_bwd() -> None:
            fn(xg).backward(grad)
        fwd = measure(clock, lambda: fn(x), warmup=2, repeats=7, min_time_s=1e-3,
                      max_time_s=0.2).median_s
        both = measure(clock, fwd_bwd, warmup=2, repeats=7, min_time_s=1e-3,
                       max_time_s=0.3).median_s
        out.append((name, fwd / n, max(0.0, both - fwd) / n))
    return tuple(out)


# a small eager network of tiny layers: its forward and backward time is all framework (module
# calls, dispatch, autograd) and kernel launches; each block traces to this many graph ops
# (Linear: transpose + addmm; GELU; LayerNorm)
_FRAMEWORK_BLOCKS, _OPS_PER_BLOCK = 16, 4


def framework_s_per_op(threads: int = 1) -> float:
    """This CPU's eager framework time per graph op and pass (what first use measures), with
    ``threads`` intra-op threads (one rank process's): for a profile measured before first
    use took it (``autoplan calibrate`` fits the transfers' waits beside it)."""
    dev = torch.device("cpu")
    clock = Clock(dev)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(1, device=dev)
        launch_s = measure(clock, lambda: torch.add(x, x), warmup=20, repeats=15,
                           min_time_s=2e-3, max_time_s=0.5).median_s
        return _framework_s_per_op(clock, dev, launch_s)
    finally:
        torch.set_num_threads(before)


def _framework_s_per_op(clock: Any, dev: torch.device, launch_s: float) -> float:
    """Eager time per graph op and pass outside its kernel (``Calibration.framework_s_per_op``),
    from the forward and backward of a network of tiny layers, less a launch per op."""
    layers: list[nn.Module] = []
    for _ in range(_FRAMEWORK_BLOCKS):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    net = nn.Sequential(*layers).to(dev)
    x = torch.randn(4, 16, device=dev)

    def fwd_bwd() -> None:
        net(x).sum().backward()
    t = measure(clock, fwd_bwd, warmup=3, repeats=15, min_time_s=5e-3, max_time_s=0.5).median_s
    ops = _FRAMEWORK_BLOCKS * _OPS_PER_BLOCK + 1
    return max(0.0, t / (2 * ops) - launch_s)
