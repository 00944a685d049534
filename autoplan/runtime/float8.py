"""fp8 linear layers in the rank program (``ParallelConfig.fp8``), as torchao's float8 training
runs them.

torchao converts a model by swapping each ``nn.Linear`` for its ``Float8Linear``
(``convert_to_float8_training``); the rank program runs the traced aten graph instead of the
user's modules, so a swap would never be called. The program therefore emits, for each linear
the plan converts (``cost.compute.fp8_converted_ops``: the ``nn.Linear`` products with weight
sides divisible by 16, but those matching ``fp8_skip``), the call ``Float8Linear.forward``
makes: the input cast to the autocast dtype, torchao's autograd function
``matmul_with_hp_or_float8_args`` on (input, weight transposed) with the recipe's
``Float8LinearConfig`` (``Float8LinearConfig.from_recipe_name``: "tensorwise" or "rowwise")
and the ``LinearMMConfig`` ``Float8Linear.__init__`` builds from it, then the bias in the
output's dtype. The weight is the program's own (the parameter the optimizer steps, gathered by
FSDP2 where the plan shards it), so the product is torchao's on the same weight.

Under FSDP2 with tensorwise scaling (``cost.float8.gathers_fp8``) the weights go over the wire
in fp8, as torchao's ``enable_fsdp_float8_all_gather`` does it (``Float8Linear.from_float``):
``fsdp_float8_weights`` wraps each gathered linear's weight (``cost.float8.fp8_gathered_weights``:
read by that linear alone, not kept whole) as torchao's ``WeightWithDynamicFloat8CastTensor``
before compilation and ``fully_shard``; FSDP2 then casts each shard to fp8 before its all-gather
(``fsdp_pre_all_gather``) and hands the linear a ``Float8TrainingTensor``, which
``matmul_with_hp_or_float8_args`` takes as cast. ``Float8Scales`` computes the scales once a
step after the optimizer step, as ``precompute_float8_dynamic_scale_for_fsdp`` does for
torchao's own ``Float8Linear`` modules (which the traced program has none of): the amax of every
gathered weight in one all-reduce. Rowwise scaling gathers 16-bit weights (torchao refuses fp8
all-gather for it).

Where it runs: fp8 pays only on GPUs with fp8 tensor cores (compute capability 8.9 or later:
L4, H100, H200, B200), the devices the planner prices it for. ``float8_refusal`` says why a
plan is not run elsewhere: on a CPU (torch 2.13's ``torch._scaled_mm`` runs fp8 products on
CPUs, without fp8 hardware, so the plan's priced speed would be fiction: refused, never
faked), on an older GPU, and under tensor parallelism (torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` scale a split weight and gradient by the whole tensor's amax, which
this program's local products do not).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from autoplan.cost.compute import fp8_converted_ops
from autoplan.cost.float8 import fp8_gathered_weights, gathers_fp8
from autoplan.graph.opgraph import OpGraph
from autoplan.torchao_quiet import quiet_torchao_import

# fp8 tensor cores: Ada (8.9) and Hopper (9.0) and later; torch._scaled_mm needs them on CUDA
MIN_CUDA_CAPABILITY = (8, 9)


def float8_refusal(config: Any, device: torch.device) -> str | None:
    """Why an fp8 plan (``config.fp8`` not "none") cannot run on ``device``, with the fix;
    None where it runs (tp = 1, on a CUDA device of compute capability 8.9 or later)."""
    if config.fp8 == "none":
        return None
    head = (f"the plan runs its linear layers in fp8 (fp8={config.fp8!r}, torchao's float8 "
            f"training, {len(config.fp8_skip)} linear pattern(s) kept in bf16), but ")
    fix = (". Re-plan without fp8: autoplan plan --precision bf16 (or plan(..., "
           "precision='bf16') without force fp8)")
    if config.tp > 1:
        return (head + f"splits them over tp={config.tp} ranks: torchao scales a "
                "split fp8 weight by the whole tensor's amax (Float8ColwiseParallel), which "
                "this runtime's local products do not yet do. Re-plan with max_tp=1 or "
                "without fp8")
    if device.type != "cuda":
        return (head + f"this rank runs on {device.type}, not on a GPU with fp8 tensor cores "
                "(compute capability 8.9 or later: L4, H100, H200, B200): fp8 was priced for "
                "such a GPU, and torch._scaled_mm on a CPU gains nothing from it" + fix)
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CUDA_CAPABILITY:
        return (head + f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{cap[0]}.{cap[1]}: fp8 GEMMs (torch._scaled_mm) need 8.9 or later (L4, H100, "
                "H200, B200)" + fix)
    return None


def fp8_program_ops(graph: OpGraph, config: Any) -> frozenset[int]:
    """The ops of the exported ``graph`` whose product runs in fp8 under ``config``."""
    if config.fp8 == "none":
        return frozenset()
    return fp8_converted_ops(graph, tuple(config.fp8_skip))


def fsdp_gathered_fqns(graph: OpGraph, config: Any) -> frozenset[str]:
    """The FQNs of the weights FSDP2 gathers in fp8 under ``config`` (none where it does not:
    ``cost.float8.gathers_fp8``), as the planner priced them."""
    if not gathers_fp8(config):
        return frozenset()
    return frozenset(fp8_gathered_weights(graph, fp8_program_ops(graph, config),
                                          tuple(config.dp_whole)).values())


def fsdp_float8_weights(module: torch.nn.Module, fqns: frozenset[str]
                        ) -> list[torch.nn.Parameter]:
    """Each parameter of ``module`` named in ``fqns`` (checkpoint wrappers dropped) replaced by
    the same tensor wrapped as torchao's ``WeightWithDynamicFloat8CastTensor`` (tensorwise, fp8
    all-gather on), as ``Float8Linear.from_float`` wraps its weight; before ``fully_shard``,
    which then gathers it in fp8. Returns the new parameters."""
    if not fqns:
        return []
    with quiet_torchao_import():
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    config, mm_config = _configs("tensorwise", fsdp_all_gather=True)
    dtype = config.cast_config_weight.target_dtype
    out = []
    for name, owner in list(module.named_modules()):
        for attr, p in list(owner.named_parameters(recurse=False)):
            fqn = f"{name}.{attr}" if name else attr
            if fqn.replace("_checkpoint_wrapped_module.", "") not in fqns or isinstance(
                    p, WeightWithDynamicFloat8CastTensor):
                continue
            new = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(p, mm_config, dtype),
                                     requires_grad=p.requires_grad)
            setattr(owner, attr, new)
            out.append(new)
    return out


class Float8Scales:
    """The scales FSDP's fp8 all-gather casts with, computed once a step after the optimizer
    step: ``precompute_float8_dynamic_scale_for_fsdp`` (torchao 0.18, ``fsdp_utils.py``) over
    the wrapped weights of this rank's modules (found again each time: ``fully_shard`` holds
    them as DTensors). Each weight's amax (``torch._foreach_norm(ord=inf)`` on its shard, then
    one all-reduce of the stacked amaxes through DTensor), clamped to torchao's EPS, its scale
    ``finfo(fp8).max / amax`` in float64 then float32, as ``amax_to_scale``. Without it (the
    first step, or after a load) FSDP computes each scale in its gather (an all-reduce per
    weight)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules

    def __call__(self) -> None:
        import math

        from torch.distributed.tensor import DTensor
        from torchao.float8.float8_utils import EPS
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
        weights = list({id(p): p for m in self.modules for p in m.parameters()
                        if isinstance(p, DTensor) and isinstance(
                            p._local_tensor, WeightWithDynamicFloat8CastTensor)}.values())
        if not weights:
            return
        dtype = weights[0]._local_tensor._dtype
        with torch.no_grad():
            amax = torch.clamp(torch.stack(torch._foreach_norm(weights, ord=math.inf)), EPS)
            scale = (torch.finfo(dtype).max / amax.to(torch.float64)).to_local()
            scale = scale.to(torch.float32)
        for i, w in enumerate(weights):
            w._local_tensor._precomputed_scale = scale[i]


@functools.lru_cache(maxsize=None)
def _configs(recipe: str, fsdp_all_gather: bool = False) -> tuple[Any, Any]:
    """(Float8LinearConfig, LinearMMConfig) of ``recipe``, the pair ``Float8Linear`` keeps;
    ``fsdp_all_gather``: with ``enable_fsdp_float8_all_gather`` (tensorwise only)."""
    import dataclasses
    with quiet_torchao_import():
        from torchao.float8.config import Float8LinearConfig  # lazily: it loads its kernels
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input,
             config.gemm_config_grad_weight)
    return config, LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False,
                                                   config.pad_inner_dim) for g in gemms))


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as torchao's ``Float8Linear.forward`` computes it under
    ``recipe``: the input in the autocast dtype where autocast is on (on the input's device),
    the product by ``matmul_with_hp_or_float8_args``, the bias added in the output's dtype."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # lazily: as above
    config, mm_config = _configs(recipe)
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        x = x.to(torch.get_autocast_dtype(kind))
    y = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
    return y if bias is None else y + bias.to(y.dtype)
