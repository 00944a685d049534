"""Attention whose mask is proven causal runs as ``is_causal=True``, without the mask.

Plain eager Hugging Face Llama (transformers 5.x) calls ``scaled_dot_product_attention`` with
no mask and ``is_causal=True``; under ``torch.export`` the library always builds the causal
mask (``_ignore_causal_mask_sdpa`` answers False while exporting), so the traced graph hands
SDPA a materialised ``[B or 1, 1, S, S]`` boolean (or additive float) mask and no
``is_causal``. On CUDA a mask rules out the flash-attention kernel: the rank program of HF
Llama 0.89B ran 308.6 ms a step against 266.2 for plain eager on an H200
(benchmarks/data/h200-gpu-check-20261127/).

The rewrite is proven, not guessed: the mask's producing subgraph must read no graph input of
any kind (user input, parameter, buffer, constant) and hold no random op, so its value is a
function of the traced shapes alone. It is then evaluated once and compared with the causal
lower triangle: a boolean mask must equal ``ones(S, S).tril()`` in every leading slice; an
additive float mask must be exactly 0 on and below the diagonal and ``-inf`` or at most the
dtype's lowest finite value above it (after softmax those weights are 0, the diagonal being
always kept). Query and key lengths must be equal (``is_causal`` is the top-left triangle).
A padding mask (an ``attention_mask`` input) reads a user input and is left as it is.

The mask is the same for every head and every sample, so the rewrite holds under any split of
batch or heads (tensor parallelism); ring attention (context parallelism) reads ``is_causal``
itself and skips the blocks above the diagonal instead of taking the mask's columns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autoplan.runtime.kernels import get_arg, set_arg
from autoplan.runtime.local_args import map_devices

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SEEDED = torch.Tag.nondeterministic_seeded


def causal_attention_nodes(graph: fx.Graph, device: torch.device) -> frozenset[str]:
    """Names of the ``scaled_dot_product_attention`` nodes of ``graph`` (an exported
    program's) whose ``attn_mask`` is proven to be the causal mask of equal query and key
    lengths (see the module's docstring); the mask is evaluated on ``device`` (the CPU for
    the meta device), once per mask node."""
    dev = torch.device("cpu") if device.type == "meta" else device
    proven: dict[str, bool] = {}
    found = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _SDPA:
            continue
        mask = get_arg(_SDPA, list(n.args), dict(n.kwargs), "attn_mask")
        if not isinstance(mask, fx.Node) or get_arg(_SDPA, list(n.args), dict(n.kwargs),
                                                    "is_causal", False):
            continue
        if not _equal_lengths(n, mask):
            continue
        if mask.name not in proven:
            proven[mask.name] = _is_causal_mask(mask, dev)
        if proven[mask.name]:
            found.append(n.name)
    return frozenset(found)


def as_causal(args: Any, kwargs: dict) -> tuple[list, dict]:
    """SDPA's arguments with the mask dropped and ``is_causal=True``."""
    args, kwargs = set_arg(_SDPA, list(args), dict(kwargs), "attn_mask", None)
    return set_arg(_SDPA, args, kwargs, "is_causal", True)


def drop_unused(graph: fx.Graph, roots: list[fx.Node]) -> int:
    """Erase ``roots`` and then their producers, as far as nothing else reads them (the mask
    the rewrite no longer passes, and the moves and ops that made it); impure nodes stay.
    Returns how many nodes went."""
    erased: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in erased or n.graph is not graph or n.users or n.op != "call_function" \
                or n.is_impure():
            continue
        producers = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        todo.extend(producers)
    return len(erased)


def _val_shape(n: fx.Node) -> tuple[int, ...] | None:
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _equal_lengths(sdpa: fx.Node, mask: fx.Node) -> bool:
    q, k = (_val_shape(a) if isinstance(a, fx.Node) else None for a in sdpa.args[:2])
    m = _val_shape(mask)
    if q is None or k is None or m is None or len(q) < 2 or len(k) < 2 or len(m) < 2:
        return False
    s = q[-2]
    return k[-2] == s and m[-2:] == (s, s)


def _producers(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None when one reads a graph input
    (placeholder, attribute) or is not a deterministic aten op."""
    seen: dict[fx.Node, None] = {}
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or _SEEDED in n.target.tags or n.target._schema.is_mutable:
            return None
        seen[n] = None
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_causal_mask(mask: fx.Node, device: torch.device) -> bool:
    nodes = _producers(mask)
    if nodes is None:
        return False
    env: dict[fx.Node, Any] = {}
    try:
        with torch.no_grad():
            for n in nodes:
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                env[n] = n.target(*map_devices(args, device), **map_devices(kwargs, device))
    except Exception:       # an op that does not run here: not proven, the mask stays
        return False
    value = env[mask]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    s = value.shape[-1]
    tril = torch.ones(s, s, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool((value == tril).all())
    if not value.is_floating_point():
        return False
    kept = value == 0
    lowest = torch.finfo(value.dtype).min
    blocked = value <= lowest           # -inf, or the dtype's lowest finite value
    return bool((kept == tril).all()) and bool((blocked == ~tril).all())


__all__ = ["as_causal", "causal_attention_nodes", "drop_unused"]
