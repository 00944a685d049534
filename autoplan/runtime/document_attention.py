"""Document-masked attention on CUDA as flex attention with a block mask: the kernel that skips
the masked-out blocks, which the planner prices (``sharding/doc_work.py``, ``kernel=
"block_sparse"``).

A model given packed documents (position ids restarting per document, ``models/packing.py``)
builds its mask in the traced graph: autoplan's Llama ``same document & k <= q``, Hugging
Face's Llama ``same document & position[k] <= position[q]``, handed to
``scaled_dot_product_attention`` as a dense ``[B, 1, S, S]`` boolean. SDPA with a mask computes
the whole square (and the mask alone is S^2 bytes a row: 16 GiB at 128K tokens). On CUDA the
rank program instead runs such an attention as ``flex_attention`` with a ``BlockMask`` made from
the document ids of the position ids (compiled, 128 x 128 blocks, fully masked ones skipped),
and drops the dense mask and the ops that made it.

The rewrite is checked, not guessed: the mask's producing subgraph reads one graph input (the
position ids), no weight and no random op, and evaluated on test position ids (several rows of
different document splits, three draws) it equals ``models.packing.document_mask`` of them
exactly. The kernel then computes the document ids from that same input at run time.

On a CPU the mask stays dense: flex attention has no backward pass there (torch 2.13: "does not
support backward on CPU"), and its eager forward took 2.4 s for a 2 x 4 x 256 x 16 attention on
this machine against milliseconds for SDPA. Ring attention (context parallelism, or a ring on the
tp axis) keeps its own kernel, which computes every block with its mask's columns: those
attentions are not rewritten.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import fx

from autoplan.models.packing import document_ids, document_mask, document_position_ids
from autoplan.runtime.kernels import get_arg, set_arg
from autoplan.runtime.local_args import map_devices

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SEEDED = torch.Tag.nondeterministic_seeded
_DRAWS = 3
_FLEX: Any = None
_BLOCKS: dict[str, Any] = {}       # the last position ids' block mask: (tensor, version, mask)


def document_attention_nodes(graph: fx.Graph, device: torch.device) -> dict[str, str]:
    """SDPA node name -> the name of the graph input its mask is proven the document mask of
    (module doc), for the nodes that run as flex attention on ``device`` (CUDA only: empty
    elsewhere)."""
    if device.type != "cuda":
        return {}
    return proven_document_masks(graph)


def proven_document_masks(graph: fx.Graph) -> dict[str, str]:
    """SDPA node name -> position-ids input name, wherever the node's ``attn_mask`` is proven
    to be the document mask of that input (module doc), whatever the device."""
    found: dict[str, str] = {}
    proven: dict[str, str | None] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _SDPA:
            continue
        args, kwargs = list(n.args), dict(n.kwargs)
        mask = get_arg(_SDPA, args, kwargs, "attn_mask")
        if not isinstance(mask, fx.Node) or get_arg(_SDPA, args, kwargs, "is_causal", False) \
                or get_arg(_SDPA, args, kwargs, "dropout_p", 0.0):
            continue
        if mask.name not in proven:
            proven[mask.name] = _document_input(mask)
        if proven[mask.name] is not None:
            found[n.name] = proven[mask.name]
    return found


def _document_input(mask: fx.Node) -> str | None:
    """The input ``mask`` is proven the document mask of (None: not proven)."""
    nodes, inputs = [], []
    seen: set[fx.Node] = set()
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            inputs.append(n)
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or _SEEDED in n.target.tags or n.target._schema.is_mutable:
            return None
        nodes.append(n)
        todo.extend(n.all_input_nodes)
    if len(inputs) != 1:
        return None
    pos = inputs[0]
    val = pos.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or val.dtype.is_floating_point \
            or val.shape[1] < 2:
        return None
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    rows, s = int(val.shape[0]), int(val.shape[1])
    for draw in range(_DRAWS):
        test = document_position_ids(_splits(rows, s, draw), s)
        try:
            got = _evaluate(nodes, pos, test.to(val.dtype), mask)
        except Exception:       # an op that does not run on the CPU: not proven
            return None
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.dim() != 4:
            return None
        want = document_mask(test)
        try:
            if not bool((got.expand(want.shape) == want).all()):
                return None
        except RuntimeError:    # shapes that do not broadcast
            return None
    return pos.name


def _splits(rows: int, s: int, draw: int) -> list[list[int]]:
    """Document lengths per row: one whole document, one token then the rest, and random
    splits (seeded by ``draw``)."""
    rnd = random.Random(draw)
    out = []
    for r in range(rows):
        kind = (r + draw) % 3
        if kind == 0 and draw == 0:
            out.append([s])
        elif kind == 1:
            out.append([1, s - 1])
        else:
            docs, left = [], s
            while left:
                docs.append(min(left, rnd.randint(1, max(1, s // 3))))
                left -= docs[-1]
            out.append(docs)
    return out


def _evaluate(nodes: list[fx.Node], pos: fx.Node, value: torch.Tensor, out: fx.Node) -> Any:
    cpu = torch.device("cpu")
    env: dict[fx.Node, Any] = {pos: value}
    with torch.no_grad():
        for n in nodes:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*map_devices(args, cpu), **map_devices(kwargs, cpu))
    return env[out]


def without_mask(args: Any, kwargs: dict) -> tuple[list, dict]:
    """SDPA's arguments with the mask dropped (the kernel builds the block mask)."""
    return set_arg(_SDPA, list(args), dict(kwargs), "attn_mask", None)


def kernel_document_attention(target: Any, args: Any, kwargs: dict,
                              position_ids: torch.Tensor) -> torch.Tensor:
    """``target`` (SDPA, its mask dropped) as flex attention within the documents of
    ``position_ids`` (this rank's rows of the input the mask was proven from)."""
    q, k, v = args[:3]
    b, s = q.shape[0], q.shape[-2]
    if tuple(position_ids.shape) != (b, s) or k.shape[-2] != s:
        raise RuntimeError(
            f"document attention: position ids of shape {tuple(position_ids.shape)} for "
            f"queries of batch {b} and length {s}; the plan splits the position-ids input "
            "otherwise than the attention's rows: re-plan with --force "
            "sequence_parallel=false, or report this plan")
    scale = get_arg(target, list(args), kwargs, "scale", None)
    gqa = bool(get_arg(target, list(args), kwargs, "enable_gqa", False))
    if q.device.type != "cuda":                 # the dense mask, as the graph had it
        return target(q, k, v, attn_mask=document_mask(position_ids), scale=scale,
                      enable_gqa=gqa)
    if torch.is_autocast_enabled(q.device.type):
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    return _flex()(q, k, v, block_mask=block_mask(position_ids), scale=scale, enable_gqa=gqa)


def _flex() -> Any:
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def block_mask(position_ids: torch.Tensor) -> Any:
    """The block mask of ``position_ids``' documents (causal within each), made once for the
    position ids every layer of a step reads."""
    last = _BLOCKS.get("last")
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    from torch.nn.attention.flex_attention import create_block_mask
    doc = document_ids(position_ids)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    b, s = position_ids.shape
    mask = create_block_mask(same_document_causal, b, None, s, s, device=position_ids.device,
                             _compile=position_ids.device.type == "cuda")
    _BLOCKS["last"] = (position_ids, position_ids._version, mask)
    return mask


__all__ = ["block_mask", "document_attention_nodes", "kernel_document_attention",
           "proven_document_masks", "without_mask"]
