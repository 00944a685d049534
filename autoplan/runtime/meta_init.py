"""How one module of a meta-device model gets its first values, when a rank materializes it.

A rank allocates a meta module's own tensors (``LocalState._materialize``) and fills them the
way the model's authors would, in this order:

1. the module's ``reset_parameters()`` (torch's layers, and user modules that follow them);
2. the ``_init_weights(module)`` of the Hugging Face model it sits in: norms to one, linear and
   embedding weights at the config's ``initializer_range``, rotary frequencies recomputed from
   the config;
3. otherwise the usual defaults: a norm's 1-D ``weight`` one, a ``bias`` zero, other parameters
   N(0, 0.02).

Tensors that already hold values are kept: buffers computed under ``autoplan.empty_weights()``
(weights on meta, buffers on the CPU). A floating-point buffer on meta that none of these fills
(rotary frequencies or a mask computed in the module's ``__init__`` under
``torch.device("meta")``) cannot be recovered: it is refused with what to do, never filled with
noise (random rotary frequencies train, silently, another model). Where only
the bytes and the time count (``emulate``, under :func:`values_unneeded`), it is zero-filled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

from autoplan.errors import PlanError


_VALUES_UNNEEDED: ContextVar[bool] = ContextVar("autoplan_values_unneeded", default=False)


@contextlib.contextmanager
def values_unneeded() -> Iterator[None]:
    """Materialize for measuring (emulate): a buffer no initializer fills is zero-filled."""
    token = _VALUES_UNNEEDED.set(True)
    try:
        yield
    finally:
        _VALUES_UNNEEDED.reset(token)


def hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the innermost Hugging Face model (one with ``_init_weights`` and a
    ``config``) that holds it, for every module under one."""
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner: nn.Module | None) -> None:
        if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return owners


def initialize(module: nn.Module, name: str, hf_owner: nn.Module | None,
               held: frozenset[str] = frozenset()) -> None:
    """Fill ``module``'s own tensors (just allocated, not its children's); ``name`` is its path
    in the model, for the refusal; ``held``: the attributes that held values before (buffers
    computed under ``autoplan.empty_weights()``), put back by the caller, never refused."""
    reset = getattr(module, "reset_parameters", None)
    with torch.no_grad():
        if callable(reset):
            reset()
            return
        if hf_owner is not None:
            hf_owner._init_weights(module)
            return
        norm = "norm" in type(module).__name__.lower()
        for attr, p in module._parameters.items():
            if p is None or not p.is_floating_point():
                continue
            if attr == "bias":
                p.zero_()
            elif norm and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    for attr, b in module._buffers.items():
        if b is None or attr in held or not (b.is_floating_point() or b.is_complex()):
            continue
        if _VALUES_UNNEEDED.get():
            with torch.no_grad():
                b.zero_()
        else:
            raise PlanError(
                f"buffer {name + '.' if name else ''}{attr} of {type(module).__name__} is "
                "computed when the module is built, and a model built on the meta device holds "
                "no values for it: build the model under autoplan.empty_weights() instead of "
                "torch.device('meta') (weights on meta, buffers computed), give the module a "
                "reset_parameters() that fills its tensors (as torch's layers have), or build "
                "the model on the CPU (drop --meta)")


__all__ = ["hf_owners", "initialize", "values_unneeded"]
