"""Adam and AdamW with their two moments in less memory (``ParallelConfig.optimizer_state``),
run by torchao's low-bit optimizers (an optional dependency: ``pip install autoplan[lowbit]``).

- ``"8bit"``: ``torchao.optim.AdamW8bit`` / ``Adam8bit`` (Dettmers et al. 2022, "8-bit
  Optimizers via Block-wise Quantization"): each moment a tensor subclass of uint8 codes into a
  dynamic-exponent map, with one fp32 scale (the absolute maximum) per block of 256 elements
  (torchao's default ``block_size``). As bitsandbytes, torchao keeps fp32 moments for a tensor
  of fewer than 4,096 elements or not a multiple of the block.
- ``"bf16"``: ``BF16StateAdamW`` (``bf16_adam.py``), torchao's step with its moment buffers
  made in bf16 (Megatron-Core's precision-aware optimizer: ``exp_avg`` and ``exp_avg_sq`` in
  bf16, the update computed in fp32 on the fp32 weights).

torchao compiles its per-parameter step (``torch.compile``, one graph per distinct shape), on
the CPU as on a GPU; its states work under DTensor (FSDP2 shards: the moment is made from the
local shard and wrapped like the weight) and on ZeRO-1's whole tensors.

The user's optimizer factory stays the source of the hyper-parameters: it is called on the
parameters (torch's Adam makes no state before its first step), and the low-bit optimizer is
made with its param groups' learning rate, betas, eps, weight decay and amsgrad. Anything but
``torch.optim.Adam`` / ``AdamW`` (or already the torchao class the plan names) is refused.

Checkpoints (``checkpoint.py``): a quantised moment is saved dequantised (``plain_state``: the
fp32 values its codes and scales stand for), an elementwise tensor DCP reshards like any other,
and quantised again into the loading plan's buffers (``requantize``). Loaded under the same blocks
(ZeRO-0/1's whole tensors, dim-0 shards at multiples of 256 elements, on any plan that keeps
them so) the codes and scales come back as saved; under other blocks each is quantised anew
from the saved values, as torchao would quantise them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError
from autoplan.torchao_quiet import quiet_torchao_import

# what one asks pip for when torchao is missing
INSTALL = "pip install 'autoplan[lowbit]'"
# the per-group settings a low-bit Adam takes from the user's optimizer
_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def require_library(optimizer_state: str) -> None:
    """PlanError when ``optimizer_state`` needs torchao and it is not installed."""
    if optimizer_state == "fp32":
        return
    try:
        with quiet_torchao_import():
            import torchao.optim  # noqa: F401  # lazily: an optional dependency, 1.3 s to import
    except ImportError as e:
        raise PlanError(f"the plan holds Adam's moments in {optimizer_state} "
                        f"(optimizer_state={optimizer_state!r}), which runs on torchao's "
                        f"low-bit optimizers, not installed here ({e}). Install them: "
                        f"{INSTALL}; or re-plan with optimizer_state=fp32") from None


def lowbit_class(optimizer_state: str, adamw: bool) -> type:
    """The torchao optimizer class that holds Adam's moments as ``optimizer_state`` says."""
    require_library(optimizer_state)
    if optimizer_state == "bf16":
        from autoplan.runtime import bf16_adam  # lazily: it imports torchao (optional)
        return bf16_adam.BF16StateAdamW if adamw else bf16_adam.BF16StateAdam
    from torchao.optim import Adam8bit, AdamW8bit  # lazily: an optional dependency
    return AdamW8bit if adamw else Adam8bit


def state_factory(factory: Callable[[Any], Any], optimizer_state: str
                  ) -> Callable[[Any], Any]:
    """``factory`` (params -> the user's torch optimizer) as a factory of the low-bit
    optimizer ``optimizer_state`` names, with the user's hyper-parameters per param group."""
    if optimizer_state == "fp32":
        return factory

    def make(params: Any) -> Any:
        params = list(params)
        user = factory(params)
        adamw = _is_adamw(user, optimizer_state)
        cls = lowbit_class(optimizer_state, adamw)
        if isinstance(user, cls):
            return user
        groups = [{"params": g["params"], **{k: _plain(g[k]) for k in _HPARAMS if k in g}}
                  for g in user.param_groups]
        return cls(groups, **{k: _plain(user.defaults[k]) for k in _HPARAMS
                              if k in user.defaults})
    return make


def _is_adamw(opt: Any, optimizer_state: str) -> bool:
    """Whether the user's ``opt`` decouples its weight decay (AdamW) or not (Adam); PlanError
    for an optimizer a low-bit Adam cannot stand for."""
    if type(opt).__module__.startswith("torchao.") or type(opt).__module__.endswith("bf16_adam"):
        return bool(getattr(opt, "is_adamw", True))
    if not isinstance(opt, torch.optim.Adam):     # AdamW is an Adam in torch 2.13
        raise PlanError(f"the plan holds Adam's moments in {optimizer_state} "
                        f"(optimizer_state={optimizer_state!r}) but the optimizer factory made "
                        f"a {type(opt).__name__}: low-bit states are Adam's and AdamW's. Pass "
                        "a factory of torch.optim.Adam or AdamW, or re-plan with "
                        "optimizer_state=fp32")
    for g in opt.param_groups:
        if g.get("maximize") or g.get("differentiable"):
            raise PlanError(f"torchao's low-bit Adam has no maximize or differentiable mode; "
                            f"the factory's {type(opt).__name__} sets one: drop it, or re-plan "
                            "with optimizer_state=fp32")
    return isinstance(opt, torch.optim.AdamW) or bool(
        opt.defaults.get("decoupled_weight_decay", False))


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _quantised(t: Any) -> bool:
    """Whether ``t`` (a moment, maybe a DTensor) is held as a torchao subclass of codes."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return isinstance(local, torch.Tensor) and type(local) is not torch.Tensor \
        and hasattr(local, "dequantize") and hasattr(local, "codes")


def plain_state(value: Any) -> Any:
    """A moment as the checkpoint holds it: a quantised one as the fp32 values it stands for
    (this rank's local piece), anything else as it is."""
    if not _quantised(value):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.dequantize()


def requantize(opt: Any) -> None:
    """After a checkpoint loaded ``opt``'s moments as fp32 tensors: each one torchao keeps
    quantised is made again as the optimizer makes it and filled from the loaded values
    (``quantise_into``)."""
    new_buffer = getattr(opt, "_new_buffer", None)
    if new_buffer is None:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key not in state:
                    continue
                buf = new_buffer(p, key == "exp_avg")         # signed: the first moment only
                if _quantised(buf):
                    quantise_into(_local(buf), _local(state[key]))
                    state[key] = buf


@torch.no_grad()
def quantise_into(buf: Any, values: torch.Tensor) -> None:
    """Codes and block scales of torchao's 8-bit state ``buf`` for the fp32 ``values`` a
    dequantised state holds, the same codes and scales where its blocks are the saved ones.
    Each block's scale is its largest magnitude over the magnitude of the code that holds it:
    1.0 for a positive peak, but the signed map's most negative code is not -1.0 (a block
    whose peak was -s holds it as ``qmap[0] * s``), so the peak's sign picks the code.
    (``copy_``, torchao's own quantisation, takes the largest magnitude as the scale and so
    shrinks such a block's scale and moves its codes.)"""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap  # lazily: optional
    x = values.to(torch.float32).reshape(-1, buf.block_size)
    peak = x.gather(1, x.abs().argmax(1, keepdim=True)).squeeze(1)
    qmap = buf.qmap
    held = torch.where(peak < 0, -qmap[0], qmap[-1])
    scale = (peak.abs() / held).clip(1e-12)                  # torchao's floor for zero blocks
    codes = quantize_8bit_with_qmap(x / scale.view(-1, 1), qmap)
    buf.codes.copy_(codes.view(buf.codes.shape))
    buf.scale.copy_(scale)


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t
