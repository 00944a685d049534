"""Build a model with no memory for its weights but real values for its buffers.

``with torch.device("meta")`` builds a model of any size in no memory, but everything its
``__init__`` computes is lost with it: the rotary table torchtitan's Llama registers
(``freqs_cis``), a frequency table. Nothing can recompute such a buffer on a rank later, so
``autoplan run --meta`` and ``compile()`` of a meta model refuse it.

``empty_weights()`` keeps them: the model is built as usual, on the CPU, except that

- every parameter moves to the meta device as it is registered (before the module's own
  ``reset_parameters`` runs on it, so nothing is filled: the technique of Hugging Face
  accelerate's ``init_empty_weights(include_buffers=False)``);
- a tensor factory (``torch.empty``, ``randn``, ``zeros``, ...) asked for more than
  ``meta_above_numel`` elements makes it on meta at once, so a weight written as
  ``nn.Parameter(torch.randn(experts, d, f) * 0.02)`` is never computed either.

Buffers are computed and kept on the CPU: tables and masks are small. Each rank then allocates
and initializes only its shard of the weights (``runtime/meta_init.py``) and hands out the
buffers as they were computed. A buffer over the bound stays on meta, and a rank refuses it by
name, as under ``torch.device("meta")``; raise the bound for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_LOCK = threading.RLock()      # one patch at a time; nested blocks are fine

# factories whose result's size follows from their arguments (made on meta first to see it)
_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand,
                        torch.randn, torch.randint, torch.randperm, torch.arange,
                        torch.linspace, torch.logspace, torch.eye, torch.empty_strided})


class _BigOnMeta(TorchFunctionMode):
    """Factories asked for more than ``limit`` elements make their tensor on meta."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            shaped = func(*args, **{**kwargs, "device": "meta"})
            if shaped.numel() > self.limit:
                return shaped
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_weights(meta_above_numel: int = 2**24) -> Iterator[None]:
    """Models built in this block hold their parameters on the meta device (no memory, no
    values) and their buffers as computed, on the CPU; tensors of more than
    ``meta_above_numel`` elements are made on meta wherever they are made::

        with autoplan.empty_weights():
            model = Transformer(args)     # freqs_cis kept, 405B of weights not allocated
    """
    if not isinstance(meta_above_numel, int) or isinstance(meta_above_numel, bool) \
            or meta_above_numel < 0:
        raise ValueError(f"meta_above_numel must be a count of elements >= 0, got "
                         f"{meta_above_numel!r}")
    with _LOCK:
        register = nn.Module.register_parameter

        def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and not param.is_meta:
                module._parameters[name] = _on_meta(param)

        nn.Module.register_parameter = register_on_meta    # type: ignore[method-assign]
        try:
            with _BigOnMeta(meta_above_numel):
                yield
        finally:
            nn.Module.register_parameter = register        # type: ignore[method-assign]


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    data = param.detach().to("meta")
    try:
        return type(param)(data, requires_grad=param.requires_grad)
    except TypeError:        # a Parameter subclass built otherwise: a plain one
        return nn.Parameter(data, requires_grad=param.requires_grad)


__all__ = ["empty_weights"]
